"""The parent's sweep: every size x layout x implementation timed and checked, with the
optional ncu and trace passes, into the results dict the JSON holds.

`run` keeps the JSON's layout (experiment, config, env, runs, checks, traces, notes, complete):
experiments.headline, the plot and the tests read it. After each size the partial results go
to --json_out with "complete": false, and on Ctrl-C or SIGTERM the rows measured so far
(`program.on_interrupt`), so that an interrupted sweep keeps what it measured.
"""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from experiments import program
from experiments.chain import runners
from experiments.chain.children import hbm_pass, run_timing_child, run_trace_child
from experiments.chain.options import (
    CPU_DEFAULTS,
    PALLAS_IMPLS,
    ChainConfig,
    Options,
    check_memory,
)
from experiments.chain.passes import measure, trace_pass
from experiments.chain.report import (
    ChainTrace,
    Outputs,
    add_checks,
    add_vs_best,
    format_traces,
    size_label,
)
from experiments.cli import UserError
from experiments.measure import ceilings as ceilings_lib
from experiments.measure import ncu as ncu_lib
from experiments.measure import results as results_lib
from experiments.measure import timing
from experiments.torch_ref import chain as torch_chain


def note_fn(notes: list[str]) -> Callable[[str], None]:
    """A `note(msg)` that keeps `msg` for the JSON's notes and prints it above any progress."""
    from tqdm import tqdm

    def note(msg: str) -> None:
        notes.append(msg)
        tqdm.write(msg)

    return note


def select_impls(opts: Options, on_gpu: bool, note: Callable[[str], None]) -> tuple[str, ...]:
    """Drops what cannot run here, each with a one-line note."""
    impls = list(opts.impls)
    no_cmdbuf = [i for i in impls if i.endswith("_no_cmdbuf")]
    if no_cmdbuf and not on_gpu:
        note(f"command buffers exist only on GPU; {', '.join(no_cmdbuf)} skipped")
        impls = [i for i in impls if i not in no_cmdbuf]
    pallas = [i for i in impls if i in PALLAS_IMPLS]
    if pallas and not (on_gpu and runners.pallas_supported()):
        note(f"the Pallas kernels need a GPU with Mosaic GPU (sm_90); {', '.join(pallas)} skipped")
        impls = [i for i in impls if i not in pallas]
    torch_impls = [i for i in impls if i in torch_chain.IMPLS]
    if torch_impls:
        if not torch_chain.available():
            note(
                f"PyTorch is not installed ({torch_chain.INSTALL}); "
                f"{', '.join(torch_impls)} skipped"
            )
            impls = [i for i in impls if i not in torch_impls]
        elif not on_gpu or not torch_chain.cuda_available():
            note(f"torch impls need a CUDA GPU; {', '.join(torch_impls)} skipped")
            impls = [i for i in impls if i not in torch_impls]
    return tuple(impls)


def load_ceilings(device_kind: str, path: str) -> ceilings_lib.Ceilings | None:
    """The device's measured ceilings (from `path`, or the device's default file when "");
    None when the project has none for it. A file that cannot be used is a UserError."""
    try:
        return ceilings_lib.for_device(device_kind, path or None)
    except ceilings_lib.CeilingsError as e:
        raise UserError(f"--ceilings: {e}") from None


def run_record(
    cfg: ChainConfig,
    layout: str,
    impl: str,
    samples: timing.Samples,
    bw: float | None,
    compile_seconds: float | None = None,
) -> dict[str, Any]:
    """One row of the results: samples, medians, GB/s, % of the HBM floors (`bw`: the measured
    read-only streaming rate in B/s, or None) and the first call's time."""
    w = cfg.weight_bytes
    t = samples.median
    return {
        "size_bytes": cfg.size_bytes,
        "d": cfg.d,
        "weight_bytes": w,
        "layout": layout,
        "impl": impl,
        "chains_per_call": samples.per_call,
        **samples.summary_us(),
        "gbps": cfg.steps * w / t / 1e9,
        # floor: the time to read W once, or steps*W, at the device's measured read rate
        "pct_floor_once": 100 * (w / bw) / t if bw else None,
        "pct_floor_steps": 100 * (cfg.steps * w / bw) / t if bw else None,
        "compile_seconds": compile_seconds,
        "samples": samples.to_dict(),
        "hbm": None,
    }


def flag_values(opts: Options) -> dict[str, Any]:
    """The program's own flags as this run used them: the CPU's scaled-down timing and the
    plot path it chose, not the flags' defaults; the child-only flags left out."""
    values = program.own_flag_values()  # without the child-only (Internal:) flags
    values.update({k: getattr(opts, k) for k in CPU_DEFAULTS}, plot_out=opts.plot_out)
    return values


def run(opts: Options, notes: list[str], note: Callable[[str], None]) -> dict[str, Any]:
    """Every size x layout x impl: timing, checks, optional ncu and trace passes."""
    import jax

    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    ceilings = load_ceilings(device.device_kind, opts.ceilings)  # a bad file fails here
    impls = select_impls(opts, on_gpu, note)
    if not impls:
        raise UserError("no implementation can run here (see the notes above)")
    in_process = [i for i in impls if not i.endswith("_no_cmdbuf")]
    no_cmdbuf = [i for i in impls if i.endswith("_no_cmdbuf")]
    ncu = ncu_lib.find_ncu() if opts.hbm and on_gpu else None
    if opts.hbm and ncu is None:
        note(ncu_lib.SKIP_LINE + ("" if on_gpu else " (no GPU here)"))
    holders = 1 + any(i in torch_chain.IMPLS for i in impls) + bool(no_cmdbuf or ncu)
    check_memory(opts, device, holders)
    unrolled = runners.unrolled_chains(opts.chains_per_call, opts.configs[0].steps)
    if "xla_loop_unrolled" in impls and unrolled < opts.chains_per_call:
        note(
            f"xla_loop_unrolled: {unrolled} chains per call "
            f"({runners.UNROLLED_MAX_PRODUCTS} products)"
        )

    env = results_lib.environment(flag_values(opts))
    default_file = ceilings_lib.default_path(device.device_kind)
    env.update(
        ceilings=ceilings.to_dict() if ceilings else None,
        ceilings_source=ceilings.source if ceilings else f"none: no {default_file}",
    )
    bw = ceilings.read_bytes_per_s if ceilings else None
    first = opts.configs[0]
    data: dict[str, Any] = {
        "experiment": "chain",
        "config": {
            "steps": first.steps,
            "batch": first.batch,
            "dtype": first.dtype,
            "layouts": list(opts.layouts),
            "impls": list(impls),
            "warmup": opts.warmup,
            "repeats": opts.repeats,
            "chains_per_call": opts.chains_per_call,
            "ncu_chains": opts.ncu_chains,
            "sizes_bytes": [c.size_bytes for c in opts.configs],
            "gemm": opts.gemm,
            "torch_compile_mode": opts.torch_compile_mode,
        },
        "env": env,
        "runs": [],
        "checks": {"layouts": [], "agreement": [], "one_chain": []},
        "traces": [],
        "notes": notes,
    }

    def save_partial():
        """The rows measured so far, "complete": false (also after each size: a crash keeps
        what is done)."""
        if opts.json_out:
            return results_lib.write_json_atomic(opts.json_out, {**data, "complete": False})
        return None

    with program.on_interrupt(save_partial):
        for cfg in opts.configs:
            x_host, w_host = runners.host_values(cfg)
            outputs = time_size(
                cfg, opts, (x_host, w_host), in_process, no_cmdbuf, bw, note, data["runs"]
            )
            add_checks(data, cfg, x_host, w_host, outputs, runners.LAYOUTS_NOT_COMPARABLE)
            add_vs_best(data["runs"])
            if ncu is not None:
                # Two children at most: default XLA flags, and command buffers off.
                for group in (in_process, no_cmdbuf):
                    if group:
                        add_hbm(data, cfg, opts, group, ncu, note)
            if opts.trace_dir:
                add_traces(data, cfg, trace_all(cfg, opts, impls, x_host, w_host, note), opts)
            save_partial()
    data["complete"] = True
    return data


def time_size(
    cfg: ChainConfig,
    opts: Options,
    values: tuple[np.ndarray, np.ndarray],
    in_process: Sequence[str],
    no_cmdbuf: Sequence[str],
    bw: float | None,
    note: Callable[[str], None],
    runs: list[dict[str, Any]],
) -> dict[tuple[str, str], Outputs]:
    """Times every layout x impl of one size, appending their records to `runs`: the in-process
    impls one by one, the _no_cmdbuf impls in one child (a failed child is a note); returns their
    outputs."""
    x_host, w_host = values
    outputs: dict[tuple[str, str], Outputs] = {}
    # One task per in-process (layout, impl); (None, None) for the child of every _no_cmdbuf impl.
    tasks = [(layout, impl) for layout in opts.layouts for impl in in_process]
    tasks += [(None, None)] if no_cmdbuf else []
    for layout, impl in program.progress(tasks, f"chain {size_label(cfg.weight_bytes)}"):
        if layout is None or impl is None:
            try:
                child = run_timing_child(cfg, opts, no_cmdbuf)
            except RuntimeError as e:
                note(f"{', '.join(no_cmdbuf)} at W={cfg.weight_bytes} B: {e}")
                child = {}
            for (layout, impl), (samples, out, seconds) in sorted(child.items()):
                runs.append(run_record(cfg, layout, impl, samples, bw, seconds))
                outputs[(layout, impl)] = out
            continue
        runner, release = runners.build_runner(impl, layout, x_host, w_host, cfg, opts)
        samples, outputs[(layout, impl)] = measure(runner, opts)
        release()
        runs.append(run_record(cfg, layout, impl, samples, bw, runner.compile_seconds))
    return outputs


def add_hbm(
    data: dict[str, Any],
    cfg: ChainConfig,
    opts: Options,
    impls: Sequence[str],
    ncu: str,
    note: Callable[[str], None],
) -> None:
    """HBM bytes read per chain (in units of W) and L2 hit rate of `impls`, from one ncu child,
    into their run records of this size; a failed pass is a note."""
    try:
        summaries = hbm_pass(cfg, opts, impls, ncu)
    except (ncu_lib.NcuError, ValueError, OSError, subprocess.SubprocessError) as e:
        note(f"ncu at W={size_label(cfg.weight_bytes)} ({', '.join(impls)}): {e}")
        return
    for rec in data["runs"]:
        summary = summaries.get((rec["layout"], rec["impl"]))
        if rec["weight_bytes"] == cfg.weight_bytes and summary is not None:
            rec["hbm"] = {
                **dataclasses.asdict(summary),
                "read_x_w": summary.bytes_read_per_chain / cfg.weight_bytes,
            }


def trace_all(
    cfg: ChainConfig,
    opts: Options,
    impls: Sequence[str],
    x_host: np.ndarray,
    w_host: np.ndarray,
    note: Callable[[str], None],
) -> dict[str, dict[str, ChainTrace]]:
    """layout -> impl -> trace of every impl: in this process, or in a child for the _no_cmdbuf
    impls (their XLA_FLAGS) and the torch impls (CUPTI, see `run_trace_child`)."""
    traced: dict[str, dict[str, ChainTrace]] = {layout: {} for layout in opts.layouts}
    for impl in impls:
        if impl.endswith("_no_cmdbuf") or impl in torch_chain.IMPLS:
            try:
                for layout, one in run_trace_child(cfg, opts, impl).items():
                    traced[layout][impl] = one
            except RuntimeError as e:
                note(f"trace of {impl} at W={size_label(cfg.weight_bytes)}: {e}")
            continue
        for layout in opts.layouts:
            traced[layout][impl] = trace_pass(cfg, opts, layout, impl, x_host, w_host)
    for layout, by_impl in traced.items():
        for impl, one in by_impl.items():
            if not one.rows:
                note(f"trace of {impl} {layout}: the profiler recorded no kernels")
    return traced


def add_traces(
    data: dict[str, Any], cfg: ChainConfig, traced: dict[str, dict[str, ChainTrace]], opts: Options
) -> None:
    """Prints the kernels per chain of every traced impl and adds the traces to the results."""
    from tqdm import tqdm

    for layout, by_impl in traced.items():
        tqdm.write(format_traces(cfg.weight_bytes, layout, by_impl, opts.chains_per_call))
        data["traces"].extend(
            {"weight_bytes": cfg.weight_bytes, "layout": layout, "impl": impl, **t.to_dict()}
            for impl, t in by_impl.items()
        )
