"""Tests of experiments.measure.trace: the trace parser on recorded CPU and GPU samples, the
timeline's busy time and gaps, which events count as kernels, the side-by-side table, and a
profile taken on CPU."""

from __future__ import annotations

import pytest
from conftest import DATA

from experiments.measure import trace


def test_parse_trace_cpu_sample():
    """Recorded on CPU: 3 chains of 4 steps (d=64) of the jitted chain, one dispatch each.
    Expected values counted in the file: 13 XLA ops with an "hlo_op" argument, 3 events each
    ("end: ..." events left out); dot.4 takes 3.463 µs over its 3 events, the longest op
    (wrapped_convert) 30.255 µs."""
    rows = trace.parse_trace(DATA / "chain_cpu.trace.json.gz", chains=3)
    names = {r.name for r in rows}
    assert len(rows) == 13 and {"dot.4", "dot.5", "dot.6", "dot.7"} <= names
    assert not any(n.startswith("end: ") or n.startswith("ThunkExecutor") for n in names)
    assert all(r.launches == 3 for r in rows)
    for r in rows:
        assert r.us_per_chain == pytest.approx(r.total_us / 3)
    assert rows == sorted(rows, key=lambda r: -r.total_us)
    assert rows[0].name == "wrapped_convert" and rows[0].total_us == pytest.approx(30.255)
    dot4 = next(r for r in rows if r.name == "dot.4")
    assert dot4.total_us == pytest.approx(3.463) and dot4.us_per_chain == pytest.approx(3.463 / 3)


def test_parse_trace_gpu_samples():
    """Recorded on the H200: 20 chains of 8 steps, W = 72 MiB, shared, profiler on. Expected
    values counted in the file: the events of thread "Stream #14(Compute)" of process
    "/device:GPU:0", summed by name (dot_17: 3016.366 µs, dot_16: 423.649, reduce: 223.490);
    the torch trace: 160 events of "cat": "kernel", 3392.973 µs."""
    rows = trace.parse_trace(DATA / "chain_h200.trace.json.gz", chains=20)
    # XLA: 8 products per chain, each a GEMM fusion (one of them a different fusion) + reduce
    assert [(r.name, r.launches) for r in rows] == [
        ("gemm_fusion_dot_17", 140),
        ("gemm_fusion_dot_16", 20),
        ("loop_reduce_fusion", 160),
    ]
    totals = [3016.366, 423.649, 223.490]
    assert [r.total_us for r in rows] == pytest.approx(totals)
    assert [r.us_per_chain for r in rows] == pytest.approx([t / 20 for t in totals])
    assert not any("Pjit" in r.name for r in rows)  # host-side events are not kernels
    # torch eager (its profiler's Chrome trace): one cuBLAS kernel per product
    torch_rows = trace.parse_trace(DATA / "chain_h200_torch.trace.json.gz", chains=20)
    assert [(r.launches, r.total_us) for r in torch_rows] == [(160, pytest.approx(3392.973))]
    assert torch_rows[0].us_per_chain == pytest.approx(3392.973 / 20)
    assert torch_rows[0].name.startswith("nvjet_sm90")


def test_timeline_splits_the_span_into_busy_time_and_gaps():
    """Hand-made: kernels at [10, 13) and [20, 23), and one nested in the first (counted once):
    span 13, busy 6, gaps 7. The recorded XLA chain trace: busy at most the kernels' sum (a few
    overlap by their timestamps), and the span is longer."""
    made = [{"ts": 10.0, "dur": 3.0}, {"ts": 11.0, "dur": 1.0}, {"ts": 20.0, "dur": 3.0}]
    assert trace.timeline(made) == trace.Timeline(span=13.0, busy=6.0)
    assert trace.timeline(made).gaps == 7.0
    assert trace.timeline([]) == trace.Timeline(0.0, 0.0)
    # overlapping and touching intervals: [0, 4) [2, 5) [5, 6) merge to [0, 6); [8, 9) alone
    merged = [{"ts": t, "dur": d} for t, d in ((2, 3), (0, 4), (5, 1), (8, 1))]
    assert trace.timeline(merged) == trace.Timeline(span=9.0, busy=7.0)
    # The recorded trace: 320 kernels over 4395.371 µs, 3663.505 µs summed, 3562.314 µs covered
    # (counted on a 1 ns grid: consecutive kernels overlap by their timestamps).
    events = trace.kernel_events(trace.load_trace(DATA / "chain_h200.trace.json.gz"))
    spent = trace.timeline(events)
    assert len(events) == 320 and sum(e["dur"] for e in events) == pytest.approx(3663.505)
    assert spent.span == pytest.approx(4395.371) and spent.busy == pytest.approx(3562.314)
    assert trace.per_unit(trace.timeline(made), 2) == {"span": 6.5, "busy": 3.0, "gaps": 3.5}
    assert trace.per_unit_line(trace.per_unit(trace.timeline(made), 2), "chain") == (
        "traced span 6.5 µs per chain: 3.0 busy, 3.5 between kernels"
    )
    with pytest.raises(ValueError, match="units=0"):
        trace.per_unit(spent, 0)


def _event(pid, tid, name, dur, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "ts": 0, "dur": dur, "name": name, "args": args}


def _meta(kind, pid, name, tid=None):
    e = {"ph": "M", "pid": pid, "name": kind, "args": {"name": name}}
    if tid is not None:
        e["tid"] = tid
    return e


def test_kernel_events_prefers_gpu_streams_over_derived_lines():
    events = [
        _meta("process_name", 1, "/host:CPU"),
        _meta("process_name", 2, "/device:GPU:0"),
        _meta("thread_name", 2, "Stream #13(Compute)", tid=13),
        _meta("thread_name", 2, "XLA Ops", tid=99),
        _event(1, 5, "PjitFunction(chain)", 50.0),
        _event(2, 13, "gemv", 4.0, hlo_op="dot.1"),
        _event(2, 13, "gemv", 6.0, hlo_op="dot.2"),
        _event(2, 99, "dot.1", 4.0),
    ]
    rows = trace.parse_trace({"traceEvents": events}, chains=2)
    assert rows == [trace.Row("gemv", 2, 10.0, 5.0)]


def test_kernel_events_torch_chrome_trace():
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 9.0, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "kernel", "name": "nvjet_x", "dur": 3.0, "pid": 0, "tid": 7},
    ]
    assert trace.parse_trace({"traceEvents": events}, chains=1) == [
        trace.Row("nvjet_x", 1, 3.0, 3.0)
    ]


def test_side_by_side_lays_out_blocks():
    text = trace.side_by_side(
        {
            "xla": [trace.Row("fusion", 8, 80.0, 8.0)],
            "torch_eager": [trace.Row("x" * 80, 8, 40.0, 4.0), trace.Row("y", 1, 1.0, 1.0)],
        },
        name_width=20,
    )
    lines = text.splitlines()
    assert lines[0].startswith("xla") and "| torch_eager" in lines[0]
    assert "…" in text and "12.00" not in text
    assert lines[-1].strip().endswith("5.00")  # torch total: 4 + 1 µs per chain


def test_side_by_side_top_rows_keep_the_whole_total():
    rows = [trace.Row(f"k{i}", 2, 10.0 * (5 - i), 5.0 - i) for i in range(5)]  # 5+4+3+2+1 µs
    lines = trace.side_by_side({"xla": rows}, top=2, per="iter").splitlines()
    assert "µs/iter" in lines[1]
    assert [ln.split()[0] for ln in lines[2:4]] == ["k0", "k1"]
    assert lines[4].startswith("(3 other kernels)") and lines[4].split()[-1] == "6.00"
    assert lines[5].split()[1:] == ["10", "15.00"]  # all 5 kernels, 10 launches


def test_profile_jax_on_cpu(tmp_path):
    import jax.numpy as jnp

    x = jnp.ones((4, 4))
    (x @ x).block_until_ready()  # compiled before the trace

    def twice():
        (x @ x).block_until_ready()
        (x @ x).block_until_ready()

    path = trace.profile_jax(twice, tmp_path)
    rows = trace.parse_trace(path, chains=2)
    assert list(tmp_path.rglob("*.xplane.pb"))
    # On CPU the rows are XLA ops: the product's one op, run once per call.
    assert [(r.name.split(".")[0], r.launches) for r in rows] == [("dot_general", 2)]
    assert rows[0].us_per_chain == pytest.approx(rows[0].total_us / 2) and rows[0].total_us > 0
    assert trace.latest_trace_file(tmp_path).name.endswith(".trace.json.gz")
    with pytest.raises(FileNotFoundError, match="no"):
        trace.latest_trace_file(tmp_path / "empty")
