"""Every program's command line against input a user can get wrong, from one table: exit status 2,
one line on stderr naming the problem, no traceback, and no output file touched; and `--help`:
exit status 0 and the program's main flags with their defaults.

Each row runs `python -m PROGRAM ...` with JAX on the CPU, in a process forked from one that has
imported JAX (tests/program_runs.py). The programs check their flags, output paths, model files
and memory needs before they compile or allocate anything, so a row costs about the program's
own imports.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import SELECTED_ITEMS, TINY_A
from program_runs import run_forked

REPO = Path(__file__).resolve().parent.parent
KEPT = '{"kept": true}\n'  # what an existing --json_out holds before a failing run

# Programs with a --json_out flag: each bad row that does not set it points it at an existing
# file, which must be left as it was.
WRITES_JSON = {
    "experiments.chain",
    "experiments.core",
    "experiments.adapter",
    "experiments.decode_attention",
    "experiments.prefill_attention",
    "experiments.roofline",
    "experiments.ceilings",
    "experiments.headline",
    "experiments.train",
    "experiments.generate_vs_torch",
    "experiments.allreduce",
    "experiments.kernels.fused_gemv_tune",
    "experiments.kernels.core_stream",
    "experiments.kernels.core_fused",
    "experiments.kernels.stream_units",
    "experiments.kernels.prefill_gemm",
    "experiments.kernels.looped_matmul_smoke",
    "huginn_jax.generate",
}


@dataclasses.dataclass(frozen=True)
class Bad:
    """A command line that must fail: `says` is part of the one stderr line. In `args`, {trunc}
    is a checkpoint with a truncated model.safetensors, {four} one whose config.json has
    "n_heads": "four"."""

    program: str
    args: str
    says: str

    def __str__(self) -> str:
        return f"{self.program.rsplit('.', 1)[-1]} {self.args}".strip()


@dataclasses.dataclass(frozen=True)
class Help:
    """`--help` of `program`: exit status 0, `flags` listed, each with its default."""

    program: str
    flags: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.program.rsplit('.', 1)[-1]} --help"


CHAIN, CORE, GENERATE = "experiments.chain", "experiments.core", "huginn_jax.generate"
MICRO = "--config=micro --random_weights --prompt_len=4 --max_new_tokens=4"
BAD = [
    # unknown flags: absl's parser, the generate command line's
    Bad(CHAIN, "--nosuch", "Unknown command line flag 'nosuch'"),
    Bad(GENERATE, "--nosuch", "Unknown command line flag 'nosuch'"),
    # chain
    Bad(CHAIN, "--size=-1MiB", "invalid size '-1MiB': must be positive"),
    Bad(CHAIN, "--size=1000GiB --impls=xla", "--size: needs"),
    Bad(CHAIN, "--impls=bogus", "unknown impl 'bogus'"),
    # core
    Bad(CORE, "--context=100000000", "the Core's cache takes at most 1048576"),
    Bad(CORE, "--iterations=", "--iterations is empty"),
    Bad(CORE, "--persistent_schedule=6", "--persistent_schedule: '6' is not RING:KV_STAGES"),
    Bad(CORE, "--config=/no/such/dir", "/no/such/dir: no such directory (presets: huginn_0125"),
    Bad(CORE, "--config={trunc} --weights=trained", "model.safetensors: truncated or damaged"),
    Bad(CORE, "--config={four} --weights=trained", "key 'n_heads' is \"four\"; expected an int"),
    Bad(CORE, "--json_out=/proc/x.json", "/proc/x.json: cannot write there"),
    # adapter
    Bad("experiments.adapter", "--m=10000000000", "--m=10000000000: needs"),
    Bad("experiments.adapter", "--config=/no/such/dir", "unknown preset '/no/such/dir'"),
    # decode_attention
    Bad("experiments.decode_attention", "--context=10000000000 --impls=xla", "at most 2147483647"),
    Bad("experiments.decode_attention", "--impls=", "--impls is empty"),
    Bad("experiments.decode_attention", "--heads=-1", "--heads must be >= 1"),
    # prefill_attention
    Bad("experiments.prefill_attention", "--tokens=10000000", "--tokens=10000000: needs"),
    Bad("experiments.prefill_attention", "--impls=bogus", "unknown impl 'bogus'"),
    # roofline
    Bad("experiments.roofline", "--context=100000000000", "a b200 holds"),
    Bad("experiments.roofline", "--iterations=-1", "-1 is not a positive integer"),
    # ceilings
    Bad("experiments.ceilings", "--gib=nan", "--gib=nan"),
    Bad("experiments.ceilings", "--gemm_size=10000000", "--gemm_size=10000000: needs"),
    # headline
    Bad("experiments.headline", "", "give at least 3 results JSONs"),
    Bad("experiments.headline", "/no/a.json /no/b.json /no/c.json", "/no/a.json: cannot read"),
    # train
    Bad("experiments.train", "--steps=0", "--steps must be >= 1, got 0"),
    Bad("experiments.train", "--lr=nan", "lr=nan must be positive"),
    Bad("experiments.train", "--batch=100000000", "--batch=100000000: needs"),
    Bad("experiments.train", "--vocab_size=100", "task root needs 273 tokens"),
    # generate_vs_torch
    Bad("experiments.generate_vs_torch", "--checkpoint={trunc} --prompt_len=8", "truncated"),
    Bad("experiments.generate_vs_torch", "--checkpoint={four}", "key 'n_heads' is \"four\""),
    Bad("experiments.generate_vs_torch", "--torch_impls=bogus", "--torch_impls: unknown bogus"),
    Bad("experiments.generate_vs_torch", "--prompt_len=100000000", "exceeds the model's block"),
    Bad(
        "experiments.generate_vs_torch",
        "--core_decode=persistent --persistent_schedule=6",
        "persistent_schedule: '6' is not RING:KV_STAGES",
    ),
    # allreduce
    Bad("experiments.allreduce", "--chain=0", "--chain"),
    # kernels
    Bad("experiments.kernels.fused_gemv_tune", "--shapes=bogus", "unknown shape 'bogus'"),
    Bad("experiments.kernels.fused_gemv_tune", "--configs=1:2", "'1:2' is not block_n:block_k"),
    Bad("experiments.kernels.core_stream", "--rings=", "--rings is empty"),
    Bad("experiments.kernels.core_stream", "", "needs an sm_90 GPU"),
    Bad("experiments.kernels.core_fused", "--batch=9", "at most 8 sequences"),
    Bad("experiments.kernels.core_fused", "--schedules=40:2", "schedule 40:2, --batch=1"),
    Bad("experiments.kernels.core_fused", "--schedules=8", "is not RING:KV_STAGES"),
    Bad(
        "experiments.kernels.core_fused",
        "--schedules=3:2:0:0:64:0:0:8:1:1 --profile",
        "records of 8 iterations > 232448; a profile of 3 iterations fits (--iterations=3)",
    ),
    Bad("experiments.kernels.core_fused", "--schedules=6:3:30", "the L2 lookahead (30)"),
    Bad("experiments.kernels.core_fused", "--skip_barriers=proj,mlp", "['mlp'] not among"),
    Bad("experiments.kernels.core_fused", "", "needs an sm_90 GPU"),
    Bad("experiments.kernels.stream_units", "--sizes=1000", "k must be a multiple of 64"),
    Bad("experiments.kernels.stream_units", "--sizes=1024 --rings=3", "must be shorter"),
    Bad("experiments.kernels.stream_units", "--rings=3 --lags=3", "lag=3 must be in [0, ring=3)"),
    Bad("experiments.kernels.stream_units", "--lags=-1", "--lags=-1: values must be >= 0"),
    Bad("experiments.kernels.stream_units", "", "needs an sm_90 GPU"),
    Bad("experiments.kernels.prefill_gemm", "--reps=0", "--reps=0: must be >= 1"),
    Bad("experiments.kernels.prefill_gemm", "--xla_flags=-x", "'-x' is not an XLA flag"),
    Bad("experiments.kernels.looped_matmul_smoke", "--case=bogus", "unknown case 'bogus'"),
    Bad("experiments.kernels.looped_matmul_smoke", "--reps=0", "--reps=0: must be >= 1"),
    Bad("experiments.kernels.looped_matmul_smoke", "--suite=x", "value should be one of"),
    Bad("experiments.kernels.looped_matmul_smoke", "", "needs an sm_90 GPU"),
    # generate
    Bad(GENERATE, "--checkpoint={trunc} --prompt_ids=1,2", "truncated or damaged"),
    Bad(GENERATE, "--checkpoint={four} --prompt_ids=1,2", "key 'n_heads' is \"four\""),
    Bad(GENERATE, "--checkpoint=/no/such/dir --prompt_ids=1,2", "config.json does not exist"),
    Bad(GENERATE, f"{MICRO} --criterion=kl --threshold=-1", "--threshold=-1.0: --criterion=kl"),
    Bad(GENERATE, "--config=micro --random_weights --prompt_len=-4", "--prompt_len=-4"),
    Bad(GENERATE, "--config=micro --random_weights --prompt_len=100000000", "block_size=32"),
    Bad(GENERATE, f"{MICRO} --batch=100000000", "--batch=100000000: the weights"),
    Bad(GENERATE, f"{MICRO} --temperature=nan", "--temperature=nan"),
    Bad(GENERATE, "--config=micro --random_weights --prompt_ids=", "the prompt is empty"),
    Bad(GENERATE, f"{MICRO} --json_out=/proc/x.json", "/proc/x.json: cannot write there"),
    Bad(GENERATE, f"{MICRO} --mesh=model:x", "--mesh=model:x: expected model:N"),
    Bad(GENERATE, f"{MICRO} --mesh=model:64", "needs 64 devices; 1 present"),
    Bad(GENERATE, f"{MICRO} --mesh=model:2 --decode_gemv=pallas", "--decode_gemv=pallas is a"),
    Bad(GENERATE, f"{MICRO} --persistent_schedule=3:3", "needs core_decode='persistent'"),
]

HELP = [
    Help(CHAIN, ("json_out", "size", "impls", "repeats")),
    Help(CORE, ("json_out", "impls", "context", "iterations")),
    Help("experiments.adapter", ("json_out", "impls", "m")),
    Help("experiments.decode_attention", ("json_out", "impls", "context", "batch")),
    Help("experiments.prefill_attention", ("json_out", "impls", "tokens")),
    Help("experiments.roofline", ("device", "context", "iterations")),
    Help("experiments.ceilings", ("gemm_counts", "reps")),
    Help("experiments.headline", ("json_out", "txt_out")),
    Help("experiments.train", ("config", "task", "steps", "batch")),
    Help("experiments.generate_vs_torch", ("json_out", "config", "prompt_len", "torch_impls")),
    Help("experiments.allreduce", ("json_out", "repeats")),
    Help("experiments.kernels.fused_gemv_tune", ("json_out", "shapes", "configs")),
    Help("experiments.kernels.core_stream", ("json_out", "batch", "rings")),
    Help("experiments.kernels.core_fused", ("json_out", "batch", "contexts", "profile")),
    Help("experiments.kernels.stream_units", ("json_out", "sizes", "unit_cols", "rings", "lags")),
    Help("experiments.kernels.prefill_gemm", ("json_out", "tokens", "forms", "xla_flags")),
    Help("experiments.kernels.looped_matmul_smoke", ("suite", "reps", "timeout")),
    Help(GENERATE, ("max_new_tokens", "num_steps", "criterion", "batch")),
]


@dataclasses.dataclass
class Run:
    proc: subprocess.CompletedProcess
    json_out: Path | None  # the existing file the run was pointed at, if any


def _damaged_checkpoints(root: Path) -> dict[str, str]:
    trunc, four = root / "trunc", root / "four"
    shutil.copytree(TINY_A, trunc)
    shutil.copytree(TINY_A, four)
    weights = trunc / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    config = json.loads((four / "config.json").read_text())
    (four / "config.json").write_text(json.dumps({**config, "n_heads": "four"}))
    return {"trunc": str(trunc), "four": str(four)}


def _run(case: Bad | Help, folder: Path, paths: dict[str, str]) -> Run:
    if isinstance(case, Help):
        args, json_out = ["--help"], None
    else:
        args = case.args.format(**paths).split()
        json_out = None
        if case.program in WRITES_JSON and not any(a.startswith("--json_out") for a in args):
            folder.mkdir(parents=True)
            json_out = folder / "out.json"
            json_out.write_text(KEPT)
            args.append(f"--json_out={json_out}")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = run_forked(case.program, *args, cwd=REPO, env=env, timeout=120)
    return Run(proc, json_out)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The selected cases' runs, started one after another when the module's first test asks."""
    root = tmp_path_factory.mktemp("cli_inputs")
    paths = _damaged_checkpoints(root)
    wanted = [
        item.callspec.params["case"]
        for item in request.config.stash[SELECTED_ITEMS]
        if item.module is request.module and hasattr(item, "callspec")
    ]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        yield {
            case: pool.submit(_run, case, root / f"case{i}", paths)
            for i, case in enumerate(dict.fromkeys(wanted))
        }


@pytest.mark.parametrize("case", BAD, ids=str)
def test_bad_input_is_one_line_and_exit_2(runs, case):
    run = runs[case].result()
    out, err = run.proc.stdout, run.proc.stderr
    assert "Traceback" not in out + err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    name = "generate" if case.program == GENERATE else case.program.rsplit(".", 1)[-1]
    assert lines[0].startswith(f"{name}: "), lines[0]
    assert case.says in lines[0]
    assert run.proc.returncode == 2, err
    if run.json_out is not None:  # the existing results file is left as it was, nothing beside
        assert run.json_out.read_text() == KEPT
        assert [p.name for p in run.json_out.parent.iterdir()] == ["out.json"]


@pytest.mark.parametrize("case", HELP, ids=str)
def test_help_lists_the_main_flags_with_defaults(runs, case):
    run = runs[case].result()
    out = run.proc.stdout
    assert run.proc.returncode == 0, run.proc.stderr
    assert "Traceback" not in out + run.proc.stderr
    for flag in case.flags:
        # absl: "  --flag: help" then "(default: ...)"
        block = re.search(rf"^\s+--(?:\[no\])?{flag}\b.*?(?=^\s+--|\Z)", out, re.M | re.S)
        assert block, f"--{flag} not in --help"
        assert "(default:" in block.group(0), block.group(0)
    if case.program in WRITES_JSON:
        assert "--json_out" in out
