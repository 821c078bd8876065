"""experiments.prefill_attention: its float64 reference, FLOP count, PyTorch's causal attention
compiled whole, "vs best", the exit status of a failed check and the CLI on CPU; on the GPU
(marked) every implementation against the reference at huginn-0125's head shape."""

import functools
import json
import time
import weakref

import jax.numpy as jnp
import numpy as np
import pytest
from attention_programs import (
    ON_GPU,
    TORCH_ROWS,
    assert_refused,
    check_compiled_whole,
    check_torch_row,
    run_forked_program,
    run_program,
    write_ceilings,
)
from tolerance import rel_fro

from experiments import attention_bench as bench
from experiments import prefill_attention as pa
from huginn_jax.layers import attend


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


run_cli = functools.partial(run_program, "prefill_attention")
run_cli_forked = functools.partial(run_forked_program, "prefill_attention")


def test_cli_on_cpu_writes_json(tmp_path):
    out = tmp_path / "pa.json"
    proc = run_cli(
        "--batch=1,2", "--tokens=128", "--heads=5", "--head_dim=16", "--sets=2", "--repeats=2",
        f"--json_out={out}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    impls = bench.with_sdpa_backends(pa.IMPLS, bench.DEFAULT_SDPA_BACKENDS) if ON_GPU else ["xla"]
    if not ON_GPU:
        assert "need(s) CUDA; skipped" in proc.stdout
    data = json.loads(out.read_text())
    records = data["records"]
    assert [(r["impl"], r["batch"]) for r in records] == [(i, b) for b in (1, 2) for i in impls]
    assert all(r["us"] > 0 and r["tflop_per_s"] > 0 and r["rel_err_vs_f64"] < 2e-2 for r in records)
    assert all(r["check_ok"] for r in records)
    lines = proc.stdout.splitlines()
    if not ON_GPU:  # no ceilings file for a CPU, and JAX rows only: no % of floor, no vs best
        assert data["ceilings"] is None and lines[-1] == "no ceilings file for 'cpu': no % of floor"
        assert all("pct_of_gemm_rate" not in r and r["vs_best"] is None for r in records)
        head = next(line for line in lines if line.startswith("impl "))
        row = lines[lines.index(head) + 2]
        for name in ("%GEMM", "vs best"):
            column = slice(head.index(name), head.index(name) + len(name))
            assert row[column].strip() == "-", (name, row)
    assert "TFLOP/s" in lines[-2]


def test_vs_best_and_a_failed_check_exit_1_after_the_table(capsys):
    def row(impl, tokens, us, ok=True):
        err = 1e-3 if ok else 0.5
        return {"impl": impl, "batch": 1, "tokens": tokens, "us": us, "us_p10": us, "us_p90": us,
                "tflop_per_s": 1.0, "rel_err_vs_f64": err, "check_ok": ok}  # fmt: skip

    records = [
        row("xla", 64, 30.0), row("cudnn", 64, 20.0), row("torch_graph/flash", 64, 25.0),
        row("torch_compile/cudnn", 64, 10.0, ok=False),
    ]  # fmt: skip
    bench.add_vs_best(records, pa.CASE_KEYS)
    assert [r["vs_best"] for r in records] == pytest.approx([25 / 30, 25 / 20, 20 / 25, None])
    table = pa.format_table(records)
    assert "0.83x" in table and "1.25x" in table and "0.80x" in table
    bench.fail_on_check("prefill_attention", records[:3], pa.CASE_KEYS)  # all passed: returns
    with pytest.raises(SystemExit) as exit_:
        bench.fail_on_check("prefill_attention", records, pa.CASE_KEYS)
    assert exit_.value.code == 1
    assert capsys.readouterr().err.splitlines() == [
        "prefill_attention: rel err above 0.02 against the reference: "
        "torch_compile/cudnn batch=1 tokens=64"
    ]


def test_time_one_checks_records_and_keeps_compile_time_out_of_the_samples():
    class Runner:
        sync = None
        compile_seconds, compile_mode = 3.0, "default"

        def __init__(self, value):
            self.value, self.calls = value, 0

        def __call__(self):
            self.calls += 1
            return jnp.full((2,), self.value)

    def build_slowly():  # as TorchRunner compiles: in the constructor, before any sample
        time.sleep(0.3)
        return Runner(1.0)

    ref = np.ones(2)
    good = bench.time_one({"impl": "torch_compile/flash"}, build_slowly, np.asarray, ref,
                          per_call=1, warmup=1, repeats=3)  # fmt: skip
    assert good["check_ok"] and good["rel_err_vs_f64"] == 0 and len(good["samples_s"]) == 3
    assert good["compile_seconds"] == 3.0 and max(good["samples_s"]) < 0.1
    bad = bench.time_one({"impl": "xla"}, lambda: Runner(1.5), np.asarray, ref,
                         per_call=1, warmup=0, repeats=1)  # fmt: skip
    assert bad["check_ok"] is False and bad["rel_err_vs_f64"] == pytest.approx(0.5)


def test_sweep_prepares_each_case_once_and_drops_the_previous_inputs_first():
    """Rows in case-then-impl order; a case's inputs are made once, after the previous case's
    are gone (two cases' inputs never share the device)."""

    class Inputs:
        pass

    made, alive_when_made = [], []

    def prepare(case):
        alive_when_made.append([ref() is not None for ref in made])
        inputs = Inputs()
        made.append(weakref.ref(inputs))
        return inputs

    def measure(case, impl, inputs):
        assert made[-1]() is inputs
        return {"case": case, "impl": impl}

    records = bench.sweep("test", [1, 2], ["a", "b"], prepare, measure)
    assert [(r["case"], r["impl"]) for r in records] == [(1, "a"), (1, "b"), (2, "a"), (2, "b")]
    assert alive_when_made == [[], [False]]


def test_known_impls_keeps_order_drops_repeats_and_names_the_unknown():
    assert bench.known_impls(["xla", "cudnn", "xla"], pa.IMPLS) == ["xla", "cudnn"]
    with pytest.raises(bench.UserError, match="--impls: unknown impl 'flash'"):
        bench.known_impls(["xla", "flash"], pa.IMPLS)


def test_torch_causal_attention_compiles_whole_and_matches_the_reference():
    """What torch_compile compiles, on the CPU: outputs [B, T, H, K] per set within tolerance;
    without the causal mask the check fails."""
    q, k, v = pa.inputs(2, 1, 24, pa.CHECKED_HEADS + 1, 8, seed=7)
    check_compiled_whole(pa, pa.first_set_checked_heads, q, k, v, causal=True)


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
        ("--tokens=10000000", "--tokens=10000000: needs"),
        ("--sdpa_backends=", "--sdpa_backends is empty"),
        ("--torch_compile_mode=max-autotune", "torch_compile_mode"),
    ],
)
def test_cli_bad_flags_exit_2(tmp_path, flag, message):
    assert_refused(run_cli_forked(flag, f"--json_out={tmp_path / 'x.json'}"), message)


def test_ceilings_of_another_device_exit_2_with_one_line(tmp_path):
    ceilings = write_ceilings(tmp_path / "c.json", "NVIDIA B200", 7e12, 2e15)
    proc = run_cli_forked(
        "--tokens=64", f"--ceilings={ceilings}", f"--json_out={tmp_path / 'x.json'}"
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if "'tpu'" not in line]
    assert len(lines) == 1 and lines[0].startswith("prefill_attention: --ceilings: ")
    assert "'NVIDIA B200'" in lines[0] and not (tmp_path / "x.json").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["xla", "cudnn", "mgpu"])
@pytest.mark.parametrize("tokens", [200, 1024])  # 200: mgpu pads T to 256
def test_impls_match_the_reference_gpu(impl, tokens):
    q, k, v = pa.inputs(1, 1, tokens, 55, 96, seed=tokens)
    out = pa.first_set_checked_heads(pa.XlaRunner(impl, q, k, v)())
    assert rel_fro(out, pa.reference(q, k, v)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("impl, mode, backend", TORCH_ROWS)
def test_torch_rows_match_the_reference_gpu(impl, mode, backend):
    q, k, v = pa.inputs(2, 1, 1024, 55, 96, seed=8)
    check_torch_row(pa, pa.first_set_checked_heads, q, k, v, impl, mode, backend)
