"""The Core iteration's weight stream as one persistent kernel (Mosaic GPU, Hopper).

A decode iteration at batch 1 is bound by streaming its weights from HBM once. Launched per
product, each matrix-vector product starts with an empty pipeline and ends with a drain, and the
launches leave gaps. Here one kernel runs `iterations` x the iteration's products (`plan.Phase`),
with a grid barrier between dependent products, and the weight stream never pauses: weights do
not depend on the activations, so each worker's TMA ring runs ahead across the barriers into the
next product's units while the activation vector is exchanged.

Per worker (one warpgroup per SM) and unit (a [64, unit_cols] bf16 weight tile, unit_cols = 64,
128 or 256): wait for the input chunk x[64 rows, n_pad] (f32, TMA from L2), round it to bf16 into
the wgmma B tile, wait for the weight unit in the ring, one wgmma acc[unit_cols, n_pad] +=
unit^T @ x (the weight is the A operand, so a batch of M <= n_pad rows costs what one row does;
wider units pay these fixed steps once per 16 or 32 KiB); when the unit's wgmma is done its ring
slot takes the unit `ring` places later in the worker's sequence, in this product or the next.
At the end of a tile's segment the f32 partial sums go to the product's output by a TMA
reduce-add. The output of product p+1 is zeroed during product p.

This kernel exchanges the raw products (each input is the leading rows of the previous output):
it measures how close the persistent design streams to the read ceiling at the Core's shapes,
before the norms, the attention and the residuals are fused in. Reference: `reference.py`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.core_step.plan import UNIT, Phase, check_chained, min_units
from pallas_kernels.looped_matmul.barrier import GridBarrier
from pallas_kernels.smem import SMEM_LIMIT, aligned

SWIZZLE_128 = (plgpu.TilingTransform((8, UNIT)), plgpu.SwizzleTransform(128))
MAX_RING = 32  # barriers per array


def n_pad_rows(m: int) -> int:
    """Rows of the activation as multiplied: M rounded up to a multiple of 8 (the wgmma N)."""
    return max(8, -(-m // 8) * 8)


def default_ring(unit_cols: int) -> int:
    """16 slots of [64, 64], or as many wider slots as hold the same 128 KiB."""
    return max(1, 16 * UNIT // unit_cols)


def smem_bytes(ring: int, x_stages: int, lag: int, unit_cols: int, n_pad: int) -> int:
    """Shared memory of one block: the weight ring, the f32 input chunks, the bf16 B tiles, the
    output and zero tiles (each aligned to 1 KiB as Pallas allocates them), the mbarriers."""
    buffers = (
        ring * UNIT * unit_cols * 2,  # ring_ref
        x_stages * UNIT * n_pad * 4,  # xf
        (lag + 1) * n_pad * UNIT * 2,  # xb
        unit_cols * n_pad * 4,  # out
        unit_cols * n_pad * 4,  # zero
    )
    return sum(aligned(b) for b in buffers) + 8 * (ring + x_stages)


def check_schedule(
    phases: tuple[Phase, ...],
    workers: int,
    ring: int,
    x_stages: int,
    *,
    unit_cols: int = UNIT,
    lag: int = 1,
    m: int = 1,
) -> None:
    """ValueError unless the schedule can run: chained phases padded to the tile width, a unit's
    copy issued before its wait (lag < ring), every worker owning more units of each phase than
    the ring holds (a slot's next unit is then in the same phase or the next one, the only ones
    `release` looks at), and the buffers fitting in shared memory."""
    check_chained(phases, unit_cols)
    if not 1 <= ring <= MAX_RING:
        raise ValueError(f"ring={ring} must be in [1, {MAX_RING}]")
    if not 0 <= lag < ring:
        raise ValueError(f"lag={lag} must be in [0, ring={ring}): a slot is reused after it")
    if not 1 <= x_stages <= ring:
        raise ValueError(f"x_stages={x_stages} must be in [1, ring={ring}]")
    fewest = min_units(phases, workers, unit_cols)
    if fewest <= ring:
        raise ValueError(
            f"a worker owns {fewest} units of some phase with {workers} workers and "
            f"unit_cols={unit_cols}: the ring ({ring}) must be shorter (fewer workers, narrower "
            "units or a shorter ring)"
        )
    need = smem_bytes(ring, x_stages, lag, unit_cols, n_pad_rows(m))
    if need > SMEM_LIMIT:
        raise ValueError(
            f"ring={ring} of [{UNIT}, {unit_cols}] units, x_stages={x_stages}, m={m}: "
            f"{need} bytes of shared memory > {SMEM_LIMIT} (shorten the ring)"
        )


def build_weight_stream(
    phases: tuple[Phase, ...],
    m: int,
    iterations: int,
    *,
    workers: int,
    unit_cols: int = UNIT,
    ring: int | None = None,
    x_stages: int = 4,
    lag: int = 1,
    interpret: Any = None,
    profile_dir: str = "",
):
    """Returns f(x0 [k0, n_pad] f32, *weights [k, n] bf16) -> y [phases, n_max, n_pad] f32,
    the last iteration's result in y[-1, :phases[-1].n]. Weight tiles are [64, unit_cols];
    ring=None: `default_ring(unit_cols)`. Interpret mode: one worker only (it has no global
    semaphores for the grid barrier). `profile_dir`: Mosaic GPU's on-device profiler records
    each phase's (named as it) and each barrier's entry and exit (SM clock) there."""
    if interpret is not None and workers != 1:
        raise ValueError("interpret mode runs one worker only (no grid barrier)")
    ring = default_ring(unit_cols) if ring is None else ring
    check_schedule(phases, workers, ring, x_stages, unit_cols=unit_cols, lag=lag, m=m)
    cols = unit_cols
    n_pad, n_phases = n_pad_rows(m), len(phases)
    state_chunks = phases[-1].n // UNIT
    n_max = max(p.n for p in phases)
    reduce = workers > 1  # one worker writes every tile whole
    xb_slots = lag + 1  # a B tile is rewritten once its wgmma is done
    bf16, f32 = jnp.bfloat16, jnp.float32

    def body(x0_ref, *refs, ring_ref, wbar, xf, xbar, xb, out, zero):
        w_refs, y_ref = refs[:n_phases], refs[n_phases]
        worker = lax.axis_index("b")
        barrier = GridBarrier(workers, "wait", 0, 1) if reduce else None
        units = [p.units(cols) for p in phases]
        first = [u * worker // workers for u in units]
        count = [u * (worker + 1) // workers - f for u, f in zip(units, first, strict=True)]
        cum = [sum(count[:q], jnp.int32(0)) for q in range(n_phases)]
        per_iteration = sum(count, jnp.int32(0))

        def issue_weight(q, j, c):
            """TMA of unit j of the worker's range in phase q into ring slot c % ring."""
            u = first[q] + j
            t = u // phases[q].k_chunks
            kc = u - t * phases[q].k_chunks
            slot = lax.rem(c, ring)
            src = w_refs[q].at[pl.ds(kc * UNIT, UNIT), pl.ds(t * cols, cols)]
            plgpu.copy_gmem_to_smem(src, ring_ref.at[slot], wbar.at[slot])  # 8-32 KiB of W

        def release(it, p, j):
            """Unit j of phase p is done: its slot takes the unit `ring` places later."""
            jj = j + ring
            c = it * per_iteration + cum[p] + jj
            pl.when(jj < count[p])(lambda: issue_weight(p, jj, c))
            if p + 1 < n_phases:
                pl.when(jj >= count[p])(lambda: issue_weight(p + 1, jj - count[p], c))
            else:
                more = jnp.logical_and(jj >= count[p], it < iterations - 1)
                pl.when(more)(lambda: issue_weight(0, jj - count[p], c))

        def zero_buffer(q):
            """Zeroes the worker's tiles (t = worker mod workers) of phase q's output."""
            tiles = phases[q].tiles(cols)

            @pl.loop(0, -(-tiles // workers))
            def _(r):
                t = worker + r * workers
                pl.when(t < tiles)(
                    lambda: plgpu.copy_smem_to_gmem(zero, y_ref.at[q, pl.ds(t * cols, cols), :])
                )

        def phase(it, p):
            kch, n, u0 = phases[p].k_chunks, count[p], first[p]
            c0 = it * per_iteration + cum[p]

            def issue_x(i):
                """TMA of the f32 input chunk of local unit i into x slot i % x_stages."""
                slot = lax.rem(i, x_stages)
                rows = pl.ds(lax.rem(u0 + i, kch) * UNIT, UNIT)
                kc = lax.rem(u0 + i, kch)

                def copy(src):
                    plgpu.copy_gmem_to_smem(src, xf.at[slot], xbar.at[slot])

                if p > 0:
                    copy(y_ref.at[p - 1, rows, :])
                else:  # the state rows from the last iteration, the rest from x0
                    from_state = jnp.logical_and(kc < state_chunks, it > 0)
                    pl.when(from_state)(lambda: copy(y_ref.at[n_phases - 1, rows, :]))
                    pl.when(jnp.logical_not(from_state))(lambda: copy(x0_ref.at[rows, :]))

            for i in range(x_stages):  # every worker owns more than `ring` >= x_stages units
                issue_x(i)
            if reduce:
                if p + 1 < n_phases:
                    zero_buffer(p + 1)
                else:
                    pl.when(it < iterations - 1)(lambda: zero_buffer(0))

            @pl.loop(u0 // kch, (u0 + n - 1) // kch + 1)
            def _segment(t):
                ua = jnp.maximum(u0, t * kch) - u0
                ub = jnp.minimum(u0 + n, (t + 1) * kch) - u0

                def compute(acc):
                    @pl.loop(ua, ub)
                    def _unit(i):
                        xs, bs = lax.rem(i, x_stages), lax.rem(i, xb_slots)
                        plgpu.barrier_wait(xbar.at[xs])
                        chunk = plgpu.load(xf.at[xs], layout=plgpu.Layout.WGMMA)
                        xb.at[bs].T[...] = chunk.astype(bf16)  # stmatrix.trans into the B tile
                        plgpu.commit_smem()  # every thread is done with the f32 slot
                        pl.when(i + x_stages < n)(lambda: issue_x(i + x_stages))
                        slot = lax.rem(c0 + i, ring)
                        plgpu.barrier_wait(wbar.at[slot])
                        # A = the [64, cols] unit transposed: cols / 64 m64 wgmma groups
                        plgpu.wgmma(acc, ring_ref.at[slot].T, xb.at[bs].T)
                        plgpu.wgmma_wait(lag)  # unit i - lag is done
                        pl.when(i - lag >= ua)(lambda: release(it, p, i - lag))

                    partial = acc[...]  # waits for the segment's wgmmas
                    for back in range(lag, 0, -1):
                        j = ub - back
                        pl.when(j >= ua)(lambda j=j: release(it, p, j))
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # `out` is free
                    out[...] = partial
                    plgpu.commit_smem()
                    dst = y_ref.at[p, pl.ds(t * cols, cols), :]
                    if reduce:
                        plgpu.copy_smem_to_gmem(out, dst, reduction_op="add")
                    else:
                        plgpu.copy_smem_to_gmem(out, dst)

                pl.run_scoped(compute, plgpu.ACC((cols, n_pad), f32))

            plgpu.wait_smem_to_gmem(0)  # sums and zeroing complete before the barrier

        def cross(it, p):
            epoch = 1 + it * n_phases + p + 1

            def go():
                with jax.named_scope("barrier"):
                    barrier.arrive()
                    barrier.wait(epoch)

            if p == n_phases - 1:
                pl.when(it < iterations - 1)(go)
            else:
                go()

        # Prologue: the ring's first fill, phase 0's output zeroed, one barrier.
        for g in range(ring):
            issue_weight(0, g, g)
        zero[...] = jnp.zeros((cols, n_pad), f32)
        plgpu.commit_smem()
        if reduce:
            zero_buffer(0)
            plgpu.wait_smem_to_gmem(0)
            barrier.arrive()
            barrier.wait(1)

        @pl.loop(0, iterations)
        def _iteration(it):
            for p in range(n_phases):
                with jax.named_scope(phases[p].name):
                    phase(it, p)
                if reduce:
                    cross(it, p)

    scratch = dict(
        ring_ref=plgpu.SMEM((ring, UNIT, cols), bf16, transforms=SWIZZLE_128),
        wbar=plgpu.Barrier(num_barriers=ring),
        xf=plgpu.SMEM((x_stages, UNIT, n_pad), f32),
        xbar=plgpu.Barrier(num_barriers=x_stages),
        xb=plgpu.SMEM((xb_slots, n_pad, UNIT), bf16, transforms=SWIZZLE_128),
        out=plgpu.SMEM((cols, n_pad), f32),
        zero=plgpu.SMEM((cols, n_pad), f32),
    )
    params = plgpu.CompilerParams()
    if profile_dir:  # two ranges per phase (its own and its barrier's), and a few more
        params = plgpu.CompilerParams(
            profile_space=2 * iterations * n_phases + 8, profile_dir=profile_dir
        )
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((n_phases, n_max, n_pad), f32),
        scratch_types=scratch,
        grid=(workers,),
        grid_names=("b",),
        compiler_params=params,
        interpret=interpret,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "phases",
        "iterations",
        "workers",
        "unit_cols",
        "ring",
        "x_stages",
        "lag",
        "interpret",
        "profile_dir",
    ),
)
def weight_stream(
    x0: jax.Array,
    weights: tuple[jax.Array, ...],
    *,
    phases: tuple[Phase, ...],
    iterations: int,
    workers: int,
    unit_cols: int = UNIT,
    ring: int | None = None,
    x_stages: int = 4,
    lag: int = 1,
    interpret: Any = None,
    profile_dir: str = "",
) -> jax.Array:
    """x0 [M, k0] (the state rows, then the external rows) -> [M, n_last] f32 after
    `iterations` iterations of the phases. weights[p]: [k, n] bf16 of phases[p], n a multiple
    of unit_cols (`core_phases(..., unit_cols)`); `profile_dir`: `build_weight_stream`'s."""
    m, _ = x0.shape
    n_pad = n_pad_rows(m)
    f = build_weight_stream(
        phases,
        m,
        iterations,
        workers=workers,
        unit_cols=unit_cols,
        ring=ring,
        x_stages=x_stages,
        lag=lag,
        interpret=interpret,
        profile_dir=profile_dir,
    )
    x0_t = jnp.pad(x0.T.astype(jnp.float32), ((0, 0), (0, n_pad - m)))
    y = f(x0_t, *weights)
    return y[-1, : phases[-1].n, :m].T
