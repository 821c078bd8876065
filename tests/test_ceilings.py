"""The ceilings: the probes (experiments.measure.probes), the program that stores them
(experiments.ceilings, run on CPU), and the loader every program reads them with
(experiments.measure.ceilings)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from program_runs import run_forked

from experiments import ceilings as program
from experiments.measure import ceilings, probes

REPO = Path(__file__).resolve().parent.parent
SMALL = ["--gib=0.004", "--reps=3", "--gemm_counts=2,6", "--gemm_size=64", "--gemm_repeats=3"]


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "experiments.ceilings", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


# ------------------------------------------------------------------ probes
def test_device_time_takes_cupti_samples_when_cupti_measures(monkeypatch):
    """One CUPTI measurement (of 2 calls) per sample; its kernel time is the sample."""
    times = iter([7.0, 5.0, 6.0])
    calls = []

    def fake_cupti(fn, reps, *args):
        calls.append((reps, args))
        return next(times), 2, "2 kernel(s)"

    monkeypatch.setattr(probes, "cupti_us", fake_cupti)
    x = jnp.arange(4.0)
    got = probes.device_time(jax.jit(lambda x: x + 1), (x,), 3)
    assert got.samples_us == [7.0, 5.0, 6.0] and got.median_us == 6.0
    assert (got.method, got.kernels) == ("cupti", 2)
    assert [reps for reps, _ in calls] == [2, 2, 2] and calls[0][1][0] is x
    assert got.calls_per_sample == probes.CUPTI_CALLS == 2
    assert got.describe() == "CUPTI kernel time per call (mean of 2 calls), median of 3"


def test_device_time_falls_back_to_wall_time_and_says_why(monkeypatch):
    """CUPTI measures the first call only: every sample is then wall time, and the note keeps
    CUPTI's reason. A call that sleeps 20 ms takes at least that per call."""
    answers = iter([(4.0, 1, "1 kernel(s)"), (None, None, "CUPTI saw no kernels")])
    monkeypatch.setattr(probes, "cupti_us", lambda fn, reps, *args: next(answers))

    def slow(x):
        time.sleep(0.02)
        return x

    got = probes.device_time(slow, (jnp.ones(2),), 2, wall_calls=3)
    assert got.method == "wall" and got.kernels is None and got.calls_per_sample == 3
    assert got.note == "CUPTI unavailable (CUPTI saw no kernels)"
    assert len(got.samples_us) == 2 and all(20e3 <= us < 20e3 + 50e3 for us in got.samples_us)


def test_device_time_on_cpu_is_wall_time():
    got = probes.device_time(jax.jit(lambda x: x * 2), (jnp.ones(8),), 2, wall_calls=2)
    assert got.method == "wall" and "CUPTI unavailable" in got.note
    with pytest.raises(ValueError, match="reps >= 1"):
        probes.device_time(lambda: None, (), 0)


def test_read_probes_compute_and_count_bytes():
    """W [8, 3]: the GEMV with x of ones and the sum over K are W's column sums; the copy adds 1.
    Bytes: W once for the reads, twice (read + write) for the copy."""
    w = jax.random.normal(jax.random.key(0), (8, 3), jnp.bfloat16)
    column_sums = w.astype(jnp.float32).sum(0)
    by_name = {p.name: p for p in probes.read_probes(w)}
    assert list(by_name) == ["gemv", "sum", "copy"]
    gemv, total, copy = by_name["gemv"], by_name["sum"], by_name["copy"]
    assert jnp.allclose(gemv.fn(*gemv.args)[0].astype(jnp.float32), column_sums, rtol=1e-2)
    assert jnp.allclose(total.fn(*total.args), column_sums, rtol=1e-5)
    assert jnp.array_equal(copy.fn(*copy.args), w + 1)
    assert (gemv.nbytes, total.nbytes, copy.nbytes) == (48, 48, 96)
    assert gemv.read_only and total.read_only and not copy.read_only


def test_stream_weight_and_weights_sizes():
    assert probes.stream_weight(2**20, 64, jax.random.key(0)).shape == (64, 2**20 // 128)
    assert probes.stream_weight(10, 64, jax.random.key(0)).shape == (64, 1)
    copies = probes.weights(16, 32, 3000, jax.random.key(1))  # 1 KiB each: 3 reach 3000 B
    assert len(copies) == 3 and not jnp.array_equal(copies[0], copies[1])
    assert len(probes.weights(16, 32, 0, jax.random.key(1))) == 1


def test_gemm_times_runs_each_count_and_marks_the_edges(monkeypatch):
    """Each count: `repeats` runs, an idle pause before each, the edges marked around them."""
    slept, edges = [], []
    monkeypatch.setattr(probes.time, "sleep", slept.append)
    got = probes.gemm_times(
        32, [2, 5], repeats=3, idle_s=0.25, on_edge=lambda n, e: edges.append((n, e))
    )
    assert list(got) == [2, 5] and all(len(v) == 3 and min(v) > 0 for v in got.values())
    assert slept == [0.25] * 6
    assert edges == [(2, "start"), (2, "end"), (5, "start"), (5, "end")]
    assert probes.gemm_flops(32, 5) == 5 * 2 * 32**3
    for bad in ({"counts": [0]}, {"counts": []}, {"repeats": 0}, {"idle_s": -1.0}):
        kw = {"counts": [1], "repeats": 1, "idle_s": 0.0} | bad
        with pytest.raises(ValueError, match="bad gemm probe"):
            probes.gemm_times(8, **kw)


# ------------------------------------------------------------------ the ceilings from records
def test_ceilings_of_takes_the_faster_read_and_the_longest_gemm_run():
    def read(case, rate, kind="read"):
        return {
            "case": case,
            "kind": kind,
            "what": f"{case} of W",
            "method": "m",
            "bytes_per_s": rate,
        }

    def gemm(count, rate):
        return {"kind": "gemm", "count": count, "what": f"{count} matmuls", "flops_per_s": rate}

    records = [read("gemv", 4.4e12), read("sum", 3.6e12), read("copy", 3.4e12, "copy")]
    records += [gemm(10, 750e12), gemm(400, 690e12)]
    got = program.ceilings_of(records, repeats=5)
    assert got["read_bytes_per_s"] == 4.4e12 and got["read_method"] == "gemv: gemv of W; m"
    assert got["bf16_flops_per_s"] == 690e12 and got["gemm_method"].startswith("400 matmuls")
    assert got["copy_bytes_per_s"] == 3.4e12
    records[1]["bytes_per_s"] = 5e12
    assert program.ceilings_of(records, repeats=5)["read_method"].startswith("sum:")


# ------------------------------------------------------------------ the program on CPU
def test_cpu_run_writes_ceilings_the_loader_reads(tmp_path):
    out = tmp_path / "c.json"
    proc = run_cli(*SMALL, f"--json_out={out}", "--idle_s=0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = ceilings.load(out)
    kind = jax.devices()[0].device_kind  # the subprocess sees the same devices
    assert loaded.device_kind == kind and loaded.source == str(out)
    assert loaded.read_bytes_per_s > 0 and loaded.bf16_flops_per_s > 0
    assert ceilings.for_device(kind, out) == loaded

    data = json.loads(out.read_text())
    records = {r["case"]: r for r in data["records"]}
    assert list(records) == ["gemv", "sum", "copy", "gemm x2", "gemm x6"]
    w_bytes = 8192 * int(0.004 * 2**30 // (2 * 8192)) * 2
    assert records["gemv"]["bytes"] == records["sum"]["bytes"] == w_bytes
    assert records["copy"]["bytes"] == 2 * w_bytes
    on_gpu = jax.default_backend() == "gpu"
    for r in data["records"]:
        assert len(r["samples"]["seconds"]) == 3  # --reps=3, --gemm_repeats=3
        # no CUPTI on a CPU; the matmul runs are timed on the wall clock everywhere
        assert r["timing"] == "wall" or (on_gpu and r["kind"] != "gemm" and r["timing"] == "cupti")
    # Rates are the work over the median sample, and the ceilings are picked from them.
    gemv = records["gemv"]
    assert gemv["bytes_per_s"] == pytest.approx(w_bytes / (gemv["samples"]["median_us"] * 1e-6))
    x6 = records["gemm x6"]
    assert x6["flops"] == 6 * 2 * 64**3
    assert x6["flops_per_s"] == pytest.approx(x6["flops"] / (x6["samples"]["median_us"] * 1e-6))
    stored = data["ceilings"]
    assert stored["read_bytes_per_s"] == max(records[c]["bytes_per_s"] for c in ("gemv", "sum"))
    assert stored["bf16_flops_per_s"] == x6["flops_per_s"]
    assert stored["copy_bytes_per_s"] == records["copy"]["bytes_per_s"]
    assert stored["read_method"].split(":")[0] in ("gemv", "sum")
    assert data["environment"]["flags"]["gemm_size"] == 64
    assert "--xla_gpu_enable_triton_gemm=false" in data["environment"]["xla_flags"]
    # The table comes last: its rows are the records.
    last = proc.stdout.strip().splitlines()[-5:]
    assert [line.split()[0] for line in last] == ["gemv", "sum", "copy", "gemm", "gemm"]
    assert "TFLOP/s" in last[-1] and "TB/s" in last[0]


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="would write results/<device>/")
def test_cpu_default_path_is_out(tmp_path):
    """Without --json_out, a CPU run writes out/ceilings.json (never results/)."""
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.ceilings", *SMALL, "--idle_s=0"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ceilings.load(tmp_path / "out" / "ceilings.json").read_bytes_per_s > 0


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--gib=0", "--gib=0.0: the weight must hold"),
        ("--gib=-1", "--gib=-1.0: the weight must hold"),
        ("--reps=0", "--reps and --gemm_repeats must be >= 1"),
        ("--gemm_repeats=0", "--reps and --gemm_repeats must be >= 1"),
        ("--gemm_counts=10,0", "--gemm_counts=10,0: values must be >= 1"),
        ("--gemm_counts=x", "--gemm_counts=x: expected integers"),
        ("--gemm_size=0", "--gemm_size=0: must be >= 1"),
        ("--idle_s=-1", "--idle_s=-1.0: must be >= 0"),
        ("--gemm=triton", "ceilings: flag --gemm=triton"),
        ("--reps=many", "ceilings: flag --reps=many"),
        ("extra", "unexpected arguments: extra"),
    ],
)
def test_bad_flags_exit_2_with_one_line(tmp_path, flag, message):
    out = tmp_path / "c.json"
    proc = run_forked("experiments.ceilings", flag, f"--json_out={out}", cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "tpu" not in line.lower()]
    assert len(lines) == 1 and lines[0].startswith("ceilings:") and message in lines[0], lines
    assert not out.exists()


# ------------------------------------------------------------------ the loader
def write(path: Path, data) -> Path:
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


GOOD = {
    "environment": {"device_kind": "NVIDIA H200"},
    "ceilings": {"read_bytes_per_s": 4.4e12, "bf16_flops_per_s": 6.9e14},
}


def test_for_device_of_another_device_raises(tmp_path):
    path = write(tmp_path / "c.json", GOOD)
    assert ceilings.for_device("NVIDIA H200", path).read_bytes_per_s == 4.4e12
    with pytest.raises(ceilings.CeilingsError, match="measured on 'NVIDIA H200', this run is on"):
        ceilings.for_device("NVIDIA H100 80GB HBM3", path)


def test_for_device_without_a_file_is_none_and_with_one_loads_it(tmp_path, monkeypatch):
    monkeypatch.setattr(ceilings, "RESULTS_DIR", tmp_path)
    assert ceilings.for_device("NVIDIA H200") is None
    (tmp_path / "h200").mkdir()
    write(tmp_path / "h200" / "ceilings.json", GOOD)
    got = ceilings.for_device("NVIDIA H200")
    assert got.bf16_flops_per_s == 6.9e14 and got.source == str(tmp_path / "h200/ceilings.json")


@pytest.mark.parametrize(
    "content, match",
    [
        ("{not json", "not a ceilings file"),
        ({"environment": {"device_kind": "x"}}, "not a ceilings file .KeyError"),
        ({**GOOD, "ceilings": {"read_bytes_per_s": "fast", "bf16_flops_per_s": 1}}, "ValueError"),
        ({"ceilings": GOOD["ceilings"], "environment": None}, "TypeError"),
    ],
)
def test_load_rejects_what_is_not_a_ceilings_file(tmp_path, content, match):
    with pytest.raises(ceilings.CeilingsError, match=match):
        ceilings.load(write(tmp_path / "c.json", content))
    with pytest.raises(ceilings.CeilingsError, match="cannot read"):
        ceilings.load(tmp_path / "missing.json")


@pytest.mark.parametrize(
    "kind, slug",
    [
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100_80gb_hbm3"),
        ("cpu", "cpu"),
        ("  ", "device"),
    ],
)
def test_device_slug_and_default_path(kind, slug):
    assert ceilings.device_slug(kind) == slug
    assert ceilings.default_path(kind) == ceilings.RESULTS_DIR / slug / "ceilings.json"


def test_cupti_us_reads_one_iteration_and_several(monkeypatch):
    """The profiler returns one run's (name, ms) pairs unnested when asked for one iteration."""
    from jax.experimental.mosaic.gpu import profiler

    from experiments.measure import device_time

    one = [("gemv", 0.010), ("reduce", 0.002)]
    monkeypatch.setattr(profiler, "measure", lambda fn, **kw: lambda *a: (None, one))
    assert device_time.cupti_us(lambda: None, 1) == pytest.approx((12.0, 2, "2 kernel(s)"))
    runs = [[("k", 0.001)], [("k", 0.003)], [("k", 0.002)]]
    monkeypatch.setattr(profiler, "measure", lambda fn, **kw: lambda *a: (None, runs))
    us, kernels, _ = device_time.cupti_us(lambda: None, 3)
    assert us == pytest.approx(2.0) and kernels == 1


def test_an_optional_probe_that_fails_is_left_out_and_a_required_one_stops(capsys):
    """`probe_time`: an optional probe (the TMA one) that raises is reported on one line and
    measured as None; a required one's error propagates."""

    def broken(x):
        raise RuntimeError("Mosaic GPU: no such thing\nsecond line")

    x = jnp.ones(4)
    optional = probes.Probe("tma", broken, (x,), 16, True, "a kernel", optional=True)
    assert probes.probe_time(optional, reps=2) is None
    assert capsys.readouterr().out == "tma left out: RuntimeError: Mosaic GPU: no such thing\n"
    with pytest.raises(RuntimeError, match="no such thing"):
        probes.probe_time(probes.Probe("gemv", broken, (x,), 16, True, "a GEMV"), reps=2)
    ok = probes.Probe("sum", jax.jit(jnp.sum), (x,), 16, True, "a sum", optional=True)
    assert len(probes.probe_time(ok, reps=2).samples_us) == 2
