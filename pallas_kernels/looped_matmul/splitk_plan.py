"""The split-K kernel's static schedule: who owns what, in which order, what it allocates.

`plan_splitk(m, d, steps, cfg)` derives from a `SplitKConfig` everything `build_splitk`
(`splitk_kernel.py`) lowers as Python constants; `scratch_types` is the shared memory it asks
for (`WorkerBarriers` indexes its barrier arrays); `PHASES` and `profile_ranges` are what its
on-device profile records.

Partition. Worker = warpgroup; `warpgroups` (1 or 2) per block, blocks <= SM count (grid
barrier). Worker w: column group c = w // k_split (block_cols = 64 * tiles columns), K range
j = w % k_split (k_chunks chunks of 64 rows from `cfg.chunk_start(d, j)`; with a ragged split
the first `cfg.short_ranges(d)` ranges own one chunk less and zero the state of their last
chunk, which belongs to the next range). Units are numbered k chunk major, tile minor; the
first ones are streamed, then come the resident ones, then the register ones, so that each step
starts on the ring (prefetched during the previous exchange) and L2 stays busy.

State buffers. Three f32 buffers S[3, d, n_pad] (the kernel's output). Step s reads
S[(s-1) % 3] (step 0 reads x0 = x^T as f32), adds its partial sums into S[s % 3], and the
j == 0 worker of each column group zeroes its columns of S[(s+1) % 3] (which held step s-2's
result, read by everyone during step s-1). With `cfg.sync == "flags"` workers drift up to a
step apart, so there are 5 buffers and S[(s+2) % 5] is zeroed during step s.

Zigzag (`cfg.zigzag`). The fully streamed k chunks are read in reverse order on odd steps, so a
step starts on the weight the previous step read last. Read cyclically, a slice larger than what
the L2 keeps misses on every line (LRU-like replacement); read back and forth, the most recently
read part hits. It needs the whole state staged (x_stages >= k chunks): chunks are converted in
the order they are computed.

Traffic per step, whole grid (W = 2 d^2 bytes, workers = G_c * k_split, n = n_pad):
- registers: reg_units * 8 KiB per worker, read by the tensor cores, no memory traffic.
- shared memory reads: (smem_units + streamed units) * 8 KiB per worker (wgmma A) + the bf16
  state k_len * n * 2 per worker and unit-tile (wgmma B, n=8: 1 KiB per unit).
- L2 -> SM: streamed units * 8 KiB * workers (the weight not on chip), f32 state
  G_c * d * n * 4, reduce-adds k_split * d * n * 4, zeroing d * n * 4.
- HBM: the first step reads W once; later steps re-read whatever part of the streamed
  weight the L2 did not keep.

Registers. 2 warpgroups x 128 threads x <= 255 registers = the whole 64K file. A register unit
costs 16 registers per thread (4 ldmatrix.x4.trans at load time), the accumulator
tiles * n_pad / 2; the picker keeps 16 * reg_units + accumulator + 64 <= 240
(splitk_pick.PICK_MAX_REGS).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.looped_matmul.barrier import needs_poll_barrier
from pallas_kernels.looped_matmul.splitk_config import UNIT, SplitKConfig

# A [64, 64] bf16 tile with the 128-byte swizzle: weight units and the bf16 state (wgmma A, B).
SWIZZLE_128 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

# The named scopes of a step, in its order, that the on-device profile records (besides "step"):
# x_wait (the f32 state chunk's TMA), x_convert (f32 -> bf16 into the wgmma B tile), w_wait (a
# streamed weight unit's TMA), acc (waiting for the step's wgmmas and writing the partial sums to
# shared memory), partial_out (issuing the TMA reduce-adds and the zeroing), partial_wait (their
# completion), barrier (the grid barrier, or with sync="flags" the wait on the column groups'
# counters), x_issue (the next step's state TMAs).
PHASES = (
    "x_wait",
    "x_convert",
    "w_wait",
    "acc",
    "partial_out",
    "partial_wait",
    "barrier",
    "x_issue",
)


def profile_ranges(cfg: SplitKConfig, d: int, steps: int) -> int:
    """Named ranges one worker records in a call (the profile buffer's size in ranges)."""
    per_step = 1 + 2 * cfg.k_chunks(d) + cfg.streamed_units(d) + 5
    return steps * per_step + 8


@dataclasses.dataclass(frozen=True)
class SplitKPlan:
    """The static schedule of one `build_splitk` call (see the module docstring).

    Unit order in a step: `streamed_units` units first, through a ring of `ring_slots` (the ring
    keeps L2 busy from the step's start; the on-chip units are computed while it prefetches the
    next step), then `resident_units` from shared memory, then `register_units`. Chunks
    [0, streamed_chunks) are entirely streamed and run as one dynamic loop; the rest is static.
    """

    n_pad: int
    tiles: int
    block_cols: int
    k_split: int
    k_chunks: int
    short_ranges: int  # ragged split: ranges 0..short_ranges-1 own one chunk less
    register_units: int
    resident_units: int
    streamed_units: int
    ring_slots: int
    x_in_flight: int  # f32 state chunks in flight (their TMAs issued ahead)
    x_slots: int  # f32 state slots, also the partial sums' (one per tile)
    wgmma_lag: int
    warpgroups: int
    workers: int
    reduce: bool  # k_split > 1: partial sums added by TMA reduce-adds
    total_streamed: int  # streamed units over all steps
    streamed_chunks: int  # chunks [0, streamed_chunks) hold only streamed units
    zigzag: bool
    first_resident: int  # unit index of the first resident unit
    first_register: int  # unit index of the first register unit
    emulate: bool  # interpret mode: the reduce-add emulated, A operands staged in smem
    use_barrier: bool
    barrier_epoch0: int  # the prologue's arrival (S[0] zeroed) with reduce-adds
    state_buffers: int
    flags_sync: bool  # after the prologue, steps wait on per-column-group counters
    zero_ahead: int  # grid: zero S[s+1] during step s (0); flags: S[s+2] (2)
    poll_barrier: bool  # the `leader` poll's shared-memory barrier is allocated


def plan_splitk(
    m: int,
    d: int,
    steps: int,
    cfg: SplitKConfig,
    *,
    interpret: bool = False,
    grid_barrier: bool = True,
) -> SplitKPlan:
    """The schedule of `cfg` at (m, d, steps); raises ValueError where interpret mode cannot
    run it (a grid barrier, or reduce-adds racing between the warpgroups of a block)."""
    k_chunks = cfg.k_chunks(d)
    streamed = cfg.streamed_units(d)
    workers = cfg.num_workers(d)
    reduce = cfg.k_split > 1
    streamed_chunks = streamed // cfg.tiles
    # Interpret mode runs blocks in order (worker order, the zeroing worker of a column group
    # first), so one step needs no barrier there.
    use_barrier = grid_barrier and workers > 1 and (steps > 1 or (reduce and not interpret))
    if interpret and use_barrier:
        raise ValueError(
            "interpret mode cannot run the grid barrier (no global semaphores): use one "
            "worker, or steps = 1"
        )
    if interpret and reduce and cfg.warpgroups > 1:
        raise ValueError(
            "interpret mode emulates the TMA reduce-add by a read-modify-write, which races "
            "between the warpgroups of a block: use warpgroups=1 with k_split > 1"
        )
    return SplitKPlan(
        n_pad=cfg.n_pad(m),
        tiles=cfg.tiles,
        block_cols=cfg.block_cols,
        k_split=cfg.k_split,
        k_chunks=k_chunks,
        short_ranges=cfg.short_ranges(d),
        register_units=cfg.reg_units,
        resident_units=cfg.smem_units,
        streamed_units=streamed,
        ring_slots=cfg.ring_slots(d),
        x_in_flight=min(cfg.x_stages, k_chunks),
        x_slots=cfg.x_slots(d),
        wgmma_lag=cfg.wgmma_lag,
        warpgroups=cfg.warpgroups,
        workers=workers,
        reduce=reduce,
        total_streamed=steps * streamed,
        streamed_chunks=streamed_chunks,
        # Zigzag needs every state chunk staged at once (converted in any order), >= 2 chunks.
        zigzag=cfg.zigzag and streamed_chunks >= 2,
        first_resident=streamed,
        first_register=streamed + cfg.smem_units,
        emulate=interpret,
        use_barrier=use_barrier,
        barrier_epoch0=1 if reduce else 0,
        state_buffers=cfg.state_buffers,
        flags_sync=use_barrier and cfg.sync == "flags",
        zero_ahead=cfg.state_buffers - 3,
        poll_barrier=use_barrier and needs_poll_barrier(cfg.poll, cfg.warpgroups),
    )


class WorkerBarriers:
    """The `n` barriers of one worker inside a flat [warpgroups * n] barrier array of
    `scratch_types`. Flat (worker-major) because interpret mode mis-indexes 2-D ones."""

    def __init__(self, ref: Any, wg: Any, n: int):
        self.ref, self.base = ref, wg * n

    def at(self, i: Any) -> Any:
        return self.ref.at[self.base + i]


def scratch_types(plan: SplitKPlan) -> dict[str, Any]:
    """The kernel's shared memory, per warpgroup (leading axis): `xf` the f32 state slots and
    partial sums, `xbar` their barriers, `xb` the bf16 state (wgmma B), `zero` a zero tile for
    the reduce-add buffers, `res`/`rbar` the resident units, `ring`/`wbar` the streamed ring,
    `pollbar` the `leader` poll's barrier, `a_tmp` interpret mode's staged register operand."""
    warpgroups, n_pad, bf16 = plan.warpgroups, plan.n_pad, jnp.bfloat16
    scratch: dict[str, Any] = dict(
        xf=plgpu.SMEM((warpgroups, plan.x_slots, UNIT, n_pad), jnp.float32),
        xbar=plgpu.Barrier(num_barriers=warpgroups * plan.x_slots),
        xb=plgpu.SMEM((warpgroups, plan.k_chunks, n_pad, UNIT), bf16, transforms=SWIZZLE_128),
    )
    if plan.reduce:
        scratch["zero"] = plgpu.SMEM((warpgroups, UNIT, n_pad), jnp.float32)
    if plan.resident_units:
        shape = (warpgroups, plan.resident_units, UNIT, UNIT)
        scratch["res"] = plgpu.SMEM(shape, bf16, transforms=SWIZZLE_128)
        scratch["rbar"] = plgpu.Barrier(num_barriers=warpgroups * plan.resident_units)
    if plan.ring_slots:
        shape = (warpgroups, plan.ring_slots, UNIT, UNIT)
        scratch["ring"] = plgpu.SMEM(shape, bf16, transforms=SWIZZLE_128)
        scratch["wbar"] = plgpu.Barrier(num_barriers=warpgroups * plan.ring_slots)
    if plan.poll_barrier:
        scratch["pollbar"] = plgpu.Barrier()
    if plan.emulate and plan.register_units:  # interpret mode: wgmma cannot take A from registers
        scratch["a_tmp"] = plgpu.SMEM((warpgroups, UNIT, UNIT), bf16, transforms=SWIZZLE_128)
    return scratch
