"""The products of the fused Core decode kernel (`fused.py`), one worker's share of each: its
units' input chunks (their weights come through `fused_ring.WeightRing`), its partial sums
reduce-added into each product's output, the norms' sums of squares and stored vectors of the
chunks it owns, the residuals it adds, and its waits on the counters of the data it reads
(`fused_counters.py`); what later steps add into is zeroed by `fused_zeros.py`."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.core_step.fused_counters import Counters
from pallas_kernels.core_step.fused_inputs import (
    KernelContext,
    is_gate_up,
    output_of,
    scaled,
    sources,
)
from pallas_kernels.core_step.fused_plan import (
    N_PAD,
    SCALAR_ROWS,
    Schedule,
    kind_of,
)
from pallas_kernels.core_step.fused_ring import WeightRing
from pallas_kernels.core_step.fused_zeros import Zeros
from pallas_kernels.core_step.plan import UNIT
from pallas_kernels.core_step.tiles import WGMMA, bcast_rows, col_of, in_row
from pallas_kernels.looped_matmul.barrier import GridBarrier


class Products:
    """One worker's products: built inside the kernel's body (it allocates the counters,
    `counters`, and computes the worker's ranges of units), then `prologue`, and per
    iteration `product`, `signal_tiles` and `prefetch_next` for each product in turn.
    `inputs`: the kernel's weights (one ref per kind of product), given state, e_part and
    gains; `barrier`: the grid barrier (None with one worker)."""

    def __init__(
        self,
        k: KernelContext,
        schedule: Schedule,
        iterations: int,
        x_stages: int,
        skip_barriers: tuple[str, ...],
        inputs: dict,
        barrier: GridBarrier | None,
    ):
        self.k, self.schedule, self.iterations = k, schedule, iterations
        self.x_stages, self.lag, self.skip_barriers = x_stages, schedule.lag, skip_barriers
        self.barrier = barrier
        self.state, self.e_part, self.gains = inputs["state"], inputs["e_part"], inputs["gains"]
        shape = k.shape
        self.phases, self.cols = shape.phases, shape.unit_cols
        self.n_phases = len(self.phases)
        self.handover = schedule.handover if k.reduce else 0
        self.chunks_d = shape.k_d // UNIT  # 64-row chunks of a d-vector
        self.ring = WeightRing(k, schedule, iterations, inputs["weights"])
        counted = tuple(p for p in range(self.n_phases) if self.signals(p))
        self.counters = Counters(k, counted, schedule)
        self.zeros = Zeros(k, iterations, self.hands_over)

    def hands_over(self, p):
        """Whether the product after p starts on p's tile counters (`Schedule.handover`)."""
        kind, _ = kind_of(self.phases[p].name)
        kept = kind not in self.skip_barriers
        if self.k.dataflow or not (self.handover > 0 and kept and p + 1 < self.n_phases):
            return False
        return kind in ("proj", "mlp_proj")

    def waits_on_inputs(self, p):
        """Whether product p's units wait on the tiles of the step before it: with one grid
        barrier per iteration, unless that step's kind is in `skip_barriers` (a bound)."""
        return self.k.shape.step_before(p) not in self.skip_barriers

    def signals(self, p):
        """Whether product p's output tiles are counted: its reader starts on them."""
        return self.hands_over(p) or (self.k.dataflow and p + 1 < self.n_phases)

    def split_q(self, p):
        """Whether product p's units are two ranges: q's tiles, then the rest (overlap)."""
        return len(self.ring.pieces[p]) > 1

    def signal_tiles(self, p):
        """Once the worker's adds of product p are complete: its output tiles' counters."""
        self.counters.signal_product(p, self.ring.pieces[p])

    def product(self, it, p, handed):
        """Product p, its buffers in a scope of their own (`fused_fit.scratch_types`).
        `handed`: the epoch of the barrier after product p - 1 where p starts on p - 1's
        tile counters (`hands_over`), else None."""
        s = self.k.s
        self.k.scope("product", lambda ps: self._product_in_scope(it, p, {**s, **ps}, handed))

    def _copy_input(self, it, p, s, act, kc, slot, gains) -> None:
        """Copies input chunk kc of product p into `slot` of the product's scope: a (the gate's
        and the up half's chunk in one, for the MLP proj), b where p has one, and the chunk's
        gains for an owner's Σ(v g)²: `gains` True, or where the traced `gains` holds (None:
        never)."""
        src_a, src_b, sums, gain_col, _, _ = sources(self.k.shape, p)
        rows = pl.ds(kc * UNIT, UNIT)
        dst_a, bar_a = s["xa"].at[slot, pl.ds(0, UNIT)], s["bara"].at[slot]

        def source(src):
            return self.e_part.at[rows, :] if src == "e_part" else act.at[src, rows, :]

        if is_gate_up(src_a):  # both halves' chunk kc
            src = act.at[src_a[1], pl.ds(kc * 2 * UNIT, 2 * UNIT), :]
            plgpu.copy_gmem_to_smem(src, s["xa"].at[slot], bar_a)
        elif isinstance(src_a, tuple):  # the adapter: the given state, then the last state
            fresh = self.state.at[rows, :]
            later = self.k.acts(it, back=1).at[src_a[1], rows, :]
            pl.when(it == 0)(lambda: plgpu.copy_gmem_to_smem(fresh, dst_a, bar_a))
            pl.when(it > 0)(lambda: plgpu.copy_gmem_to_smem(later, dst_a, bar_a))
        else:
            plgpu.copy_gmem_to_smem(source(src_a), dst_a, bar_a)
        if src_b is not None:
            plgpu.copy_gmem_to_smem(source(src_b), s["xbb"].at[slot], s["barb"].at[slot])
        if gains is not None and gain_col is not None and sums[1] is not None:
            g_src = self.gains.at[max(kind_of(self.phases[p].name)[1], 0), rows, :]

            def copy():
                plgpu.copy_gmem_to_smem(g_src, s["xg"].at[slot], s["barg"].at[slot])

            if gains is True:
                copy()
            else:
                pl.when(gains)(copy)

    def _own(self, it, p, s, act, kc, v, slot) -> None:
        """The owner of product p's input chunk kc (its value v): its sums of squares into the
        scalar tile, and the stored vector."""
        _, _, sums, gain_col, store, _ = sources(self.k.shape, p)
        k = self.k
        if sums is not None:
            tile = in_row(jnp.sum(v * v, axis=0), sums[0])
            if sums[1] is not None:
                plgpu.barrier_wait(s["barg"].at[slot])
                g = col_of(plgpu.load(s["xg"].at[slot], layout=WGMMA), gain_col)
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

    def own_chunks(self, it, p, s, act, fn) -> None:
        """`Schedule.dataflow`: the owners' work on product p's input (`_own`) before the
        product's units, on chunks c = worker + r workers, each copied on its own once its
        tile is complete; then counted on p's owners' counter (`fused_counters.py`)."""
        k, counters, kch = self.k, self.counters, self.phases[p].k_chunks
        src_b = sources(k.shape, p)[1]
        for r in range(-(-kch // k.workers)):
            c = k.worker + r * k.workers

            @pl.when(c < kch)
            def _(c=c):
                if p:
                    counters.wait_input(it, p, c)
                self._copy_input(it, p, s, act, c, 0, gains=True)
                plgpu.barrier_wait(s["bara"].at[0])
                a = plgpu.load(s["xa"].at[0, pl.ds(0, UNIT)], layout=WGMMA)
                b = None
                if src_b is not None:
                    plgpu.barrier_wait(s["barb"].at[0])
                    b = plgpu.load(s["xbb"].at[0], layout=WGMMA)
                self._own(it, p, s, act, c, fn(a, b)[1], 0)

        plgpu.wait_smem_to_gmem(0)
        for r in range(-(-kch // k.workers)):
            pl.when(k.worker + r * k.workers < kch)(lambda: counters.signal_owned(p))

    def _product_in_scope(self, it, p, s, handed):
        k, phases, cols, ring, counters = self.k, self.phases, self.cols, self.ring, self.counters
        x_stages, lag, handover, dataflow = self.x_stages, self.lag, self.handover, self.k.dataflow
        late_inputs = self.schedule.late_inputs
        act = k.acts(it)
        bf16, f32 = jnp.bfloat16, jnp.float32
        kind, j = kind_of(phases[p].name)
        kch, n_all = phases[p].k_chunks, ring.count[p]
        tiles = phases[p].tiles(cols)
        c0 = ring.first_slot(it, p)
        src_a, src_b, sums, gain_col, store, residual = sources(k.shape, p)
        gate_up = is_gate_up(src_a)
        owned = sums is not None or store is not None
        owner_tiles = k.shape.q_tiles if self.split_q(p) else tiles
        first_units = ring.pieces[p][0][1]

        def is_owner(i):  # the owners are in the first range (q's tiles, split_q)
            u = ring.unit_of(p, i)
            t = u // kch
            return jnp.logical_and(lax.rem(u - t * kch, owner_tiles) == t, i < first_units)

        def input_ready(i, kc):
            """Before unit i's input copy, where p starts on the counters of the output before
            it: the unit waits for the counter of the tiles its chunk comes from (once per
            counter, `Counters.waits_at`), with `handover` the first `handover` units, and unit
            `handover` for every worker's arrival after p - 1."""
            first = counters.waits_at(p, jnp.asarray(i), first_units, kc)
            waits = first if dataflow else jnp.logical_and(i < handover, first)
            pl.when(waits)(lambda: counters.wait_input(it, p, kc))
            if not dataflow:
                pl.when(jnp.asarray(i) == handover)(lambda: self.barrier.wait(handed))

        def issue_x(i):
            kc = lax.rem(ring.unit_of(p, i), kch)
            if handed is not None or (dataflow and p > 0 and self.waits_on_inputs(p)):
                input_ready(i, kc)
            owns = None if dataflow else is_owner(i)
            self._copy_input(it, p, s, act, kc, lax.rem(i, x_stages), owns)

        scalars = (kind, j) == ("qkv", 0) or kind == "mlp_proj" or (kind == "proj" and j > 0)
        if dataflow:  # the norms' scalars and the residual's source: their owners' counters
            # (profiled as the product's kind and `fused_fit.DATAFLOW_PRODUCT_PARTS`)
            owners = None
            if kind in ("proj", "mlp_proj"):  # the qkv's or the fc's before it
                owners = p - 1
            elif (kind, j) == ("qkv", 0):  # the adapter's: the state's scalar
                owners = 0
            if owners is not None:
                with jax.named_scope(f"{kind}_wait_owned"):
                    counters.wait_owned(it, owners)
            if scalars:
                k.load_scalars()
            fn, residual_scale = scaled(k, it, p)
            if owned:
                with jax.named_scope(f"{kind}_own"):
                    self.own_chunks(it, p, s, act, fn)
        profiled = jax.named_scope(f"{kind}_inputs") if dataflow and p else None
        with profiled or contextlib.nullcontext():
            for i in range(x_stages):
                issue_x(i)
        if residual is not None:
            self.issue_residual(act, residual, k.worker, s)
        self.zeros.after_start(it, p, s)
        if not dataflow:
            if scalars:
                k.load_scalars()  # while the first chunks are on their way
            fn, residual_scale = scaled(k, it, p)
        dst_buf, dst_off = output_of(k.shape, p)

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
                        if owned and owners and not dataflow:

                            @pl.when(lax.rem(kc, owner_tiles) == t)
                            def _own():
                                self._own(it, p, s, act, kc, v, xs)

                        s["bt"].at[bs].T[...] = inp.astype(bf16)
                        plgpu.commit_smem()

                        def input_ahead():  # into the stage this unit's input was read from
                            pl.when(i + x_stages < n_all)(lambda: issue_x(i + x_stages))

                        if not late_inputs:
                            input_ahead()
                        slot = lax.rem(c0 + i, self.schedule.ring)
                        plgpu.barrier_wait(s["wbar"].at[slot])
                        plgpu.wgmma(acc, s["ring"].at[slot].T, s["bt"].at[bs].T)
                        plgpu.wgmma_wait(lag)
                        pl.when(i - lag >= ua)(lambda: ring.release(it, p, i - lag))
                        if late_inputs:
                            input_ahead()

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
            with jax.named_scope("wait_parts"):  # for the second warpgroup's partials
                pl.when(k.worker < k.items)(lambda: plgpu.barrier_wait(k.parts_ready))

        if residual is not None:
            plgpu.wait_smem_to_gmem(0)  # one worker: the product's tiles are written
            self.add_residual(act, residual, residual_scale, dst_buf, s)
        if handed is not None:  # fewer units than `handover`: the arrivals waited for here
            pl.when(n_all <= handover)(lambda: self.barrier.wait(handed))

    def issue_residual(self, act, residual, c, s):
        """Copies of residual chunk c (of the buffers `act`) and its layer's gains (issued at
        the product's start for the worker's first chunk)."""
        src, _, layer = residual
        rows = pl.ds(c * UNIT, UNIT)

        @pl.when(c < self.chunks_d)
        def _():
            plgpu.copy_gmem_to_smem(act.at[src, rows, :], s["rx"].at[0], s["rbar"])
            plgpu.copy_gmem_to_smem(self.gains.at[layer, rows, :], s["rx"].at[1], s["rbar"])

    def add_residual(self, act, residual, scale, dst_buf, s):
        """Adds the worker's chunks (c = worker + r workers) of x g r into the output."""
        k = self.k
        _, gain_col, _ = residual

        @pl.loop(0, -(-self.chunks_d // k.workers))
        def _(r):
            c = k.worker + r * k.workers

            @pl.when(c < self.chunks_d)
            def _():
                pl.when(r > 0)(lambda: self.issue_residual(act, residual, c, s))
                plgpu.barrier_wait(s["rbar"])
                x = plgpu.load(s["rx"].at[0], layout=WGMMA)
                x = x * col_of(plgpu.load(s["rx"].at[1], layout=WGMMA), gain_col)
                if scale is not None:
                    x = x * bcast_rows(scale, UNIT)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                s["rsum"][...] = x
                plgpu.commit_smem()
                k.add_into(s["rsum"], act.at[dst_buf, pl.ds(c * UNIT, UNIT), :], UNIT)

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
        """The ring's first fill, what the first steps add into zeroed (`Zeros.first`), one
        barrier."""
        self.ring.fill()
        self.zeros.first()
        plgpu.wait_smem_to_gmem(0)
        if self.k.reduce:
            self.barrier.arrive()
            self.barrier.wait(1)
