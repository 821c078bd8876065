"""The split-K kernel's phase profile: the trace parser (CPU) on a made-up trace."""

from __future__ import annotations

import json

import pytest

from experiments.kernels.looped_matmul_phases import PHASES, phase_cycles, phase_table


def worker_events(tid: int, steps: list[list[tuple[str, float]]], t0: float) -> list[dict]:
    """Events as Mosaic's profiler dump writes them: "ts" = cycles / 1e3, nested B/E pairs."""
    events, t = [], t0
    for phases in steps:
        events.append({"name": "step", "ph": "B", "ts": t / 1e3, "tid": tid, "pid": 1})
        for name, cycles in phases:
            t += 10  # untracked time between phases: "other"
            events.append({"name": name, "ph": "B", "ts": t / 1e3, "tid": tid, "pid": 1})
            t += cycles
            events.append({"name": name, "ph": "E", "ts": t / 1e3, "tid": tid, "pid": 1})
        t += 10
        events.append({"name": "step", "ph": "E", "ts": t / 1e3, "tid": tid, "pid": 1})
    return events


def test_phase_cycles_per_step_and_the_rest():
    step = [("x_wait", 100), ("x_convert", 40), ("x_wait", 60), ("acc", 300), ("barrier", 500)]
    slow = [("x_wait", 100), ("x_convert", 40), ("acc", 300), ("barrier", 1500)]
    trace = {"traceEvents": worker_events(1, [step, step], 0) + worker_events(2, [slow], 5000)}
    got = phase_cycles(trace)
    assert set(got) == {*PHASES, "other", "step"}
    assert got["x_wait"] == pytest.approx([160, 100])
    assert got["barrier"] == pytest.approx([500, 1500])
    assert got["w_wait"] == [0, 0]
    # 10 cycles before each phase and before the step's end
    assert got["other"] == pytest.approx([60, 50])
    assert got["step"] == pytest.approx([160 + 40 + 300 + 500 + 60, 100 + 40 + 300 + 1500 + 50])


def test_phase_cycles_rejects_unbalanced_ranges():
    events = worker_events(1, [[("acc", 5)]], 0)
    events[1], events[2] = dict(events[1], name="barrier"), events[2]
    with pytest.raises(ValueError, match="unbalanced"):
        phase_cycles({"traceEvents": events})


def test_phase_table_reads_the_newest_trace(tmp_path):
    step = [("x_wait", 1980), ("acc", 3960)]
    old = {"traceEvents": worker_events(1, [step], 0)}
    (tmp_path / "a.json").write_text(json.dumps(old))
    new = {"traceEvents": worker_events(1, [[("barrier", 1980)]], 0)}
    newest = tmp_path / "b.json"
    newest.write_text(json.dumps(new))
    table = phase_table(tmp_path, clock_ghz=1.98)
    barrier = next(line for line in table.splitlines() if line.startswith("barrier"))
    assert barrier.split()[1:3] == ["1980", "1.00"]  # cycles, us at 1.98 GHz
    with pytest.raises(FileNotFoundError):
        phase_table(tmp_path / "missing", clock_ghz=1.98)
