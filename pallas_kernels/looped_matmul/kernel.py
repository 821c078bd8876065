"""Persistent looped matmul on Hopper, Mosaic GPU backend: `steps` matmuls in one launch.

Math. The chain x <- x @ w is computed transposed, x^T <- w^T x^T, so that the weight is the
wgmma's A operand (M = output columns, 64 per instruction) and the small state is its B operand
(N = M rows padded to n_pad in {16, 32, 64}). With x as A instead, M <= 64 rows would be padded to
64 and a step would cost 64 * d^2 multiply-adds whatever M is. The state lives in global memory
transposed and padded, state^T [d, n_pad] bf16, zero in the padding columns (0 @ w stays 0).

Partition. Block b owns output columns [b*block_cols, (b+1)*block_cols): the weight slice
w[:, cols] [d, block_cols], cut into d/block_k chunks [block_k, block_cols]. The first
`resident_chunks` chunks are copied (TMA) into shared memory once, before the loop, and reused
at every step; the others are streamed each step through a `stream_stages`-deep ring (TMA,
mbarriers). The streamed sequence is periodic across steps, so the ring prefetches the next
step's first chunks while the current step ends and while the block waits at the barrier.

Per step and block: wait for the state chunks [block_k, n_pad] (x ring), one wgmma per chunk
acc[block_cols, n_pad] += chunk^T @ state_chunk (float32; `wgmma_lag` groups stay in flight, a
chunk's ring slots are refilled once its group is done), then acc -> bf16 -> shared memory ->
TMA store of state^T[cols, :] into one of two global buffers (step s writes buffer s % 2 and
reads buffer (s-1) % 2, so a write never races a read of the previous step), wait for the
store, then a grid barrier: a global semaphore used as an epoch counter (every block adds 1,
then waits until it reads num_blocks * (steps done); `barrier.GridBarrier`). This kernel polls
with every thread (`all_threads`, the poll its GPU tests cover); the split-K kernel's cheaper
default `wait` is untested here (docs/looped_matmul.md).

Traffic per step, whole grid (W = d*d*2 bytes, R = resident fraction of each slice):
- shared memory: reads W bytes of weight (every chunk once, resident or ring) plus
  num_blocks * d * n_pad * 2 bytes of state; the wgmma reads both operands from shared memory.
- L2 -> SM: (1 - R) * W bytes of streamed weight plus num_blocks * d * n_pad * 2 bytes of state
  (every block reads the whole state); writes d * n_pad * 2 bytes of state.
- HBM: ideally nothing after the first step: the streamed (1 - R) * W must stay in L2 (60 MiB
  on the H200, shared with the state). First step: W bytes (resident and streamed).
  Per chain: W + (steps - 1) * (L2 misses of the streamed part); stacked weights: steps * W.
On-chip capacity assumed: one block per SM, <= 132 blocks, 227 KiB of shared memory per block
(232,448 B opt-in), i.e. about 29 MiB of resident weight over the whole H200 at best, and the
streamed remainder (<= ~45 MiB) held by the 60 MiB L2 between steps.

Use: stacked weights, and shapes where no split-K tiling fits. For one weight and small M the
split-K kernel (`splitk_kernel.py`: 2-D split over all SMs, weight in registers + shared memory,
one state round trip per step) is faster; docs/looped_matmul.md has both kernels' times and why
this one misses the 72 MiB target.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.looped_matmul.barrier import GridBarrier
from pallas_kernels.looped_matmul.config import LoopedMatmulConfig


def build_looped_matmul(
    m: int,
    d: int,
    steps: int,
    cfg: LoopedMatmulConfig,
    *,
    stacked: bool = False,
    interpret: Any = None,
    grid_barrier: bool = True,
    debug: bool = False,
):
    """Returns f(xT [d, n_pad] bf16, w) -> state [2, d, n_pad] bf16, result in state[(steps-1) % 2].

    w is [d, d] bf16, or [steps, d, d] when `stacked`. `m` only fixes n_pad (cfg.n_pad(m)).
    `grid_barrier=False` drops the barrier (only correct for one block or one step; for debugging
    and interpret mode, which cannot run a global semaphore).
    """
    n_pad = cfg.n_pad(m)
    block_cols, block_k = cfg.block_cols, cfg.block_k
    num_blocks = d // block_cols
    num_chunks = d // block_k
    n_resident = cfg.resident_chunks
    n_streamed = num_chunks - n_resident  # streamed chunks per step
    n_ring = cfg.stream_stages if n_streamed else 0
    x_slots = min(cfg.x_stages, num_chunks)
    lag = cfg.wgmma_lag
    total_streamed = steps * n_streamed
    use_barrier = grid_barrier and steps > 1 and num_blocks > 1
    if interpret is not None and use_barrier:
        raise ValueError(
            "interpret mode cannot run the grid barrier (no global semaphores): use one block "
            "(block_cols = d) or steps = 1"
        )
    dtype = jnp.bfloat16
    # One swizzle for every operand: the state chunk [block_k, n_pad] is N-major B, its rows are
    # n_pad * 2 bytes, and wgmma needs A's swizzle to equal B's.
    swizzle = n_pad * 2
    transforms = (plgpu.TilingTransform((8, n_pad)), plgpu.SwizzleTransform(swizzle))

    scratch: dict[str, Any] = dict(
        xring=plgpu.SMEM((x_slots, block_k, n_pad), dtype, transforms=transforms),
        xbar=plgpu.Barrier(num_barriers=x_slots),
        out_smem=plgpu.SMEM((block_cols, n_pad), dtype, transforms=transforms),
    )
    if n_resident:
        scratch["res"] = plgpu.SMEM((n_resident, block_k, block_cols), dtype, transforms=transforms)
        scratch["rbar"] = plgpu.Barrier(num_barriers=n_resident)
    if n_ring:
        scratch["wring"] = plgpu.SMEM((n_ring, block_k, block_cols), dtype, transforms=transforms)
        scratch["wbar"] = plgpu.Barrier(num_barriers=n_ring)

    def body(x_ref, w_ref, state_ref, **smem):
        xring, xbar, out_smem = smem["xring"], smem["xbar"], smem["out_smem"]
        res, rbar = smem.get("res"), smem.get("rbar")
        wring, wbar = smem.get("wring"), smem.get("wbar")
        block = lax.axis_index("b")
        cols = pl.ds(block * block_cols, block_cols)
        barrier = GridBarrier(num_blocks, "all_threads", 0, 1) if use_barrier else None

        def w_chunk(step, kc):
            rows = pl.ds(kc * block_k, block_k)
            return w_ref.at[step, rows, cols] if stacked else w_ref.at[rows, cols]

        def issue_stream(g):
            """TMA of streamed chunk number g (global over steps) into ring slot g % n_ring."""
            step, kc = g // n_streamed, n_resident + g % n_streamed
            slot = g % n_ring
            # reads block_k*block_cols*2 B of W from L2 (HBM on the first step)
            plgpu.copy_gmem_to_smem(w_chunk(step, kc), wring.at[slot], wbar.at[slot])

        def issue_x(s, kc):
            """TMA of state rows [kc*block_k, (kc+1)*block_k) of step s's input into x slot
            kc % x_slots."""
            rows = pl.ds(kc * block_k, block_k)
            slot = kc % x_slots

            # reads block_k*n_pad*2 B of state from L2
            def from_input():
                plgpu.copy_gmem_to_smem(x_ref.at[rows, :], xring.at[slot], xbar.at[slot])

            def from_state():
                src = state_ref.at[lax.rem(s + 1, 2), rows, :]  # buffer (s - 1) % 2
                plgpu.copy_gmem_to_smem(src, xring.at[slot], xbar.at[slot])

            if steps == 1:
                from_input()
            else:
                pl.when(s == 0)(from_input)
                pl.when(s > 0)(from_state)

        def release(s, j):
            """Chunk j's wgmma has completed: refill its x slot and (if streamed) its ring slot."""
            if x_slots < num_chunks:

                @pl.when(j + x_slots < num_chunks)
                def _():
                    issue_x(s, j + x_slots)

            if n_ring:

                @pl.when(j >= n_resident)
                def _():
                    g = s * n_streamed + (j - n_resident) + n_ring

                    @pl.when(g < total_streamed)
                    def _():
                        issue_stream(g)

        # Prologue: resident weight, loaded once (reads n_resident * chunk bytes of W from HBM).
        for r in range(n_resident):
            plgpu.copy_gmem_to_smem(w_chunk(0, r), res.at[r], rbar.at[r])
        # First ring fill; later fills run ahead across steps.
        for g in range(min(n_ring, total_streamed)):
            issue_stream(g)

        @pl.loop(0, steps)
        def _step(s):
            for kc in range(x_slots):
                issue_x(s, kc)

            def compute(acc_ref):
                if n_resident:

                    @pl.loop(0, n_resident)
                    def _resident(kc):
                        if steps == 1:
                            plgpu.barrier_wait(rbar.at[kc])
                        else:
                            pl.when(s == 0)(lambda: plgpu.barrier_wait(rbar.at[kc]))
                        xs = kc % x_slots
                        plgpu.barrier_wait(xbar.at[xs])
                        # reads a chunk of resident W and block_k*n_pad*2 B of state from smem
                        plgpu.wgmma(acc_ref, res.at[kc].transpose((1, 0)), xring.at[xs])
                        plgpu.wgmma_wait(lag)  # chunk kc-lag is done: refill its slots
                        pl.when(kc >= lag)(lambda: release(s, kc - lag))

                if n_streamed:

                    @pl.loop(n_resident, num_chunks)
                    def _streamed(kc):
                        xs = kc % x_slots
                        plgpu.barrier_wait(xbar.at[xs])
                        slot = (s * n_streamed + (kc - n_resident)) % n_ring
                        plgpu.barrier_wait(wbar.at[slot])
                        plgpu.wgmma(acc_ref, wring.at[slot].transpose((1, 0)), xring.at[xs])
                        plgpu.wgmma_wait(lag)
                        pl.when(kc >= lag)(lambda: release(s, kc - lag))

                acc = acc_ref[...]  # waits for every wgmma of the step
                for j in range(max(0, num_chunks - lag), num_chunks):  # the last `lag` chunks
                    release(s, j)
                out_smem[...] = acc.astype(dtype)  # bf16 rounding of the state, as in the chain

            pl.run_scoped(compute, plgpu.ACC((block_cols, n_pad), jnp.float32))
            plgpu.commit_smem()
            # writes block_cols*n_pad*2 B of state
            plgpu.copy_smem_to_gmem(out_smem, state_ref.at[lax.rem(s, 2), cols, :])
            # The store must be complete (not only read out of smem) before the barrier signal,
            # and out_smem is rewritten next step.
            plgpu.wait_smem_to_gmem(0)

            if use_barrier:

                @pl.when(s < steps - 1)
                def _barrier():
                    barrier.arrive()
                    barrier.wait(s + 1)  # barriers passed, this one included

    out_type = jax.ShapeDtypeStruct((2, d, n_pad), dtype)
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        grid=(num_blocks,),
        grid_names=("b",),
        compiler_params=plgpu.CompilerParams(),
        interpret=interpret,
        debug=debug,  # prints the kernel jaxpr and the Mosaic GPU module when lowering
    )


def to_state(x: jax.Array, n_pad: int) -> jax.Array:
    """[M, d] -> transposed, zero-padded state [d, n_pad] (same dtype)."""
    m, _ = x.shape
    return jnp.pad(x.T, ((0, 0), (0, n_pad - m)))


def from_state(state: jax.Array, m: int, steps: int) -> jax.Array:
    """state [2, d, n_pad] from the kernel -> the final [M, d]."""
    return state[(steps - 1) % 2, :, :m].T


@functools.partial(
    jax.jit, static_argnames=("steps", "cfg", "stacked", "interpret", "grid_barrier")
)
def looped_matmul_kernel(
    x: jax.Array,
    w: jax.Array,
    *,
    steps: int,
    cfg: LoopedMatmulConfig,
    stacked: bool = False,
    interpret: Any = None,
    grid_barrier: bool = True,
) -> jax.Array:
    """Unchecked kernel call: x [M, d] bf16, w [d, d] (or [steps, d, d]) bf16 -> [M, d] bf16."""
    m, d = x.shape
    n_pad = cfg.n_pad(m)
    f = build_looped_matmul(
        m, d, steps, cfg, stacked=stacked, interpret=interpret, grid_barrier=grid_barrier
    )
    state = f(to_state(x, n_pad), w)
    return from_state(state, m, steps)
