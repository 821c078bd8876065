"""Split-K persistent looped matmul, Mosaic GPU: weight in registers + shared memory + L2.

x <- x @ w, `steps` times, in one launch, for one weight w [d, d] bf16 and a small state
x [M, d] bf16 (M <= 64). The weight is split in 2-D (column groups x K ranges) over up to all
SMs; each worker keeps the first units of its slice in registers (loop-invariant wgmma A
fragments), the next ones in shared memory, and streams only the rest from L2; a step loads its
input state in one round trip. Why: blocks that own whole columns (`kernel.py`) leave SMs idle
at large d, keep little of the weight on chip and re-read the state several times per step.
Measurements, tuned picks and rejected variants: docs/looped_matmul.md.

Math, transposed as in `kernel.py`: out^T[cols, n] += w[k, cols]^T @ x^T[k, n], the weight is
the wgmma A operand (M = 64 output columns per instruction) and the state the B operand
(N = n_pad = M rounded up to 8). A unit is w[64 k, 64 cols]; in shared memory it is a TMA tile
with a 128-byte swizzle and A is its transposed view; in registers it is loaded once with
ldmatrix.trans into the WGMMA layout (16 registers per thread) before the step loop and reused
by every step. B is x[n_pad, 64 k] (K-major, 128-byte swizzle), built every step from f32.

Partition. Worker = warpgroup; `warpgroups` (1 or 2) per block, blocks <= SM count (grid
barrier). Worker w: column group c = w // k_split (block_cols = 64 * tiles columns), K range
j = w % k_split (k_chunks chunks of 64 rows from `cfg.chunk_start(d, j)`; with a ragged split
the first `cfg.short_ranges(d)` ranges own one chunk less and zero the state of their last
chunk, which belongs to the next range). Units are numbered k chunk major, tile minor; the
first ones are streamed, then come the resident ones, then the register ones, so that each step
starts on the ring (prefetched during the previous exchange) and L2 stays busy.

State. Three f32 buffers S[3, d, n_pad] (the kernel's output). Step s reads S[(s-1) % 3] (step
0 reads x0 = x^T as f32), adds its partial [block_cols, n_pad] into S[s % 3] with a TMA
reduce-add (k_split > 1; a plain TMA store when k_split == 1), and the j == 0 worker of each
column group zeroes its columns of S[(s+1) % 3] (which held step s-2's result, read by everyone
during step s-1). Prologue: zero S[0], then arrive at the grid barrier; the matching wait is
just before step 0's first reduce-add (split-phase, hidden behind the weight prologue).
Consumers round the f32 sums to bf16 themselves (f32 [64, n_pad] chunk -> WGMMA-layout
registers -> bf16 -> stmatrix.trans into the swizzled B tile): one f32 sum, one bf16 rounding
per step, as the unfused chain. Grid barrier: one global epoch counter, every worker adds 1
(red.release.gpu) and waits for workers x epoch; who polls and how is `cfg.poll` (barrier.py).
With `cfg.sync == "flags"` the steps wait instead on per-column-group counters
(barrier.GroupFlags: only for the groups whose columns are the worker's K range); workers then
drift up to a step apart, so there are 5 buffers and S[(s+2) % 5] is zeroed during step s.

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
(splitk_config.PICK_MAX_REGS).

Tests: on CPU, lowering for sm_90 of every picked config (the module holds 4 register-A wgmmas
and 4 ldmatrix.trans per register unit, the TMA reduce-adds, the barrier ops) and GPU interpret
mode vs reference.py for barrier-free configs (one worker and several steps, zigzag included;
several workers and one step, with the reduce-add emulated); on a GPU, the picks and variants
against the reference (tests/test_looped_matmul.py, `-m gpu`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.looped_matmul.barrier import GridBarrier, GroupFlags, needs_poll_barrier
from pallas_kernels.looped_matmul.phases import profile_ranges
from pallas_kernels.looped_matmul.splitk_config import UNIT, SplitKConfig

SWIZZLE_128 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


class _WorkerBarriers:
    """The `n` barriers of one worker inside a flat [warpgroups * n] barrier array."""

    def __init__(self, ref: Any, wg: Any, n: int):
        self.ref, self.base = ref, wg * n

    def at(self, i: Any) -> Any:
        return self.ref.at[self.base + i]


def build_splitk(
    m: int,
    d: int,
    steps: int,
    cfg: SplitKConfig,
    *,
    interpret: Any = None,
    grid_barrier: bool = True,
    debug: bool = False,
    profile_dir: str = "",
):
    """Returns f(x0 [d, n_pad] f32, w [d, d] bf16) -> S [B, d, n_pad] f32 (B = cfg.state_buffers),
    the result in S[(steps-1) % B].

    `grid_barrier=False` drops the barrier (only correct for one worker, or one step with
    k_split == 1). `profile_dir`: record the phases of every step (phases.PHASES, SM clock
    cycles) with Mosaic GPU's on-device profiler, one trace file per call written there
    (`phases.phase_table` reads them); costs shared memory and a few cycles per phase.
    Interpret mode runs blocks one after another and has neither global semaphores nor TMA
    reductions: there the reduce-add is emulated by a read-modify-write, which is correct
    only with one warpgroup per block and one step (or one worker).
    """
    n_pad = cfg.n_pad(m)
    tiles, block_cols = cfg.tiles, cfg.block_cols
    k_split, k_chunks = cfg.k_split, cfg.k_chunks(d)
    short_ranges = cfg.short_ranges(d)  # ragged split: ranges 0..short_ranges-1 are short
    n_reg, n_res = cfg.reg_units, cfg.smem_units
    n_str = cfg.streamed_units(d)
    n_ring = cfg.ring_slots(d)
    n_xs = min(cfg.x_stages, k_chunks)  # f32 state chunks in flight
    n_x_slots = cfg.x_slots(d)
    lag = cfg.wgmma_lag
    wgs = cfg.warpgroups
    workers = cfg.num_workers(d)
    reduce = k_split > 1
    total_str = steps * n_str
    # Unit order in a step: streamed units first (the ring keeps L2 busy from the step's
    # start; the on-chip units are computed while the ring prefetches the next step), then
    # resident, then register units. Chunks [0, dyn_chunks) are all streamed: a dynamic loop.
    dyn_chunks = n_str // tiles
    # Zigzag needs every state chunk staged at once (converted in any order) and >= 2 chunks.
    zigzag = cfg.zigzag and dyn_chunks >= 2
    first_res, first_reg = n_str, n_str + n_res  # unit index of the first resident/register
    emulate = interpret is not None
    # Interpret mode runs blocks in order (worker order, the zeroing worker of a column group
    # first), so one step needs no barrier there.
    use_barrier = grid_barrier and workers > 1 and (steps > 1 or (reduce and not emulate))
    if emulate and use_barrier:
        raise ValueError(
            "interpret mode cannot run the grid barrier (no global semaphores): use one "
            "worker, or steps = 1"
        )
    if emulate and reduce and wgs > 1:
        raise ValueError(
            "interpret mode emulates the TMA reduce-add by a read-modify-write, which races "
            "between the warpgroups of a block: use warpgroups=1 with k_split > 1"
        )
    barrier_epoch0 = 1 if reduce else 0  # the prologue's arrival (S[0] zeroed)
    n_buf = cfg.state_buffers
    # sync="flags": after the prologue, steps wait on per-column-group counters, not the grid.
    flags_sync = use_barrier and cfg.sync == "flags"
    zero_ahead = n_buf - 3  # grid: zero S[s+1] during step s; flags: S[s+2]
    bf16 = jnp.bfloat16

    scratch: dict[str, Any] = dict(
        xf=plgpu.SMEM((wgs, n_x_slots, UNIT, n_pad), jnp.float32),
        xbar=plgpu.Barrier(num_barriers=wgs * n_x_slots),
        xb=plgpu.SMEM((wgs, k_chunks, n_pad, UNIT), bf16, transforms=SWIZZLE_128),
    )
    if reduce:
        scratch["zero"] = plgpu.SMEM((wgs, UNIT, n_pad), jnp.float32)
    if n_res:
        scratch["res"] = plgpu.SMEM((wgs, n_res, UNIT, UNIT), bf16, transforms=SWIZZLE_128)
        scratch["rbar"] = plgpu.Barrier(num_barriers=wgs * n_res)
    if n_ring:
        scratch["ring"] = plgpu.SMEM((wgs, n_ring, UNIT, UNIT), bf16, transforms=SWIZZLE_128)
        scratch["wbar"] = plgpu.Barrier(num_barriers=wgs * n_ring)
    if use_barrier and needs_poll_barrier(cfg.poll, wgs):
        scratch["pollbar"] = plgpu.Barrier()
    if emulate and n_reg:  # interpret mode: wgmma cannot take A from registers
        scratch["a_tmp"] = plgpu.SMEM((wgs, UNIT, UNIT), bf16, transforms=SWIZZLE_128)

    def unit_coords(u):
        """Unit u of a worker's slice -> (k chunk, tile); u may be traced."""
        return u // tiles, u % tiles

    def body(x0_ref, w_ref, s_ref, **sc):
        wg = lax.axis_index("wg") if wgs > 1 else 0
        worker = lax.axis_index("b") * wgs + wg
        col0 = (worker // k_split) * block_cols
        k_range = worker % k_split
        row0 = cfg.chunk_start(d, k_range) * UNIT
        is_zeroer = k_range == 0
        xf, xb = sc["xf"].at[wg], sc["xb"].at[wg]
        res = sc["res"].at[wg] if n_res else None
        ring = sc["ring"].at[wg] if n_ring else None
        # Barrier arrays are flat (worker-major): interpret mode mis-indexes 2-D ones.
        xbar = _WorkerBarriers(sc["xbar"], wg, n_x_slots)
        rbar = _WorkerBarriers(sc["rbar"], wg, n_res) if n_res else None
        wbar = _WorkerBarriers(sc["wbar"], wg, n_ring) if n_ring else None
        barrier = (
            GridBarrier(workers, cfg.poll, wg, wgs, sc.get("pollbar")) if use_barrier else None
        )
        if flags_sync:
            flags = GroupFlags(
                cfg.col_groups(d),
                k_split,
                group=worker // k_split,
                first=row0 // block_cols,
                last=(row0 + cfg.k_len(d) - 1) // block_cols,
            )

        def cols(t):
            return pl.ds(col0 + t * UNIT, UNIT)

        def w_unit(u):
            kc, t = unit_coords(u)
            return w_ref.at[pl.ds(row0 + kc * UNIT, UNIT), cols(t)]

        # ------------------------------------------------------------ state (f32 -> bf16)
        def issue_x(s, kc):
            """TMA of f32 state rows [row0 + kc*64, +64) of step s's input into its slot."""
            rows = pl.ds(row0 + kc * UNIT, UNIT)
            slot = kc % n_xs

            # reads 64 * n_pad * 4 B of state from L2
            def from_input():
                plgpu.copy_gmem_to_smem(x0_ref.at[rows, :], xf.at[slot], xbar.at(slot))

            def from_state():
                src = s_ref.at[lax.rem(s + n_buf - 1, n_buf), rows, :]
                plgpu.copy_gmem_to_smem(src, xf.at[slot], xbar.at(slot))

            if isinstance(s, int):
                (from_input if s == 0 else from_state)()
            else:
                pl.when(s == 0)(from_input)
                pl.when(s > 0)(from_state)

        def convert_x(s, kc, static: bool):
            """Waits for f32 chunk kc, rounds it to bf16 into the wgmma B tile xb[kc]."""
            slot = kc % n_xs
            with jax.named_scope("x_wait"):
                plgpu.barrier_wait(xbar.at(slot))
            with jax.named_scope("x_convert"):
                chunk = plgpu.load(xf.at[slot], layout=plgpu.Layout.WGMMA)  # [64, n_pad] f32
                if short_ranges and not (isinstance(kc, int) and kc < k_chunks - 1):
                    # A short range's last chunk is the next range's first: state zeroed.
                    owned = jnp.logical_or(kc < k_chunks - 1, k_range >= short_ranges)
                    chunk = chunk * owned.astype(jnp.float32)
                # stmatrix.trans into the K-major, 128-B swizzled [n_pad, 64] tile
                xb.at[kc].T[...] = chunk.astype(bf16)
                plgpu.commit_smem()  # visible to wgmma; every thread is done with the f32 slot
            if n_xs < k_chunks:
                if static:
                    if kc + n_xs < k_chunks:
                        issue_x(s, kc + n_xs)
                else:
                    pl.when(kc + n_xs < k_chunks)(lambda: issue_x(s, kc + n_xs))

        # ------------------------------------------------------------ streamed ring
        def streamed_chunk(s, kc):
            """The k chunk computed at position kc of step s's fully streamed chunks: reversed
            on odd steps with `zigzag`, so that a step starts on the weight the previous one
            read last (still in L2 under LRU-like replacement)."""
            if not zigzag:
                return kc
            return jnp.where(s % 2 == 1, dyn_chunks - 1 - kc, kc)

        def issue_stream(g):
            """TMA of streamed unit number g (global over steps) into ring slot g % n_ring."""
            slot = g % n_ring
            i = g % n_str  # position in the step's stream
            if zigzag:
                kc, t = i // tiles, i % tiles
                in_dyn = kc < dyn_chunks
                i = jnp.where(in_dyn, streamed_chunk(g // n_str, kc) * tiles + t, i)
            # reads 8 KiB of W from L2 (from HBM on the first step)
            plgpu.copy_gmem_to_smem(w_unit(i), ring.at[slot], wbar.at(slot))

        def release(s, i):
            """Streamed unit i of step s is done (its wgmma group completed): refill its slot."""
            g = s * n_str + i + n_ring

            @pl.when(g < total_str)
            def _():
                issue_stream(g)

        # ------------------------------------------------------------ prologue
        for kc in range(n_xs):
            issue_x(0, kc)
        if reduce:
            zero = sc["zero"].at[wg]
            zero[...] = jnp.zeros((UNIT, n_pad), jnp.float32)
            plgpu.commit_smem()

            @pl.when(is_zeroer)
            def _():
                for buf in range(min(zero_ahead + 1, steps)):  # S[0] (and S[1] with flags)
                    for t in range(tiles):  # writes block_cols * n_pad * 4 B
                        plgpu.copy_smem_to_gmem(zero, s_ref.at[buf, cols(t), :])

            plgpu.wait_smem_to_gmem(0)
            if use_barrier:
                barrier.arrive()  # split phase: waited for just before step 0's first reduce-add

        # Register units: staged through every shared-memory weight slot, loaded once
        # (ldmatrix.trans, reads n_reg * 8 KiB of W from HBM), kept for all steps.
        stage = [(res.at[r], rbar.at(r)) for r in range(n_res)]
        stage += [(ring.at[q], wbar.at(q)) for q in range(n_ring)]
        regs = []
        for first in range(0, n_reg, max(len(stage), 1)):
            batch = list(range(first, min(n_reg, first + len(stage))))
            for u, (slot, bar) in zip(batch, stage, strict=False):
                plgpu.copy_gmem_to_smem(w_unit(first_reg + u), slot, bar)
            for _u, (slot, bar) in zip(batch, stage, strict=False):
                plgpu.barrier_wait(bar)
                regs.append(plgpu.load(slot.T, layout=plgpu.Layout.WGMMA))
            plgpu.commit_smem()  # all ldmatrix reads done before the slots are refilled
        # Resident units (reads n_res * 8 KiB of W from HBM), then the first ring fill.
        for r in range(n_res):
            plgpu.copy_gmem_to_smem(w_unit(first_res + r), res.at[r], rbar.at(r))
        for g in range(min(n_ring, total_str)):
            issue_stream(g)

        # ------------------------------------------------------------ steps
        def step(s):
            def mma(acc_ref, t, a, kc):
                acc_t = acc_ref.at[pl.ds(t * UNIT, UNIT)] if tiles > 1 else acc_ref
                plgpu.wgmma(acc_t, a, xb.at[kc].T)

            def reg_operand(u):
                if not emulate:
                    return regs[u]
                a_tmp = sc["a_tmp"].at[wg]
                a_tmp[...] = regs[u]
                plgpu.commit_smem()
                return a_tmp

            def streamed_unit(acc_ref, kc, t, i):
                g = s * n_str + i
                slot = g % n_ring
                with jax.named_scope("w_wait"):
                    plgpu.barrier_wait(wbar.at(slot))
                # reads 8 KiB of W (L2 -> smem by TMA) and the bf16 state tile from smem
                mma(acc_ref, t, ring.at[slot].T, kc)
                plgpu.wgmma_wait(lag)  # streamed unit i - lag is done: refill its slot
                if isinstance(i, int):
                    if i >= lag:
                        release(s, i - lag)
                else:
                    pl.when(i >= lag)(lambda: release(s, i - lag))

            def finish_stream():
                """After the step's last streamed unit: refill the slots of the last `lag`."""
                plgpu.wgmma_wait(0)
                for i in range(max(0, n_str - lag), n_str):
                    release(s, i)

            def compute(acc_ref):
                # Chunks that are entirely streamed: one dynamic loop.
                if dyn_chunks:

                    @pl.loop(0, dyn_chunks)
                    def _chunk(pos):
                        kc = streamed_chunk(s, pos)
                        convert_x(s, kc, static=False)
                        for t in range(tiles):
                            streamed_unit(acc_ref, kc, t, pos * tiles + t)

                if n_str and n_str == dyn_chunks * tiles:
                    finish_stream()

                # Chunks holding resident or register units: static code.
                for kc in range(dyn_chunks, k_chunks):
                    convert_x(s, kc, static=True)
                    for t in range(tiles):
                        u = kc * tiles + t
                        if u < first_res:
                            streamed_unit(acc_ref, kc, t, u)
                            if u == n_str - 1:
                                finish_stream()
                        elif u < first_reg:  # A from shared memory: 8 KiB read
                            r = u - first_res
                            if steps == 1:
                                plgpu.barrier_wait(rbar.at(r))
                            else:
                                pl.when(s == 0)(lambda r=r: plgpu.barrier_wait(rbar.at(r)))
                            mma(acc_ref, t, res.at[r].T, kc)
                        else:  # A from registers: no memory traffic
                            mma(acc_ref, t, reg_operand(u - first_reg), kc)

                with jax.named_scope("acc"):
                    acc = acc_ref[...]  # waits for every wgmma of the step
                    # f32 partial sums, one [64, n_pad] tile per 64 columns, in the free x slots
                    for t in range(tiles):
                        xf.at[t][...] = acc[t * UNIT : (t + 1) * UNIT]

            pl.run_scoped(compute, plgpu.ACC((block_cols, n_pad), jnp.float32))
            plgpu.commit_smem()
            if reduce and use_barrier:
                pl.when(s == 0)(lambda: barrier.wait(barrier_epoch0))  # S[0] is zeroed
            with jax.named_scope("partial_out"):
                out = lax.rem(s, n_buf)
                for t in range(tiles):  # writes (adds) block_cols * n_pad * 4 B into L2
                    dst = s_ref.at[out, cols(t), :]
                    if not reduce:
                        plgpu.copy_smem_to_gmem(xf.at[t], dst)
                    elif not emulate:
                        plgpu.copy_smem_to_gmem(xf.at[t], dst, reduction_op="add")
                    else:
                        emulate_reduce_add(xf.at[t], dst, xbar.at(t % n_x_slots))
                if reduce and steps > zero_ahead + 1:
                    ahead = zero_ahead + 1  # the buffer step s + ahead adds into

                    @pl.when(jnp.logical_and(is_zeroer, s < steps - ahead))
                    def _():
                        nxt = lax.rem(s + ahead, n_buf)
                        for t in range(tiles):  # writes block_cols * n_pad * 4 B
                            plgpu.copy_smem_to_gmem(zero, s_ref.at[nxt, cols(t), :])

            with jax.named_scope("partial_wait"):
                # Complete (not only read out of smem) before the barrier signal; the x slots
                # are refilled next.
                plgpu.wait_smem_to_gmem(0)

            if steps > 1:

                @pl.when(s < steps - 1)
                def _next():
                    if flags_sync:
                        with jax.named_scope("barrier"):
                            flags.arrive_and_wait(s + 1)
                    elif use_barrier:
                        with jax.named_scope("barrier"):
                            barrier.arrive()
                            barrier.wait(barrier_epoch0 + s + 1)
                    with jax.named_scope("x_issue"):
                        for kc in range(n_xs):
                            issue_x(s + 1, kc)

        @pl.loop(0, steps)
        def _steps(s):
            with jax.named_scope("step"):
                step(s)

    def emulate_reduce_add(part, dst, bar):
        """Interpret mode only: dst += part through shared memory (blocks run in order)."""
        tmp_val = part[...]
        plgpu.copy_gmem_to_smem(dst, part, bar)
        plgpu.barrier_wait(bar)
        part[...] = part[...] + tmp_val
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(part, dst)

    out_type = jax.ShapeDtypeStruct((n_buf, d, n_pad), jnp.float32)
    kwargs: dict[str, Any] = dict(grid=(cfg.num_blocks(d),), grid_names=("b",))
    if wgs > 1:
        kwargs.update(num_threads=wgs, thread_name="wg")
    params = plgpu.CompilerParams()
    if profile_dir:
        params = plgpu.CompilerParams(
            profile_space=profile_ranges(cfg, d, steps),
            profile_dir=profile_dir,
            profile_bounds_check=True,
        )
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        compiler_params=params,
        interpret=interpret,
        debug=debug,
        **kwargs,
    )


@functools.partial(
    jax.jit, static_argnames=("steps", "cfg", "interpret", "grid_barrier", "profile_dir")
)
def looped_matmul_splitk(
    x: jax.Array,
    w: jax.Array,
    *,
    steps: int,
    cfg: SplitKConfig,
    interpret: Any = None,
    grid_barrier: bool = True,
    profile_dir: str = "",
) -> jax.Array:
    """Unchecked kernel call: x [M, d] bf16, w [d, d] bf16 -> [M, d] bf16."""
    m, d = x.shape
    n_pad = cfg.n_pad(m)
    f = build_splitk(
        m, d, steps, cfg, interpret=interpret, grid_barrier=grid_barrier, profile_dir=profile_dir
    )
    x0 = jnp.pad(x.T.astype(jnp.float32), ((0, 0), (0, n_pad - m)))
    state = f(x0, w)
    return state[(steps - 1) % cfg.state_buffers, :, :m].T.astype(x.dtype)
