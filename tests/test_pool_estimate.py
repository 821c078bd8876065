"""tools/pool_estimate.py's pooled ends on hand-set rates."""

from __future__ import annotations

import pytest

from tools.pool_estimate import pooled_end


def test_without_a_pool_the_end_is_the_slowest_workers():
    assert pooled_end([10.0, 30.0, 20.0], [10, 10, 10], pool=0, grab=0.0) == 30.0


def test_equal_workers_end_as_before_when_grabs_are_free_and_later_when_not():
    cycles, shares = [20.0] * 4, [10] * 4
    assert pooled_end(cycles, shares, pool=2, grab=0.0) == pytest.approx(20.0)
    assert pooled_end(cycles, shares, pool=2, grab=1.0) == pytest.approx(23.0)  # and the empty one


def test_the_fast_workers_take_the_slow_ones_pooled_units():
    # worker 1 takes 3 cycles per unit, worker 0 one: with 4 pooled units each, worker 0 ends
    # its own 6 units at 6 and worker 1 its 6 at 18; the 8 pooled units go to whoever is free
    cycles, shares = [10.0, 30.0], [10, 10]
    end = pooled_end(cycles, shares, pool=4, grab=0.0)
    assert end == pytest.approx(18.0)  # worker 0 takes all 8 (ends at 14), worker 1 none
    # with 2 cycles per grab worker 0 is free at 18 after 4, they share the rest, and each
    # finds the pool empty at the end
    assert pooled_end(cycles, shares, pool=4, grab=2.0) == pytest.approx(30.0)
