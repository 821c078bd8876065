"""experiments.decode_attention on CPU: the head-major candidate computes the model's attention,
and the program runs end to end on tiny sizes. (The model's own decode variants are tested in
test_model.py.)"""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import decode_attention as da
from huginn_jax.layers import attend

REPO = Path(__file__).resolve().parent.parent


S = 37  # cached positions in the tests below


def fresh_qkv(seed: int):
    """One float32 query [2, 1, 3, 8], keys and values [2, S, 3, 8], and the key positions."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (2, 1, 3, 8), jnp.float32)
    keys, values = (jax.random.normal(key, (2, S, 3, 8), jnp.float32) for key in (kk, kv))
    return q, keys, values, jnp.arange(S, dtype=jnp.int32)


def test_head_major_equals_the_models_attention():
    q, keys, values, k_pos = fresh_qkv(0)
    q_pos = jnp.array([20], jnp.int32)  # positions after 20 are masked out
    want = attend(q, keys, values, q_pos, k_pos)
    got = da.attend_head_major(
        q, jnp.swapaxes(keys, 1, 2), jnp.swapaxes(values, 1, 2), q_pos, k_pos
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # The mask matters: with every position visible the result differs.
    everything = attend(q, keys, values, jnp.array([S - 1], jnp.int32), k_pos)
    assert not np.allclose(everything, want, atol=1e-3)


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "experiments.decode_attention", *args],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip


def test_cli_on_cpu_writes_json(tmp_path):
    out = tmp_path / "da.json"
    proc = run_cli(
        "--batch=1", "--context=40", "--heads=3", "--head_dim=8", "--slots=3", "--repeats=2",
        f"--json_out={out}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    impls = ["xla", "xla_split", "xla_head_major", "pallas"]
    if jax.default_backend() == "gpu":  # the subprocess sees the same devices
        impls = ["xla", "xla_split", "xla_head_major", "cudnn", "pallas", "torch"]
    else:
        assert "need(s) CUDA; skipped" in proc.stdout
    records = json.loads(out.read_text())["records"]
    assert [r["impl"] for r in records] == impls
    assert all(r["us"] > 0 and r["rel_err_vs_f64"] < 2e-2 for r in records)


@pytest.mark.parametrize(
    "flag, message",
    [("--impls=flash", "unknown impl"), ("--context=0", "must be >= 1"), ("--head_dim=7", "even")],
)
def test_cli_bad_flags_exit_2(tmp_path, flag, message):
    proc = run_cli(flag, f"--json_out={tmp_path / 'x.json'}")
    assert proc.returncode == 2 and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
