"""The counters in global memory that order the fused Core kernel's steps (`fused.py`) where no
grid barrier does: a step waits for the data it reads, not for every worker.

- Tile counters: once a worker's adds into a product's output are complete (its partial sums,
  its chunks of the residual), it adds 1 to the counter of each output tile it added into;
  `fused_plan.tile_signals` gives the count that completes a tile. The products that another
  product reads (all but the qkv, whose tiles the attention reads) count `counter_tiles`
  tiles on one counter (`Schedule.counter_tiles`): their readers wait once per that many
  tiles of their input. With `Schedule.dataflow` the attention output's tiles are counted
  too, by the heads' first splits (`fused_plan.attention_tile_heads`).
- Owners' counters (`Schedule.dataflow`): per product whose input's sums of squares (or stored
  vector) are reduced beside it, one add per 64-row chunk of that input, once the chunk's
  sums are in the scalar tile (`fused_products.Products.own_chunks`): a norm's scalar is
  complete when its counter is.
The counters only grow, so iteration `it` waits for `it + 1` times a count. One worker
(interpret mode) has no global semaphores: every wait and signal is then left out.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.core_step.fused_inputs import KernelContext, input_chunk_rows, sources
from pallas_kernels.core_step.fused_plan import (
    SHIFT,
    FusedShape,
    Schedule,
    attention_tile_heads,
    counter_signals,
    counter_span,
    kind_of,
    tiles_per_counter,
    unit_ranges,
    waits_on_counter,
)
from pallas_kernels.core_step.plan import UNIT


def input_counters(shape: FusedShape, schedule: Schedule, p: int) -> tuple[int, int]:
    """(rows of one of product p's input chunks, rows of its input that one counter counts):
    `fused_inputs.input_chunk_rows`, `fused_plan.counter_span`."""
    return input_chunk_rows(shape, p), counter_span(shape, schedule, p)


def counter_waits(shape: FusedShape, workers: int, schedule: Schedule) -> list[int]:
    """Each worker's waits on the tile counters per iteration with `Schedule.dataflow`, as
    its units make them (`Counters.waits_at`) in every product after the adapter. Those of the
    chunks a worker owns and of the attention's items are left out."""
    waits = [0] * workers
    for p, phase in enumerate(shape.phases[1:], start=1):
        rows, span = input_counters(shape, schedule, p)
        for w in range(workers):
            pieces = unit_ranges(shape, phase, w, workers, bool(schedule.overlap))
            units = (u for first, n in pieces for u in range(first, first + n))
            waits[w] += sum(
                waits_on_counter(i, pieces[0][1], u % phase.k_chunks, rows, span)
                for i, u in enumerate(units)
            )
    return waits


def _wait(sem, target) -> None:
    plgpu.semaphore_wait(sem, target, decrement=False, memory_scope="gpu")


def _signal(sem) -> None:
    plgpu.semaphore_signal(sem, 1, memory_scope="gpu")


class Counters:
    """The kernel's counters, built inside its body. `counted`: the products whose output
    tiles are counted (the others' readers wait at a grid barrier); with `Schedule.dataflow`
    (`k.dataflow`) also the attention outputs' tiles and the owners' counters."""

    def __init__(self, k: KernelContext, counted: tuple[int, ...], schedule: Schedule):
        self.k, self.schedule = k, schedule
        self.phases, self.cols = k.shape.phases, k.shape.unit_cols
        self.chunks_d = k.shape.k_d // UNIT
        self.active = k.reduce
        self.group = [tiles_per_counter(k.shape, schedule, p) for p in range(len(self.phases))]
        self.base, total = {}, 0
        for p in counted:
            counters = -(-self.phases[p].tiles(self.cols) // self.group[p])
            self.base[p], total = total, total + counters
        self.att_base = {}  # the attention outputs' tiles, per layer
        if self.k.dataflow:
            for j in range(k.shape.layers):
                self.att_base[j], total = total, total + -(-k.shape.k_d // self.cols)
        on = self.active and total
        self.tiles = pl.get_global(plgpu.SemaphoreType.REGULAR((total,))) if on else None
        owning = len(self.phases) if self.k.dataflow and self.active else 0
        self.owned = pl.get_global(plgpu.SemaphoreType.REGULAR((owning,))) if owning else None

    def residual_chunks(self, p) -> int:
        """64-row chunks of the residual product p adds into its output (0: none)."""
        return self.chunks_d if sources(self.k.shape, p)[5] is not None else 0

    def counter_adds(self, p, g):
        """The signals that complete counter g of product p (its `group[p]` output tiles)."""
        phase, k = self.phases[p], self.k
        split = k.overlap and kind_of(phase.name)[0] == "qkv"  # `fused_plan.unit_ranges`
        split_at = k.shape.q_tiles * phase.k_chunks if split else 0
        residual = self.residual_chunks(p)
        return counter_signals(phase, self.cols, k.workers, residual, g, self.group[p], split_at)

    def signal_product(self, p, pieces) -> None:
        """Once the worker's adds of product p (its ranges of units, `pieces`: (first, count)
        each, and its chunks of the residual) are complete: 1 on the counter of each tile
        they went into."""
        if not self.active:
            return
        k, kch = self.k, self.phases[p].k_chunks
        per_tile = self.cols // UNIT

        def signal(t):
            _signal(self.tiles.at[self.base[p] + t // self.group[p]])

        for first, units in pieces:
            end = jnp.where(units > 0, (first + units - 1) // kch + 1, first // kch)
            pl.loop(first // kch, end)(signal)
        if self.residual_chunks(p):

            @pl.loop(0, -(-self.chunks_d // k.workers))
            def _residual(r):
                c = k.worker + r * k.workers
                pl.when(c < self.chunks_d)(lambda: signal(c // per_tile))

    def waits_at(self, p, i, first_range, kc):
        """Whether the worker's i-th unit of product p (its input chunk kc; `first_range`
        units in its first range) waits on a counter of its input (`waits_on_counter`)."""
        rows, span = input_counters(self.k.shape, self.schedule, p)
        return waits_on_counter(i, first_range, kc, rows, span)

    def wait_input(self, it, p, kc) -> None:
        """Until the tiles of the output before product p (the attention's before a proj)
        that hold p's input chunk kc are complete in iteration `it`: their counters'."""
        if not self.active:
            return
        kind, j = kind_of(self.phases[p].name)
        rows, span = input_counters(self.k.shape, self.schedule, p)

        @pl.loop(kc * rows // span, ((kc + 1) * rows - 1) // span + 1)
        def _counter(g):
            if kind == "proj" and self.k.dataflow:
                count = attention_tile_heads(self.k.shape, self.cols, g)
                _wait(self.tiles.at[self.att_base[j] + g], (it + 1) * count)
            else:
                target = (it + 1) * self.counter_adds(p - 1, g)
                _wait(self.tiles.at[self.base[p - 1] + g], target)

    def signal_owned(self, p) -> None:
        """One more of product p's input chunks has its sums in the scalar tile."""
        if self.active:
            _signal(self.owned.at[p])

    def wait_owned(self, it, p) -> None:
        """Until every chunk of product p's input has its sums (and stored vector) out."""
        if self.active:
            _wait(self.owned.at[p], (it + 1) * self.phases[p].k_chunks)

    def wait_head(self, it, j, starts) -> None:
        """Until the qkv tiles that layer j's head windows read (q and k from column ck, v
        from c0, `starts`; each window kp rows and SHIFT either side) are complete, and the
        layer input's norms; with `Schedule.known_complete`, the tiles from the qkv's
        `q_tiles` on only (the rest and the norms are complete before the step)."""
        if not self.active:
            return
        shape, p = self.k.shape, 1 + 4 * j
        known = bool(self.schedule.known_complete)
        n = self.phases[p].n
        ck, c0 = starts
        for start in (ck, shape.d + ck, 2 * shape.d + c0):
            lo = jnp.maximum(start - SHIFT, 0) // self.cols
            if known:
                lo = jnp.maximum(lo, shape.q_tiles)
            hi = (jnp.minimum(start + shape.kp + SHIFT, n) - 1) // self.cols

            @pl.loop(lo, hi + 1)
            def _tile(t):  # a qkv's counters count one tile each (`tiles_per_counter`)
                _wait(self.tiles.at[self.base[p] + t], (it + 1) * self.counter_adds(p, t))

        if not known:
            self.wait_owned(it, p)

    def signal_head(self, j, c0) -> None:
        """A head's rows (its window from c0) are added into layer j's attention output."""
        if not self.active:
            return
        kp = self.k.shape.kp
        lo, hi = c0 // self.cols, (c0 + kp - 1) // self.cols
        pl.loop(lo, hi + 1)(lambda t: _signal(self.tiles.at[self.att_base[j] + t]))
