"""Tests of experiments.measure: timing helper, ncu CSV parser, trace parser, results, plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from experiments.cli import UserError
from experiments.measure import hlo, memory, ncu, plot, results, timing, trace

DATA = Path(__file__).parent / "data"


# ---------------------------------------------------------------- timing


class FakeClock:
    """perf_counter for experiments.measure.timing: time moves only when `advance` says."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(timing, "time", fake)
    return fake


def test_time_fn_times_call_and_sync_divided_by_per_call(clock):
    """Warm-up calls take 100 s each and are not timed; timed call i takes i s and the sync
    0.5 s after it; 4 units per call: samples (i + 0.5) / 4."""
    durations = iter([100.0, 100.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    events = []

    def fn():
        events.append("call")
        clock.advance(next(durations))

    def sync():
        events.append("sync")
        clock.advance(0.5)

    samples = timing.time_fn(fn, warmup=2, repeats=5, sync=sync, per_call=4)
    assert events == ["call", "sync"] * 7
    assert samples.seconds == [0.375, 0.625, 0.875, 1.125, 1.375]
    assert samples.per_call == 4 and samples.warmup == 2
    assert samples.median == 0.875
    assert samples.p10 == pytest.approx(0.475) and samples.p90 == pytest.approx(1.275)
    assert timing.Samples.from_dict(samples.to_dict()) == samples


def test_time_fn_waits_on_what_fn_returns_inside_the_timed_interval(clock, monkeypatch):
    """Without `sync`, the result of each call is passed to jax.block_until_ready, and the wait
    (2 s here) is part of the sample."""
    import jax

    waited = []

    def block_until_ready(out):
        waited.append(out)
        clock.advance(2.0)
        return out

    monkeypatch.setattr(jax, "block_until_ready", block_until_ready)
    results = iter(range(10))

    def fn():
        clock.advance(1.0)
        return next(results)

    samples = timing.time_fn(fn, warmup=1, repeats=3)
    assert waited == [0, 1, 2, 3]
    assert samples.seconds == [3.0, 3.0, 3.0]


def test_time_fn_measures_real_time():
    """A call that sleeps 20 ms: every sample is at least that (sleep never returns early) and
    not much more."""
    import time

    samples = timing.time_fn(lambda: time.sleep(0.02), warmup=1, repeats=5, sync=lambda: None)
    assert all(0.02 <= s < 0.02 + 0.05 for s in samples.seconds), samples.seconds
    halves = timing.time_fn(
        lambda: time.sleep(0.02), warmup=0, repeats=3, sync=lambda: None, per_call=2
    )
    assert all(0.01 <= s < 0.01 + 0.025 for s in halves.seconds), halves.seconds


def test_samples_quantiles():
    s = timing.Samples(seconds=[4.0, 1.0, 3.0, 2.0, 5.0], warmup=0)
    assert s.median == 3.0
    assert s.quantile(0.0) == 1.0 and s.quantile(1.0) == 5.0
    # sorted [1, 2, 3, 4, 5]: q = 0.1 sits at position 0.4, q = 0.9 at 3.6, q = 0.25 at 1.0
    assert s.p10 == pytest.approx(1.4) and s.p90 == pytest.approx(4.6)
    assert s.quantile(0.25) == 2.0
    assert s.summary_us() == pytest.approx(
        {"median_us": 3e6, "p10_us": 1.4e6, "p90_us": 4.6e6, "min_us": 1e6, "max_us": 5e6}
    )
    even = timing.Samples(seconds=[1.0, 2.0, 4.0, 8.0], warmup=0)
    assert even.median == 3.0 and even.quantile(0.5) == 3.0


@pytest.mark.parametrize("kw", [{"warmup": -1}, {"repeats": 0}, {"per_call": 0}])
def test_time_fn_rejects_bad_counts(kw):
    args = {"warmup": 0, "repeats": 1, "per_call": 1} | kw
    with pytest.raises(ValueError):
        timing.time_fn(lambda: None, sync=lambda: None, **args)


def test_times_print_in_the_unit_their_size_calls_for():
    assert [timing.format_us(us) for us in (852101.0, 49199.0, 649.1, 20.34, 0.5)] == [
        "852 ms", "49.2 ms", "649 µs", "20.3 µs", "500 ns",
    ]  # fmt: skip
    assert timing.format_us(3.2e9) == "3200 s" and timing.format_us(float("nan")) == "-"
    assert timing.format_us_range(538.0, 855.0) == "538-855 µs"
    assert timing.format_us_range(538.0, 1200.0) == "0.538-1.2 ms"  # the larger one's unit
    assert timing.format_us_range(None, 1.0) == "-"


# ---------------------------------------------------------------- ncu


def test_parse_ncu_csv_synthetic_sample():
    """2 chains x 3 kernels, ==PROF== lines, thousands separators, Mbyte/Kbyte units, n/a."""
    kernels = ncu.parse_ncu_csv((DATA / "ncu_sample.csv").read_text())
    assert [k.id for k in kernels] == list(range(6))
    assert kernels[0].name.startswith("void gemv2T_kernel_val<int, int, __nv_bfloat16")
    assert kernels[1].name == "loop_convert_fusion"
    assert kernels[0].metrics[ncu.DRAM_READ] == 75_497_472
    assert kernels[1].metrics[ncu.DRAM_READ] == pytest.approx(0.01e6)
    assert kernels[3].metrics[ncu.DRAM_WRITE] == pytest.approx(12.29e3)
    assert math.isnan(kernels[2].metrics[ncu.L2_HIT])

    s = ncu.summarize(kernels, chains=2)
    read = 75_497_472 + 0.01e6 + 0 + 75.52e6 + 10_000 + 2_048
    assert s.bytes_read_per_chain == pytest.approx(read / 2)
    assert s.bytes_write_per_chain == pytest.approx((12_288 + 4_096 + 12.29e3 + 4.10e3) / 2)
    # kernel 2 has no hit rate; the others are weighted by their sectors
    pairs = [(3.12, 2_359_552), (80.0, 1_024), (2.88, 2_359_552), (82.5, 1_024), (100, 64)]
    expected = sum(r * n for r, n in pairs) / sum(n for _, n in pairs)
    assert s.l2_hit_weighting == "sectors" and s.l2_hit_pct == pytest.approx(expected)
    assert s.results == 6 and s.chains == 2


def test_parse_ncu_csv_h200_range_sample():
    """Recorded on an H200: app-range replay, 4 ranges (shared/copies x xla/torch_graph).
    Expected values read off the file: each range's dram__bytes_read.sum, .._write.sum and
    hit rate, divided by its chains (10, 20, 10, 20)."""
    ranges = ncu.parse_ncu_csv((DATA / "ncu_h200_range.csv").read_text())
    assert [r.id for r in ranges] == [0, 1, 2, 3] and [r.name for r in ranges] == ["range"] * 4
    chains = (10, 20, 10, 20)
    read = (6_041_031_936, 12_080_898_560, 6_040_857_088, 12_080_893_184)
    write = (30_295_808, 2_258_688, 17_081_088, 2_322_432)
    hit = (1.77, 2.55, 1.77, 2.56)
    for r, n, rd, wr, h in zip(ranges, chains, read, write, hit, strict=True):
        s = ncu.summarize([r], n)
        assert s.bytes_read_per_chain == rd / n and s.bytes_write_per_chain == wr / n
        assert s.l2_hit_pct == pytest.approx(h) and s.l2_hit_weighting == "sectors"
    assert ranges[1].metrics[ncu.L2_SECTORS] == 582_015_822
    # 72 MiB > 60 MiB L2: every layout reads W (6144^2 bf16) about 8 times per chain of 8 steps
    w = 6144 * 6144 * 2
    assert [round(rd / n / w, 3) for rd, n in zip(read, chains, strict=True)] == [
        8.002,
        8.001,
        8.001,
        8.001,
    ]


def test_parse_ncu_csv_h200_kernel_sample():
    """Recorded on an H200: kernel replay, 2 chains x 16 kernels (XLA's multiply + reduce).
    Expected values counted in the file with awk, not with the parser: 32 IDs; names per chain
    loop_multiply_fusion_7 x1, _6 x7, input_reduce_fusion_1 x7, input_reduce_fusion x1; DRAM
    read 402,939,392 B and written 14,781,184 B in all; hit rates weighted by sectors 49.0573 %."""
    kernels = ncu.parse_ncu_csv((DATA / "ncu_h200_kernel.csv").read_text())
    assert [k.id for k in kernels] == list(range(32))
    names = [k.name for k in kernels]
    assert {n: names.count(n) for n in set(names)} == {
        "loop_multiply_fusion_7": 2,
        "loop_multiply_fusion_6": 14,
        "input_reduce_fusion_1": 14,
        "input_reduce_fusion": 2,
    }
    assert kernels[0].metrics == {
        ncu.DRAM_READ: 8_396_032,
        ncu.DRAM_WRITE: 904_704,
        ncu.L2_HIT: 69.56,
        ncu.L2_SECTORS: 1_219_006,
    }
    s = ncu.summarize(kernels, chains=2)
    assert s.results == 32 and s.chains == 2
    assert s.bytes_read_per_chain == 402_939_392 / 2
    assert s.bytes_write_per_chain == 14_781_184 / 2
    assert s.l2_hit_weighting == "sectors" and s.l2_hit_pct == pytest.approx(49.0573467, abs=1e-6)


def test_parse_ncu_csv_without_header_fails():
    with pytest.raises(ValueError, match="no ncu CSV header"):
        ncu.parse_ncu_csv("==PROF== Connected to process 1\n==ERROR== nothing profiled\n")


def test_summarize_plain_mean_without_sectors():
    ks = [
        ncu.KernelMetrics(0, "a", {ncu.DRAM_READ: 10.0, ncu.L2_HIT: 20.0}),
        ncu.KernelMetrics(1, "b", {ncu.DRAM_READ: 30.0, ncu.L2_HIT: 60.0}),
    ]
    s = ncu.summarize(ks, chains=4)
    assert s.bytes_read_per_chain == 10.0
    assert s.l2_hit_weighting == "mean" and s.l2_hit_pct == 40.0
    with pytest.raises(ncu.NcuError):
        ncu.summarize([], chains=1)


def test_ncu_command_profiles_only_the_ranges():
    cmd = ncu.ncu_command("ncu", ["python", "-m", "x"], log_file="/tmp/l.csv")
    joined = " ".join(cmd)
    assert "--clock-control none --cache-control none" in joined
    assert "--replay-mode app-range" in joined and "--profile-from-start" not in joined
    assert ",".join(ncu.METRICS) in joined and cmd[-3:] == ["python", "-m", "x"]
    kernel = " ".join(ncu.ncu_command("ncu", ["p"], log_file="l", replay_mode="kernel"))
    assert "--profile-from-start off" in kernel


def _executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_find_ncu_takes_path_first(tmp_path, monkeypatch):
    ncu_on_path = _executable(tmp_path / "bin" / "ncu")
    monkeypatch.setenv("PATH", str(ncu_on_path.parent))
    assert ncu.find_ncu() == str(ncu_on_path)


def test_find_ncu_then_the_newest_executable_install_else_none(tmp_path, monkeypatch):
    """Not on PATH, no /usr/local/cuda/bin/ncu: the newest /opt/nvidia/nsight-compute/*/ncu
    that is an executable file (a newer one that is not executable is passed over)."""
    import os
    import types

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    installs = tmp_path / "nsight-compute"
    _executable(installs / "2024.1.0" / "ncu")
    _executable(installs / "2025.3.1" / "ncu")
    (installs / "2026.1.0").mkdir()
    (installs / "2026.1.0" / "ncu").write_text("not executable")
    patterns = []

    def fake_glob(pattern):
        patterns.append(pattern)
        return [str(p) for p in installs.glob("*/ncu")]

    monkeypatch.setattr(ncu, "glob", types.SimpleNamespace(glob=fake_glob))
    no_cuda_bin = types.SimpleNamespace(
        path=types.SimpleNamespace(
            isfile=lambda p: p != "/usr/local/cuda/bin/ncu" and os.path.isfile(p)
        ),
        access=os.access,
        X_OK=os.X_OK,
    )
    monkeypatch.setattr(ncu, "os", no_cuda_bin)
    assert ncu.find_ncu() == str(installs / "2025.3.1" / "ncu")
    assert patterns == ["/opt/nvidia/nsight-compute/*/ncu"]
    (installs / "2025.3.1" / "ncu").chmod(0o644)
    (installs / "2024.1.0" / "ncu").unlink()
    assert ncu.find_ncu() is None


# ---------------------------------------------------------------- trace


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


# ---------------------------------------------------------------- results and plot


def test_write_json_atomic(tmp_path):
    path = tmp_path / "a" / "b" / "r.json"
    results.write_json_atomic(path, {"x": [1.0, float("nan")], "y": float("inf")})
    assert json.loads(path.read_text()) == {"x": [1.0, None], "y": None}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # no temporary left


def test_write_json_atomic_leaves_nothing_on_failure(tmp_path):
    path = tmp_path / "r.json"
    with pytest.raises(TypeError):
        results.write_json_atomic(path, {"x": object()})
    assert list(tmp_path.iterdir()) == []


def test_environment():
    import jax

    env = results.environment({"size": "8MiB"})
    assert env["platform"] == jax.devices()[0].platform
    assert (env["l2_bytes"] is None) == (env["platform"] != "gpu")
    assert env["versions"]["jax"] and env["flags"] == {"size": "8MiB"}
    assert env["timestamp_utc"].endswith("+00:00")


def _fake_results(hbm: bool) -> dict:
    runs = []
    for w in (8 * 2**20, 72 * 2**20):
        for layout in ("shared", "copies"):
            runs.append(
                {
                    "weight_bytes": w,
                    "layout": layout,
                    "impl": "xla",
                    "median_us": 10.0,
                    "p10_us": 9.0,
                    "p90_us": 11.0,
                    "hbm": {"read_x_w": 8.0} if hbm else None,
                }
            )
    return {
        "config": {"steps": 8},
        "env": {"device_kind": "NVIDIA H200", "l2_bytes": 60 * 2**20},
        "runs": runs,
    }


@pytest.mark.parametrize("hbm", [False, True])
def test_plot_from_json(tmp_path, hbm):
    data = _fake_results(hbm)
    if hbm:  # with the device's ceilings: the floor lines
        data["env"]["ceilings"] = {"read_bytes_per_s": 4.2e12, "bf16_flops_per_s": 7e14}
    src = results.write_json_atomic(tmp_path / "r.json", data)
    out = plot.plot_chain(src, tmp_path / "plots" / "r.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in out.parent.iterdir()) == ["r.png"]


def test_l2_line_is_the_measured_size_else_the_datasheets_labelled_nominal():
    assert plot.l2_marker({"l2_bytes": 50 * 2**20}) == (50 * 2**20, "L2 50 MiB")
    nominal = plot.l2_marker({"l2_bytes": None, "device_kind": "NVIDIA H200"})
    assert nominal == (60 * 2**20, "L2 60 MiB (nominal, h200)")
    assert plot.l2_marker({"l2_bytes": None, "device_kind": "cpu"}) is None


def test_loop_report_finds_cache_slots_materialized_in_the_loop():
    """A recorded sample (cuDNN decode attention in the Core on the H200): XLA writes each
    layer's K and V slot out of the cache for the custom call, 4 fusions per iteration; the
    cache writes themselves stay in place (no copy of the whole cache)."""
    text = (DATA / "hlo_cudnn_decode_body.txt").read_text()
    cache, slot = (32, 1, 1025, 55, 96), (1, 1025, 55, 96)
    report = hlo.loop_report(text, None, big_buffer_dims=cache, slice_dims=slot)
    copies = report["slice_copies_per_iteration"]
    assert len(copies) == 4 and all("loop_dynamic_slice_fusion" in line for line in copies)
    assert report["big_buffer_copies"] == []
    other = hlo.loop_report(text, None, big_buffer_dims=cache, slice_dims=(1, 1024, 55, 96))
    assert other["slice_copies_per_iteration"] == []


# ---------------------------------------------------------------- memory


class FakeDevice:
    def __init__(self, platform: str, limit: int | None = None):
        self.platform, self.device_kind, self.limit = platform, f"Fake {platform}", limit

    def memory_stats(self):
        return {"bytes_limit": self.limit} if self.limit else None


def test_check_fits_names_the_flag_the_need_and_what_there_is(monkeypatch):
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 16 * 2**30)
    gpu = FakeDevice("gpu", limit=80 * 2**30)
    memory.check_fits("--context=1", "caches", 79 * 2**30, 15 * 2**30, device=gpu)  # fits
    with pytest.raises(UserError) as e:
        memory.check_fits("--context=9", "caches", 81 * 2**30, device=gpu, hint="use less")
    assert str(e.value) == (
        "--context=9: needs 81 GiB of device memory for caches; Fake gpu allows 80 GiB: use less"
    )
    with pytest.raises(UserError, match="needs 17 GiB of host memory for caches; 16 GiB"):
        memory.check_fits("--m=9", "caches", 1, 17 * 2**30, device=gpu)
    # On a CPU the device's arrays are host memory: both needs count against it.
    cpu = FakeDevice("cpu")
    memory.check_fits("--m=1", "x", 8 * 2**30, 8 * 2**30, device=cpu)
    with pytest.raises(UserError, match=r"needs 17 GiB of host memory \(the CPU device's"):
        memory.check_fits("--m=2", "x", 9 * 2**30, 8 * 2**30, device=cpu)
    # A device that reports no limit, a host that reports no memory: nothing to check against.
    monkeypatch.setattr(memory, "host_available_bytes", lambda: None)
    memory.check_fits("--m=3", "x", 2**60, 2**60, device=FakeDevice("gpu"))
    assert memory.format_bytes(1.5 * 2**30) == "1.5 GiB" and memory.format_bytes(512) == "512 B"


def test_host_available_bytes_is_at_most_the_physical_memory():
    available, physical = memory.host_available_bytes(), results.host_memory_bytes()
    assert available is None or physical is None or 0 < available <= physical
