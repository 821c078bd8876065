"""The three ways the chain runs a prepared Runner: timed (`measure`), under the profiler
(`trace_pass`), and inside a CUDA profiler range for Nsight Compute (`profile_range`).

Each works the same in the parent and in a child process, so that an implementation measured
in a child (command buffers off, ncu, the torch profiler) goes through the same code.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from experiments.chain.options import ChainConfig, Options
from experiments.chain.report import ChainTrace, Outputs, size_label
from experiments.chain.runners import build_runner
from experiments.measure import ncu as ncu_lib
from experiments.measure import timing
from experiments.measure import trace as trace_lib
from experiments.torch_ref import chain as torch_chain


def measure(runner: Any, opts: Options) -> tuple[timing.Samples, Outputs]:
    """Times a Runner (JAX or torch) with the one timing helper; returns the samples and the
    outputs after one call's chains and after one chain."""
    samples = timing.time_fn(
        runner.fn,
        warmup=opts.warmup,
        repeats=opts.repeats,
        sync=runner.sync,
        per_call=runner.per_call,
    )
    return samples, Outputs(runner.output(), runner.chains_in_output, runner.one_chain())


def trace_pass(
    cfg: ChainConfig, opts: Options, layout: str, impl: str, x_host: np.ndarray, w_host: np.ndarray
) -> ChainTrace:
    """Profiler trace of about `chains_per_call` chains of `impl` (calls of `per_call` chains
    each), compiled and warmed up first; the per-kernel breakdown and the timeline."""
    base = Path(opts.trace_dir) / f"{size_label(cfg.weight_bytes)}-{layout}-{impl}"
    runner, release = build_runner(impl, layout, x_host, w_host, cfg, opts)
    calls = max(1, opts.chains_per_call // runner.per_call)
    chains = calls * runner.per_call
    for _ in range(max(opts.warmup, 1)):  # compile and autotune outside the trace
        timing.wait(runner.fn(), runner.sync)

    def run_all() -> None:
        for _ in range(calls):
            y = runner.fn()
        timing.wait(y, runner.sync)

    torch = impl in torch_chain.IMPLS
    try:
        rows, per_chain = trace_lib.trace_run(
            run_all, f"{base}.trace.json" if torch else base, torch=torch, units=chains
        )
    finally:
        release()
    return ChainTrace(rows, per_chain)


def profile_range(runner: Any, opts: Options) -> int:
    """Warm-up, then ceil(ncu_chains / per_call) calls inside the profiler range; returns the
    chains run inside it. GPU only."""
    for _ in range(max(opts.warmup, 1)):
        timing.wait(runner.fn(), runner.sync)
    calls = math.ceil(opts.ncu_chains / runner.per_call)
    with ncu_lib.cuda_profiler_range():
        for _ in range(calls):
            out = runner.fn()
        timing.wait(out, runner.sync)
    return calls * runner.per_call
