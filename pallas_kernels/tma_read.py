"""A read-only stream by TMA (Mosaic GPU, Hopper): the most a persistent kernel's weight stream
can read per second with a given number of bytes in flight per SM.

`workers` blocks, one per SM, each copy their contiguous share of a weight's [rows, cols] bf16
units into a ring of `ring` shared-memory slots, as the persistent Core kernel's weight ring
does (`core_step.stream`: the same units, swizzle and one barrier per slot), and do nothing else
with them: each slot takes the unit `ring` places later as soon as its copy has landed. So the
rate is the memory system's for that many copies in flight, with no arithmetic, no input and no
grid barrier beside it. The result is each worker's last unit as it arrived, so that a test can
tell that the copies read what they should.

`resident` > 0: each worker marks the first `resident` units of its share, once landed, to be
evicted from L2 last (`l2.mark_in_l2`), so that a call after it may find them there: what a
persistent kernel that reads the same weights at every iteration could keep on chip between
iterations, and what that saves (`tools/l2_resident.py`). With `priority` "evict_normal" the
same units are marked back to L2's normal priority, so that one case's marks do not outlive it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.core_step.plan import even_share
from pallas_kernels.core_step.stream import MAX_RING, SWIZZLE_128
from pallas_kernels.l2 import check_priority, mark_in_l2
from pallas_kernels.smem import SMEM_LIMIT, aligned

UNIT_ROWS = 64  # rows of a unit: the weight stream's k chunk


def check_read(units: int, cols: int, workers: int, ring: int, resident: int = 0) -> None:
    """ValueError unless every worker owns at least `ring` and `resident` units and the ring
    fits in shared memory (`cols` a multiple of 64, the swizzle's tile)."""
    if cols % 64 or cols < 64:
        raise ValueError(f"cols={cols} must be a positive multiple of 64")
    if not 1 <= ring <= MAX_RING:
        raise ValueError(f"ring={ring} must be in [1, {MAX_RING}]")
    if workers < 1 or units // workers < max(ring, resident):
        raise ValueError(
            f"{units} units over {workers} workers: each must own at least ring={ring} and "
            f"resident={resident}"
        )
    if resident < 0:
        raise ValueError(f"resident={resident} must be >= 0")
    need = aligned(ring * UNIT_ROWS * cols * 2) + 8 * ring
    if need > SMEM_LIMIT:
        raise ValueError(f"ring={ring} of [{UNIT_ROWS}, {cols}] units: {need} bytes > {SMEM_LIMIT}")


def build_tma_read(
    units: int,
    cols: int,
    *,
    workers: int,
    ring: int,
    resident: int = 0,
    priority: str = "evict_last",
    interpret: Any = None,
):
    """f(w [units, 64, cols] bf16) -> [workers, 64, cols] bf16, worker i's last unit. Worker i
    copies units [units i / workers, units (i + 1) / workers) in order, `ring` in flight, and
    gives the first `resident` of them L2's `priority` once each has landed (`l2.mark_in_l2`; not
    in interpret mode, which runs the copies alone)."""
    check_read(units, cols, workers, ring, resident)
    check_priority(priority)  # before any tracing, also where no unit is marked

    def body(w_ref, out_ref, slots, arrived):
        worker = lax.axis_index("w")
        first, end = even_share(units, workers, worker)
        count = end - first

        def issue(i, slot):
            plgpu.copy_gmem_to_smem(w_ref.at[first + i], slots.at[slot], arrived.at[slot])

        for i in range(ring):  # every worker owns at least `ring` units
            issue(i, i)

        @pl.loop(0, count)
        def _unit(i):
            slot = lax.rem(i, ring)
            plgpu.barrier_wait(arrived.at[slot])
            if resident and interpret is None:
                pl.when(i < resident)(lambda: mark_in_l2(w_ref.at[first + i], priority))
            pl.when(i + ring < count)(lambda: issue(i + ring, slot))

        plgpu.copy_smem_to_gmem(slots.at[lax.rem(count - 1, ring)], out_ref.at[worker])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((workers, UNIT_ROWS, cols), jnp.bfloat16),
        scratch_types=(
            plgpu.SMEM((ring, UNIT_ROWS, cols), jnp.bfloat16, transforms=SWIZZLE_128),
            plgpu.Barrier(num_barriers=ring),
        ),
        grid=(workers,),
        grid_names=("w",),
        interpret=interpret,
    )


@functools.partial(
    jax.jit, static_argnames=("workers", "ring", "resident", "priority", "interpret")
)
def tma_read(
    w: jax.Array,
    *,
    workers: int,
    ring: int,
    resident: int = 0,
    priority: str = "evict_last",
    interpret: Any = None,
) -> jax.Array:
    """`build_tma_read` over w [units, 64, cols] bf16: each worker's last unit."""
    units, rows, cols = w.shape
    if rows != UNIT_ROWS or w.dtype != jnp.bfloat16:
        raise ValueError(f"w must be [units, {UNIT_ROWS}, cols] bf16, not {w.shape} {w.dtype}")
    build = build_tma_read(
        units,
        cols,
        workers=workers,
        ring=ring,
        resident=resident,
        priority=priority,
        interpret=interpret,
    )
    return build(w)


def last_units(units: int, workers: int) -> list[int]:
    """The unit each worker copies last (what `tma_read` returns, per worker)."""
    return [even_share(units, workers, i)[1] - 1 for i in range(workers)]
