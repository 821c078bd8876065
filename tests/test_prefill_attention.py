"""experiments.prefill_attention: its float64 reference, FLOP count and CLI on CPU; on the GPU
(marked) every implementation against the reference at huginn-0125's head shape."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import prefill_attention as pa
from huginn_jax.layers import attend

REPO = Path(__file__).resolve().parent.parent
ON_GPU = jax.default_backend() == "gpu"


def test_reference_is_the_models_causal_attention():
    q, k, v = pa.inputs(2, 2, 33, pa.CHECKED_HEADS + 1, 8, seed=3)
    positions = jnp.arange(33, dtype=jnp.int32)
    f32 = [x[0].astype(jnp.float32) for x in (q, k, v)]
    want = attend(*f32, positions, positions)  # float32 inputs: full float32 products
    got = pa.reference(q, k, v)
    assert got.shape == (2, 33, pa.CHECKED_HEADS, 8)
    np.testing.assert_allclose(got, np.asarray(want[:, :, : pa.CHECKED_HEADS]), atol=2e-5)
    # Causal: the first position sees only itself, so its output is its own value.
    np.testing.assert_allclose(got[:, 0], np.asarray(f32[2][:, 0, : pa.CHECKED_HEADS]), atol=1e-6)


def test_causal_flops_counts_the_lower_triangle():
    # T = 2: pairs (0,0), (1,0), (1,1); two products of 2 x K FLOPs each per pair and head
    assert pa.causal_flops(1, 2, 1, 1) == 2 * 2 * 3
    assert pa.causal_flops(2, 4, 3, 8) == 2 * 2 * 2 * 3 * 10 * 8


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "experiments.prefill_attention", *args],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip


def test_cli_on_cpu_writes_json(tmp_path):
    out = tmp_path / "pa.json"
    proc = run_cli(
        "--batch=1,2", "--tokens=128", "--heads=5", "--head_dim=16", "--sets=2", "--repeats=2",
        f"--json_out={out}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    impls = list(pa.IMPLS) if ON_GPU else ["xla"]
    if not ON_GPU:
        assert "need(s) CUDA; skipped" in proc.stdout
    records = json.loads(out.read_text())["records"]
    assert [(r["impl"], r["batch"]) for r in records] == [(i, b) for b in (1, 2) for i in impls]
    assert all(r["us"] > 0 and r["tflop_per_s"] > 0 and r["rel_err_vs_f64"] < 2e-2 for r in records)
    assert "TFLOP/s" in proc.stdout.splitlines()[-1]


def test_cli_trace_dir_breaks_each_jax_call_down(tmp_path):
    out = tmp_path / "pa.json"
    proc = run_cli(
        "--impls=xla", "--tokens=64", "--heads=2", "--head_dim=16", "--sets=2", "--repeats=2",
        f"--json_out={out}", f"--trace_dir={tmp_path / 'trace'}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    (record,) = json.loads(out.read_text())["records"]
    spent = record["trace_us_per_attention"]
    assert spent["busy"] > 0 and spent["span"] >= spent["busy"]
    assert record["trace"] and all(row["launches"] >= 1 for row in record["trace"])
    assert "traced span" in proc.stdout and list((tmp_path / "trace").rglob("*.trace.json.gz"))


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--impls=flash", "unknown impl"),
        ("--tokens=0", "must be >= 1"),
        ("--sets=0", "--sets must be >= 1"),
    ],
)
def test_cli_bad_flags_exit_2(tmp_path, flag, message):
    proc = run_cli(flag, f"--json_out={tmp_path / 'x.json'}")
    assert proc.returncode == 2 and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("impl", ["xla", "cudnn", "mgpu"])
@pytest.mark.parametrize("tokens", [200, 1024])  # 200: mgpu pads T to 256
def test_impls_match_the_reference_gpu(impl, tokens):
    q, k, v = pa.inputs(1, 1, tokens, 55, 96, seed=tokens)
    out = pa.first_set_checked_heads(pa.XlaRunner(impl, q, k, v)())
    ref = pa.reference(q, k, v)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2
