"""The products of the fused Core decode kernel (`fused.py`), one worker's share of each: its
units' input chunks (their weights come through `fused_ring.WeightRing`), its partial sums
reduce-added into each product's output, the norms' sums of squares and stored vectors of the
chunks it owns, the residuals it adds, the tile counters of the hand-overs, and the zeroing of
what later steps add into."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.core_step.fused_inputs import KernelContext, scaled, sources
from pallas_kernels.core_step.fused_plan import (
    N_PAD,
    SCALAR_ROWS,
    SHIFT,
    Buffers,
    Schedule,
    kind_of,
    tile_signals,
)
from pallas_kernels.core_step.fused_ring import WeightRing
from pallas_kernels.core_step.plan import UNIT, pad_to
from pallas_kernels.core_step.tiles import WGMMA, bcast_rows, col_of, in_row
from pallas_kernels.looped_matmul.barrier import GridBarrier


class Products:
    """One worker's products: built inside the kernel's body (it allocates the tile counters
    of the hand-overs and computes the worker's ranges of units), then `prologue`, and per
    iteration `product`, `signal_tiles` and `prefetch_next` for each product in turn.
    `inputs`: the kernel's weights (one ref per kind of product), given state, e_part and
    gains; `barrier`: the grid barrier (None with one worker)."""

    def __init__(
        self,
        k: KernelContext,
        schedule: Schedule,
        iterations: int,
        x_stages: int,
        lag: int,
        skip_barriers: tuple[str, ...],
        inputs: dict,
        barrier: GridBarrier | None,
    ):
        self.k, self.schedule, self.iterations = k, schedule, iterations
        self.x_stages, self.lag, self.skip_barriers = x_stages, lag, skip_barriers
        self.barrier = barrier
        self.state, self.e_part, self.gains = inputs["state"], inputs["e_part"], inputs["gains"]
        shape = k.shape
        self.phases, self.cols = shape.phases, shape.unit_cols
        self.n_phases = len(self.phases)
        self.handover = schedule.handover if k.reduce else 0
        self.per_tile = self.cols // UNIT  # 64-row chunks of an output tile
        self.chunks_d = shape.k_d // UNIT  # 64-row chunks of a d-vector
        self.tile_base, counted = {}, 0
        for p in range(self.n_phases):
            if self.hands_over(p):
                self.tile_base[p], counted = counted, counted + self.phases[p].tiles(self.cols)
        self.tile_done = pl.get_global(plgpu.SemaphoreType.REGULAR((counted,))) if counted else None
        self.ring = WeightRing(k, schedule, iterations, inputs["weights"])

    def hands_over(self, p):
        """Whether the product after p starts on p's tile counters (`Schedule.handover`)."""
        kind, _ = kind_of(self.phases[p].name)
        kept = kind not in self.skip_barriers
        return self.handover > 0 and kept and p + 1 < self.n_phases and kind in ("proj", "mlp_proj")

    def split_q(self, p):
        """Whether product p's units are two ranges: q's tiles, then the rest (overlap)."""
        return len(self.ring.pieces[p]) > 1

    def zero_rows(self, buf, offset, n):
        """The worker's tiles of act[buf, offset : offset + n] set to 0, a 64-row chunk per
        copy (the tile of zeros is one chunk, to leave the shared memory to the rest)."""
        k, cols = self.k, self.cols
        tiles = n // cols

        @pl.loop(0, -(-tiles // k.workers))
        def _(r):
            t = k.worker + r * k.workers

            @pl.when(t < tiles)
            def _():
                for c in range(self.per_tile):
                    dst = k.act.at[buf, pl.ds(offset + t * cols + c * UNIT, UNIT), :]
                    plgpu.copy_smem_to_gmem(k.s["zero"], dst)

    def output_of(self, p):
        """(buffer, row offset) of product p's output."""
        kind, j = kind_of(self.phases[p].name)
        if kind == "adapter":
            return Buffers.A, 0
        kind = {"qkv": "qkv", "proj": "o", "fc": "fc", "mlp_proj": "m"}[kind]
        return Buffers.of(kind, j), SHIFT if kind == "qkv" else 0

    def residual_chunks(self, p):
        """64-row chunks of the residual product p adds into its output (0: none)."""
        return self.chunks_d if sources(self.k.shape, p)[5] is not None else 0

    def tile_adds(self, p, t):
        """The signals that complete output tile t of product p (`fused_plan.tile_signals`)."""
        k = self.k
        return tile_signals(self.phases[p], self.cols, k.workers, self.residual_chunks(p), t)

    def signal_tiles(self, p):
        """Signals, once the worker's adds of product p are complete, the counter of each
        tile they went into: one per tile of its units, one per chunk of the residual."""
        k = self.k
        u0, n, kch = self.ring.first[p], self.ring.count[p], self.phases[p].k_chunks

        def signal(t):
            done = self.tile_done.at[self.tile_base[p] + t]
            plgpu.semaphore_signal(done, 1, memory_scope="gpu")

        pl.loop(u0 // kch, (u0 + n - 1) // kch + 1)(signal)
        if self.residual_chunks(p):

            @pl.loop(0, -(-self.chunks_d // k.workers))
            def _residual(r):
                c = k.worker + r * k.workers
                pl.when(c < self.chunks_d)(lambda: signal(c // self.per_tile))

    def product(self, it, p, handed):
        """Product p, its buffers in a scope of their own (`fused_fit.scratch_types`).
        `handed`: the epoch of the barrier after product p - 1 where p starts on p - 1's
        tile counters (`hands_over`), else None."""
        s = self.k.s
        self.k.scope("product", lambda ps: self._product_in_scope(it, p, {**s, **ps}, handed))

    def _product_in_scope(self, it, p, s, handed):
        k, phases, cols, ring = self.k, self.phases, self.cols, self.ring
        x_stages, lag = self.x_stages, self.lag
        act, handover, per_tile = k.act, self.handover, self.per_tile
        bf16, f32 = jnp.bfloat16, jnp.float32
        kind, j = kind_of(phases[p].name)
        kch, n_all = phases[p].k_chunks, ring.count[p]
        tiles = phases[p].tiles(cols)
        c0 = ring.first_slot(it, p)
        src_a, src_b, sums, gain_col, store, residual = sources(k.shape, p)
        gate_up = isinstance(src_a, tuple) and src_a[0] == "gate_up"
        owned = sums is not None or store is not None
        layer_gains = self.gains.at[max(j, 0)]

        def chunk_src(src, rows, kc):
            if src == "e_part":
                return self.e_part.at[rows, :]
            return act.at[src, rows, :]

        owner_tiles = k.shape.q_tiles if self.split_q(p) else tiles

        def is_owner(i):  # the owners are in the first range (q's tiles, split_q)
            u = ring.unit_of(p, i)
            t = u // kch
            first_units = ring.pieces[p][0][1]
            return jnp.logical_and(lax.rem(u - t * kch, owner_tiles) == t, i < first_units)

        def input_ready(i, kc):
            """Before unit i's input copy, where p starts on p - 1's counters: the first
            `handover` units wait for the tile their chunk comes from (once per tile),
            unit `handover` for every worker's arrival after p - 1."""
            t = kc // per_tile
            first_of_tile = jnp.logical_or(i == 0, lax.rem(kc, per_tile) == 0)
            target = (it + 1) * self.tile_adds(p - 1, t)

            @pl.when(jnp.logical_and(i < handover, first_of_tile))
            def _():
                plgpu.semaphore_wait(
                    self.tile_done.at[self.tile_base[p - 1] + t], target, decrement=False,
                    memory_scope="gpu",
                )  # fmt: skip

            pl.when(jnp.asarray(i) == handover)(lambda: self.barrier.wait(handed))

        def issue_x(i):
            slot = lax.rem(i, x_stages)
            kc = lax.rem(ring.unit_of(p, i), kch)
            rows = pl.ds(kc * UNIT, UNIT)
            if handed is not None:
                input_ready(i, kc)
            dst_a, bar_a = s["xa"].at[slot, pl.ds(0, UNIT)], s["bara"].at[slot]
            if gate_up:  # chunk kc of the gate and of the up half, interleaved
                src = act.at[src_a[1], pl.ds(kc * 2 * UNIT, 2 * UNIT), :]
                plgpu.copy_gmem_to_smem(src, s["xa"].at[slot], bar_a)
            elif isinstance(src_a, tuple):  # the adapter: the given state, then the state
                fresh, later = self.state.at[rows, :], act.at[src_a[1], rows, :]
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
            self.issue_residual(residual, k.worker, s)
        self.zero_next(it, p)
        if (kind, j) == ("qkv", 0) or kind == "mlp_proj" or (kind == "proj" and j > 0):
            k.load_scalars()  # while the first chunks are on their way
        fn, residual_scale = scaled(k, it, p)
        dst_buf, dst_off = self.output_of(p)

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
                k.add_into(s["sst"], k.scal.at[lax.rem(it, 2)], SCALAR_ROWS)
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
                        slot = lax.rem(c0 + i, self.schedule.ring)
                        plgpu.barrier_wait(s["wbar"].at[slot])
                        plgpu.wgmma(acc, s["ring"].at[slot].T, s["bt"].at[bs].T)
                        plgpu.wgmma_wait(lag)
                        pl.when(i - lag >= ua)(lambda: ring.release(it, p, i - lag))

                    partial = acc[...]
                    for back in range(lag, 0, -1):
                        jb = ub - back
                        pl.when(jb >= ua)(lambda jb=jb: ring.release(it, p, jb))
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    s["out"][...] = partial
                    plgpu.commit_smem()
                    dst = act.at[dst_buf, pl.ds(dst_off + t * cols, cols), :]
                    if k.reduce:
                        plgpu.copy_smem_to_gmem(s["out"], dst, reduction_op="add")
                    else:
                        plgpu.copy_smem_to_gmem(s["out"], dst)

                pl.run_scoped(compute, plgpu.ACC((cols, N_PAD), f32))

        (a0, na), *rest = ring.pieces[p]
        run_range(a0, na, 0, True)
        if rest:  # q's tiles are out: the second warpgroup can take q (blocks_ahead)
            ((b0, nb),) = rest
            plgpu.wait_smem_to_gmem(0)
            plgpu.semaphore_signal(k.q_done, 1, memory_scope="gpu")
            run_range(b0, nb, na, False)
            pl.when(k.worker < k.items)(lambda: plgpu.barrier_wait(k.parts_ready))

        if residual is not None:
            plgpu.wait_smem_to_gmem(0)  # one worker: the product's tiles are written
            self.add_residual(residual, residual_scale, dst_buf, s)
        if handed is not None:  # fewer units than `handover`: the arrivals waited for here
            pl.when(n_all <= handover)(lambda: self.barrier.wait(handed))

    def issue_residual(self, residual, c, s):
        """Copies of residual chunk c and its layer's gains (issued at the product's start
        for the worker's first chunk)."""
        src, _, layer = residual
        rows = pl.ds(c * UNIT, UNIT)

        @pl.when(c < self.chunks_d)
        def _():
            plgpu.copy_gmem_to_smem(self.k.act.at[src, rows, :], s["rx"].at[0], s["rbar"])
            plgpu.copy_gmem_to_smem(self.gains.at[layer, rows, :], s["rx"].at[1], s["rbar"])

    def add_residual(self, residual, scale, dst_buf, s):
        """Adds the worker's chunks (c = worker + r workers) of x g r into the output."""
        k = self.k
        _, gain_col, _ = residual

        @pl.loop(0, -(-self.chunks_d // k.workers))
        def _(r):
            c = k.worker + r * k.workers

            @pl.when(c < self.chunks_d)
            def _():
                pl.when(r > 0)(lambda: self.issue_residual(residual, c, s))
                plgpu.barrier_wait(s["rbar"])
                x = plgpu.load(s["rx"].at[0], layout=WGMMA)
                x = x * col_of(plgpu.load(s["rx"].at[1], layout=WGMMA), gain_col)
                if scale is not None:
                    x = x * bcast_rows(scale, UNIT)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                s["rsum"][...] = x
                plgpu.commit_smem()
                k.add_into(s["rsum"], k.act.at[dst_buf, pl.ds(c * UNIT, UNIT), :], UNIT)

    def zero_next(self, it, p):
        """Zeroes what later steps add into: the next product's output (several workers),
        during a qkv the attention output, the outputs of the products that start on
        tile counters (`hands_over`: no barrier orders them after the zeroing in the
        step before) and during layer 0's qkv the next scalar tile."""
        k, phases, n_phases = self.k, self.phases, self.n_phases
        kind, j = kind_of(phases[p].name)
        if kind == "qkv":
            self.zero_rows(Buffers.of("att", j), 0, pad_to(k.shape.k_d, self.cols))
            for q in (p + 1, p + 3):  # proj (then fc) and the mlp proj (then a qkv)
                if q < n_phases and self.hands_over(q):
                    self.zero_rows(*self.output_of(q + 1), phases[q + 1].n)
            if j == 0:

                @pl.when(k.worker == 0)
                def _():
                    zero = k.s["zero"].at[pl.ds(0, SCALAR_ROWS)]
                    plgpu.copy_smem_to_gmem(zero, k.scal.at[lax.rem(it + 1, 2)])

        nxt = (p + 1) % n_phases
        buf, off = self.output_of(nxt)
        if k.reduce and not self.hands_over(p):  # each output tile is written whole by adds
            if p + 1 < n_phases:
                self.zero_rows(buf, off, phases[nxt].n)
            else:
                more = it < self.iterations - 1
                pl.when(more)(lambda: self.zero_rows(buf, off, phases[nxt].n))

    def prefetch_next(self, it, p):
        """Once product p is done (at the worker's arrival at the barrier after it), the next
        product's units after those in the ring go into L2 (`l2_attention` after a qkv,
        `l2_barrier` after the others): HBM streams them while the barrier and the
        attention hold the ring."""
        ring = self.schedule.ring
        kind, _ = kind_of(self.phases[p].name)
        n = self.schedule.l2_attention if kind == "qkv" else self.schedule.l2_barrier
        q = (p + 1) % self.n_phases

        def go():  # the next phase's (of the next iteration after the last phase)
            for g in range(ring, ring + n):
                self.ring.prefetch_weight(q, g, False)

        if n and q:
            go()
        elif n:
            pl.when(it < self.iterations - 1)(go)

    def prologue(self):
        """The ring's first fill; a, both scalar tiles and the qkv buffers' padding rows
        zeroed; one barrier."""
        k, s = self.k, self.k.s
        self.ring.fill()
        s["zero"][...] = jnp.zeros((UNIT, N_PAD), jnp.float32)
        plgpu.commit_smem()

        @pl.when(k.worker == 0)
        def _pads():
            for parity in range(2):
                plgpu.copy_smem_to_gmem(s["zero"].at[pl.ds(0, SCALAR_ROWS)], k.scal.at[parity])
            for j in range(k.shape.layers):  # the rows around the product that RoPE's windows read
                for r in (0, SHIFT + self.phases[1].n):
                    dst = k.act.at[Buffers.of("qkv", j), pl.ds(r, SHIFT), :]
                    plgpu.copy_smem_to_gmem(s["zero"].at[pl.ds(0, SHIFT)], dst)

        if k.reduce:
            self.zero_rows(Buffers.A, 0, self.phases[0].n)
        plgpu.wait_smem_to_gmem(0)
        if k.reduce:
            self.barrier.arrive()
            self.barrier.wait(1)
