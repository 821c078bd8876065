"""Every case x impl of `experiments.core` timed into the results dict the JSON holds: one
record per run that fit in memory, the agreement checks, each torch impl's conformance, and
the optional traces and ncu pass."""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
from absl import flags

from experiments import program
from experiments.cli import UserError
from experiments.core import mesh as core_mesh
from experiments.core import profiling, report
from experiments.core.cases import (
    GPU_ONLY_IMPLS,
    PERSISTENT,
    XLA_IMPLS,
    Case,
    core_config,
    jax_dtype,
)
from experiments.core.runners import core_weights, to_numpy, why_not_persistent
from experiments.measure import compare, timing
from experiments.measure import hlo as hlo_lib
from experiments.torch_ref import chain as torch_chain  # imports no torch
from experiments.torch_ref.core import compile_modes_for, run_each_mode  # imports no torch
from experiments.torch_ref.core_runner import TORCH_IMPLS, torch_device  # imports no torch

FLAGS = flags.FLAGS


def local_shape(x) -> tuple[int, ...]:
    """One device's shape of `x` (its whole shape on one device; a shard's under --mesh, as the
    per-device HLO names it)."""
    return tuple(x.sharding.shard_shape(x.shape))


def run_case(
    impl, cfg, graphdef, params, case, ceilings, compile_mode: str = "default"
) -> tuple[dict, Any]:
    """One (case, impl): its runner built (torch_compile in `compile_mode`), its XLA executable
    summarized (and its HLO written under --hlo_dir), timed; the record and the output state of
    its last call."""
    runner = profiling.runner_for(impl, cfg, graphdef, params, case, compile_mode)
    extra = {}
    if impl in XLA_IMPLS:
        text, memory = runner.compile_report()
        xla_report = hlo_lib.loop_report(
            text,
            memory,
            big_buffer_dims=local_shape(runner.cache.k),
            slice_dims=local_shape(runner.cache.k)[-4:],  # one slot, [B, S, H, K]
        )
        live = runner.cache.nbytes + sum(x.nbytes for x in jax.tree.leaves(params))
        xla_report["temp_pct_of_weights_and_cache"] = 100 * xla_report.get("temp_bytes", 0) / live
        extra["xla_report"] = xla_report
    if impl == PERSISTENT:
        extra["schedule"] = str(runner.prepared.schedule)
    if FLAGS.hlo_dir and hasattr(runner, "compile_report"):  # the JAX impls
        path = Path(FLAGS.hlo_dir) / f"core-{impl}-{case.spec().replace(':', '-')}.hlo.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(runner.compile_report()[0])
    sync = getattr(runner, "sync", None)
    samples = timing.time_fn(
        runner, warmup=FLAGS.warmup, repeats=FLAGS.repeats, sync=sync, per_call=case.iterations
    )
    back_to_back = None
    if FLAGS.back_to_back:  # the calls are ordered: a donated cache (JAX), one stream (torch)
        back_to_back = timing.time_back_to_back(
            runner,
            warmup=1,
            repeats=FLAGS.repeats,
            calls=FLAGS.back_to_back,
            sync=sync,
            per_call=case.iterations,
        )
    out = to_numpy(runner())
    if sync:
        sync()
    cost = report.cost_of(cfg, case, 2 if FLAGS.dtype == "bf16" else 4)
    rec = report.record(case, impl, samples, cost, ceilings, back_to_back)
    rec.update(extra, **core_mesh.comm_record(cfg, case, 2 if FLAGS.dtype == "bf16" else 4))
    if getattr(runner, "compile_seconds", None) is not None:  # torch_compile: apart from timing
        rec["compile_seconds"] = runner.compile_seconds
        rec["torch_compile_mode"] = compile_mode
    runner.release()
    return rec, out


def run_torch_compile(
    cfg,
    graphdef,
    params,
    case,
    ceilings,
    conformance: dict,
    modes: tuple[str, ...],
    so_far: dict | None = None,
) -> tuple[dict, Any]:
    """torch_compile timed in each of `modes` (`compile_modes_for(--torch_compile_mode)`), one
    after another in this process, each mode's Core checked (`check_conformance`): the fastest
    mode's record (by ms per iteration), with every mode's times (`torch_compile_modes`: ms per
    iteration, waited and back to back), and output. Each mode's record goes into `so_far` as
    it is timed (what an interrupted run writes: an autotuning mode can take minutes). A mode
    that torch.compile fails to build (`compile_failure`) is left out with a line, its error in
    the record's `torch_compile_failures`, while another mode remains (`run_each_mode`)."""

    def run_mode(mode):
        rec, out = run_case("torch_compile", cfg, graphdef, params, case, ceilings, mode)
        check_conformance("torch_compile", mode, conformance)
        return rec, out

    def say(line):
        print(f"core: torch_compile {case.spec()}, {line}", file=sys.stderr, flush=True)

    ended = None if so_far is None else lambda mode, timed: so_far.update({mode: timed[0]})
    timed, failed = run_each_mode(modes, run_mode, say, ended)
    for mode, why in failed.items():
        print(
            f"note: torch_compile {case.spec()}: mode {mode} left out, torch.compile failed: {why}"
        )
    fastest = min(timed, key=lambda mode: timed[mode][0]["ms_per_iteration"])
    rec, out = timed[fastest]
    keys = ("ms_per_iteration", "back_to_back_ms_per_iteration")
    rec["torch_compile_modes"] = {m: {k: r.get(k) for k in keys} for m, (r, _) in timed.items()}
    if failed:
        rec["torch_compile_failures"] = failed
    if len(modes) > 1:
        each = ", ".join(f"{m} {r['ms_per_iteration']:.3f}" for m, (r, _) in timed.items())
        print(f"torch_compile {case.spec()}: {each} ms per iteration; kept {fastest}")
    return rec, out


@functools.cache
def torch_conformance(impl: str, device: str, compile_mode: str) -> dict:
    """`conformance.check_core_impl`, once per (impl, device, mode) in a process."""
    from experiments.torch_ref.conformance import check_core_impl

    return check_core_impl(impl, device, compile_mode)


def release_torch_memory() -> None:
    """Returns torch's cached blocks to the driver (when torch is loaded), for the next case."""
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        torch_chain.release()


def runnable(impls: list[str], on_gpu: bool) -> list[str]:
    """`impls` less those that cannot run here, with a note line for each group left out."""
    if not on_gpu:
        skipped = [i for i in impls if i in GPU_ONLY_IMPLS]
        impls = [i for i in impls if i not in skipped]
        if skipped:
            print(f"note: {', '.join(skipped)} need(s) CUDA; skipped on this device")
    if PERSISTENT in impls and not on_gpu:
        print(f"note: {PERSISTENT} runs in Pallas' GPU interpret mode here (one worker: slow)")
    if any(i in TORCH_IMPLS for i in impls) and not torch_chain.available():
        print(f"note: PyTorch is not installed ({torch_chain.INSTALL}); torch impls skipped")
        impls = [i for i in impls if i not in TORCH_IMPLS]
    return impls


def check_conformance(impl: str, compile_mode: str, conformance: dict[str, dict]) -> None:
    """A torch impl's Core (torch_compile: in `compile_mode`) against the conformance
    checkpoint, once per run; UserError when it misses, as its timings would then be void."""
    key = f"{impl} ({compile_mode})" if impl == "torch_compile" else impl
    if impl not in TORCH_IMPLS or key in conformance:
        return
    check = torch_conformance(impl, torch_device(), compile_mode)
    conformance[key] = check
    print(
        f"conformance {key} ({check['core']} Core) vs huginn_tiny_a: max abs err "
        f"{check['max_abs_err']:.2e} (tolerance {check['tolerance']:.0e})"
    )
    if not check["passed"]:
        raise UserError(
            f"{impl}: its Core code misses the conformance logits (max abs err "
            f"{check['max_abs_err']:.2e} > {check['tolerance']:.0e}); timings void"
        )


def run(cases: list[Case], impls: list[str], result: dict | None = None) -> dict:
    """Every case, then every runnable impl, timed (a case that runs out of device memory is
    noted and skipped); then traces, "vs best", agreement checks and the ncu pass. The records
    and failures go into `result` as they are measured (what an interrupted run writes); it is
    returned, complete."""
    result = {} if result is None else result
    records = result.setdefault("records", [])
    failures = result.setdefault("failures", [])
    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    impls = core_mesh.runnable_on_mesh(runnable(impls, on_gpu))
    cfg = core_config(FLAGS.config)
    ceilings = report.device_ceilings(device.device_kind, FLAGS.ceilings)
    graphdef, params = core_weights(
        cfg, jax_dtype(FLAGS.dtype), weights=FLAGS.weights, path=FLAGS.config, seed=FLAGS.seed
    )
    cfg, graphdef, params = core_mesh.shard_core(cfg, graphdef, params)  # --mesh: split
    outputs: dict[tuple, np.ndarray] = {}
    conformance: dict[str, dict] = {}  # torch impl -> its Core's check against huginn_tiny_a
    grid = [(c, i) for c in cases for i in impls]
    schedule = profiling.persistent_schedule()
    for case, impl in program.progress(grid, "core"):
        if impl == PERSISTENT and (reason := why_not_persistent(cfg, case, FLAGS.dtype, schedule)):
            print(f"note: {impl} skipped for {case.spec()}: {reason}")
            continue
        try:
            if impl == "torch_compile":
                modes = compile_modes_for(FLAGS.torch_compile_mode)
                # the modes timed so far, written only by an interrupt (not an exception)
                result["torch_compile_modes_so_far"] = so_far = {}
                rec, out = run_torch_compile(
                    cfg, graphdef, params, case, ceilings, conformance, modes, so_far
                )
            else:
                rec, out = run_case(impl, cfg, graphdef, params, case, ceilings)
        except Exception as e:  # out of memory in one case of a sweep: note it, go on
            result.pop("torch_compile_modes_so_far", None)
            if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
                raise
            first = str(e).strip().splitlines()[0][:200]
            print(f"note: {impl} {case.spec()} ran out of device memory: {first}")
            failures.append({**dataclasses.asdict(case), "impl": impl, "error": first})
            release_torch_memory()
            continue
        result.pop("torch_compile_modes_so_far", None)  # in the record now
        records.append(rec)
        outputs[(case, impl)] = out
        if impl != "torch_compile":  # run_torch_compile checked each of its modes
            check_conformance(impl, "default", conformance)
    if FLAGS.trace_dir:
        profiling.trace_all(records, cfg, graphdef, params)
    compare.add_vs_best(
        records, group_keys=("mode", "batch", "context", "iterations"), time_key="ms_per_iteration"
    )
    checks = report.agreement_checks(cases, impls, outputs, FLAGS.dtype)
    profiling.add_hbm(records, on_gpu)
    result.update(
        checks=checks,
        ceilings=ceilings.to_dict() if ceilings else None,
        conformance=list(conformance.values()),
    )
    return result
