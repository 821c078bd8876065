"""Grid barrier of the persistent kernels: one global epoch counter, and how it is polled.

Every worker (warpgroup) arrives with one `red.release.gpu.add` of 1 on a zeroed global counter
and waits until it reads `workers * epoch`. Arrival is the same in every variant; the wait
differs in who polls the counter and with which load (`POLLS`):

- `all_threads`: every thread spins on `pl.semaphore_read` (`ld.acquire.sys`); 4 loads per
  worker per round. The resident kernel's poll.
- `leader`: warpgroup 0 of a block spins as above, then releases warpgroup 1 through a
  shared-memory barrier (half the polling load, one mbarrier hop more).
- `wait` (the default): `plgpu.semaphore_wait(decrement=False, memory_scope="gpu")`: one
  thread spins on `ld.relaxed.gpu`, then `fence.acquire.gpu` and a warpgroup barrier. The
  cheapest of the four on the H200; it runs inside `pl.loop` (the probe and every split-K
  kernel of the GPU tests do).
- `one_thread`: the same protocol written here with `inline_mgpu`: one thread per worker spins
  on `ld.acquire.gpu` (one L2 round trip per poll, no system-scope ordering), then a warpgroup
  barrier.

The cost of each poll per barrier and per split-K step: docs/looped_matmul.md
(`python -m experiments.kernels.looped_matmul_smoke --suite barrier` measures it).

The barrier is only correct when every block is resident at once (grid <= SM count, one block
per SM), which the kernels' configs check. Interpret mode has no global semaphores.
`build_barrier_probe` times the barrier alone (no data), for the smoke program's `barrier` suite.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, scf
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

POLLS = ("all_threads", "leader", "wait", "one_thread")


def check_poll(poll: str) -> None:
    if poll not in POLLS:
        raise ValueError(f"poll={poll!r} is not one of {POLLS}")


def needs_poll_barrier(poll: str, warpgroups: int) -> bool:
    """Whether the `leader` variant's shared-memory barrier is allocated."""
    return poll == "leader" and warpgroups > 1


def _spin_acquire_one_thread(sem: Any, target: Any) -> None:
    """One thread of the warpgroup spins on ld.acquire.gpu until sem >= target; then all sync."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WG_SPLAT(shape=())))
    def spin(ctx, sem_ref, target_fa):
        del ctx
        i32 = mgpu.utils.dtype_to_ir_type(jnp.int32)
        [want] = list(target_fa.registers.flat)
        ptr = mgpu.utils.memref_ptr(sem_ref)
        with mgpu.utils.single_thread(mgpu.utils.ThreadSubset.WARPGROUP):
            loop = scf.WhileOp([], [])
            before = loop.before.blocks.append()
            with ir.InsertionPoint(before):
                seen = mgpu.utils.inline_ptx(
                    "ld.acquire.gpu.global.b32 $0, [$1];",
                    ptr,
                    result_types=i32,
                    has_side_effects=True,
                )
                scf.condition(arith.cmpi(arith.CmpIPredicate.ult, seen, want), [])
            after = loop.after.blocks.append()
            with ir.InsertionPoint(after):
                scf.yield_([])
        mgpu.utils.warpgroup_barrier()

    spin(sem, target)


class GridBarrier:
    """Arrive / wait on one global epoch counter shared by `workers` warpgroups.

    `wg` is the warpgroup index inside the block (0 with one warpgroup) and `poll_barrier` the
    shared-memory barrier of the `leader` variant (None otherwise); with one warpgroup per
    block `leader` polls as `all_threads`.
    """

    def __init__(self, workers: int, poll: str, wg: Any, warpgroups: int, poll_barrier=None):
        check_poll(poll)
        self.workers, self.wg = workers, wg
        self.poll = "all_threads" if poll == "leader" and warpgroups == 1 else poll
        self.poll_barrier = poll_barrier
        self.sem = pl.get_global(plgpu.SemaphoreType.REGULAR)

    def arrive(self) -> None:
        plgpu.semaphore_signal(self.sem, 1, memory_scope="gpu")

    def _spin_all_threads(self, target: Any) -> None:
        lax.while_loop(
            lambda v: v < target,
            lambda v: pl.semaphore_read(self.sem),
            pl.semaphore_read(self.sem),
        )

    def wait(self, epoch: Any) -> None:
        """Returns once every worker has arrived `epoch` times (epoch >= 1, may be traced)."""
        target = jnp.asarray(self.workers * epoch, jnp.int32)
        if self.poll == "all_threads":
            self._spin_all_threads(target)
        elif self.poll == "wait":
            plgpu.semaphore_wait(self.sem, target, decrement=False, memory_scope="gpu")
        elif self.poll == "one_thread":
            _spin_acquire_one_thread(self.sem, target)
        else:  # leader

            @pl.when(self.wg == 0)
            def _leader():
                self._spin_all_threads(target)
                plgpu.barrier_arrive(self.poll_barrier)

            pl.when(self.wg != 0)(lambda: plgpu.barrier_wait(self.poll_barrier))


class GroupFlags:
    """Per-column-group step counters, the split-K kernel's `sync="flags"` in place of a grid
    barrier between steps: a worker adds 1 to its column group's counter once its partial sums
    of a step are in L2, then, before reading the next step's state, waits until every group
    its K range overlaps (`first`..`last`) has counted `arrivals` (k_split) per finished step.
    Counters are zeroed per call (Mosaic's GMEM scratch); polled as the `wait` barrier does."""

    def __init__(self, groups: int, arrivals: int, *, group: Any, first: Any, last: Any):
        self.sem = pl.get_global(plgpu.SemaphoreType.REGULAR((groups,)))
        self.arrivals, self.group, self.first, self.last = arrivals, group, first, last

    def arrive_and_wait(self, steps_done: Any) -> None:
        """Signals this worker's step; returns once the groups it reads finished `steps_done`."""
        plgpu.semaphore_signal(self.sem.at[self.group], 1, memory_scope="gpu")
        target = jnp.asarray(self.arrivals * steps_done, jnp.int32)

        @pl.loop(self.first, self.last + 1)
        def _(g):
            plgpu.semaphore_wait(self.sem.at[g], target, decrement=False, memory_scope="gpu")


def build_barrier_probe(blocks: int, warpgroups: int, epochs: int, poll: str):
    """A kernel that only crosses the grid barrier `epochs` times (inside `pl.loop`).

    Returns f() -> int32[blocks * warpgroups]: the counter each worker read after its last
    barrier, which must be workers * epochs (every worker has arrived `epochs` times and none
    more); a hang or another value is a broken barrier.
    """
    check_poll(poll)
    workers = blocks * warpgroups
    scratch: dict[str, Any] = dict(seen=plgpu.SMEM((warpgroups, 128), jnp.int32))
    if needs_poll_barrier(poll, warpgroups):
        scratch["pollbar"] = plgpu.Barrier()

    def body(out_ref, seen, pollbar=None):
        wg = lax.axis_index("wg") if warpgroups > 1 else 0
        worker = lax.axis_index("b") * warpgroups + wg
        barrier = GridBarrier(workers, poll, wg, warpgroups, pollbar)

        @pl.loop(0, epochs)
        def _epoch(e):
            barrier.arrive()
            barrier.wait(e + 1)

        value = pl.semaphore_read(barrier.sem)
        seen.at[wg][...] = jnp.full((128,), value, jnp.int32)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(seen.at[wg], out_ref.at[worker])
        plgpu.wait_smem_to_gmem(0)

    kwargs: dict[str, Any] = dict(grid=(blocks,), grid_names=("b",))
    if warpgroups > 1:
        kwargs.update(num_threads=warpgroups, thread_name="wg")
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((workers, 128), jnp.int32),
        scratch_types=scratch,
        **kwargs,
    )
    return jax.jit(lambda: kernel()[:, 0])
