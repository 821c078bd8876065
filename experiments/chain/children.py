"""The chain's child processes: `python -m experiments.chain --child=MODE` for one size.

  timing  the _no_cmdbuf impls, in a process whose XLA_FLAGS turn command buffers off (XLA reads
          them once, at start): samples and outputs (`run_timing_child`)
  ncu     every layout x impl in its own cuProfilerStart/Stop range, under Nsight Compute:
          HBM bytes and L2 hit rate per chain (`hbm_pass`)
  trace   profiler traces of one impl: the torch profiler and JAX's both use CUPTI, and once
          torch's has run in a process, JAX's cannot subscribe there again (`run_trace_child`)

The parent builds the command line (`child_argv`) and environment (`child_env`); the child runs
`child_main` and writes child.json (and .npy outputs) into a temporary directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from experiments.chain.options import ChainConfig, Options
from experiments.chain.passes import measure, profile_range, trace_pass
from experiments.chain.report import ChainTrace, Outputs
from experiments.chain.runners import build_runner, host_values
from experiments.cli import UserError
from experiments.measure import ncu as ncu_lib
from experiments.measure import results as results_lib
from experiments.measure import timing
from huginn_jax.xla_flags import COMMAND_BUFFERS_OFF

REPO_ROOT = Path(__file__).resolve().parents[2]


def child_argv(
    cfg: ChainConfig,
    opts: Options,
    mode: str,
    layouts: Sequence[str],
    impls: Sequence[str],
    out_dir: str,
) -> list[str]:
    """The command line that re-runs this program as a child for one size."""
    return [
        sys.executable,
        "-m",
        "experiments.chain",
        f"--child={mode}",
        f"--child_out={out_dir}",
        f"--size={cfg.size_bytes}B",
        f"--d={cfg.d}",
        f"--steps={cfg.steps}",
        f"--batch={cfg.batch}",
        f"--dtype={cfg.dtype}",
        f"--seed={cfg.seed}",
        f"--layouts={','.join(layouts)}",
        f"--impls={','.join(impls)}",
        f"--warmup={opts.warmup}",
        f"--repeats={opts.repeats}",
        f"--chains_per_call={opts.chains_per_call}",
        f"--ncu_chains={opts.ncu_chains}",
        f"--gemm={opts.gemm}",
        f"--torch_compile_mode={opts.torch_compile_mode}",
        "--json_out=",
        "--plot_out=",
        *([f"--trace_dir={opts.trace_dir}"] if opts.trace_dir else []),
    ]


def child_env(impls: Sequence[str]) -> dict[str, str]:
    """Environment of a child: importable repo, no JAX preallocation (the parent holds memory
    too), and command buffers off for the _no_cmdbuf impls (XLA reads XLA_FLAGS once, at start)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    if any(i.endswith("_no_cmdbuf") for i in impls):
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {COMMAND_BUFFERS_OFF}".strip()
    return env


def _run_child(
    cfg: ChainConfig, opts: Options, mode: str, impls: Sequence[str], out: str
) -> dict[str, Any]:
    """Runs one child for every layout of `impls`; its child.json, or RuntimeError with the
    last line it printed."""
    argv = child_argv(cfg, opts, mode, opts.layouts, impls, out)
    proc = subprocess.run(
        argv, env=child_env(impls), cwd=REPO_ROOT, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise RuntimeError(f"{mode} child exited with {proc.returncode}: {tail}")
    return results_lib.read_json(Path(out) / "child.json")


def run_timing_child(
    cfg: ChainConfig, opts: Options, impls: Sequence[str]
) -> dict[tuple[str, str], tuple[timing.Samples, Outputs, float | None]]:
    """Times the _no_cmdbuf impls in a child process whose XLA_FLAGS turn command buffers off;
    per (layout, impl): samples, outputs (with the chains they went through), and the first
    call's seconds."""
    with tempfile.TemporaryDirectory(prefix="chain-child-") as out:
        data = _run_child(cfg, opts, "timing", impls, out)
        return {
            (r["layout"], r["impl"]): (
                timing.Samples.from_dict(r["samples"]),
                Outputs(
                    np.load(Path(out) / r["output_file"]),
                    int(r["chains_in_output"]),
                    np.load(Path(out) / r["one_chain_file"]),
                ),
                r["compile_seconds"],
            )
            for r in data["runs"]
        }


def run_trace_child(cfg: ChainConfig, opts: Options, impl: str) -> dict[str, ChainTrace]:
    """Traces `impl` for every layout in a child process: the torch profiler and JAX's both
    use CUPTI, and once torch's has run in a process, JAX's cannot subscribe there again."""
    with tempfile.TemporaryDirectory(prefix="chain-trace-") as out:
        traces = _run_child(cfg, opts, "trace", [impl], out)["traces"]
        return {t["layout"]: ChainTrace.from_dict(t) for t in traces}


def hbm_pass(
    cfg: ChainConfig, opts: Options, impls: Sequence[str], ncu: str
) -> dict[tuple[str, str], ncu_lib.HbmSummary]:
    """Re-runs every layout x impl in one child under ncu (application-range replay), each in
    its own profiler range; HBM bytes and L2 hit rate per chain for each."""
    with tempfile.TemporaryDirectory(prefix="chain-ncu-") as out:
        argv = child_argv(cfg, opts, "ncu", opts.layouts, impls, out)
        text = ncu_lib.run_ncu(
            argv,
            ncu=ncu,
            log_file=str(Path(out) / "ncu.csv"),
            env=child_env(impls),
            cwd=str(REPO_ROOT),
            timeout_s=opts.ncu_timeout,
        )
        ranges = results_lib.read_json(Path(out) / "child.json")["ranges"]
        results = ncu_lib.parse_ncu_csv(text)
        if len(results) != len(ranges):
            raise ncu_lib.NcuError(f"ncu gave {len(results)} results for {len(ranges)} ranges")
        # One result per cuProfilerStart/Stop range, in the order the child opened them.
        return {
            (r["layout"], r["impl"]): ncu_lib.summarize([res], r["chains"])
            for r, res in zip(ranges, results, strict=True)
        }


def child_main(opts: Options, mode: str, out_dir: str) -> None:
    """The child's side. timing: time the given impls, write samples and outputs. ncu: for
    each layout x impl, warm up, then run --ncu_chains chains inside their own
    cuProfilerStart/Stop range. trace: trace each layout x impl. All write child.json."""
    out = Path(out_dir)
    cfg = opts.configs[0]
    xla_flags = os.environ.get("XLA_FLAGS", "").split()
    if any(i.endswith("_no_cmdbuf") for i in opts.impls) and COMMAND_BUFFERS_OFF not in xla_flags:
        raise UserError(f"_no_cmdbuf impls need XLA_FLAGS to contain {COMMAND_BUFFERS_OFF}")
    x_host, w_host = host_values(cfg)
    runs, ranges, traces = [], [], []
    for layout in opts.layouts:
        for impl in opts.impls:
            if mode == "trace":
                traced = trace_pass(cfg, opts, layout, impl, x_host, w_host)
                traces.append({"layout": layout, **traced.to_dict()})
                continue
            runner, release = build_runner(impl, layout, x_host, w_host, cfg, opts)
            if mode == "timing":
                samples, outputs = measure(runner, opts)
                name = f"{layout}-{impl}"
                np.save(out / f"{name}.npy", outputs.y)
                np.save(out / f"{name}-one.npy", outputs.one_chain)
                runs.append(
                    {
                        "layout": layout,
                        "impl": impl,
                        "samples": samples.to_dict(),
                        "output_file": f"{name}.npy",
                        "one_chain_file": f"{name}-one.npy",
                        "chains_in_output": outputs.chains,
                        "compile_seconds": runner.compile_seconds,
                    }
                )
            else:
                chains = profile_range(runner, opts)
                ranges.append({"layout": layout, "impl": impl, "chains": chains})
            release()
    results_lib.write_json_atomic(
        out / "child.json", {"runs": runs, "ranges": ranges, "traces": traces}
    )
