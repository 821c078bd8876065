"""The on-device profiler's scopes summed per worker (`experiments.kernels.scopes`), on made-up
traces (CPU)."""

from __future__ import annotations

import json

import pytest

from experiments.kernels.scopes import (
    occurrences,
    read_newest,
    recorders,
    recording_workers,
    scope_cycles,
    spread,
)


def ranges(tid: int, spans: list[tuple[str, float, float]], sm: int = 0) -> list[dict]:
    """B/E events as Mosaic's profiler dump writes them ("ts" = cycles / 1e3, pid 1 + the
    block's SM: `sm`, else one SM per trace); spans given as (name, start, end) cycles, in the
    order their events come."""
    pid = 1 + (sm or 100 + tid)
    events = []
    for name, start, end in spans:
        events.append({"name": name, "ph": "B", "ts": start / 1e3, "tid": tid, "pid": pid})
        events.append({"name": name, "ph": "E", "ts": end / 1e3, "tid": tid, "pid": pid})
    return sorted(events, key=lambda e: (e["ts"], e["ph"] == "B"))


def test_sums_each_kind_per_worker_then_takes_the_median():
    # worker 1: qkv0 (100), its barrier (50), qkv1 (300) holding a nested "rope" (40)
    one = ranges(1, [("qkv0", 0, 100), ("barrier", 100, 150), ("qkv1", 150, 450)])
    one += ranges(1, [("attn/rope", 200, 240)])
    two = ranges(2, [("qkv0", 0, 200), ("barrier", 200, 210)])
    three = ranges(3, [("qkv0", 0, 600)])
    trace = {"traceEvents": one + two + three}
    assert recording_workers(trace) == 3
    got = scope_cycles(trace, per=2)
    assert set(got) == {"qkv", "barrier", "rope"}
    assert got["qkv"]["median"] == pytest.approx(200)  # 400 / 2, 200 / 2, 600 / 2
    assert got["barrier"]["median"] == pytest.approx(5)  # 25, 5, 0 (worker 3 has none)
    assert got["rope"]["median"] == 0 and got["rope"]["p90"] == pytest.approx(20)


def test_refuses_unbalanced_ranges():
    events = ranges(1, [("qkv0", 0, 10)])
    events[1] = dict(events[1], name="barrier")
    with pytest.raises(ValueError, match="unbalanced"):
        scope_cycles({"traceEvents": events})


def test_reads_the_newest_trace(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"traceEvents": ranges(1, [("old", 0, 1)])}))
    newest = {"traceEvents": ranges(1, [("new", 0, 1)])}
    (tmp_path / "b.json").write_text(json.dumps(newest))
    assert read_newest(tmp_path) == newest
    with pytest.raises(FileNotFoundError):
        read_newest(tmp_path / "missing")


def test_spread_finds_the_late_worker_of_each_occurrence():
    """fc0 twice (two iterations) on three workers, worker 3 the slowest both times; a
    barrier after each, where worker 3, the last to arrive, waits least; a rope on worker 1
    only, which not every worker ran."""
    fc = {1: (100, 110), 2: (120, 100), 3: (200, 210)}
    events = []
    for w, (a, b) in fc.items():
        spans = [("fc0", 0, a), ("after_fc", a, 210), ("fc0", 220, 220 + b)]
        events += ranges(w, spans + [("after_fc", 220 + b, 440)])  # the barrier opens at 440
    events += ranges(1, [("attn/rope", 500, 550)])
    got = spread({"traceEvents": events}, per=2)
    assert set(got) == {"fc", "after_fc"}
    assert got["fc"]["late"] == pytest.approx((60 + 70) / 2)  # slowest - mean
    assert got["fc"]["waited"] == pytest.approx((20 + 10) / 2)  # median - fewest
    assert got["fc"]["repeat"] > 0.9
    # waits 110, 90, 10 and 110, 120, 10: the median worker waited 80 and 100 past the last
    assert got["after_fc"]["waited"] == pytest.approx((80 + 100) / 2)


def test_two_warpgroups_per_block_are_read_apart():
    """Blocks of two warpgroups (traces 1 + warpgroup + 2 x block, a block's two on one SM):
    each warpgroup's scopes alone, the workers numbered 1 + block; a block whose second
    warpgroup recorded nothing is not one of the second's workers."""
    events = []
    for block, sm in enumerate((7, 3, 5)):
        first, second = 1 + 2 * block, 2 + 2 * block
        events += ranges(first, [("qkv0", 0, 100 * (block + 1)), ("barrier", 400, 450)], sm=sm)
        if block < 2:  # the third block has no attention item
            events += ranges(second, [("ahead_blocks", 10, 60 + block)], sm=sm)
    trace = {"traceEvents": sorted(events, key=lambda e: e["ts"])}
    assert recorders(trace) == {1: (1, 0), 2: (1, 1), 3: (2, 0), 4: (2, 1), 5: (3, 0)}
    assert recording_workers(trace) == 3 and recording_workers(trace, warpgroup=1) == 2
    first = scope_cycles(trace)
    assert set(first) == {"qkv", "barrier"} and first["qkv"]["median"] == pytest.approx(200)
    second = scope_cycles(trace, warpgroup=1)
    assert set(second) == {"ahead_blocks"}
    assert second["ahead_blocks"]["median"] == pytest.approx(50.5)  # of 50 and 51
    assert occurrences(trace)["qkv0"] == [{1: 100, 2: 200, 3: 300}]
    assert occurrences(trace, warpgroup=1)["ahead_blocks"] == [{1: pytest.approx(50), 2: 51}]


def test_mosaic_gpus_own_dump_of_two_warpgroups_is_read_apart():
    """Mosaic GPU's profiler dump (`ProfilerSpec.dump`) of a made-up buffer of two blocks of
    two warpgroups, on SMs 5 and 2: block 0's two warpgroups and block 1's first recorded a
    scope. The trace numbers and places them as `recorders` reads them."""
    import io

    import numpy as np
    from jax.experimental.mosaic.gpu.profiler import ProfilerSpec

    spec, entries = ProfilerSpec(16), 16
    qkv, blocks = spec.intern_name("qkv0"), spec.intern_name("blocks")
    buffer = np.zeros((2, 2, entries), np.uint32)  # block, warpgroup, entries

    def record(block, warpgroup, sm, events):  # a header (start, SM, entries), then (tag, clock)
        buffer[block, warpgroup, :3] = 1000, sm, 2 * len(events)
        for i, (tag, clock) in enumerate(events):
            buffer[block, warpgroup, 3 + 2 * i : 5 + 2 * i] = tag, clock

    record(0, 0, 5, [(qkv, 100), (qkv | ProfilerSpec.EXIT, 300)])
    record(0, 1, 5, [(blocks, 150), (blocks | ProfilerSpec.EXIT, 250)])
    record(1, 0, 2, [(qkv, 100), (qkv | ProfilerSpec.EXIT, 500)])
    dumped = io.StringIO()
    spec.dump(buffer.reshape(-1), dumped, grid=(2,), block=(256,))
    trace = json.loads(dumped.getvalue())
    assert recorders(trace) == {1: (1, 0), 2: (1, 1), 3: (2, 0)}
    assert recording_workers(trace) == 2 and recording_workers(trace, warpgroup=1) == 1
    # cycles less the dump's estimate of the profiler's own cost per event
    first = occurrences(trace)["qkv0"][0]
    assert sorted(first) == [1, 2] and first[2] - first[1] == pytest.approx(200)
    assert set(occurrences(trace, warpgroup=1)) == {"blocks"}
