"""experiments.kernels.prefill_gemm on CPU: the products of a Core iteration, the two JAX forms
against a float32 reference, refused flags, the program end to end (JSON rows, iteration rows,
the XLA_FLAGS it ran with), and how experiments.measure.device_time.torch_us counts calls."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_programs import assert_refused, run_forked_program, run_program, write_ceilings
from tolerance import assert_close, rel_fro, rtol

from experiments import attention_bench as bench
from experiments.kernels import prefill_gemm
from experiments.measure import device_time
from experiments.torch_ref import chain as torch_chain
from huginn_jax.config import HuginnConfig
from huginn_jax.xla_flags import TRITON_GEMM_OFF

MODULE = "kernels.prefill_gemm"


def test_huginn_0125_iteration_runs_17_products_of_5_shapes():
    shapes = prefill_gemm.shapes(HuginnConfig.from_name("huginn_0125"))
    d, f = 5280, 17920
    assert [(s.name, s.k, s.n, s.count) for s in shapes] == [
        ("adapter", 2 * d, d, 1),
        ("qkv", d, 3 * d, 4),
        ("proj", d, d, 4),
        ("fc", d, 2 * f, 4),
        ("mlp_proj", f, d, 4),
    ]
    assert sum(s.count for s in shapes) == 17


def test_both_jax_forms_match_a_float32_product_of_the_same_inputs():
    kx, kw = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (16, 384), jnp.bfloat16)
    w = (jax.random.normal(kw, (384, 384)) / 384**0.5).astype(jnp.bfloat16)
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    ref = prefill_gemm.reference(x, w)
    assert ref.dtype == jnp.float32
    assert_close(ref, want, dtype="float32")
    for got in (prefill_gemm.x_at_w(x, w), prefill_gemm.x_at_wt(x, jnp.transpose(w))):
        assert got.dtype == jnp.bfloat16 and got.shape == (16, 384)
        assert_close(np.asarray(got, np.float32), want)  # one bf16 rounding of the output
    # The check sees a wrong layout: w read as if stored [n, k].
    assert rel_fro(np.asarray(prefill_gemm.x_at_wt(x, w), np.float32), want) > bench.TOLERANCE
    assert rtol() < bench.TOLERANCE  # the program's check is looser than the tests'


@pytest.mark.parametrize(
    "flag, message",
    [("--tokens=0", "--tokens=0: must be >= 1"), ("--forms=x@W", "unknown form 'x@W'"),
     ("--config=huge", "--config: unknown preset"), ("--xla_flags=autotune=0", "not an XLA flag")],
)  # fmt: skip
def test_bad_flags_exit_2_with_one_line_before_any_work(tmp_path, flag, message):
    out = tmp_path / "p.json"
    proc = run_forked_program(MODULE, flag, f"--json_out={out}")
    assert_refused(proc, message)
    assert proc.stderr.startswith("prefill_gemm: ") and not out.exists()


def test_program_on_cpu_writes_a_row_per_shape_and_form_and_an_iteration_row(tmp_path):
    out = tmp_path / "p.json"
    ceilings = write_ceilings(tmp_path / "c.json", jax.devices()[0].device_kind, 1e9, 1e10)
    proc = run_program(
        MODULE, "--config=tiny", "--tokens=8", "--reps=2", "--warmup=0", f"--json_out={out}",
        f"--ceilings={ceilings}", "--xla_flags=--xla_gpu_autotune_level=0",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["complete"] and data["check_tolerance"] == bench.TOLERANCE
    words = data["environment"]["xla_flags"].split()
    assert TRITON_GEMM_OFF in words and words[-1] == "--xla_gpu_autotune_level=0"
    records = data["records"]
    forms = [f for f in prefill_gemm.FORMS if f.startswith("x@") or torch_chain.available()]
    shapes = prefill_gemm.shapes(HuginnConfig.from_name("tiny"))
    names = [s.name for s in shapes]
    assert [(r["shape"], r["impl"]) for r in records] == [
        (shape, form) for shape in [*names, "iteration"] for form in forms
    ]
    rows = {(r["shape"], r["impl"]): r for r in records}
    for r in records:
        assert r["check_ok"] and r["us_min"] <= r["us"] <= r["us_max"]
        assert r["pct_of_gemm"] == pytest.approx(100 * r["tflops"] * 1e12 / 1e10)
        assert r["tflops"] == pytest.approx(r["flops"] / r["us"] / 1e6)
    for form in forms:
        iteration = rows["iteration", form]
        assert iteration["count"] == 17
        for key in ("us", "us_min", "us_max"):
            want = sum(s.count * rows[s.name, form][key] for s in shapes)
            assert iteration[key] == pytest.approx(want)
        assert iteration["flops"] == sum(s.count * 2 * 8 * s.k * s.n for s in shapes)
    if len(forms) == 4:  # PyTorch ran too (on the CPU): every row has a rival
        assert all(r["vs_best"] and r["best_rival"] for r in records)
    head = proc.stdout.split("results: ")[1].splitlines()[1]
    assert "vs best" in head and "% GEMM" in head
    assert proc.stdout.strip().splitlines()[-1].endswith(f"({ceilings})")


@pytest.mark.parametrize("cuda", [False, True])
def test_torch_us_times_calls_back_to_back_after_one_untimed_call(monkeypatch, cuda):
    """Per sample: one untimed call, then `calls` timed ones (CUDA events: a fake clock that
    counts the calls made before each event, 1 ms each)."""
    torch = pytest.importorskip("torch", reason='needs PyTorch: pip install -e ".[torch]"')
    calls = []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self):
            self.at = len(calls)

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return float(end.at - self.at)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    samples = device_time.torch_us(lambda: calls.append(1), 3, warmup=2, calls=4, cuda=cuda)
    assert len(samples) == 3 and len(calls) == 2 + 3 * (4 + cuda)
    if cuda:
        assert samples == [pytest.approx(1e3)] * 3  # µs per call
