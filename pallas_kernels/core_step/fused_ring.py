"""A worker's weight ring in the fused Core decode kernel (`fused.py`): its units of every
product in one sequence (`fused_plan.unit_ranges`), `Schedule.ring` of them in flight into
shared memory by TMA, so that the ring runs on from one product into the next, across the grid
barriers and the attention between them; with `Schedule.l2_units`, also prefetched into L2 that
many units ahead; with `Schedule.l2_keep`, some of its adapter units marked to stay in L2 from
one iteration to the next."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.core_step.fused_blocks import prefetch_blocks
from pallas_kernels.core_step.fused_inputs import KernelContext
from pallas_kernels.core_step.fused_plan import Schedule, kind_of, unit_ranges
from pallas_kernels.core_step.plan import UNIT
from pallas_kernels.l2 import mark_in_l2


class WeightRing:
    """The worker's units, per product (`pieces`: its ranges (first unit, units) in the order
    it takes them; `first`, `count`), and the ring's copies: `fill` before the first product,
    `release` as each unit's wgmma is done. `weights`: one ref per kind of product."""

    def __init__(self, k: KernelContext, schedule: Schedule, iterations: int, weights: dict):
        self.k, self.schedule, self.iterations, self.weights = k, schedule, iterations, weights
        self.phases = k.shape.phases
        self.n_phases = len(self.phases)
        self.pieces = [
            unit_ranges(k.shape, phase, k.worker, k.workers, k.overlap) for phase in self.phases
        ]
        self.first = [ranges[0][0] for ranges in self.pieces]
        self.count = [sum(n for _, n in ranges) for ranges in self.pieces]
        self.cum = [sum(self.count[:q], jnp.int32(0)) for q in range(self.n_phases)]
        self.per_iteration = sum(self.count, jnp.int32(0))

    def first_slot(self, it, p):
        """The place in the worker's sequence of units of product p's first in iteration it
        (its ring slot modulo the ring)."""
        return it * self.per_iteration + self.cum[p]

    def unit_of(self, p, i):
        """The unit that is the worker's i-th of product p."""
        (a0, na), *rest = self.pieces[p]
        if not rest:
            return a0 + i
        ((b0, _),) = rest
        return jnp.where(i < na, a0 + i, b0 + i - na)

    def send_unit(self, q, j, raw, send):
        """send(unit) of unit j of the worker's range in phase q (a [64, cols] GMEM ref);
        `raw`: the adapter's own rows (the first iteration's, whose state is not normed)."""
        u = self.unit_of(q, j)
        t = u // self.phases[q].k_chunks
        kc = u - t * self.phases[q].k_chunks
        kind, layer = kind_of(self.phases[q].name)
        if kind == "adapter":  # [with norm_4 folded in, raw]
            layer = jnp.asarray(raw, jnp.int32)
        send(self.weights[kind].at[layer, t, pl.ds(kc * UNIT, UNIT), :])

    def issue_weight(self, q, j, c, raw):
        """TMA of unit j of phase q into ring slot c % ring."""
        s = self.k.s
        slot = lax.rem(c, self.schedule.ring)
        dst, bar = s["ring"].at[slot], s["wbar"].at[slot]
        self.send_unit(q, j, raw, lambda src: plgpu.copy_gmem_to_smem(src, dst, bar))

    def prefetch_weight(self, q, j, raw):
        """Unit j of phase q into L2 (its TMA into the ring comes `l2_units` units later)."""
        self.send_unit(q, j, raw, plgpu.async_prefetch)

    def ahead(self, it, p, jj, issue):
        """issue(q, j, raw) of the unit jj places after unit 0 of phase p: in this phase
        or the next (of the next iteration after the last); jj < the next phase's count."""
        count = self.count
        same = jnp.logical_and(it == 0, p == 0)
        pl.when(jj < count[p])(lambda: issue(p, jj, same))
        if p + 1 < self.n_phases:
            pl.when(jj >= count[p])(lambda: issue(p + 1, jj - count[p], False))
        else:
            more = jnp.logical_and(jj >= count[p], it < self.iterations - 1)
            pl.when(more)(lambda: issue(0, jj - count[p], False))

    def release(self, it, p, j):
        """Unit j of phase p is done: its slot takes the unit `ring` places later, and the
        unit `ring + l2_units` places later goes into L2. When that L2 lookahead leaves a
        qkv, the attention's first cached blocks go into L2 too. An adapter unit that
        `Schedule.l2_keep` keeps is marked evict_last in L2 (after the first iteration)."""
        l2_units, l2_blocks = self.schedule.l2_units, self.schedule.l2_blocks
        jj = j + self.schedule.ring
        c = self.first_slot(it, p) + jj
        self.ahead(it, p, jj, lambda q, jq, raw: self.issue_weight(q, jq, c, raw))
        if l2_units:
            self.ahead(it, p, jj + l2_units, self.prefetch_weight)
        keep = self.schedule.l2_keep
        if keep and p == 0 and not self.k.interpreted:  # interpret mode has no L2 to mark
            ring = self.schedule.ring
            kept = jnp.logical_and(it > 0, jnp.logical_and(j >= ring, j < ring + keep))
            pl.when(kept)(lambda: self.send_unit(0, j, False, mark_in_l2))
        kind, layer = kind_of(self.phases[p].name)
        if l2_blocks and kind == "qkv":
            at_end = jj + l2_units == self.count[p]
            pl.when(at_end)(lambda: prefetch_blocks(self.k, it, layer, l2_blocks))

    def fill(self):
        """The ring's first fill, and the L2 prefetches ahead of it (the first iteration)."""
        ring = self.schedule.ring
        for g in range(ring):
            self.issue_weight(0, g, g, True)
        for g in range(ring, ring + self.schedule.l2_units):
            self.prefetch_weight(0, g, True)
