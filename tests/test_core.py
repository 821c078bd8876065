"""experiments.core on CPU: the cache-update path and the Core against the model's forward."""

import functools
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from program_runs import run_forked

import huginn_jax
from experiments.core import cases, report, runners
from experiments.measure import hlo, timing
from experiments.torch_ref.core import COMPILE_MODES
from huginn_jax.config import HuginnConfig
from huginn_jax.model import Core, embed, initial_state, run_prelude

REPO = Path(__file__).resolve().parent.parent
CFG = cases.core_config("micro")


@functools.cache
def core_weights():
    """The float32 micro Core's random weights of seed 0 (graphdef, params), drawn once for the
    module: their jitted init compiles for seconds, and no test changes them."""
    return runners.build_core(CFG, jnp.float32, 0)


def decode_setup(iterations):
    graphdef, params = core_weights()
    case = cases.Case("decode", batch=2, context=7, iterations=iterations)
    state, embedded, cache = runners.case_inputs(CFG, case, jnp.float32, 0)
    return graphdef, params, case, state, embedded, cache


def test_decode_updates_the_cache_in_place_without_a_copy():
    graphdef, params, case, state, embedded, cache = decode_setup(iterations=3)
    core, weights = runners.jit_core(graphdef, params, iterations=3)
    compiled = core.lower(weights, state, embedded, cache, jnp.int32(7)).compile()
    report = hlo.loop_report(
        compiled.as_text(),
        compiled.memory_analysis(),
        big_buffer_dims=cache.k.shape,
        slice_dims=cache.k.shape[-4:],
    )
    assert report["while_loops"] == 1
    assert report["big_buffer_copies"] == []
    assert report["slice_copies_per_iteration"] == []  # each slot is read where it is
    assert report["alias_bytes"] >= cache.nbytes  # both K and V alias their outputs
    k_before = cache.k
    core(weights, state, embedded, cache, jnp.int32(7))
    assert k_before.is_deleted()  # donated: the output reuses the input's buffer


def test_decode_writes_the_right_slots_and_keeps_the_history():
    graphdef, params, case, state, embedded, cache = decode_setup(iterations=2)
    history_k = np.asarray(cache.k)
    # The history is random, and different in every slot (drawn slot by slot).
    assert 0.8 < history_k[:, :, :7].std() < 1.2
    assert np.abs(history_k[0, :, :7] - history_k[1, :, :7]).mean() > 0.5
    core2, weights = runners.jit_core(graphdef, params, iterations=2)
    _, cache2 = core2(weights, state, embedded, cache, jnp.int32(7))
    k2 = np.asarray(cache2.k)
    np.testing.assert_array_equal(k2[:, :, :7], history_k[:, :, :7])  # history untouched
    written = k2[:, :, 7]
    assert np.all(np.abs(written).reshape(written.shape[0], -1).max(axis=1) > 0)
    # Iteration 0's entries do not depend on later iterations: a 1-iteration run writes the same.
    *_, cache1_in = decode_setup(iterations=1)
    core1, _ = runners.jit_core(graphdef, params, iterations=1)
    _, cache1 = core1(weights, state, embedded, cache1_in, jnp.int32(7))
    # float32, two executables (XLA fuses r = 1 and r = 2 differently): ~1e-6 apart on the H200
    np.testing.assert_allclose(np.asarray(cache1.k)[:, :, 7], written[: CFG.n_core], rtol=1e-5)
    assert np.abs(written[CFG.n_core :] - written[: CFG.n_core]).max() > 1e-3  # iteration 1 differs


def test_prefill_from_zero_equals_reading_the_cache():
    """from_zero (start the constant 0: attend to the new positions alone, plainly causal)
    computes what the traced-start prefill computes over the whole, still empty, cache."""
    graphdef, params = core_weights()
    case = cases.Case("prefill", batch=2, context=9, iterations=2)
    state, embedded, cache = runners.case_inputs(CFG, case, jnp.float32, 0)
    reading, weights = runners.jit_core(graphdef, params, iterations=2)
    from_zero, _ = runners.jit_core(graphdef, params, iterations=2, from_zero=True)
    want, want_cache = reading(weights, state, embedded, cache, jnp.int32(0))
    *_, cache = runners.case_inputs(CFG, case, jnp.float32, 0)  # the first was donated
    got, got_cache = from_zero(weights, state, embedded, cache, jnp.int32(5))  # start ignored
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_cache.k, want_cache.k, rtol=1e-5, atol=1e-5)


def test_core_matches_the_model_forward():
    """The Core the experiment times is the model's own: same weights, same state."""
    cfg = HuginnConfig.from_name("micro")
    model = huginn_jax.random_init(cfg, jax.random.key(3))
    ids = jax.random.randint(jax.random.key(4), (2, 6), 0, cfg.vocab_size)
    state0 = initial_state(cfg, (2, 6), init_scale=1.0, key=jax.random.key(5), dtype=jnp.float32)
    expected = model(ids, num_steps=3, init_state=state0).state
    embedded, _ = run_prelude(model, embed(model, ids), jnp.int32(0), None)
    core_graph = nnx.graphdef(Core(CFG, rngs=nnx.Rngs(0)))
    core_state = nnx.state(Core(CFG, rngs=nnx.Rngs(0)))
    nnx.replace_by_pure_dict(
        core_state,
        {
            "adapter": nnx.to_pure_dict(nnx.state(model.adapter)),
            "core_block": nnx.to_pure_dict(nnx.state(model.core_block)),
        },
    )
    core, weights = runners.jit_core(core_graph, core_state, iterations=3)
    got, _ = core(weights, state0, embedded, None, jnp.int32(0))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_trained_weights_are_the_exported_models_core(tmp_path):
    """--weights=trained: the Core of a from_pretrained directory, equal to the model's own."""
    cfg = HuginnConfig.from_name("micro")
    model = huginn_jax.random_init(cfg, jax.random.key(6))
    huginn_jax.save_pretrained(model, tmp_path)
    ids = jax.random.randint(jax.random.key(7), (2, 5), 0, cfg.vocab_size)
    state0 = initial_state(cfg, (2, 5), init_scale=1.0, key=jax.random.key(8), dtype=jnp.float32)
    expected = model(ids, num_steps=2, init_state=state0).state
    embedded, _ = run_prelude(model, embed(model, ids), jnp.int32(0), None)
    graphdef, params = runners.load_core(
        cases.core_config(str(tmp_path)), jnp.float32, str(tmp_path)
    )
    core, weights = runners.jit_core(graphdef, params, iterations=2)
    got, _ = core(weights, state0, embedded, None, jnp.int32(0))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert cases.core_config(str(tmp_path)) == CFG
    _, random_params = core_weights()
    assert not np.allclose(
        random_params["adapter"]["kernel"][...], params["adapter"]["kernel"][...]
    )


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "experiments.core", *args], cwd=REPO, capture_output=True, text=True
    )


def test_cli_on_cpu_writes_json(tmp_path):
    """The XLA paths of the model config in one run, each checked against xla. Decode only on a
    CPU: there the paths differ in decode attention and decode GEMVs alone, so in prefill each
    would compile and run xla's own Core again (prefill cases: test_core_persistent.py, and
    test_cli_torch_impls_on_cpu with PyTorch); on a GPU prefill too, where xla_mgpu's prefill
    attention is its own."""
    out = tmp_path / "core.json"
    on_gpu = jax.default_backend() == "gpu"  # the subprocess sees the same devices
    modes = ["decode", "prefill"] if on_gpu else ["decode"]
    proc = run_cli(
        "--config=micro",
        f"--mode={','.join(modes)}",
        "--context=16",
        "--iterations=2",  # one r: every impl compiles per case
        "--impls=xla,xla_split,xla_pallas,xla_row_gemv,xla_rows8,xla_mgpu",
        "--repeats=1",
        "--warmup=0",
        f"--json_out={out}",
        *([] if on_gpu else ["--hbm"]),  # on a GPU, --hbm runs ncu: minutes
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    if not on_gpu:
        assert "HBM counters need a GPU" in proc.stdout
        assert "xla_mgpu need(s) CUDA; skipped" in proc.stdout
    import json

    data = json.loads(out.read_text())
    impls = ["xla", "xla_split", "xla_pallas", "xla_row_gemv", "xla_rows8"]
    ran = impls + (["xla_mgpu"] if on_gpu else [])
    assert [(r["mode"], r["impl"]) for r in data["records"]] == [(m, i) for m in modes for i in ran]
    assert all(r["ms_per_iteration"] > 0 for r in data["records"])
    assert all(r["back_to_back_ms_per_iteration"] > 0 for r in data["records"])  # on by default
    assert all(r["back_to_back_samples"]["repeats"] == 1 for r in data["records"])
    assert data["records"][0]["xla_report"]["big_buffer_copies"] == []
    # The other decode paths compute what xla computes (bf16, so not bit for bit).
    for impl in impls[1:]:
        checks = [c for c in data["checks"] if c["impl"] == impl]
        assert [c["mode"] for c in checks] == modes
        assert all(c["passed"] and c["reference"] == "xla" for c in checks)
        assert all(c["rel_err"] <= c["tolerance"] for c in checks)


def test_agreement_checks_fail_beyond_tolerance():
    """A run whose implementations disagree is reported as failed (and the program exits 2)."""
    case = cases.Case("decode", batch=1, context=4, iterations=4)
    ref = np.random.default_rng(0).standard_normal((1, 1, 8)).astype(np.float32)
    tol = report.check_tolerance("bf16", 4)
    outputs = {
        (case, "xla"): ref,
        (case, "torch_graph"): ref * (1 + tol / 2),  # within tolerance
        (case, "torch_eager"): ref * (1 + 2 * tol),  # beyond it
        (case, "torch_teaching"): ref * np.nan,  # NaN never passes
    }
    impls = ["xla", "torch_graph", "torch_eager", "torch_teaching"]
    checks = {c["impl"]: c for c in report.agreement_checks([case], impls, outputs, "bf16")}
    assert set(checks) == {"torch_graph", "torch_eager", "torch_teaching"}
    assert checks["torch_graph"]["passed"]
    assert not checks["torch_eager"]["passed"] and not checks["torch_teaching"]["passed"]
    assert checks["torch_eager"]["rel_err"] == pytest.approx(2 * tol, rel=1e-5)


def test_record_and_table_carry_the_back_to_back_and_host_times():
    """The back-to-back median in ms per iteration and its samples beside the waited call's; the
    table's b2b/iter column shows it, "-" in a record without it (--back_to_back=0). The waited
    call's host part (its median time until it returned) in host/iter."""
    case = cases.Case("decode", batch=1, context=4, iterations=4)
    cost = report.cost_of(CFG, case, 4)
    waited = timing.Samples(
        seconds=[4e-3, 6e-3, 5e-3], warmup=1, per_call=4, returned=[1e-3, 3e-4, 2e-4]
    )
    b2b = timing.Samples(seconds=[2e-3, 3e-3, 2.5e-3], warmup=1, per_call=4)
    rec = report.record(case, "xla", waited, cost, None, b2b)
    plain = report.record(case, "torch_graph", waited, cost, None)
    assert rec["ms_per_iteration"] == pytest.approx(5.0)
    assert rec["host_ms_per_iteration"] == pytest.approx(0.3)
    assert timing.Samples.from_dict(rec["samples"]) == waited
    assert rec["back_to_back_ms_per_iteration"] == pytest.approx(2.5)
    assert timing.Samples.from_dict(rec["back_to_back_samples"]) == b2b
    assert rec["tflops"] == plain["tflops"]  # the rates stay the waited call's
    assert "back_to_back_ms_per_iteration" not in plain and "back_to_back_samples" not in plain
    head, _, with_b2b, without = report.format_table([rec, plain]).splitlines()[:4]
    end = head.index("b2b/iter") + len("b2b/iter")  # right-aligned under its header
    assert with_b2b[:end].endswith(" 2.5 ms") and without[:end].endswith(" -")
    end = head.index("host/iter") + len("host/iter")
    assert with_b2b[:end].endswith(" 300 µs") and without[:end].endswith(" 300 µs")
    one = {**rec, "iterations": 1, "ms_per_iteration": 10.0, "back_to_back_ms_per_iteration": 2.0}
    assert report.scaling_lines([one, rec]) == [
        "xla decode B=1 ctx=4: r=4 costs 0.500 x r x (r=1), back to back 1.250"
    ]


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--back_to_back=1", "--back_to_back=1: must be 0 (off) or >= 2"),
        ("--back_to_back=-3", "--back_to_back=-3: must be 0 (off) or >= 2"),
        ("--mode=sideways", "--mode: unknown 'sideways'; known: decode, prefill"),
        ("--context=0", "must be >= 1"),
        ("--iterations=x", "expected integers"),
        ("--impls=jax", "unknown 'jax'"),
        ("--config=huge", "unknown preset"),
        # --config=/no/such/dir and --context=100000000: tests/test_cli_inputs.py
        ("--context=1000000", "for prefill at batch 1"),  # device or host memory
        ("--weights=trained", "needs --config=DIR"),
        ("--torch_compile_mode=fast", "value should be one of"),
    ],
)
def test_cli_bad_flags_exit_2(tmp_path, flag, message):
    proc = run_forked("experiments.core", flag, f"--json_out={tmp_path / 'x.json'}", cwd=REPO)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.json").exists()


def test_cli_unwritable_outputs_exit_2_before_any_measurement(tmp_path):
    """Every output path is checked first: the JSON's, and a file under --trace_dir / --hlo_dir."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    for flag in ("--json_out", "--trace_dir", "--hlo_dir"):
        proc = run_forked("experiments.core", "--config=micro", f"{flag}={blocker}/sub", cwd=REPO)
        assert proc.returncode == 2, (flag, proc.stderr[-2000:])
        assert "cannot write there" in proc.stderr and "core:" not in proc.stdout
        assert len(proc.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------- the PyTorch runners


def torch_outputs(case, params, impls, compile_mode="default") -> dict:
    """Each torch impl's output state for `case` (float32 micro Core), from fresh inputs (on a
    GPU the runner writes the cache in place in the JAX buffers), two calls each."""
    import torch

    from experiments.torch_ref.core_runner import TorchRunner

    outs = {}
    for impl in impls:
        state, embedded, cache = runners.case_inputs(CFG, case, jnp.float32, 0)
        runner = TorchRunner(
            impl, nnx.to_pure_dict(params), CFG, state, embedded, cache, case, "fp32",
            compile_mode=compile_mode,
        )  # fmt: skip
        first = runner().clone()
        second = runner()
        runner.sync()
        # every call restarts from the same state and history
        torch.testing.assert_close(second, first, rtol=1e-6, atol=1e-6)
        assert (runner.compile_seconds is not None) == (impl == "torch_compile")
        if impl == "torch_compile":
            assert runner.compile_seconds > 0 and runner.graphs_compiled == 1
        outs[impl] = first.cpu().numpy()
        runner.release()
    return outs


def xla_output(graphdef, params, case) -> np.ndarray:
    state, embedded, cache = runners.case_inputs(CFG, case, jnp.float32, 0)
    return np.asarray(runners.XlaRunner(graphdef, params, state, embedded, cache, case)())


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_torch_runners_compute_what_xla_computes(mode):
    """All five torch impls (on the CPU without CUDA graphs) against xla, float32."""
    pytest.importorskip("torch", reason='needs PyTorch: pip install -e ".[torch]"')
    from experiments.torch_ref.core_runner import TORCH_IMPLS

    graphdef, params = core_weights()
    case = cases.Case(mode, batch=2, context=7, iterations=2)
    want = xla_output(graphdef, params, case)
    for impl, got in torch_outputs(case, params, TORCH_IMPLS).items():
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=impl)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "compile_mode", ["default", "reduce-overhead", "max-autotune-no-cudagraphs"]
)
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_torch_runners_on_cuda(mode, compile_mode):
    """CUDA graphs (torch_graph, torch_reference, torch_compile) replay what xla computes; with
    "reduce-overhead", Inductor records its CUDA graphs (no skip) and nothing recompiles."""
    torch = pytest.importorskip("torch", reason='needs PyTorch: pip install -e ".[torch]"')
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    from torch._dynamo.utils import counters

    from experiments.torch_ref.core_runner import TORCH_IMPLS

    graphdef, params = runners.build_core(CFG, jnp.float32, 0)
    case = cases.Case(mode, batch=2, context=64, iterations=3)
    want = xla_output(graphdef, params, case)
    impls = TORCH_IMPLS if compile_mode == "default" else ("torch_compile",)
    skips = counters["inductor"]["cudagraph_skips"]
    outs = torch_outputs(case, params, impls, compile_mode)
    assert counters["inductor"]["cudagraph_skips"] == skips
    for impl, got in outs.items():
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=impl)


def test_cli_torch_impls_on_cpu(tmp_path):
    """--impls=torch: the runnable torch impls timed, each one's Core checked once against the
    conformance checkpoint (on a GPU all five, torch_compile with compile_seconds); a decode
    and a prefill case, each impl's output checked against xla's."""
    pytest.importorskip("torch", reason='needs PyTorch: pip install -e ".[torch]"')
    import json

    out = tmp_path / "core.json"
    on_gpu = jax.default_backend() == "gpu"
    proc = run_cli(
        "--config=micro", "--mode=decode,prefill", "--context=8", "--iterations=2",
        "--impls=xla,torch", "--dtype=fp32", "--repeats=1", "--warmup=0", f"--json_out={out}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    runnable = (
        ["torch_compile", "torch_graph", "torch_eager", "torch_reference", "torch_teaching"]
        if on_gpu
        else ["torch_eager", "torch_teaching"]
    )
    checked = runnable
    if on_gpu:  # torch_compile in every compile mode ("fastest"), each mode's Core checked once
        checked = ["torch_compile"] * len(COMPILE_MODES) + runnable[1:]
        compiled = [c["compile_mode"] for c in data["conformance"] if c["impl"] == "torch_compile"]
        assert compiled == list(COMPILE_MODES)
        for rec in (r for r in data["records"] if r["impl"] == "torch_compile"):
            modes = rec["torch_compile_modes"]
            assert list(modes) == list(COMPILE_MODES)  # the fastest mode's record kept
            fastest = min(modes, key=lambda m: modes[m]["ms_per_iteration"])
            assert rec["torch_compile_mode"] == fastest
            assert rec["ms_per_iteration"] == modes[fastest]["ms_per_iteration"]
    else:
        assert "torch_compile, torch_graph, torch_reference need(s) CUDA; skipped" in proc.stdout
    assert [c["impl"] for c in data["conformance"]] == checked  # once each, two cases
    assert all(c["passed"] for c in data["conformance"])
    assert proc.stdout.count("conformance torch_eager (fast Core)") == 1
    assert {r["mode"] for r in data["records"]} == {"decode", "prefill"}
    assert all(r["ms_per_iteration"] > 0 for r in data["records"])
    assert all(r["back_to_back_ms_per_iteration"] > 0 for r in data["records"])  # on by default
    assert all(r["back_to_back_samples"]["repeats"] == 1 for r in data["records"])
    timed = [r for r in data["records"] if r["impl"].startswith("torch")]
    assert len(timed) == 2 * len(runnable)
    assert all(("compile_seconds" in r) == (r["impl"] == "torch_compile") for r in timed)
    checks = {(c["impl"], c["mode"]) for c in data["checks"] if c["passed"]}
    assert checks == {(impl, mode) for impl in runnable for mode in ("decode", "prefill")}


def test_torch_compile_keeps_its_fastest_mode(monkeypatch, capsys):
    """`run_torch_compile`: each mode timed in turn and its Core checked, the fastest mode's
    record and output kept, every mode's times in it (the runs faked)."""
    from experiments.core import sweep

    waited = {"default": 0.98, "reduce-overhead": 0.99, "max-autotune-no-cudagraphs": 0.97}
    checked = []

    def fake_run_case(impl, cfg, graphdef, params, case, ceilings, compile_mode="default"):
        ms = waited[compile_mode]
        rec = dict(impl=impl, ms_per_iteration=ms, back_to_back_ms_per_iteration=ms - 0.01)
        return dict(rec, torch_compile_mode=compile_mode), compile_mode

    monkeypatch.setattr(sweep, "run_case", fake_run_case)
    monkeypatch.setattr(sweep, "check_conformance", lambda impl, mode, c: checked.append(mode))
    case = cases.Case("decode", 1, 1024, 8)
    rec, out = sweep.run_torch_compile(None, None, None, case, None, {}, tuple(waited))
    assert checked == list(waited)  # every mode's Core, as each was timed
    assert out == "max-autotune-no-cudagraphs" and rec["ms_per_iteration"] == 0.97
    assert rec["torch_compile_modes"]["default"] == dict(
        ms_per_iteration=0.98, back_to_back_ms_per_iteration=pytest.approx(0.97)
    )
    assert "default 0.980, reduce-overhead 0.990, max-autotune-no-cudagraphs 0.970" in (
        capsys.readouterr().out
    )
    one, _ = sweep.run_torch_compile(None, None, None, case, None, {}, ("default",))
    assert list(one["torch_compile_modes"]) == ["default"] and capsys.readouterr().out == ""


def test_torch_compile_keeps_each_mode_timed_for_an_interrupt(monkeypatch, capsys):
    """`run_torch_compile(..., so_far)`: each mode's record lands in `so_far` as it is timed, so
    a run interrupted in a later mode (an autotuning one can take minutes) writes the modes
    before it; a line on stderr names each mode as it starts (the runs faked)."""
    from experiments.core import sweep

    def fake_run_case(impl, cfg, graphdef, params, case, ceilings, compile_mode="default"):
        if compile_mode == "max-autotune-no-cudagraphs":
            raise KeyboardInterrupt
        return dict(impl=impl, ms_per_iteration=1.0, torch_compile_mode=compile_mode), None

    monkeypatch.setattr(sweep, "run_case", fake_run_case)
    monkeypatch.setattr(sweep, "check_conformance", lambda impl, mode, c: None)
    case = cases.Case("decode", 1, 1024, 8)
    modes = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
    so_far: dict = {}
    with pytest.raises(KeyboardInterrupt):
        sweep.run_torch_compile(None, None, None, case, None, {}, modes, so_far)
    assert list(so_far) == ["default", "reduce-overhead"]
    assert so_far["reduce-overhead"]["torch_compile_mode"] == "reduce-overhead"
    err = capsys.readouterr().err
    assert f"torch_compile {case.spec()}, mode max-autotune-no-cudagraphs (3 of 3)" in err


class CompileFailed(Exception):
    """Stands in for torch.compile failing to build a graph (no torch needed)."""


def test_torch_compile_leaves_out_a_mode_that_fails_to_compile(monkeypatch, capsys):
    """`run_torch_compile`: a mode that torch.compile fails to build is left out with a note,
    its error in the record's torch_compile_failures, the fastest of the others kept; every mode
    failing raises (the runs faked)."""
    from experiments.core import sweep

    failing = {"max-autotune-no-cudagraphs"}

    def fake_run_case(impl, cfg, graphdef, params, case, ceilings, compile_mode="default"):
        if compile_mode in failing:
            raise CompileFailed(compile_mode)
        ms = {"default": 0.98, "reduce-overhead": 0.99}[compile_mode]
        return dict(impl=impl, ms_per_iteration=ms, torch_compile_mode=compile_mode), None

    monkeypatch.setattr(sweep, "run_case", fake_run_case)
    monkeypatch.setattr(sweep, "check_conformance", lambda impl, mode, c: None)
    from experiments.torch_ref import core as torch_core

    monkeypatch.setattr(
        torch_core,
        "compile_failure",
        lambda e: f"why {e}" if isinstance(e, CompileFailed) else None,
    )
    case = cases.Case("decode", 1, 1024, 8)
    rec, _ = sweep.run_torch_compile(None, None, None, case, None, {}, COMPILE_MODES)
    assert rec["torch_compile_mode"] == "default"
    assert list(rec["torch_compile_modes"]) == ["default", "reduce-overhead"]
    failed = {"max-autotune-no-cudagraphs": "why max-autotune-no-cudagraphs"}
    assert rec["torch_compile_failures"] == failed
    out = capsys.readouterr().out
    assert f"note: torch_compile {case.spec()}: mode max-autotune-no-cudagraphs left out" in out
    failing = set(COMPILE_MODES)
    with pytest.raises(CompileFailed, match="max-autotune"):
        sweep.run_torch_compile(None, None, None, case, None, {}, COMPILE_MODES)
