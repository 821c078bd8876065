"""experiments.core --impls=persistent on CPU: timed in Pallas' GPU interpret mode on a decode
case and checked against xla like the other impls; skipped with a note where it cannot run."""

import json
import subprocess
import sys
from pathlib import Path

from experiments.core import cases, runners
from experiments.measure import compare
from huginn_jax.persistent import cache_positions
from pallas_kernels.core_step.fused_plan import Schedule

REPO = Path(__file__).resolve().parent.parent


def cli_all(arg_lists: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """`python -m experiments.core` with each argument list, the processes side by side."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "experiments.core", *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in arg_lists
    ]
    done = []
    for proc, args in zip(procs, arg_lists, strict=True):
        out, err = proc.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(args, proc.returncode, out, err))
    return done


def test_cli_times_persistent_beside_xla_and_skips_what_it_cannot_run(tmp_path):
    """The small preset's decode case runs (interpret mode) and agrees with xla within the bf16
    tolerance; its prefill case is a note line (the reasons of the other refusals:
    tests/test_persistent.py)."""
    [bf16] = cli_all([
        [
            "--config=small", "--mode=decode,prefill", "--context=63", "--iterations=1",
            "--impls=xla,persistent", "--warmup=0", "--repeats=1",
            "--back_to_back=0",  # off: an interpreted persistent call takes seconds
            f"--json_out={tmp_path / 'bf16.json'}",
        ],
    ])  # fmt: skip
    assert bf16.returncode == 0, bf16.stderr[-2000:]
    assert "persistent runs in Pallas' GPU interpret mode here" in bf16.stdout
    assert "note: persistent skipped for prefill:1:63:1: it runs decode steps" in bf16.stdout
    data = json.loads((tmp_path / "bf16.json").read_text())
    timed = {(r["mode"], r["impl"]) for r in data["records"]}
    assert timed == {("decode", "xla"), ("prefill", "xla"), ("decode", "persistent")}
    record = next(r for r in data["records"] if r["impl"] == "persistent")
    assert record["ms_per_iteration"] > 0 and "vs_best" in record
    assert record["schedule"] == str(Schedule())  # one interpreted worker: the kernel's default
    assert f"persistent decode r=1 B=1 ctx=63: schedule {Schedule()}" in bf16.stdout
    assert all("back_to_back_ms_per_iteration" not in r for r in data["records"])
    [check] = [c for c in data["checks"] if c["impl"] == "persistent"]
    assert check["reference"] == "xla" and check["passed"], check
    table = bf16.stdout[bf16.stdout.index("time/iter") :]
    assert " persistent " in table


def test_persistent_is_a_jax_impl_of_the_table():
    """Listed among the impls, ranked as JAX in "vs best" (against the best PyTorch row)."""
    assert "persistent" in cases.IMPLS and "persistent" in cases.JAX_IMPLS
    assert "persistent" not in cases.XLA_IMPLS  # never the agreement checks' reference
    assert compare.framework("persistent") == "jax"
    records = [
        {"impl": "persistent", "t": 1.0},
        {"impl": "xla", "t": 2.0},
        {"impl": "torch_graph", "t": 1.5},
    ]
    compare.add_vs_best(records, group_keys=(), time_key="t")
    assert records[0]["vs_best"] == 1.5 and records[0]["best_rival"] == "torch_graph"


def test_persistent_reasons_per_case():
    cfg = cases.core_config("small")
    decode = cases.Case("decode", batch=1, context=63, iterations=2)
    assert runners.why_not_persistent(cfg, decode, "bf16") is None
    assert cache_positions(decode.max_len) == 64
    assert cache_positions(65) == 128
    blocks_128 = Schedule(4, 2, kv_block=128)
    assert cache_positions(129) == 192
    assert cache_positions(129, blocks_128) == 256
    prefill = cases.Case("prefill", batch=1, context=64, iterations=2)
    assert "decode steps" in runners.why_not_persistent(cfg, prefill, "bf16")
    wide = cases.Case("decode", batch=9, context=63, iterations=1)
    assert "batch" in runners.why_not_persistent(cfg, wide, "bf16")  # at most 8
