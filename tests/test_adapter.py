"""experiments.adapter on CPU: the byte estimate, the roofline over given ceilings, the "vs best"
column, the PyTorch products through torch.compile, and the program end to end; on the GPU
(marked) every PyTorch runner against the float64 reference."""

import gc
import json
import subprocess
import sys
import weakref
from pathlib import Path

import jax
import numpy as np
import pytest
from attention_programs import write_ceilings
from program_runs import run_forked

from experiments import adapter
from experiments import attention_bench as bench
from huginn_jax.config import HuginnConfig

REPO = Path(__file__).resolve().parent.parent
ON_GPU = jax.default_backend() == "gpu"


def test_estimate_matches_appendix_a_and_counts_the_concat():
    cfg = HuginnConfig.from_name("huginn_0125")
    alone = adapter.estimate(cfg, 1, "matmul")
    assert alone.weight_bytes == 10560 * 5280 * 2
    assert alone.hbm_read_bytes == alone.weight_bytes + 10560 * 2
    concat = adapter.estimate(cfg, 1, "concat")
    # s and e read once more, x [1, 2h] written: 2·h·2 B read and 2·h·2 B written more.
    assert concat.hbm_read_bytes - alone.hbm_read_bytes == 2 * 5280 * 2
    assert concat.hbm_write_bytes - alone.hbm_write_bytes == 2 * 5280 * 2


def test_roofline_takes_the_slower_of_reading_and_computing(tmp_path):
    from experiments.measure import ceilings as ceilings_lib

    cfg = HuginnConfig.from_name("huginn_0125")
    ceilings = ceilings_lib.load(write_ceilings(tmp_path / "c.json", "X", 4e12, 800e12))
    decode, prefill = adapter.estimate(cfg, 1, "matmul"), adapter.estimate(cfg, 1024, "matmul")
    ideal, bound = adapter.roofline(decode, ceilings)
    assert bound == "memory" and ideal == pytest.approx(decode.hbm_bytes / 4e12)
    ideal, bound = adapter.roofline(prefill, ceilings)
    assert bound == "compute" and ideal == pytest.approx(prefill.flops / 800e12)


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "experiments.adapter", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
    )


def run_cli_forked(*args):
    """`run_cli` forked from a process that has imported JAX (tests/program_runs.py): for runs
    that end before any work."""
    return run_forked("experiments.adapter", *args, cwd=REPO)


def test_cli_on_cpu(tmp_path):
    out = tmp_path / "adapter.json"
    device_kind = jax.devices()[0].device_kind  # the subprocess sees the same device
    ceilings = write_ceilings(tmp_path / "ceilings.json", device_kind, 1e9, 1e10)
    hbm = [] if ON_GPU else ["--hbm"]  # on a GPU with ncu, --hbm profiles every row: minutes
    proc = run_cli(
        "--config=tiny", "--m=1,8", "--repeats=2", "--calls=2", f"--json_out={out}",
        f"--ceilings={ceilings}", *hbm,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ON_GPU or "HBM counters need a GPU" in proc.stdout
    data = json.loads(out.read_text())
    assert data["ceilings"]["read_bytes_per_s"] == 1e9
    assert data["ceilings"]["source"] == str(ceilings)
    records = data["records"]
    cases = [(1, "matmul"), (1, "concat"), (8, "matmul"), (8, "concat")]
    impls = list(adapter.IMPLS) if ON_GPU else ["xla"]
    assert [(r["m"], r["variant"], r["impl"]) for r in records] == [
        (m, v, i) for m, v in cases for i in impls
    ]
    for r in records:
        assert r["us"] > 0 and r["check_ok"] and r["rel_err_vs_f64"] < 1e-2
        est = r["estimate"]
        ideal = max(est["flops"] / 1e10, (est["hbm_read_bytes"] + est["hbm_write_bytes"]) / 1e9)
        assert r["ideal_us"] == pytest.approx(ideal * 1e6)
        assert r["pct_of_roofline"] == pytest.approx(100 * ideal / (r["us"] / 1e6))
    if not ON_GPU:  # JAX rows only: no rival, no vs best
        assert all(r["vs_best"] is None and r["best_rival"] is None for r in records)
        head, _, first = proc.stdout.split("results: ")[1].splitlines()[1:4]
        assert "vs best" in head and "4.25" not in head
        column = slice(head.index("vs best"), head.index("vs best") + len("vs best"))
        assert first[column].strip() == "-"
    assert proc.stdout.strip().splitlines()[-1].endswith(f"({ceilings})")


def test_vs_best_column_against_the_other_frameworks_fastest():
    def row(impl, us, ok=True):
        return {"impl": impl, "m": 1, "variant": "matmul", "us": us, "check_ok": ok,
                "gbps": 1.0, "tflops": 1.0, "rel_err_vs_f64": 1e-3}  # fmt: skip

    records = [row("xla", 30.0), row("torch_graph", 40.0), row("torch_compile", 20.0, ok=False)]
    records.append({"impl": "torch_compile", "m": 8, "variant": "matmul", "error": "boom"})
    bench.add_vs_best(records, adapter.CASE_KEYS)
    xla, graph, broken, failed = records
    # torch_compile failed its check: no one's rival, so xla's rival is torch_graph.
    assert xla["vs_best"] == pytest.approx(40 / 30) and xla["best_rival"] == "torch_graph"
    assert graph["vs_best"] == pytest.approx(30 / 40) and graph["best_rival"] == "xla"
    assert broken["vs_best"] is None and failed["vs_best"] is None
    table = adapter.format_table(records).splitlines()
    assert "1.33x" in table[2] and "0.75x" in table[3] and "failed" in table[5]


def test_ceilings_of_another_device_exit_2_with_one_line(tmp_path):
    ceilings = write_ceilings(tmp_path / "c.json", "NVIDIA A100-SXM4-80GB", 2e12, 300e12)
    proc = run_cli_forked(
        "--config=tiny", f"--ceilings={ceilings}", f"--json_out={tmp_path / 'a.json'}"
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if "tpu" not in line.lower()]
    assert len(lines) == 1 and lines[0].startswith("adapter: --ceilings:")
    assert "NVIDIA A100-SXM4-80GB" in lines[0] and not (tmp_path / "a.json").exists()


@pytest.mark.parametrize(
    "flag",
    ["--m=0", "--m=x", "--variants=transpose", "--impls=torch", "--calls=z",
     "--torch_compile_mode=fast", "--ceilings=/no/such/file.json", "--m=10000000000"],
)  # fmt: skip
def test_bad_flags_exit_2_with_one_line(tmp_path, flag):
    proc = run_cli_forked(flag, f"--json_out={tmp_path / 'a.json'}")
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if "tpu" not in line.lower()]
    assert len(lines) == 1 and lines[0].startswith("adapter:")
    assert not (tmp_path / "a.json").exists()


@pytest.mark.parametrize("variant", adapter.VARIANTS)
def test_torch_products_compile_whole_and_match_the_reference(variant):
    """What torch_compile compiles, through Inductor on the CPU: one graph (fullgraph), the
    products of every call, within the check's tolerance of the float64 reference."""
    pytest.importorskip("torch", reason='needs PyTorch: pip install -e ".[torch]"')
    ss, es, w = adapter.stacked_inputs(HuginnConfig.from_name("tiny"), 4, 3, seed=1)
    args = adapter.torch_args(variant, ss, es, w)
    compiled, seconds = bench.compile_timed(adapter.torch_products(variant), args, "default")
    out = compiled(*args)
    assert seconds > 0 and len(out) == 3 and tuple(out[0].shape) == (4, 96)
    ref = adapter.reference(ss, es, w)
    assert np.linalg.norm(adapter.checked(out) - ref) / np.linalg.norm(ref) < bench.TOLERANCE
    # The check sees a wrong product: the first call's output in place of the last's.
    wrong = adapter.checked(out[:1] * 3)
    assert np.linalg.norm(wrong - ref) / np.linalg.norm(ref) > bench.TOLERANCE


def test_torch_runner_holds_its_inputs(monkeypatch):
    """The graph reads its inputs at their addresses: xs = cat(s, e), made for the runner and
    owned by no one else, must live as long as the runner (else torch reuses its memory)."""
    torch = pytest.importorskip("torch", reason='needs PyTorch: pip install -e ".[torch]"')
    monkeypatch.setattr(bench.torch_chain, "capture_graph", lambda fn, warmup: ("graph", fn()))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    ss, es, w = adapter.stacked_inputs(HuginnConfig.from_name("tiny"), 2, 2, seed=0)
    args = adapter.torch_args("matmul", ss, es, w)
    xs = weakref.ref(args[0])
    runner = bench.TorchRunner("torch_graph", adapter.torch_products("matmul"), args, mode="")
    del args
    gc.collect()
    assert xs() is not None and runner.args[0] is xs()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "impl, mode, variant",
    [("torch_graph", "default", "matmul"), ("torch_graph", "default", "concat"),
     ("torch_compile", "default", "matmul"), ("torch_compile", "default", "concat"),
     ("torch_compile", "reduce-overhead", "matmul"),
     ("torch_compile", "max-autotune-no-cudagraphs", "concat")],
)  # fmt: skip
def test_torch_runners_match_the_reference_gpu(impl, mode, variant):
    ss, es, w = adapter.stacked_inputs(HuginnConfig.from_name("tiny"), 16, 4, seed=2)
    ref = adapter.reference(ss, es, w)
    runner = adapter.make_runner(impl, variant, ss, es, w, mode)
    for _ in range(3):  # every replay rewrites the same outputs, from inputs still in place
        got = adapter.checked(runner())  # its allocations would reuse an input freed early
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < bench.TOLERANCE
    assert (runner.compile_seconds is None) == (impl == "torch_graph")
    assert (runner.graph is None) == (mode == "reduce-overhead" and impl == "torch_compile")
