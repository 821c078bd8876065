"""The whole Core decode iteration as one persistent kernel (Mosaic GPU, Hopper).

The weight stream of `stream.py` (a TMA ring per worker that runs ahead across the grid
barriers, [64, unit_cols] weight units as the wgmma A operand, partial sums reduce-added into
each product's output) with the rest of the iteration fused in, as `step_program.py` specifies,
so that most products take their input as it is, as the bare stream does:

- the norms' gains are folded into the weights' rows (`fused_step.pack_weights`); their
  rsqrt(mean(z²) + eps) scales a product's output after its barrier. The sums of squares are
  reduced beside a product, from its input chunks, by the worker that owns the chunk's unit in
  tile kc mod tiles (so the owners spread over the workers);
- the residuals are added into the products' outputs: at the end of proj and of the mlp proj,
  each worker reduce-adds its chunks of x g rsqrt(...) into the output, so that the output is
  the next product's input;
- two products build their input per unit: layer 0's qkv (a r + e @ Wa[D:], r the state's norm
  from the adapter step, stored for layer 0's residual) and the mlp proj (the SiLU gate of the
  scaled fc output); the first iteration's adapter multiplies the given state by the adapter's
  own rows (later ones by the rows with norm_4 folded in);
- between qkv and proj, the attention step (`fused_attention.py`). With `Schedule.overlap`
  each worker's qkv units are two ranges, its share of the tiles that hold q, then of the
  rest; once every worker has put out the first (a counter, not a barrier), a second
  warpgroup per worker runs its attention item's cached blocks while the first streams the
  second range. Each warpgroup's scopes of shared memory are then a union of their own.

1 + 5 L hand-overs per iteration: grid barriers, but after proj and after an MLP proj that a qkv
follows, where the next product's first units wait for the tiles of their input on counters
(`fused_plan.Schedule.handover`). Activations are [rows, 8] float32 (`fused_plan.py`).
Reference: `step_program.core_iteration`; inputs and outputs: `fused_step.py`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.core_step.fused_attention import (
    attention_step,
    blocks_ahead,
    prefetch_blocks,
)
from pallas_kernels.core_step.fused_inputs import KernelContext, scaled, sources
from pallas_kernels.core_step.fused_plan import (
    DEFAULT_SCHEDULE,
    N_PAD,
    PRODUCT_KINDS,
    REDUCTION_SCRATCH,
    SCALAR_ROWS,
    SCOPES,
    SHIFT,
    STEP_KINDS,
    WARPGROUP_SCOPES,
    Buffers,
    FusedShape,
    Schedule,
    check_fused,
    kind_of,
    profile_ranges,
    scoped,
    scratch_types,
    second_warpgroup_types,
    splits_for,
    tile_signals,
    union_layout,
    unit_ranges,
)
from pallas_kernels.core_step.plan import UNIT, pad_to
from pallas_kernels.core_step.tiles import WGMMA, bcast_rows, col_of, in_row
from pallas_kernels.looped_matmul.barrier import GridBarrier


def build_fused_core(
    shape: FusedShape,
    iterations: int,
    *,
    workers: int,
    eps: float,
    schedule: Schedule = DEFAULT_SCHEDULE,
    x_stages: int = 2,
    lag: int = 1,
    interpret: Any = None,
    profile_dir: str = "",
    skip_barriers: tuple[str, ...] = (),
):
    """Returns f(meta, state0, e_part, gains, tables, rope_bias, k_cache, v_cache, *weights)
    -> (act, scalars, partials, kv_new), weights one array per kind of product
    (`FusedShape.weight_shapes`); `fused_step.py` builds the inputs and reads the outputs.
    `schedule` (`fused_plan.Schedule`): `ring` weight units in flight per worker into shared
    memory, `kv_stages` cached blocks of `kv_block` positions in flight in the attention;
    `l2_units` > 0 also prefetches into L2 the unit that many further on, `l2_blocks` > 0
    each attention item's first blocks, `l2_barrier` and `l2_attention` the next product's
    units after the ring's once the worker has arrived at the barrier after a product (all
    slower on the H200 than without: docs/core_step.md).
    Interpret mode: one worker (no global semaphores; prefetches are no-ops). `profile_dir`:
    Mosaic GPU's on-device profiler records every step's, barrier's (also by the kind of step
    it follows: after_qkv, after_attn, ...) and attention part's (`fused_plan.ATTENTION_PARTS`)
    entry and exit (SM clock) there. `skip_barriers`: kinds of step (`fused_plan.STEP_KINDS`)
    after which the grid barrier is left out, the last of an iteration kept: a timing bound of
    what those barriers cost, whose results are wrong."""
    if set(skip_barriers) - set(STEP_KINDS):
        raise ValueError(f"skip_barriers={skip_barriers}: each must be one of {STEP_KINDS}")
    if interpret is not None and workers != 1:
        raise ValueError("interpret mode runs one worker only (no grid barrier)")
    if schedule.overlap and interpret is not None:
        raise ValueError("overlap runs two warpgroups per worker: on the GPU only")
    if interpret is None and (shape.head_dim % 16 or (shape.d - shape.kp) % 16):
        raise ValueError(
            f"head_dim={shape.head_dim} and d - {shape.kp} must be multiples of 16: a head's "
            "cache columns are copied into tiles of 16 columns"
        )
    check_fused(shape, workers, schedule, x_stages, lag, iterations if profile_dir else 0)
    ring, kv_stages = schedule.ring, schedule.kv_stages
    l2_units, l2_blocks = schedule.l2_units, schedule.l2_blocks
    phases, cols, layers = shape.phases, shape.unit_cols, shape.layers
    n_phases, n_kinds = len(phases), len(PRODUCT_KINDS)
    splits = splits_for(shape.heads, workers)
    overlap = bool(schedule.overlap)
    steps_per_iteration = shape.steps_per_iteration
    barrier_of = {}  # step -> its barrier's place in the iteration, for the barriers kept
    for step, kind in enumerate(shape.step_kinds):
        if step == steps_per_iteration - 1 or kind not in skip_barriers:
            barrier_of[step] = len(barrier_of)
    chunks_d = shape.k_d // UNIT  # 64-row chunks of a d-vector
    bf16, f32 = jnp.bfloat16, jnp.float32

    def body(meta, state, e_part, gains, tables, rope_bias, k_cache, v_cache, *refs):
        w_refs = dict(zip(PRODUCT_KINDS, refs[:n_kinds], strict=True))
        act, scal, parts, kv_new = refs[n_kinds : n_kinds + 4]
        worker = lax.axis_index("b")
        named = dict(zip(SCRATCH_NAMES, refs[n_kinds + 4 :], strict=True))
        k = KernelContext(
            shape=shape, eps=eps, workers=workers, splits=splits, items=shape.heads * splits,
            reduce=workers > 1, worker=worker, meta=meta, pos=meta[0], act=act, scal=scal,
            parts=parts, kv_new=kv_new, tables=tables, rope_bias=rope_bias, k_cache=k_cache,
            v_cache=v_cache, s={name: named[name] for name in scratch},
            scope=scopes_of(named, "first"), kv_stages=kv_stages, kv_block=schedule.kv_block,
            overlap=overlap, parts_ready=named.get("second.parts_ready"),
            flags=pl.get_global(plgpu.SemaphoreType.REGULAR((shape.heads,)))
            if splits > 1 else None,
            q_done=pl.get_global(plgpu.SemaphoreType.REGULAR) if overlap else None,
        )  # fmt: skip
        s = k.s
        barrier = GridBarrier(workers, "wait", 0, 1) if k.reduce else None
        handover = schedule.handover if k.reduce else 0
        per_tile = cols // UNIT  # 64-row chunks of an output tile

        def hands_over(p):
            """Whether the product after p starts on p's tile counters (`Schedule.handover`)."""
            kind, _ = kind_of(phases[p].name)
            kept = kind not in skip_barriers
            return handover > 0 and kept and p + 1 < n_phases and kind in ("proj", "mlp_proj")

        tile_base, counted = {}, 0
        for p in range(n_phases):
            if hands_over(p):
                tile_base[p], counted = counted, counted + phases[p].tiles(cols)
        tile_done = pl.get_global(plgpu.SemaphoreType.REGULAR((counted,))) if counted else None

        # per product, the worker's ranges of units (first, count), in the order it takes them
        pieces = [unit_ranges(shape, phase, worker, workers, overlap) for phase in phases]

        def split_q(p):
            """Whether product p's units are two ranges: q's tiles, then the rest (overlap)."""
            return len(pieces[p]) > 1

        first = [ranges[0][0] for ranges in pieces]
        count = [sum(n for _, n in ranges) for ranges in pieces]
        cum = [sum(count[:q], jnp.int32(0)) for q in range(n_phases)]
        per_iteration = sum(count, jnp.int32(0))

        def unit_of(p, i):
            """The unit that is the worker's i-th of product p."""
            (a0, na), *rest = pieces[p]
            if not rest:
                return a0 + i
            ((b0, _),) = rest
            return jnp.where(i < na, a0 + i, b0 + i - na)

        def send_unit(q, j, raw, send):
            """send(unit) of unit j of the worker's range in phase q (a [64, cols] GMEM ref);
            `raw`: the adapter's own rows (the first iteration's, whose state is not normed)."""
            u = unit_of(q, j)
            t = u // phases[q].k_chunks
            kc = u - t * phases[q].k_chunks
            kind, layer = kind_of(phases[q].name)
            if kind == "adapter":  # [with norm_4 folded in, raw]
                layer = jnp.asarray(raw, jnp.int32)
            send(w_refs[kind].at[layer, t, pl.ds(kc * UNIT, UNIT), :])

        def issue_weight(q, j, c, raw):
            """TMA of unit j of phase q into ring slot c % ring."""
            slot = lax.rem(c, ring)
            dst, bar = s["ring"].at[slot], s["wbar"].at[slot]
            send_unit(q, j, raw, lambda src: plgpu.copy_gmem_to_smem(src, dst, bar))

        def prefetch_weight(q, j, raw):
            """Unit j of phase q into L2 (its TMA into the ring comes `l2_units` units later)."""
            send_unit(q, j, raw, plgpu.async_prefetch)

        def ahead(it, p, jj, issue):
            """issue(q, j, raw) of the unit jj places after unit 0 of phase p: in this phase
            or the next (of the next iteration after the last); jj < the next phase's count."""
            same = jnp.logical_and(it == 0, p == 0)
            pl.when(jj < count[p])(lambda: issue(p, jj, same))
            if p + 1 < n_phases:
                pl.when(jj >= count[p])(lambda: issue(p + 1, jj - count[p], False))
            else:
                more = jnp.logical_and(jj >= count[p], it < iterations - 1)
                pl.when(more)(lambda: issue(0, jj - count[p], False))

        def release(it, p, j):
            """Unit j of phase p is done: its slot takes the unit `ring` places later, and the
            unit `ring + l2_units` places later goes into L2. When that L2 lookahead leaves a
            qkv, the attention's first cached blocks go into L2 too."""
            jj = j + ring
            c = it * per_iteration + cum[p] + jj
            ahead(it, p, jj, lambda q, jq, raw: issue_weight(q, jq, c, raw))
            if l2_units:
                ahead(it, p, jj + l2_units, prefetch_weight)
            kind, layer = kind_of(phases[p].name)
            if l2_blocks and kind == "qkv":
                pl.when(jj + l2_units == count[p])(lambda: prefetch_blocks(k, it, layer, l2_blocks))

        def zero_rows(buf, offset, n):
            """The worker's tiles of act[buf, offset : offset + n] set to 0, a 64-row chunk per
            copy (the tile of zeros is one chunk, to leave the shared memory to the rest)."""
            tiles = n // cols

            @pl.loop(0, -(-tiles // workers))
            def _(r):
                t = worker + r * workers

                @pl.when(t < tiles)
                def _():
                    for c in range(per_tile):
                        dst = act.at[buf, pl.ds(offset + t * cols + c * UNIT, UNIT), :]
                        plgpu.copy_smem_to_gmem(s["zero"], dst)

        def output_of(p):
            """(buffer, row offset) of product p's output."""
            kind, j = kind_of(phases[p].name)
            if kind == "adapter":
                return Buffers.A, 0
            kind = {"qkv": "qkv", "proj": "o", "fc": "fc", "mlp_proj": "m"}[kind]
            return Buffers.of(kind, j), SHIFT if kind == "qkv" else 0

        def residual_chunks(p):
            """64-row chunks of the residual product p adds into its output (0: none)."""
            return chunks_d if sources(shape, p)[5] is not None else 0

        def tile_adds(p, t):
            return tile_signals(phases[p], cols, workers, residual_chunks(p), t)

        def signal_tiles(p):
            """Signals, once the worker's adds of product p are complete, the counter of each
            tile they went into: one per tile of its units, one per chunk of the residual."""
            u0, n, kch = first[p], count[p], phases[p].k_chunks

            def signal(t):
                plgpu.semaphore_signal(tile_done.at[tile_base[p] + t], 1, memory_scope="gpu")

            pl.loop(u0 // kch, (u0 + n - 1) // kch + 1)(signal)
            if residual_chunks(p):

                @pl.loop(0, -(-chunks_d // workers))
                def _residual(r):
                    c = worker + r * workers
                    pl.when(c < chunks_d)(lambda: signal(c // per_tile))

        def product(it, p, handed):
            """Product p, its buffers in a scope of their own (`fused_plan.scratch_types`).
            `handed`: the epoch of the barrier after product p - 1 where p starts on p - 1's
            tile counters (`hands_over`), else None."""
            k.scope("product", lambda ps: product_in_scope(it, p, {**s, **ps}, handed))

        def product_in_scope(it, p, s, handed):
            kind, j = kind_of(phases[p].name)
            kch, n_all = phases[p].k_chunks, count[p]
            tiles = phases[p].tiles(cols)
            c0 = it * per_iteration + cum[p]
            src_a, src_b, sums, gain_col, store, residual = sources(shape, p)
            gate_up = isinstance(src_a, tuple) and src_a[0] == "gate_up"
            owned = sums is not None or store is not None
            layer_gains = gains.at[max(j, 0)]

            def chunk_src(src, rows, kc):
                if src == "e_part":
                    return e_part.at[rows, :]
                return act.at[src, rows, :]

            owner_tiles = shape.q_tiles if split_q(p) else tiles

            def is_owner(i):  # the owners are in the first range (q's tiles, split_q)
                u = unit_of(p, i)
                t = u // kch
                return jnp.logical_and(lax.rem(u - t * kch, owner_tiles) == t, i < pieces[p][0][1])

            def input_ready(i, kc):
                """Before unit i's input copy, where p starts on p - 1's counters: the first
                `handover` units wait for the tile their chunk comes from (once per tile),
                unit `handover` for every worker's arrival after p - 1."""
                t = kc // per_tile
                first_of_tile = jnp.logical_or(i == 0, lax.rem(kc, per_tile) == 0)
                target = (it + 1) * tile_adds(p - 1, t)

                @pl.when(jnp.logical_and(i < handover, first_of_tile))
                def _():
                    plgpu.semaphore_wait(
                        tile_done.at[tile_base[p - 1] + t], target, decrement=False,
                        memory_scope="gpu",
                    )  # fmt: skip

                pl.when(jnp.asarray(i) == handover)(lambda: barrier.wait(handed))

            def issue_x(i):
                slot = lax.rem(i, x_stages)
                kc = lax.rem(unit_of(p, i), kch)
                rows = pl.ds(kc * UNIT, UNIT)
                if handed is not None:
                    input_ready(i, kc)
                dst_a, bar_a = s["xa"].at[slot, pl.ds(0, UNIT)], s["bara"].at[slot]
                if gate_up:  # chunk kc of the gate and of the up half, interleaved
                    src = act.at[src_a[1], pl.ds(kc * 2 * UNIT, 2 * UNIT), :]
                    plgpu.copy_gmem_to_smem(src, s["xa"].at[slot], bar_a)
                elif isinstance(src_a, tuple):  # the adapter: the given state, then the state
                    fresh, later = state.at[rows, :], act.at[src_a[1], rows, :]
                    pl.when(it == 0)(lambda: plgpu.copy_gmem_to_smem(fresh, dst_a, bar_a))
                    pl.when(it > 0)(lambda: plgpu.copy_gmem_to_smem(later, dst_a, bar_a))
                else:
                    plgpu.copy_gmem_to_smem(chunk_src(src_a, rows, kc), dst_a, bar_a)
                if src_b is not None:
                    src = chunk_src(src_b, rows, kc)
                    plgpu.copy_gmem_to_smem(src, s["xbb"].at[slot], s["barb"].at[slot])
                if gain_col is not None and sums[1] is not None:
                    g_src = layer_gains.at[rows, :]
                    pl.when(is_owner(i))(
                        lambda: plgpu.copy_gmem_to_smem(g_src, s["xg"].at[slot], s["barg"].at[slot])
                    )

            for i in range(x_stages):
                issue_x(i)
            if residual is not None:
                issue_residual(residual, worker, s)
            zero_next(it, p)
            if (kind, j) == ("qkv", 0) or kind == "mlp_proj" or (kind == "proj" and j > 0):
                k.load_scalars()  # while the first chunks are on their way
            fn, residual_scale = scaled(k, it, p)
            dst_buf, dst_off = output_of(p)

            def own(i, kc, v):
                """The owner of chunk kc: its sums of squares and the stored vector."""
                if sums is not None:
                    tile = in_row(jnp.sum(v * v, axis=0), sums[0])
                    if sums[1] is not None:
                        xs = lax.rem(i, x_stages)
                        plgpu.barrier_wait(s["barg"].at[xs])
                        g = col_of(plgpu.load(s["xg"].at[xs], layout=WGMMA), gain_col)
                        tile = tile + in_row(jnp.sum((v * g) * (v * g), axis=0), sums[1])
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    s["sst"][...] = tile
                    plgpu.commit_smem()
                    k.add_into(s["sst"], scal.at[lax.rem(it, 2)], SCALAR_ROWS)
                if store is not None:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    s["vst"][...] = v
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(s["vst"], act.at[store, pl.ds(kc * UNIT, UNIT), :])

            def run_range(start, n, i0, owners):
                """Units [start, start + n) of the product, the worker's i0-th on: one
                accumulator per tile segment; `owners`: whether the range holds the chunks'
                owners."""

                @pl.loop(start // kch, (start + n - 1) // kch + 1)
                def _segment(t):
                    ua = jnp.maximum(start, t * kch) - start + i0
                    ub = jnp.minimum(start + n, (t + 1) * kch) - start + i0

                    def compute(acc):
                        @pl.loop(ua, ub)
                        def _unit(i):
                            xs, bs = lax.rem(i, x_stages), lax.rem(i, lag + 1)
                            kc = lax.rem(start - i0 + i, kch)
                            plgpu.barrier_wait(s["bara"].at[xs])
                            a = plgpu.load(s["xa"].at[xs, pl.ds(0, UNIT)], layout=WGMMA)
                            b = None
                            if gate_up:
                                b = plgpu.load(s["xa"].at[xs, pl.ds(UNIT, UNIT)], layout=WGMMA)
                            if src_b is not None:
                                plgpu.barrier_wait(s["barb"].at[xs])
                                b = plgpu.load(s["xbb"].at[xs], layout=WGMMA)
                            inp, v = fn(a, b)
                            if owned and owners:
                                pl.when(lax.rem(kc, owner_tiles) == t)(lambda: own(i, kc, v))
                            s["bt"].at[bs].T[...] = inp.astype(bf16)
                            plgpu.commit_smem()
                            pl.when(i + x_stages < n_all)(lambda: issue_x(i + x_stages))
                            slot = lax.rem(c0 + i, ring)
                            plgpu.barrier_wait(s["wbar"].at[slot])
                            plgpu.wgmma(acc, s["ring"].at[slot].T, s["bt"].at[bs].T)
                            plgpu.wgmma_wait(lag)
                            pl.when(i - lag >= ua)(lambda: release(it, p, i - lag))

                        partial = acc[...]
                        for back in range(lag, 0, -1):
                            jb = ub - back
                            pl.when(jb >= ua)(lambda jb=jb: release(it, p, jb))
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        s["out"][...] = partial
                        plgpu.commit_smem()
                        dst = act.at[dst_buf, pl.ds(dst_off + t * cols, cols), :]
                        if k.reduce:
                            plgpu.copy_smem_to_gmem(s["out"], dst, reduction_op="add")
                        else:
                            plgpu.copy_smem_to_gmem(s["out"], dst)

                    pl.run_scoped(compute, plgpu.ACC((cols, N_PAD), f32))

            (a0, na), *rest = pieces[p]
            run_range(a0, na, 0, True)
            if rest:  # q's tiles are out: the second warpgroup can take q (blocks_ahead)
                ((b0, nb),) = rest
                plgpu.wait_smem_to_gmem(0)
                plgpu.semaphore_signal(k.q_done, 1, memory_scope="gpu")
                run_range(b0, nb, na, False)
                pl.when(worker < k.items)(lambda: plgpu.barrier_wait(k.parts_ready))

            if residual is not None:
                plgpu.wait_smem_to_gmem(0)  # one worker: the product's tiles are written
                add_residual(residual, residual_scale, dst_buf, s)
            if handed is not None:  # fewer units than `handover`: the arrivals waited for here
                pl.when(n_all <= handover)(lambda: barrier.wait(handed))

        def issue_residual(residual, c, s):
            """Copies of residual chunk c and its layer's gains (issued at the product's start
            for the worker's first chunk)."""
            src, _, layer = residual
            rows = pl.ds(c * UNIT, UNIT)

            @pl.when(c < chunks_d)
            def _():
                plgpu.copy_gmem_to_smem(act.at[src, rows, :], s["rx"].at[0], s["rbar"])
                plgpu.copy_gmem_to_smem(gains.at[layer, rows, :], s["rx"].at[1], s["rbar"])

        def add_residual(residual, scale, dst_buf, s):
            """Adds the worker's chunks (c = worker + r workers) of x g r into the output."""
            _, gain_col, _ = residual

            @pl.loop(0, -(-chunks_d // workers))
            def _(r):
                c = worker + r * workers

                @pl.when(c < chunks_d)
                def _():
                    pl.when(r > 0)(lambda: issue_residual(residual, c, s))
                    plgpu.barrier_wait(s["rbar"])
                    x = plgpu.load(s["rx"].at[0], layout=WGMMA)
                    x = x * col_of(plgpu.load(s["rx"].at[1], layout=WGMMA), gain_col)
                    if scale is not None:
                        x = x * bcast_rows(scale, UNIT)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    s["rsum"][...] = x
                    plgpu.commit_smem()
                    k.add_into(s["rsum"], act.at[dst_buf, pl.ds(c * UNIT, UNIT), :], UNIT)

        def zero_next(it, p):
            """Zeroes what later steps add into: the next product's output (several workers),
            during a qkv the attention output, the outputs of the products that start on
            tile counters (`hands_over`: no barrier orders them after the zeroing in the
            step before) and during layer 0's qkv the next scalar tile."""
            kind, j = kind_of(phases[p].name)
            if kind == "qkv":
                zero_rows(Buffers.of("att", j), 0, pad_to(shape.k_d, cols))
                for q in (p + 1, p + 3):  # proj (then fc) and the mlp proj (then a qkv)
                    if q < n_phases and hands_over(q):
                        zero_rows(*output_of(q + 1), phases[q + 1].n)
                if j == 0:

                    @pl.when(worker == 0)
                    def _():
                        zero = s["zero"].at[pl.ds(0, SCALAR_ROWS)]
                        plgpu.copy_smem_to_gmem(zero, scal.at[lax.rem(it + 1, 2)])

            nxt = (p + 1) % n_phases
            buf, off = output_of(nxt)
            if k.reduce and not hands_over(p):  # each output tile is written whole by adds
                if p + 1 < n_phases:
                    zero_rows(buf, off, phases[nxt].n)
                else:
                    pl.when(it < iterations - 1)(lambda: zero_rows(buf, off, phases[nxt].n))

        def prefetch_next(it, p):
            """Once product p is done (at the worker's arrival at the barrier after it), the next
            product's units after those in the ring go into L2 (`l2_attention` after a qkv,
            `l2_barrier` after the others): HBM streams them while the barrier and the
            attention hold the ring."""
            kind, _ = kind_of(phases[p].name)
            n = schedule.l2_attention if kind == "qkv" else schedule.l2_barrier
            q = (p + 1) % n_phases

            def go():  # the next phase's (of the next iteration after the last phase)
                for g in range(ring, ring + n):
                    prefetch_weight(q, g, False)

            if n and q:
                go()
            elif n:
                pl.when(it < iterations - 1)(go)

        def epoch_of(it, step):
            return 2 + it * len(barrier_of) + barrier_of[step]

        def cross(it, step, after: str, while_waiting=lambda: None, wait=True):
            """The grid barrier after step `step`, a step of kind `after` (its profiled range is
            also "after_" + that kind); `while_waiting()` between the worker's arrival and its
            wait. `wait` False: the arrival only (the next product waits, `hands_over`)."""
            if not k.reduce or step not in barrier_of:
                while_waiting()
                return
            epoch = epoch_of(it, step)

            def go():
                with jax.named_scope("barrier"), jax.named_scope(f"after_{after}"):
                    barrier.arrive()
                    while_waiting()
                    if wait:
                        barrier.wait(epoch)

            if step == steps_per_iteration - 1:
                pl.when(it < iterations - 1)(go)
            else:
                go()

        def prologue():
            """The ring's first fill; a, both scalar tiles and the qkv buffers' padding rows
            zeroed; one barrier."""
            for g in range(ring):
                issue_weight(0, g, g, True)
            for g in range(ring, ring + l2_units):
                prefetch_weight(0, g, True)
            s["zero"][...] = jnp.zeros((UNIT, N_PAD), f32)
            plgpu.commit_smem()

            @pl.when(worker == 0)
            def _pads():
                for parity in range(2):
                    plgpu.copy_smem_to_gmem(s["zero"].at[pl.ds(0, SCALAR_ROWS)], scal.at[parity])
                for j in range(layers):  # the rows around the product that RoPE's windows read
                    for r in (0, SHIFT + phases[1].n):
                        dst = act.at[Buffers.of("qkv", j), pl.ds(r, SHIFT), :]
                        plgpu.copy_smem_to_gmem(s["zero"].at[pl.ds(0, SHIFT)], dst)

            if k.reduce:
                zero_rows(Buffers.A, 0, phases[0].n)
            plgpu.wait_smem_to_gmem(0)
            if k.reduce:
                barrier.arrive()
                barrier.wait(1)

        def iteration(it):
            step, handed = 0, None
            for p in range(n_phases):
                with jax.named_scope(phases[p].name):
                    product(it, p, handed)
                plgpu.wait_smem_to_gmem(0)
                if hands_over(p):
                    signal_tiles(p)
                kind, j = kind_of(phases[p].name)
                cross(it, step, kind, lambda p=p: prefetch_next(it, p), wait=not hands_over(p))
                handed = epoch_of(it, step) if hands_over(p) else None
                step += 1
                if kind == "qkv":
                    with jax.named_scope(f"attn{j}"):
                        attention_step(k, it, j)
                    plgpu.wait_smem_to_gmem(0)
                    cross(it, step, "attn")
                    step += 1

        def streams():
            prologue()
            pl.loop(0, iterations)(iteration)

        if not overlap:
            streams()
            return
        # Two warpgroups: the second runs the attention items' blocks (`blocks_ahead`) inside
        # a scope of its own, so that its reductions across warps take other bytes of shared
        # memory than the first's.
        wg = lax.axis_index("wg")
        k2 = KernelContext(**{
            **k.__dict__, "scope": scopes_of(named, "second"),
            "s": {**s, **{name: named["second." + name] for name in second}},
        })  # fmt: skip

        def second_warpgroup(pad):
            del pad

            @pl.when(jnp.logical_and(wg == 1, worker < k.items))
            def _():
                @pl.loop(0, iterations)
                def _(it):
                    for j in range(layers):
                        blocks_ahead(k2, it, j, worker)

        pad = plgpu.SMEM((REDUCTION_SCRATCH,), jnp.int8)
        pl.run_scoped(second_warpgroup, pad, collective_axes="wg")
        pl.when(wg == 0)(streams)

    scratch, *scopes = scratch_types(shape, schedule, x_stages, lag)
    groups = dict(zip(SCOPES, scopes, strict=True))
    second = second_warpgroup_types(shape)
    layout = dict(scratch)
    if overlap:
        for union, names in WARPGROUP_SCOPES.items():
            layout |= union_layout(union, {g: groups[g] for g in names})
        layout |= {"second." + name: t for name, t in second.items()}

    def scopes_of(named, union):
        """k.scope(name, fn): fn(the buffers and barriers of scope `name`), those of `union`
        (`WARPGROUP_SCOPES`) where two warpgroups run, else inside `fused_plan.scoped`."""
        if not overlap:
            return lambda name, fn: scoped(groups[name], fn)
        members = dict(zip(WARPGROUP_SCOPES[union], named[union], strict=True))

        def scope(name, fn):
            barriers = {
                b: named[f"{union}.{name}.{b}"]
                for b, t in groups[name].items()
                if isinstance(t, plgpu.Barrier)
            }
            return fn({**members[name], **barriers})

        return scope

    SCRATCH_NAMES, kp = tuple(layout), shape.kp
    out_type = (
        jax.ShapeDtypeStruct((Buffers.count(layers), shape.buffer_rows, N_PAD), f32),
        jax.ShapeDtypeStruct((2, SCALAR_ROWS, N_PAD), f32),
        jax.ShapeDtypeStruct((shape.heads * splits, kp + SCALAR_ROWS, N_PAD), f32),
        jax.ShapeDtypeStruct((iterations, layers, 2, shape.heads, kp, N_PAD), f32),
    )
    params = plgpu.CompilerParams()
    if profile_dir:
        ranges = profile_ranges(shape, workers, iterations)
        params = plgpu.CompilerParams(profile_space=ranges, profile_dir=profile_dir)
    threads = dict(num_threads=2, thread_name="wg") if overlap else {}
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=tuple(layout.values()),
        grid=(workers,),
        grid_names=("b",),
        compiler_params=params,
        interpret=interpret,
        **threads,
    )
