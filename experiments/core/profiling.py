"""The profiling passes of `experiments.core`: per-kernel traces (`--trace_dir`) and HBM bytes
from Nsight Compute (`--hbm`), which runs the program again as a child under ncu
(`--ncu_child=impl:mode:batch:context:iterations`)."""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

from absl import flags

from experiments.cli import UserError
from experiments.core.cases import JAX_IMPLS, Case, core_config, jax_dtype
from experiments.core.runners import core_weights, make_runner
from experiments.measure import ncu as ncu_lib
from experiments.measure import timing
from experiments.measure import trace as trace_lib
from experiments.torch_ref.core import compile_modes_for  # imports no torch

FLAGS = flags.FLAGS
NCU_CALLS = 2  # calls inside the child's profiler range


def persistent_schedule():
    """The persistent impl's `fused_plan.Schedule` (--persistent_schedule); UserError for a bad
    one."""
    from huginn_jax.persistent import schedule_named

    try:
        return schedule_named(FLAGS.persistent_schedule)
    except ValueError as e:
        raise UserError(f"--persistent_schedule: {e}") from None


def runner_for(impl: str, cfg, graphdef, params, case: Case, compile_mode: str = "default"):
    """`runners.make_runner` with the flags' dtype, seed and persistent schedule, and
    torch.compile's `compile_mode` (torch_compile's)."""
    return make_runner(
        impl,
        cfg,
        graphdef,
        params,
        case,
        FLAGS.dtype,
        seed=FLAGS.seed,
        compile_mode=compile_mode,
        schedule=persistent_schedule(),
    )


def compile_mode_of(rec: dict) -> str:
    """The torch.compile mode a record was timed in (torch_compile's; "default" for the others,
    which ignore it)."""
    return rec.get("torch_compile_mode") or "default"


def case_of(rec: dict) -> Case:
    return Case(rec["mode"], rec["batch"], rec["context"], rec["iterations"])


def trace_all(records: list[dict], cfg, graphdef, params) -> None:
    """Per-kernel breakdowns into each record, JAX first: once the torch profiler has run in a
    process, JAX's profiler can no longer subscribe to CUPTI there (the next trace hung)."""
    order = sorted(records, key=lambda r: r["impl"] not in JAX_IMPLS)
    for rec in order:
        runner = runner_for(rec["impl"], cfg, graphdef, params, case_of(rec), compile_mode_of(rec))
        for _ in range(2):
            timing.wait(runner(), runner.sync)
        rec["trace"], rec["trace_us_per_iteration"] = trace_case(runner, rec["impl"], case_of(rec))
        runner.release()


def trace_case(runner, impl: str, case: Case) -> tuple[list[dict], dict]:
    """Per-kernel rows per Core iteration, and the traced span, busy time and gaps per
    iteration (µs)."""
    calls = 3
    label = f"{impl}-{case.spec().replace(':', '-')}"

    def run():
        for _ in range(calls):
            out = runner()
        timing.wait(out, runner.sync)

    per = calls * case.iterations  # rows are reported per Core iteration
    torch = impl not in JAX_IMPLS
    path = Path(FLAGS.trace_dir) / (f"{label}.json" if torch else label)
    rows, per_iteration = trace_lib.trace_run(run, path, torch=torch, units=per)
    return [dataclasses.asdict(r) for r in rows], per_iteration


def ncu_child(spec: str) -> None:
    """Warm up one (impl, case), then NCU_CALLS calls inside the profiler range."""
    impl, mode, batch, context, iterations = spec.split(":")
    case = Case(mode, int(batch), int(context), int(iterations))
    cfg = core_config(FLAGS.config)
    graphdef, params = core_weights(
        cfg, jax_dtype(FLAGS.dtype), weights=FLAGS.weights, path=FLAGS.config, seed=FLAGS.seed
    )
    compile_mode = compile_modes_for(FLAGS.torch_compile_mode)[0]  # the parent gives one
    runner = runner_for(impl, cfg, graphdef, params, case, compile_mode)
    for _ in range(2):
        out = runner()
    timing.wait(out, runner.sync)
    with ncu_lib.cuda_profiler_range():
        for _ in range(NCU_CALLS):
            out = runner()
        timing.wait(out, runner.sync)


def hbm_pass(impl: str, case: Case, ncu: str, compile_mode: str) -> dict:
    """The ncu summary of one (impl, case), from a child process of this program
    (torch_compile in `compile_mode`)."""
    argv = [
        sys.executable,
        "-m",
        "experiments.core",
        f"--ncu_child={impl}:{case.spec()}",
        f"--config={FLAGS.config}",
        f"--dtype={FLAGS.dtype}",
        f"--seed={FLAGS.seed}",
        f"--weights={FLAGS.weights}",
        f"--gemm={FLAGS.gemm}",
        f"--torch_compile_mode={compile_mode}",
        f"--persistent_schedule={FLAGS.persistent_schedule}",
        f"--command_buffers={FLAGS.command_buffers}",
    ]
    with tempfile.TemporaryDirectory(prefix="core-ncu-") as out:
        text = ncu_lib.run_ncu(
            argv, ncu=ncu, log_file=str(Path(out) / "ncu.csv"), timeout_s=FLAGS.ncu_timeout
        )
    summary = ncu_lib.summarize(ncu_lib.parse_ncu_csv(text), NCU_CALLS * case.iterations)
    return dataclasses.asdict(summary)


def add_hbm(records: list[dict], on_gpu: bool) -> None:
    """With --hbm, the HBM bytes per iteration of each record of `--hbm_impls` (`hbm_pass`),
    over the cost model's prediction; one line instead where ncu cannot run here."""
    if not FLAGS.hbm:
        return
    ncu = ncu_lib.find_ncu()
    if not on_gpu or ncu is None:
        print(ncu_lib.SKIP_LINE)
        return
    for rec in records:
        if rec["impl"] not in FLAGS.hbm_impls:
            continue
        case = case_of(rec)
        try:
            hbm = hbm_pass(rec["impl"], case, ncu, compile_mode_of(rec))
        except (ncu_lib.NcuError, OSError, ValueError) as e:
            print(f"note: ncu for {rec['impl']} {case.spec()} failed: {e}")
            continue
        predicted = rec["cost_model"]["hbm_read_bytes"]
        hbm["read_over_prediction"] = hbm["bytes_read_per_chain"] / predicted
        hbm["read_over_weights_kv"] = hbm["bytes_read_per_chain"] / (
            rec["cost_model"]["weight_bytes"] + rec["cost_model"]["kv_read_bytes"]
        )
        rec["hbm"] = hbm
