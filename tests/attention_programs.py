"""What the tests of experiments.decode_attention and experiments.prefill_attention share: running
a program, a ceilings file, a refused flag, and the checks of the PyTorch rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from program_runs import run_forked
from tolerance import rel_fro

from experiments import attention_bench as bench

REPO = Path(__file__).resolve().parent.parent
ON_GPU = jax.default_backend() == "gpu"
# The PyTorch rows the GPU tests check: each runner at every default SDPA backend, and
# torch_compile's reduce-overhead once.
TORCH_ROWS = [
    (impl, "default", backend)
    for impl in bench.TORCH_IMPLS
    for backend in bench.DEFAULT_SDPA_BACKENDS
] + [("torch_compile", "reduce-overhead", "cudnn")]


def run_program(module: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m experiments.MODULE ARGS` from the repository, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", f"experiments.{module}", *args],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip


def run_forked_program(module: str, *args: str) -> subprocess.CompletedProcess:
    """`run_program` forked from a process that has imported JAX (tests/program_runs.py): for
    runs that end before any work, at a flag or file the program refuses."""
    return run_forked(f"experiments.{module}", *args, cwd=REPO)


def assert_refused(proc: subprocess.CompletedProcess, message: str) -> None:
    """Exit status 2 and one line on stderr, holding `message`."""
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]


def write_ceilings(path: Path, device_kind: str, read: float, flops: float) -> Path:
    """A ceilings file as experiments.ceilings writes it (the fields ceilings.load reads)."""
    data = {
        "environment": {"device_kind": device_kind},
        "ceilings": {"read_bytes_per_s": read, "bf16_flops_per_s": flops},
    }
    path.write_text(json.dumps(data))
    return path


def import_torch():
    """torch, or the test skipped where PyTorch is not installed."""
    return pytest.importorskip("torch", reason='needs PyTorch: pip install -e ".[torch]"')


def check_compiled_whole(program, checked, q, k, v, *, causal: bool) -> None:
    """`program`'s PyTorch attention through Inductor (what torch_compile compiles): one graph
    over every set of q, k, v [sets, B, *, H, K], one contiguous output per set in the model's
    layout, `checked` within 1e-2 of `program.reference`; the other mask fails the check."""
    torch = import_torch()
    args = [torch.from_dlpack(x) for x in (q, k, v)]
    compiled, seconds = bench.compile_timed(
        bench.sdpa_fn(causal=causal, backend="flash"), args, "default"
    )
    out = compiled(*args)
    assert seconds > 0 and len(out) == q.shape[0]
    assert tuple(out[0].shape) == q.shape[1:] and out[0].is_contiguous()
    ref = program.reference(q, k, v)
    assert rel_fro(checked(out), ref) < 1e-2
    wrong = checked(bench.sdpa_fn(causal=not causal, backend="math")(*args))
    assert rel_fro(wrong, ref) > bench.TOLERANCE


def check_torch_row(program, checked, q, k, v, impl: str, mode: str, backend: str) -> None:
    """`program`'s runner of impl/backend (torch.compile's `mode`) on the GPU: three calls (a
    replay rewrites the same outputs), each `checked` within 1e-2 of `program.reference`; a
    compile time for torch_compile only."""
    ref = program.reference(q, k, v)
    runner = program.make_runner(f"{impl}/{backend}", q, k, v, mode)
    for _ in range(3):
        assert rel_fro(checked(runner()), ref) < 1e-2
    assert (runner.compile_seconds is None) == (impl == "torch_graph")
    runner.release()
