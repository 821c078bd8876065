"""Tests of experiments.measure: timing helper, results JSON, plot, HLO loop report, memory check.
The ncu and trace parsers have their own files (test_measure_ncu.py, test_measure_trace.py)."""

from __future__ import annotations

import json

import pytest
from conftest import DATA

from experiments.cli import UserError
from experiments.measure import hlo, memory, plot, results, timing

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
    assert samples.returned == [0.25, 0.5, 0.75, 1.0, 1.25]  # the calls, without the syncs
    assert samples.returned_median == 0.75
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
    assert samples.returned == [1.0, 1.0, 1.0]  # returned before its wait


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


def test_back_to_back_waits_once_per_sample_and_divides_by_calls_and_per_call(clock):
    """Warm-up calls are waited for each; then each sample is 3 calls of 1 s, 2 s and 3 s with
    no wait between them and one wait of 0.5 s on the last call's output, over 3 x 2 units."""
    durations = iter([100.0, 1.0, 2.0, 3.0, 1.0, 2.0, 3.0])
    events = []

    def fn():
        events.append("call")
        clock.advance(next(durations))
        return len(events)

    def sync():
        events.append("sync")
        clock.advance(0.5)

    samples = timing.time_back_to_back(fn, warmup=1, repeats=2, calls=3, sync=sync, per_call=2)
    assert events == ["call", "sync"] + ["call", "call", "call", "sync"] * 2
    assert samples.seconds == [6.5 / 6, 6.5 / 6]
    assert samples.warmup == 1 and samples.per_call == 2


def test_back_to_back_waits_on_the_last_calls_output(clock, monkeypatch):
    import jax

    waited = []
    monkeypatch.setattr(jax, "block_until_ready", waited.append)
    outputs = iter(range(10))
    samples = timing.time_back_to_back(lambda: next(outputs), warmup=2, repeats=2, calls=3)
    assert waited == [0, 1, 4, 7]  # each warm-up call, then the third call of each sample
    assert samples.seconds == [0.0, 0.0]


@pytest.mark.parametrize(
    "kw", [{"calls": 1}, {"calls": 0}, {"repeats": 0}, {"warmup": -1}, {"per_call": 0}]
)
def test_back_to_back_rejects_bad_counts(kw):
    args = {"warmup": 0, "repeats": 1, "calls": 2, "per_call": 1} | kw
    with pytest.raises(ValueError, match=f"{next(iter(kw))}="):
        timing.time_back_to_back(lambda: None, sync=lambda: None, **args)


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
