"""Tests of the experiments.chain program on CPU: bad input, end-to-end runs, ceilings, a failed
check's exit status, and the impl selection and children behind it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from chain_config import small_config
from program_runs import run_forked

from experiments.chain import children, options, report, runners, sweep
from huginn_jax.xla_flags import COMMAND_BUFFERS_OFF, TRITON_GEMM_OFF

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- the CLI


CLI_DEVICE_KIND = "cpu"  # what the program run by run_cli sees, on any machine


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", "experiments.chain", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_cli_forked(*args: str) -> subprocess.CompletedProcess:
    """`run_cli` forked from a process that has imported JAX (tests/program_runs.py): for runs
    that end before any work."""
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    return run_forked("experiments.chain", *args, cwd=REPO, env=env)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--size=banana"], "invalid size 'banana'"),
        (["--size=0"], "must be positive"),
        (["--size=-8MiB"], "must be positive"),
        (["--size=8MiB,banana"], "invalid size 'banana'"),
        (["--size=10B"], "too small"),
        (["--size=64GiB", "--steps=64"], "memory"),
        (["--size=8MiB", "--steps=0"], "--steps must be >= 1"),
        (["--size=8MiB", "--dtype=int8"], "unknown --dtype"),
        (["--size=8MiB", "--layouts=shared,mirrored"], "--layouts"),
        (["--size=8MiB", "--impls=cuda_fortran"], "unknown impl"),
        (["--d=0"], "--d must be >= 1"),
        (["--size=8MiB", "--gemm=tensor_cores"], "--gemm"),
        (["--size=8MiB", "--torch_compile_mode=fast"], "--torch_compile_mode"),
        (["--size=64KiB", "--ceilings=/nonexistent/ceilings.json"], "--ceilings"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, args, message):
    json_out, plot_out = tmp_path / "r.json", tmp_path / "r.png"
    proc = run_cli_forked(*args, f"--json_out={json_out}", f"--plot_out={plot_out}")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert message in lines[0] and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_end_to_end_on_cpu(tmp_path):
    json_out, plot_out = tmp_path / "out" / "chain.json", tmp_path / "out" / "chain.png"
    proc = run_cli(
        "--size=32KiB,128KiB", "--steps=4", "--repeats=3", "--warmup=1", "--impls=xla,torch",
        f"--json_out={json_out}", f"--plot_out={plot_out}", "--hbm",
        f"--trace_dir={tmp_path / 'trace'}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "HBM counters need a GPU and Nsight Compute (ncu); skipped" in out
    assert "xla_no_cmdbuf" in out and "skipped" in out  # command buffers: GPU only
    assert "torch" in out  # torch missing or no CUDA: one note
    # the table is last, then the two paths
    tail = out.strip().splitlines()
    assert tail[-2] == f"json: {json_out}" and tail[-1] == f"plot: {plot_out}"
    assert any(line.lstrip().startswith("W ") and "time/chain" in line for line in tail)
    assert "kernels per chain" in out and "dot" in out  # CPU trace breakdown

    data = json.loads(json_out.read_text())
    assert plot_out.read_bytes()[:4] == b"\x89PNG"
    assert data["env"]["platform"] == "cpu" and data["env"]["versions"]["jax"]
    assert data["config"]["repeats"] == 3 and data["config"]["chains_per_call"] == 4
    assert {(r["weight_bytes"], r["layout"], r["impl"]) for r in data["runs"]} == {
        (w, layout, impl)
        for w in (32 * 2**10, 128 * 2**10)
        for layout in ("shared", "copies")
        for impl in ("xla", "xla_loop")
    }
    for r in data["runs"]:
        assert len(r["samples"]["seconds"]) == 3 and r["median_us"] > 0 and r["hbm"] is None
    assert all(c["identical"] for c in data["checks"]["layouts"])
    assert all(c["ok"] for c in data["checks"]["agreement"] + data["checks"]["one_chain"])
    assert {t["impl"] for t in data["traces"]} == {"xla", "xla_loop"}
    for t in data["traces"]:  # the timeline per chain: span = kernels + idle between them
        span, busy, gaps = (t["per_chain"][k] for k in ("span", "busy", "gaps"))
        assert 0 < busy <= span and span == pytest.approx(busy + gaps)
    assert "xla: GPU span" in out and "idle between them" in out
    assert list((tmp_path / "trace").glob("*/plugins/profile/*/*.xplane.pb"))


def test_json_out_alone_puts_the_plot_beside_it_and_records_the_cpu_timing(tmp_path):
    json_out = tmp_path / "run7.json"
    proc = run_cli("--size=64KiB", "--impls=xla", "--layouts=shared", f"--json_out={json_out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    plot_out = tmp_path / "run7.png"
    assert proc.stdout.strip().splitlines()[-1] == f"plot: {plot_out}"
    assert plot_out.read_bytes()[:4] == b"\x89PNG"
    data = json.loads(json_out.read_text())
    used = {k: data["config"][k] for k in options.CPU_DEFAULTS}
    assert used == options.CPU_DEFAULTS  # scaled down on CPU: the flags were not given
    flags = data["env"]["flags"]
    assert {k: flags[k] for k in options.CPU_DEFAULTS} == used  # the values used, not defaults
    assert flags["plot_out"] == str(plot_out) and "child" not in flags


def test_pallas_impl_is_known_and_skipped_without_a_gpu(tmp_path):
    assert options.expand_impls(["pallas"]) == ("pallas",)
    proc = run_cli("--size=64KiB", "--impls=xla,pallas", "--json_out=", "--plot_out=")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "the Pallas kernels need a GPU" in proc.stdout + proc.stderr


def test_pallas_splitk_runs_in_the_child_without_command_buffers():
    assert options.expand_impls(["pallas_splitk_no_cmdbuf"]) == ("pallas_splitk_no_cmdbuf",)
    assert "pallas_splitk_no_cmdbuf" in runners.LAYOUTS_NOT_COMPARABLE
    assert COMMAND_BUFFERS_OFF in children.child_env(["pallas_splitk_no_cmdbuf"])["XLA_FLAGS"]
    notes: list[str] = []
    opts = options.Options(
        configs=(), layouts=("shared",), impls=("xla", "pallas_splitk_no_cmdbuf"), warmup=1,
        repeats=1, chains_per_call=1, ncu_chains=1, json_out="", plot_out="", hbm=False,
        trace_dir=None,
    )  # fmt: skip
    assert sweep.select_impls(opts, on_gpu=False, note=notes.append) == ("xla",)
    assert "pallas_splitk_no_cmdbuf skipped" in notes[0]


def test_gemm_and_torch_compile_mode_reach_the_children():
    cfg = small_config()
    opts = options.Options(
        configs=(cfg,), layouts=("shared",), impls=("xla_no_cmdbuf",), warmup=1, repeats=1,
        chains_per_call=1, ncu_chains=1, json_out="", plot_out="", hbm=False, trace_dir=None,
        gemm="cublas", torch_compile_mode="max-autotune-no-cudagraphs",
    )  # fmt: skip
    argv = children.child_argv(cfg, opts, "timing", ["shared"], ["xla_no_cmdbuf"], "/tmp/x")
    assert "--gemm=cublas" in argv and "--torch_compile_mode=max-autotune-no-cudagraphs" in argv


def test_timing_child_reports_the_chains_its_output_went_through():
    # The parent checks a child's output against the reference after that many chains; it
    # used to guess 1 for every impl without "loop" in its name (pallas_splitk_no_cmdbuf runs N).
    cfg, n = small_config(d=64, steps=3), 3
    opts = options.Options(
        configs=(cfg,), layouts=("shared",), impls=("xla", "xla_loop"), warmup=0, repeats=1,
        chains_per_call=n, ncu_chains=1, json_out="", plot_out="", hbm=False, trace_dir=None,
    )  # fmt: skip
    child = children.run_timing_child(cfg, opts, ["xla", "xla_loop"])
    x_host, w_host = runners.host_values(cfg)
    for impl, chains in (("xla", 1), ("xla_loop", n)):
        _, out, compile_seconds = child[("shared", impl)]
        assert out.chains == chains and compile_seconds > 0
        ref = report.reference_chain(x_host, w_host, cfg.steps * chains)
        other = report.reference_chain(x_host, w_host, cfg.steps * (n + 1 - chains))
        tol = report.tolerance(cfg.dtype, cfg.steps * chains)
        assert np.max(np.abs(out.y - ref)) / np.max(np.abs(ref)) <= tol
        assert np.max(np.abs(out.y - other)) / np.max(np.abs(other)) > tol
        ref1 = report.reference_chain(x_host, w_host, cfg.steps)  # the child's one chain
        assert report.agreement(out.one_chain, ref1, cfg.dtype, cfg.steps)["ok"]


def _ceilings_file(path: Path, device_kind: str, read_bytes_per_s: float) -> Path:
    path.write_text(
        json.dumps(
            {
                "environment": {"device_kind": device_kind},
                "ceilings": {"read_bytes_per_s": read_bytes_per_s, "bf16_flops_per_s": 1e12},
            }
        )
    )
    return path


def test_variants_end_to_end_with_one_chain_checks_ceilings_and_gemm(tmp_path):
    impls = ("xla", "xla_loop", "xla_f32dot", "xla_loop_unrolled")
    json_out = tmp_path / "chain.json"
    bw = 2.0e11
    ceilings = _ceilings_file(tmp_path / "ceilings.json", CLI_DEVICE_KIND, bw)
    proc = run_cli(
        f"--impls={','.join(impls)}", "--size=1MiB", f"--json_out={json_out}", "--plot_out=",
        f"--ceilings={ceilings}", "--gemm=cublas",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(json_out.read_text())
    keys = {(layout, impl) for layout in ("shared", "copies") for impl in impls}
    assert {(r["layout"], r["impl"]) for r in data["runs"]} == keys
    steps, n = data["config"]["steps"], data["config"]["chains_per_call"]
    one = data["checks"]["one_chain"]
    assert {(c["layout"], c["impl"]) for c in one} == keys
    for c in one:
        assert c["chains"] == 1 and c["ok"]
        assert c["tol"] == pytest.approx(report.tolerance("bfloat16", steps))
    chains = {c["impl"]: c["chains"] for c in data["checks"]["agreement"]}
    assert chains == {"xla": 1, "xla_loop": n, "xla_f32dot": 1, "xla_loop_unrolled": n}
    assert all(c["ok"] for c in data["checks"]["agreement"])
    assert all(c["identical"] for c in data["checks"]["layouts"])
    # the floor comes from the ceilings file; no torch rows here, so no rival
    assert data["env"]["ceilings"]["read_bytes_per_s"] == bw
    assert data["env"]["ceilings_source"] == str(ceilings)
    for r in data["runs"]:
        t = r["median_us"] * 1e-6
        assert r["pct_floor_once"] == pytest.approx(100 * r["weight_bytes"] / bw / t, rel=1e-3)
        assert r["vs_best"] is None
    compiled = {r["impl"] for r in data["runs"] if r["compile_seconds"]}
    assert compiled == set(impls)  # compiled for the first layout, cached for the second
    assert data["config"]["gemm"] == "cublas" and TRITON_GEMM_OFF in data["env"]["xla_flags"]
    assert "0.20 TB/s" in proc.stdout and "vs best" in proc.stdout


def test_ceilings_of_another_device_are_refused(tmp_path):
    ceilings = _ceilings_file(tmp_path / "c.json", "Another GPU", 4e12)
    proc = run_cli_forked("--size=64KiB", f"--ceilings={ceilings}", "--json_out=", "--plot_out=")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"chain: --ceilings: {ceilings}: measured on 'Another GPU', this run is on "
        f"{CLI_DEVICE_KIND!r}"
    ]


def test_a_failed_check_exits_1_after_writing_the_json(tmp_path):
    # Every check fails when the tolerance is negative; the program must still write the JSON.
    json_out = tmp_path / "chain.json"
    script = (
        "import sys; from experiments import program; from experiments.chain import report; "
        "from experiments.chain.__main__ import define_flags, main; "
        "report.tolerance = lambda dtype, steps: -1.0; "
        "sys.argv = ['chain'] + sys.argv[1:]; "
        "program.run('chain', define_flags, main)"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", script, "--size=64KiB", "--impls=xla_f32dot", "--layouts=shared",
         f"--json_out={json_out}", "--plot_out="],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    data = json.loads(json_out.read_text())
    assert data["complete"] and not any(c["ok"] for c in data["checks"]["one_chain"])
    errors = proc.stderr.strip().splitlines()
    assert "chain: check failed: xla_f32dot shared W=" in errors[0]
    assert "after 1 chain" in errors[0]
    assert errors[-1].startswith("chain: 2 check(s) failed")
