"""tools/dataflow_estimate.py's replays on synthetic profiles: every worker's cycles per step set
by hand, so that what each replay must give is known."""

from __future__ import annotations

import pytest

from tools.dataflow_estimate import (
    BARRIER,
    OWN,
    PHASES,
    SHARES,
    STEPS,
    WORKERS,
    Polls,
    barrier_replays,
    data_replay,
    evened,
    run_units,
)


def profile(cycles_of) -> dict:
    """One iteration's occurrences: {step: [{worker + 1: cycles_of(step, worker)}]}."""
    return {s: [{w + 1: float(cycles_of(s, w)) for w in range(WORKERS)}] for s in STEPS}


RATE = 2000  # cycles per unit, about the H200's at the read ceiling
ATTENTION = 20_000


def even(step, worker):
    return ATTENTION if step.startswith("attn") else RATE * SHARES[step][worker]


def longest(cycles_of):
    return max(sum(cycles_of(s, w) for s in STEPS) for w in range(WORKERS))


def test_equal_workers_replay_as_the_barriers_sum_and_no_wait_is_the_shortest():
    occ = profile(even)
    barriers, no_wait = barrier_replays(occ, 0)
    data = data_replay(occ, 0, latency=0.0, catch_up=False)
    steps_longest = sum(max(even(s, w) for w in range(WORKERS)) for s in STEPS)
    assert barriers == pytest.approx(steps_longest + len(STEPS) * BARRIER)
    assert no_wait == pytest.approx(longest(even) + BARRIER)
    assert no_wait - RATE <= data < barriers


def test_waits_on_data_grow_with_the_latency_and_shrink_with_the_ring_catching_up():
    occ = profile(even)
    slow = data_replay(occ, 0, latency=3000.0, catch_up=False)
    fast = data_replay(occ, 0, latency=1000.0, catch_up=False)
    caught_up = data_replay(occ, 0, latency=3000.0, catch_up=True)
    assert fast < slow
    assert caught_up < slow


def test_only_the_workers_that_read_a_late_chunk_wait_for_it():
    phase = PHASES["qkv0"]  # 83 chunks of input, 39 or 38 units per worker
    starts, rates = [0.0] * WORKERS, [float(RATE)] * WORKERS
    on_time, _ = run_units(phase, starts, rates, lambda kc: 0.0, catch_up=False)
    late, tiles = run_units(phase, starts, rates, lambda kc: 1e6 * (kc == 0), False)
    firsts = [sum(SHARES["qkv0"][:w]) for w in range(WORKERS)]
    readers = {
        w
        for w, (first, n) in enumerate(zip(firsts, SHARES["qkv0"], strict=True))
        if any(u % phase.k_chunks == 0 for u in range(first, first + n))
    }
    assert readers and len(readers) < WORKERS
    for w in range(WORKERS):
        assert (late[w] > on_time[w]) == (w in readers)
    assert max(tiles) == max(late)


def test_one_slow_worker_delays_the_data_order_no_more_than_the_barriers():
    def one_slow(step, worker):
        return even(step, worker) + (20_000 if step == "fc1" and worker == 7 else 0)

    base, slowed = profile(even), profile(one_slow)
    barriers = barrier_replays(slowed, 0)[0] - barrier_replays(base, 0)[0]
    data = data_replay(slowed, 0, 1000.0, False) - data_replay(base, 0, 1000.0, False)
    assert barriers >= 20_000 - 2 * RATE  # every worker waits for it
    # its tiles' readers wait, theirs fan out to every tile of the next product
    assert 0 < data <= barriers


def test_evened_gives_every_worker_the_median_rate_and_keeps_the_attention():
    def one_slow(step, worker):
        slow = worker == 7 and not step.startswith("attn")
        return even(step, worker) * (1.5 if slow else 1.0)

    occ = profile(one_slow)
    flat = evened(occ)
    for step in STEPS:
        for w in range(WORKERS):
            want = one_slow(step, w) if step.startswith("attn") else even(step, w)
            assert flat[step][0][w + 1] == pytest.approx(want)
    assert barrier_replays(flat, 0)[0] < barrier_replays(occ, 0)[0]


def test_counter_polls_hide_behind_the_weight_stream_until_they_outlast_it():
    """Equal workers at RATE cycles per unit wait RATE - OWN cycles per unit for their weights:
    a poll shorter than that is hidden, a longer one delays the iteration, less where a counter
    holds 4 tiles (a quarter of the polls) and where the poll comes after the slot's release."""
    occ = profile(even)

    def replay(cycles, **polls):
        return data_replay(occ, 0, 1000.0, True, Polls(cycles, **polls))

    assert replay(RATE - OWN - 100) == pytest.approx(replay(0))
    slow = replay(3 * RATE)
    assert slow > replay(0) + 100_000
    assert replay(3 * RATE, counter_tiles=4) < slow
    assert replay(3 * RATE, late=True) < slow
