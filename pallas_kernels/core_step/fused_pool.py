"""The pool of the fused Core kernel (`fused.py`, `fused_plan.Schedule.pool`): each product's
last units are taken one at a time by whichever worker asks first, so that the workers, which
stream at unequal rates, end a product together.

A worker's weight ring runs `ring` units ahead of the unit it multiplies, in the same order
as its work: per product its contiguous range of units, then the pool's units it takes, then
the next product's range. So the ring slot a finished unit frees takes a unit from one of
three parts (relative to the product the worker multiplies), and the worker keeps in shared
memory which part it issues from, how far it is in it, and, per ring slot, the pool unit the
slot holds (-1 for a unit of a range), where the multiplying side reads when its pool ends.
"""

from __future__ import annotations

from typing import Any

from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.looped_matmul.barrier import fetch_add


class Pool:
    """The worker's issue state (`pool_state`: part, index in the part, the ring position of
    the product's first unit, the interpreter's counter) and the ring slots' pool units
    (`slot_unit`), both shared-memory scratch (`fused_plan.scratch_types`). `atomic`: the
    grid's workers take pool units through global counters, one per (iteration, product);
    else one worker takes them all, in order (interpret mode)."""

    RANGE, POOL, NEXT = 0, 1, 2  # the parts: the product's range, its pool, the next range

    def __init__(self, s: dict, atomic: bool, counters: int):
        self.state, self.slot_unit = s["pool_state"], s["slot_unit"]
        self.counters = pl.get_global(plgpu.SemaphoreType.REGULAR((counters,))) if atomic else None

    def start(self, issued: int) -> None:
        """The prologue: `issued` units of the first product's range are in the ring."""
        self.state[0] = Pool.RANGE
        self.state[1] = issued
        self.state[2] = 0
        self.state[3] = 0

    def rebase(self) -> None:
        """At a product's start: the next range the ring issues from becomes its range (one
        worker: the product's pool starts at its first unit)."""
        self.state[0] = Pool.RANGE
        if self.counters is None:
            self.state[3] = 0

    def finish(self, position: Any) -> None:
        """At a product's end: the ring position of the next product's first unit."""
        self.state[2] = position

    def part(self) -> Any:
        return self.state[0]

    def index(self) -> Any:
        return self.state[1]

    def position(self) -> Any:
        return self.state[2]

    def set(self, part: Any, index: Any, slot: Any, unit: Any) -> None:
        self.state[0] = part
        self.state[1] = index
        self.slot_unit[slot] = unit

    def unit_in(self, slot: Any) -> Any:
        """The pool unit ring slot `slot` holds (-1: a unit of a range)."""
        return self.slot_unit[slot]

    def grab(self, counter: Any) -> Any:
        """The next pool unit of counter `counter`'s product (>= its pool size: none left)."""
        if self.counters is not None:
            return fetch_add(self.counters, counter, self.state.at[pl.ds(4, 1)])
        taken = self.state[3]
        self.state[3] = taken + 1
        return taken
