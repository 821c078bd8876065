"""Tests of the cost model (huginn_jax.costs) and the roofline program (experiments.roofline)."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from program_runs import run_forked

from huginn_jax import costs
from huginn_jax.config import HuginnConfig

ROOT = Path(__file__).resolve().parents[1]
CFG = HuginnConfig.from_name("huginn_0125")
B200 = costs.get_device("b200")


def _ops(mode, context=1024, batch=1, config=CFG):
    return costs.core_iteration_ops(config, batch=batch, context=context, mode=mode)


def _by_name(ops):
    return {op.name: op for op in ops}


def test_param_counts_match_huginn_md():
    assert costs.block_param_count(CFG) == 395_398_080
    assert CFG.n_core * costs.block_param_count(CFG) == 1_581_592_320
    assert costs.adapter_param_count(CFG) == 55_756_800
    assert costs.core_param_count(CFG) == 1_637_349_120
    assert costs.model_param_count(CFG) == 3_564_976_800


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_ops_sum_to_core_params(mode):
    total = costs.totals(_ops(mode))
    assert total.param_bytes == total.weight_bytes == 2 * costs.core_param_count(CFG)


def test_seed_numbers_b200():
    h = costs.headline(CFG, B200, batch=1, context=1024, iterations=32)
    assert round(h["core_adapter_param_gb"], 3) == 3.275
    assert round(h["reread_gb"], 1) == 104.8
    assert round(h["min_ms_per_token"], 1) == 13.1
    assert (h["adapter_decode_m"], h["adapter_prefill_m"]) == (1, 1024)
    assert round(h["adapter_decode_us"], 1) == 13.9
    assert h["adapter_decode_bound"] == "memory"
    assert round(h["adapter_prefill_us"], 1) == 50.8
    assert h["adapter_prefill_bound"] == "compute"


def test_iterations_scale_linearly():
    kw = dict(batch=1, context=1024, mode="decode", device=B200)
    one = costs.iterations_cost(CFG, iterations=1, **kw)
    r32 = costs.iterations_cost(CFG, iterations=32, **kw)
    assert r32.param_bytes == one.param_bytes  # storage paid once
    assert r32.weight_bytes_reread == 32 * one.weight_bytes_reread
    assert r32.flops == 32 * one.flops
    assert r32.roofline_seconds == pytest.approx(32 * one.roofline_seconds)
    assert r32.roofline_seconds >= r32.weight_read_seconds


def test_adapter_matmul_cost():
    op = costs.matmul_cost(1, 10560, 5280)
    assert op.flops == 2 * 10560 * 5280
    assert op.weight_bytes == 10560 * 5280 * 2
    assert op.hbm_read_bytes == op.weight_bytes + 10560 * 2
    assert op.hbm_write_bytes == 5280 * 2
    assert _by_name(_ops("decode"))["adapter"] == dataclasses.replace(op, name="adapter")


def test_roofline_bounds_b200():
    dec, pre = _by_name(_ops("decode")), _by_name(_ops("prefill"))
    assert dec["adapter"].roofline(B200)[1] == "memory"
    assert pre["adapter"].roofline(B200)[1] == "compute"
    for name in ("core.0.attn.Wqkv", "core.3.mlp.fc", "core.1.mlp.proj"):
        assert dec[name].roofline(B200)[1] == "memory"
        assert pre[name].roofline(B200)[1] == "compute"
    assert costs.totals(_ops("decode")).roofline(B200)[1] == "memory"
    assert costs.totals(_ops("prefill")).roofline(B200)[1] == "compute"


def test_roofline_is_max_of_compute_and_memory():
    op = costs.OpCost(
        "x", param_bytes=0, flops=10**11, hbm_read_bytes=10**9, hbm_write_bytes=0, weight_bytes=0
    )
    t, bound = op.roofline(B200)
    assert t == pytest.approx(max(1e11 / 2250e12, 1e9 / 8e12))
    assert bound == "memory"


@pytest.mark.parametrize("t", [1, 7, 64, 1024])
def test_prefill_attention_counts_causal_pairs(t):
    ops = _by_name(_ops("prefill", context=t))
    pairs = t * (t + 1) // 2
    expected = 2 * CFG.n_heads * pairs * CFG.head_dim
    assert ops["core.0.attn.QK^T"].flops == expected
    assert ops["core.0.attn.PV"].flops == expected


def test_decode_attention_pairs_and_batch():
    ops = _by_name(_ops("decode", context=100, batch=3))
    assert ops["core.2.attn.QK^T"].flops == 2 * 3 * CFG.n_heads * 101 * CFG.head_dim


def test_decode_kv_bytes_grow_linearly_with_context():
    def kv_read(context):
        return costs.totals(_ops("decode", context=context)).kv_read_bytes

    step = kv_read(1025) - kv_read(1024)
    # K and V of one position, every Core layer, bf16.
    assert step == CFG.n_core * 2 * CFG.n_embd * 2
    assert kv_read(2048) - kv_read(1024) == 1024 * step
    assert kv_read(0) == 0
    # Decode writes one new K,V per layer regardless of context.
    writes = {costs.totals(_ops("decode", context=c)).kv_write_bytes for c in (1, 512, 4096)}
    assert writes == {CFG.n_core * 2 * CFG.n_embd * 2}


def test_huginn_md_kv_entry_size():
    """HUGINN.md: 21,120 B of KV per token and entry in bf16."""
    ops = _by_name(_ops("decode", context=1))
    assert ops["core.0.attn.QK^T"].kv_read_bytes * 2 == 21_120


def test_op_names_readable():
    names = [op.name for op in _ops("decode")]
    assert names[0] == "adapter"
    assert "core.0.attn.Wqkv" in names and "core.3.norm_4" in names
    assert len(names) == 1 + CFG.n_core * 11


def test_devices():
    assert costs.get_device("h200").l2_bytes == 60 * 2**20
    assert set(costs.DEVICES) == {"b200", "h200", "h200_measured", "h100"}
    with pytest.raises(ValueError, match="known: b200"):
        costs.get_device("banana")


@pytest.mark.parametrize(
    "kw", [dict(mode="train"), dict(batch=0), dict(context=0, mode="prefill"), dict(context=-1)]
)
def test_bad_arguments_raise(kw):
    args = dict(batch=1, context=16, mode="decode") | kw
    with pytest.raises(ValueError):
        costs.core_iteration_ops(CFG, **args)


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "experiments.roofline", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


SEED_LINES = [
    "Core + adapter parameters: 3.275 GB",
    "32 iterations re-read: 104.8 GB -> >= 13.1 ms per token",
    "adapter M=1: 13.9 us (memory-bound)",
    "adapter M=1024: 50.8 us (compute-bound)",
]


def test_program_prints_seed_numbers(tmp_path):
    out = tmp_path / "sub" / "roofline.json"
    proc = _run("--device=b200", f"--json_out={out}")
    assert proc.returncode == 0, proc.stderr
    for line in SEED_LINES:
        assert line in proc.stdout
    for title in ("Parameter storage", "Matmul FLOPs", "Roofline, decode", "Roofline, prefill"):
        assert title in proc.stdout
    result = json.loads(out.read_text())
    assert result["headline_lines"] == SEED_LINES
    assert result["headline"]["core_adapter_params"] == 1_637_349_120
    assert round(result["headline"]["reread_gb"], 1) == 104.8
    assert result["device"]["name"] == "b200"
    assert {r["name"] for r in result["tables"]["decode"]} >= {"adapter", "core.3.mlp.proj"}


@pytest.mark.parametrize(
    "flag",
    ["--device=banana", "--context=0", "--batch=-1", "--context=x", "--context=100000000000"],
)
def test_program_bad_flag_one_line_exit_2(flag):
    proc = run_forked("experiments.roofline", flag, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert flag.split("=")[0].lstrip("-") in lines[0]


def test_h200_measured_is_the_stored_ceilings_file():
    """The cost model's measured H200 is the ceilings file the project measured, to 4 digits."""
    from experiments.measure import ceilings

    stored = ceilings.load(ceilings.default_path("NVIDIA H200"))
    spec = costs.get_device("h200_measured")
    assert spec.hbm_bandwidth == pytest.approx(stored.read_bytes_per_s, rel=1e-3)
    assert spec.peak_bf16_flops == pytest.approx(stored.bf16_flops_per_s, rel=1e-3)
