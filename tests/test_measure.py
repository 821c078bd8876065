"""Tests of experiments.measure: timing helper, ncu CSV parser, trace parser, results, plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from experiments.measure import hlo, ncu, plot, results, timing, trace

DATA = Path(__file__).parent / "data"


# ---------------------------------------------------------------- timing


def test_time_fn_counts_calls_and_divides_by_per_call():
    calls = []
    synced = []
    samples = timing.time_fn(
        lambda: calls.append(1), warmup=2, repeats=5, sync=lambda: synced.append(1), per_call=4
    )
    assert len(calls) == 7 and len(synced) == 7
    assert len(samples.seconds) == 5 and samples.per_call == 4 and samples.warmup == 2
    assert min(samples.seconds) <= samples.p10 <= samples.median <= samples.p90
    assert timing.Samples.from_dict(samples.to_dict()) == samples


def test_time_fn_blocks_on_jax_results():
    import jax.numpy as jnp

    samples = timing.time_fn(lambda: jnp.ones(4) * 2, warmup=0, repeats=2)
    assert all(s > 0 for s in samples.seconds)


def test_samples_quantiles():
    s = timing.Samples(seconds=[4.0, 1.0, 3.0, 2.0, 5.0], warmup=0)
    assert s.median == 3.0
    assert s.quantile(0.0) == 1.0 and s.quantile(1.0) == 5.0
    assert s.p10 == pytest.approx(1.4)
    assert s.summary_us()["median_us"] == pytest.approx(3e6)


@pytest.mark.parametrize("kw", [{"warmup": -1}, {"repeats": 0}, {"per_call": 0}])
def test_time_fn_rejects_bad_counts(kw):
    args = {"warmup": 0, "repeats": 1, "per_call": 1} | kw
    with pytest.raises(ValueError):
        timing.time_fn(lambda: None, sync=lambda: None, **args)


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
    """Recorded on an H200: app-range replay, 4 ranges (shared/copies x xla/torch_graph)."""
    ranges = ncu.parse_ncu_csv((DATA / "ncu_h200_range.csv").read_text())
    assert [r.name for r in ranges] == ["range"] * 4
    w = 6144 * 6144 * 2
    # 72 MiB > 60 MiB L2: every layout reads about 8 W per chain (10 or 20 chains per range)
    for r, chains in zip(ranges, (10, 20, 10, 20), strict=True):
        per_chain = ncu.summarize([r], chains).bytes_read_per_chain
        assert 7.5 < per_chain / w < 8.5


def test_parse_ncu_csv_h200_kernel_sample():
    """Recorded on an H200: kernel replay, 2 chains x 16 kernels (XLA's multiply + reduce)."""
    kernels = ncu.parse_ncu_csv((DATA / "ncu_h200_kernel.csv").read_text())
    assert len(kernels) == 32
    assert {k.name for k in kernels} >= {"loop_multiply_fusion_6", "input_reduce_fusion_1"}
    s = ncu.summarize(kernels, chains=2)
    assert s.bytes_read_per_chain > 8 * 2048 * 2048 * 2  # at least W per step
    assert 0 <= s.l2_hit_pct <= 100


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


def test_find_ncu_returns_an_executable_or_none():
    path = ncu.find_ncu()
    assert path is None or Path(path).exists()


# ---------------------------------------------------------------- trace


def test_parse_trace_cpu_sample():
    """Recorded on CPU: 3 chains of 4 steps (d=64) of the jitted chain, one dispatch each."""
    rows = trace.parse_trace(DATA / "chain_cpu.trace.json.gz", chains=3)
    names = {r.name for r in rows}
    assert {"dot.4", "dot.5", "dot.6", "dot.7"} <= names
    assert not any(n.startswith("end: ") or n.startswith("ThunkExecutor") for n in names)
    assert all(r.launches == 3 for r in rows)
    for r in rows:
        assert r.us_per_chain == pytest.approx(r.total_us / 3)
    assert rows == sorted(rows, key=lambda r: -r.total_us)


def test_parse_trace_gpu_samples():
    """Recorded on the H200: 20 chains of 8 steps, W = 72 MiB, shared, profiler on."""
    rows = trace.parse_trace(DATA / "chain_h200.trace.json.gz", chains=20)
    # XLA: 8 products per chain, each a GEMM fusion (one of them a different fusion) + reduce
    assert {r.name: r.launches for r in rows} == {
        "gemm_fusion_dot_17": 140,
        "gemm_fusion_dot_16": 20,
        "loop_reduce_fusion": 160,
    }
    assert not any("Pjit" in r.name for r in rows)  # host-side events are not kernels
    assert sum(r.us_per_chain for r in rows) == pytest.approx(183.2, abs=0.1)
    # torch eager (its profiler's Chrome trace): one cuBLAS kernel per product
    torch_rows = trace.parse_trace(DATA / "chain_h200_torch.trace.json.gz", chains=20)
    assert [(r.launches, round(r.us_per_chain, 1)) for r in torch_rows] == [(160, 169.6)]
    assert torch_rows[0].name.startswith("nvjet_sm90")


def test_timeline_splits_the_span_into_busy_time_and_gaps():
    """Hand-made: kernels at [10, 13) and [20, 23), and one nested in the first (counted once):
    span 13, busy 6, gaps 7. The recorded XLA chain trace: busy at most the kernels' sum (a few
    overlap by their timestamps), and the span is longer."""
    made = [{"ts": 10.0, "dur": 3.0}, {"ts": 11.0, "dur": 1.0}, {"ts": 20.0, "dur": 3.0}]
    assert trace.timeline(made) == trace.Timeline(span=13.0, busy=6.0)
    assert trace.timeline(made).gaps == 7.0
    assert trace.timeline([]) == trace.Timeline(0.0, 0.0)
    events = trace.kernel_events(trace.load_trace(DATA / "chain_h200.trace.json.gz"))
    spent = trace.timeline(events)
    total = sum(e["dur"] for e in events)
    assert 0.9 * total < spent.busy <= total
    assert spent.span > spent.busy
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
    path = trace.profile_jax(lambda: (x @ x).block_until_ready(), tmp_path)
    rows = trace.parse_trace(path, chains=1)
    assert list(tmp_path.rglob("*.xplane.pb"))
    assert isinstance(rows, list)
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
    src = results.write_json_atomic(tmp_path / "r.json", _fake_results(hbm))
    out = plot.plot_chain(src, tmp_path / "plots" / "r.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in out.parent.iterdir()) == ["r.png"]


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
