"""experiments.generate_vs_torch end to end on small sizes. Its JAX half (--torch_impls= empty,
no PyTorch): the decode attention, decode GEMV and Core decode flags reach the model, the JAX
record. With the PyTorch loops (skipped without torch): one record per loop, vs_best,
conformance, exit codes.
"""

import json
import subprocess
import sys
import types
from pathlib import Path

import jax
import pytest

from experiments.torch_ref.core import COMPILE_MODES


def run(tmp_path, decode_attention, *flags):
    out = tmp_path / f"{decode_attention}{len(flags)}.json"
    proc = subprocess.run(
        [
            sys.executable, "-m", "experiments.generate_vs_torch", "--config=micro",
            "--dtype=f32", "--prompt_len=8", "--max_new_tokens=4", "--num_steps=3",
            f"--decode_attention={decode_attention}", f"--json_out={out}", "--torch_impls=",
            *flags,
        ],
        capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def xla_run(tmp_path_factory):
    """The plain path's run: XLA's attention and GEMVs; --core_decode=persistent falls back to
    XLA's Core on micro (test_jax_alone_writes_its_record_with_a_warm_prefill)."""
    return run(tmp_path_factory.mktemp("xla"), "xla", "--core_decode=persistent")


def test_pallas_kernels_generate_the_same_tokens(tmp_path, xla_run):
    """--decode_attention=pallas and --decode_gemv=pallas at batch 1, in one run: the attention
    kernel in every decode step and the row GEMV kernels in every Core step of it (interpret
    mode on CPU) give the greedy tokens of the plain path, float32. (Each kernel alone against
    the plain path, logits and cache: test_decode_attention_kernel.py, test_fused_gemv.py.)"""
    pallas = run(tmp_path, "pallas", "--decode_gemv=pallas")
    flags = pallas["environment"]["flags"]
    assert (flags["decode_attention"], flags["decode_gemv"]) == ("pallas", "pallas")
    assert xla_run["jax"]["core_decode"] == "xla"
    assert len(pallas["jax"]["tokens"][0]) == 4
    assert pallas["jax"]["tokens"] == xla_run["jax"]["tokens"]


def test_a_persistent_jax_loop_is_the_row_jax_persistent():
    from experiments.generate_vs_torch_report import make_records

    stats = {"core_decode": "persistent", "compile_s": {}, "decode_latency_s": [1e-3]}
    gen = types.SimpleNamespace(stats={**stats, "prefill_s": 1e-2})
    assert make_records(gen, {}, {}, {}, batch=1)[0]["impl"] == "jax_persistent"


def test_jax_alone_writes_its_record_with_a_warm_prefill(xla_run):
    """One row, jax: no rival framework, so no vs_best; the prefill was timed after an untimed
    first call, whose compile seconds the record keeps. --core_decode=persistent reaches the
    loop, which decodes with XLA's Core (micro's float32 cache is not the kernel's) and says
    why: the row stays jax."""
    data = xla_run
    assert data["environment"]["flags"]["core_decode"] == "persistent"
    assert data["jax"]["core_decode"] == "xla" and "float32" in data["jax"]["core_decode_fallback"]
    assert data["torch"] == {} and data["conformance"] == {}
    (rec,) = data["records"]
    assert rec["impl"] == "jax" and rec["vs_best"] is None and rec["best_rival"] is None
    assert rec["ms_p10"] <= rec["ms_per_token"] <= rec["ms_p90"]
    assert rec["prefill_ms"] == pytest.approx(data["jax"]["prefill_s"] * 1e3)
    assert rec["prefill_ms"] > 0
    assert data["jax"]["prefill_first_call_s"] > 0
    assert data["jax"]["compile_s"]["prefill"] > 0  # from the untimed first run
    assert rec["compile_s"] >= data["jax"]["compile_s"]["prefill"]
    assert rec["tokens_per_s"] > 0


# ---------------------------------------------------------------- with the PyTorch loops

# The conformance checkpoint's shapes (prompt 6, 6 tokens, 4 steps, batch 2): the compiled
# units of the conformance check and of the timed loop are then the same graphs.
TINY_RUN = (
    "--config=tiny", "--dtype=f32", "--prompt_len=6", "--max_new_tokens=6", "--num_steps=4",
    "--batch=2",
)  # fmt: skip


def run_program(out, *flags, prelude: str = ""):
    """The program in a subprocess (after `prelude`, Python run first in it)."""
    main = "import runpy; runpy.run_module('experiments.generate_vs_torch', run_name='__main__')"
    code = f"{prelude}\n{main}"
    return subprocess.run(
        [sys.executable, "-c", code, *TINY_RUN, f"--json_out={out}", *flags],
        capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=600,
    )  # fmt: skip


def test_program_with_every_torch_loop(tmp_path):
    """Every torch loop by default: one record per loop with vs_best against the other
    framework's fastest, its tokens equal to JAX's (float32), its conformance check passed,
    compile time apart; the table prints one row per loop; torch_compile in every mode, the
    fastest kept. --trace_dir: torch_compile's decode tokens traced after its timed ones (a
    Chrome trace per mode; no CUDA kernels on a CPU)."""
    pytest.importorskip("torch", reason='needs PyTorch: pip install -e ".[torch]"')
    out = tmp_path / "r.json"
    proc = run_program(out, f"--trace_dir={tmp_path / 'traces'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    records = {rec["impl"]: rec for rec in data["records"]}
    assert list(records) == ["jax", "torch_compile", "torch_graph", "torch_reference"]
    jax_ms = records["jax"]["ms_per_token"]
    torch_ms = {impl: rec["ms_per_token"] for impl, rec in records.items() if impl != "jax"}
    fastest = min(torch_ms, key=torch_ms.get)
    assert records["jax"]["best_rival"] == fastest
    assert records["jax"]["vs_best"] == pytest.approx(torch_ms[fastest] / jax_ms)
    for impl, ms in torch_ms.items():
        rec, details = records[impl], data["torch"][impl]
        assert rec["vs_best"] == pytest.approx(jax_ms / ms) and rec["best_rival"] == "jax"
        assert rec["tokens_equal_jax"] and rec["first_difference"] is None
        assert rec["conformance_passed"] and data["conformance"][impl]["passed"]
        assert rec["ms_p10"] <= rec["ms_per_token"] <= rec["ms_p90"]
        assert rec["compile_s"] == pytest.approx(details["setup_s"]) and rec["compile_s"] > 0
        assert len(details["decode_latency_s"]) == 5
        assert details["comparison"]["logits_max_abs_diff_same_inputs"] < 1e-3
        assert details["graph"] == (jax.default_backend() == "gpu")
    compiled = data["torch"]["torch_compile"]  # every mode run, the fastest kept
    assert compiled["graphs_compiled"] == 6
    # a mode that torch.compile fails to build on this machine is left out, named with its error
    failed = compiled.get("compile_failures", {})
    assert list(compiled["compile_modes"]) == [m for m in COMPILE_MODES if m not in failed]
    assert all(f"mode {m} left out, torch.compile failed" in proc.stdout for m in failed)
    kept = min(compiled["compile_modes"], key=compiled["compile_modes"].get)
    assert compiled["compile_mode"] == kept
    assert compiled["latency_median_s"] == compiled["compile_modes"][kept]
    assert f"ms per token; kept {kept}" in proc.stdout
    traced = data["torch"]["torch_compile"]
    assert traced["trace_tokens"] == 4 and Path(traced["trace_file"]).is_file()
    assert Path(traced["trace_file"]).name == f"torch_compile.{kept}.trace.json"
    assert set(traced["trace_us_per_token"]) == {"span", "busy", "gaps"}
    assert "trace" not in data["torch"]["torch_graph"]
    assert f"torch_compile: 4 decode tokens traced ({traced['trace_file']})" in proc.stdout
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("impl "))
    assert "vs best" in lines[header] and "tokens = JAX" in lines[header]
    rows = [line.split()[0] for line in lines[header + 1 : header + 5]]
    assert rows == ["jax", "torch_compile", "torch_graph", "torch_reference"]
    assert proc.stdout.count(": passed") == 3


def test_program_exits_1_after_the_json_when_a_loop_fails_conformance(tmp_path):
    """RoPE left out of the reference-faithful PyTorch code: its conformance check fails, the
    JSON is written all the same, the exit code is 1."""
    pytest.importorskip("torch", reason='needs PyTorch: pip install -e ".[torch]"')
    out = tmp_path / "r.json"
    prelude = "import experiments.torch_ref.core as core\ncore._rope = lambda x, positions, base: x"
    proc = run_program(out, "--torch_impls=torch_reference", prelude=prelude)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "torch_reference missed the conformance greedy tokens" in proc.stderr
    data = json.loads(out.read_text())
    assert not data["conformance"]["torch_reference"]["passed"]
    assert [rec["impl"] for rec in data["records"]] == ["jax", "torch_reference"]


def test_program_refuses_an_unknown_torch_loop(tmp_path):
    proc = run_program(tmp_path / "r.json", "--torch_impls=torch_compile,torch_fast")
    assert proc.returncode == 2
    assert "--torch_impls: unknown torch_fast" in proc.stderr
    assert not (tmp_path / "r.json").exists()


def test_each_mode_is_kept_as_it_ends_for_an_interrupt():
    """`run_modes`: the modes run one after another, each announced where there are several,
    and each one's details land in `details[impl]["modes_so_far"]` as it ends, so a run
    interrupted in a later mode (an autotuning one can take minutes) writes the modes before
    it (the loops faked; no torch needed)."""
    from experiments.generate_vs_torch import run_modes

    said, details = [], {}

    def run_mode(mode):
        if mode == "max-autotune-no-cudagraphs":
            raise KeyboardInterrupt
        return None, {"compile_mode": mode}, None

    with pytest.raises(KeyboardInterrupt):
        run_modes("torch_compile", COMPILE_MODES, run_mode, details, said.append)
    assert list(details["torch_compile"]["modes_so_far"]) == ["default", "reduce-overhead"]
    assert details["torch_compile"]["modes_so_far"]["default"] == {"compile_mode": "default"}
    assert said[-1] == "torch_compile: mode max-autotune-no-cudagraphs (3 of 3)"
    said.clear()
    run_modes("torch_graph", ("default",), run_mode, details, said.append)
    assert said == [] and list(details["torch_graph"]["modes_so_far"]) == ["default"]


class CompileFailed(Exception):
    """Stands in for torch.compile failing to build a graph (no torch needed)."""


def test_a_mode_that_fails_to_compile_is_left_out(monkeypatch):
    """`run_modes`: a mode that torch.compile fails to build is left out, said with its error
    and returned apart, while the others run; an error of any other kind, or every mode
    failing, raises (the loops faked)."""
    import experiments.generate_vs_torch as program
    from experiments.torch_ref import core as torch_core

    monkeypatch.setattr(
        torch_core,
        "compile_failure",
        lambda e: f"why: {e}" if isinstance(e, CompileFailed) else None,
    )
    failing = {"reduce-overhead"}

    def run_mode(mode):
        if mode in failing:
            raise CompileFailed(mode)
        return None, {"compile_mode": mode}, None

    said, details = [], {}
    tried, failed = program.run_modes(
        "torch_compile", COMPILE_MODES, run_mode, details, said.append
    )
    ran = ["default", "max-autotune-no-cudagraphs"]
    assert [t[1]["compile_mode"] for t in tried] == ran
    assert list(details["torch_compile"]["modes_so_far"]) == ran
    assert failed == {"reduce-overhead": "why: reduce-overhead"}
    assert said[1:3] == [
        "torch_compile: mode reduce-overhead (2 of 3)",
        "torch_compile: mode reduce-overhead left out, torch.compile failed: why: reduce-overhead",
    ]
    failing = set(COMPILE_MODES)
    with pytest.raises(CompileFailed, match="max-autotune"):
        program.run_modes("torch_compile", COMPILE_MODES, run_mode, {}, said.append)
    failing = {"default"}
    with pytest.raises(CompileFailed):  # the one mode asked for
        program.run_modes("torch_compile", ("default",), run_mode, {}, said.append)

    def broken(mode):
        raise ValueError(mode)

    with pytest.raises(ValueError):  # not a compile failure: raised at once
        program.run_modes("torch_compile", COMPILE_MODES, broken, {}, said.append)
