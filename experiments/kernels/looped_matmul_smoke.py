"""GPU smoke run of the looped matmul kernels: correctness vs the reference, kernel times, a table.

    python -m experiments.kernels.looped_matmul_smoke                  # the comparison suite
    python -m experiments.kernels.looped_matmul_smoke --suite=resident  # the resident kernel
    python -m experiments.kernels.looped_matmul_smoke --suite=steps     # split-K time vs steps
    python -m experiments.kernels.looped_matmul_smoke --case=NAME       # one case, this process
    python -m experiments.kernels.looped_matmul_smoke --only=A,B --profile_dir=DIR  # + phases
    python -m experiments.kernels.looped_matmul_smoke --list

Every case runs in its own subprocess with a timeout, so that a hung grid barrier or a crash in
one case leaves the others running (its output and traceback are printed). A case prints one
`RESULT {json}` line; the parent writes the rows to --json_out and prints a compact table of
them last (`looped_matmul_smoke_report.py`). The cases, by suite, are `looped_matmul_cases.py`.
The default suite times the resident and split-K kernels side by side (d in 2048, 3520, 6144,
12288; M in 1, 8, 64; 8 steps) against XLA's unrolled chain of 8 dots, then split-K variants at
72 MiB. Kernel times are CUPTI device times (median over --reps calls, all kernels of a call
summed), as the numbers in docs/looped_matmul.md. If a split-K or barrier case times out, the
later ones with the same barrier poll are skipped (a barrier bug would hang them all); --budget
stops launching cases that could end after that many seconds.

HBM bytes of one case (target: <= 1.25 x W per chain at 72 MiB):
    ncu --clock-control none --cache-control none --metrics dram__bytes_read.sum,\
lts__t_sector_hit_rate.pct python -m experiments.kernels.looped_matmul_smoke \
--case=splitk_d6144_m1 --reps=2
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
import traceback
from typing import Any

from absl import flags

from experiments import program
from experiments.cli import UserError
from experiments.kernels.looped_matmul_cases import BARRIER_BLOCKS, SUITES
from experiments.kernels.looped_matmul_smoke_report import print_barrier_table, print_table
from experiments.measure.device_time import cupti_us, wall_us

FLAGS = flags.FLAGS


def _config_for(spec: dict[str, Any]):
    from pallas_kernels.looped_matmul import pick_any_config
    from pallas_kernels.looped_matmul.splitk_config import SplitKConfig
    from pallas_kernels.looped_matmul.splitk_pick import fill_on_chip

    m, d = spec["m"], spec["d"]
    stacked = spec.get("stacked", False)
    cfg = pick_any_config(m, d, stacked=stacked, variant=spec.get("variant", "resident"))
    over = dict(spec.get("cfg", {}))
    if "split" in over:  # another 2-D split for the split-K kernel, filled like the picker
        tiles, k_split = over.pop("split")
        base = SplitKConfig(tiles=tiles, k_split=k_split, warpgroups=cfg.warpgroups, ring=3)
        cfg = fill_on_chip(base, m, d)
        if cfg is None:
            raise ValueError(f"split {tiles} tiles x k_split {k_split} does not fit")
    return dataclasses.replace(cfg, **over) if over else cfg


def _result(name: str, spec: dict[str, Any], **fields: Any) -> None:
    row = dict(
        case=name, variant=spec.get("variant", "resident"), d=spec["d"], m=spec["m"],
        steps=spec["steps"], **fields,
    )  # fmt: skip
    print("RESULT " + json.dumps(row), flush=True)


def run_barrier_case(name: str, spec: dict[str, Any], reps: int) -> None:
    """The barrier probe: checks the counter every worker read, times the kernel."""
    import numpy as np

    from pallas_kernels.looped_matmul.barrier import build_barrier_probe

    epochs, warpgroups, poll = spec["steps"], spec["warpgroups"], spec["poll"]
    f = build_barrier_probe(BARRIER_BLOCKS, warpgroups, epochs, poll)
    t0 = time.perf_counter()
    seen = np.asarray(f())
    first_s = time.perf_counter() - t0
    want = BARRIER_BLOCKS * warpgroups * epochs
    ok = bool((seen == want).all())
    kernel_us, _, kernel_note = cupti_us(f, reps)
    print(
        f"[{name}] {BARRIER_BLOCKS} blocks x {warpgroups} wg, {epochs} barriers, poll={poll}: "
        f"first call {first_s:.1f} s; counter seen {seen.min()}..{seen.max()} (want {want}) "
        f"{'OK' if ok else 'MISMATCH'}; CUPTI {kernel_us} us ({kernel_note})",
        flush=True,
    )
    _result(name, spec, status="OK" if ok else "MISMATCH", kernel_us=kernel_us)


def run_case(
    name: str, spec: dict[str, Any], reps: int, *, calls: int = 0, profile_dir: str = ""
) -> None:
    """Runs one case in this process: prints the config, errors, times and a RESULT line.

    `calls` > 0: checks the result, then only calls the kernel that many times (for ncu, which
    cannot attach next to the CUPTI timing). `profile_dir`: split-K cases also print their
    phases per step (`looped_matmul_phases.py`), profiled in a separate compile after the
    timing."""
    if spec.get("variant") == "barrier":
        run_barrier_case(name, spec, reps)
        return
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.looped_matmul import (
        describe_config,
        looped_matmul,
        looped_matmul_copies,
        looped_matmul_copies_reference,
        looped_matmul_reference,
    )
    from pallas_kernels.looped_matmul.splitk_kernel import looped_matmul_splitk

    m, d, steps = spec["m"], spec["d"], spec["steps"]
    stacked = spec.get("stacked", False)
    try:
        cfg = _config_for(spec)
        cfg.validate(m, d, steps, stacked=stacked)
    except ValueError as e:
        print(f"[{name}] no config: {e}")
        _result(name, spec, status="n/a", note=str(e)[:80])
        return
    print(f"[{name}] M={m} d={d} steps={steps}: {describe_config(cfg, m, d)}", flush=True)
    kx, kw = jax.random.split(jax.random.key(hash(name) % 2**31))
    x = jax.random.normal(kx, (m, d), jnp.float32).astype(jnp.bfloat16)
    wshape = (steps, d, d) if stacked else (d, d)
    w = (jax.random.normal(kw, wshape, jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
    ablation = spec.get("grid_barrier") is False
    if stacked:
        kern = lambda: looped_matmul_copies(x, w, config=cfg)  # noqa: E731
        ref = lambda: looped_matmul_copies_reference(x, w)  # noqa: E731
    elif ablation:
        kern = lambda: looped_matmul_splitk(x, w, steps=steps, cfg=cfg, grid_barrier=False)  # noqa: E731
        ref = lambda: looped_matmul_reference(x, w, steps)  # noqa: E731
    else:
        kern = lambda: looped_matmul(x, w, steps, config=cfg)  # noqa: E731
        ref = lambda: looped_matmul_reference(x, w, steps)  # noqa: E731

    @jax.jit
    def unrolled(x, w):  # the chain as `steps` separate dots, as PyTorch would launch them
        for s in range(steps):
            x = jnp.dot(x, w[s] if stacked else w, preferred_element_type=jnp.float32)
            x = x.astype(jnp.bfloat16)
        return x

    t0 = time.perf_counter()
    out = jax.block_until_ready(kern())
    first_s = time.perf_counter() - t0
    want = jax.block_until_ready(ref())
    got, ref_out = np.asarray(out, np.float32), np.asarray(want, np.float32)
    rel = float(np.linalg.norm(got - ref_out) / max(np.linalg.norm(ref_out), 1e-30))
    ok = bool(np.isfinite(got).all()) and rel < 2e-2
    status = "ABLATION" if ablation else ("OK" if ok else "MISMATCH")
    print(
        f"[{name}] first call (compile+run) {first_s:.1f} s; max|out-ref|="
        f"{np.abs(got - ref_out).max():.3e} rel_fro={rel:.3e} {status}",
        flush=True,
    )
    if calls:
        jax.block_until_ready([kern() for _ in range(calls)])
        return
    kernel_us, _, kernel_note = cupti_us(kern, reps)
    xla_us, _, xla_note = cupti_us(lambda: unrolled(x, w), reps)
    kernel_wall, xla_wall = wall_us(kern, reps), wall_us(lambda: unrolled(x, w), reps)
    w_bytes = d * d * 2 * (steps if stacked else 1)
    print(
        f"[{name}] CUPTI us: kernel {kernel_us} ({kernel_note}), XLA unrolled {xla_us} "
        f"({xla_note}); wall us/call back-to-back: kernel {kernel_wall:.1f}, XLA "
        f"{xla_wall:.1f}; W={w_bytes / 2**20:.0f} MiB; chain weight bytes / kernel time = "
        f"{steps * d * d * 2 / ((kernel_us or kernel_wall) * 1e6):.2f} TB/s",
        flush=True,
    )
    _result(
        name, spec, status=status, rel=rel, kernel_us=kernel_us,
        xla_us=xla_us, kernel_wall_us=kernel_wall, xla_wall_us=xla_wall,
    )  # fmt: skip
    if profile_dir and spec.get("variant") == "splitk" and not stacked:
        print_phases(
            name, x, w, steps, cfg, os.path.join(profile_dir, name), grid_barrier=not ablation
        )


def sm_clock_ghz() -> float | None:
    """The GPU's maximum SM clock (nvidia-smi), the rate the phase table converts cycles at."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout  # fmt: skip
        return float(out.split()[0]) / 1e3
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def print_phases(name, x, w, steps, cfg, out_dir, *, grid_barrier: bool) -> None:
    """Runs the split-K kernel with its phases profiled (a separate compile) and prints where
    a step goes; the trace file stays in `out_dir`. Where the profile buffer does not fit in
    shared memory next to the kernel's, fewer steps are profiled (4, then 2)."""
    import jax

    from experiments.kernels.looped_matmul_phases import phase_table
    from pallas_kernels.looped_matmul.splitk_kernel import looped_matmul_splitk

    os.makedirs(out_dir, exist_ok=True)
    for n in sorted({steps, min(steps, 4), min(steps, 2)}, reverse=True):
        run = lambda n=n: looped_matmul_splitk(  # noqa: E731
            x, w, steps=n, cfg=cfg, grid_barrier=grid_barrier, profile_dir=out_dir
        )
        try:
            for _ in range(3):  # the last call's trace is read: caches warm as when timed
                jax.block_until_ready(run())
            break
        except ValueError as e:  # Mosaic's shared-memory check, at compile time
            print(f"[{name}] profiling {n} steps: {e}")
    else:
        return
    jax.effects_barrier()  # the trace is written by a host callback
    clock = sm_clock_ghz()
    print(f"[{name}] phases per step, {n} steps profiled (on-device profiler, {out_dir}):")
    print(phase_table(out_dir, clock_ghz=clock or 1.0))
    if clock is None:
        print("(no nvidia-smi clock: us/step are cycles / 1000)")


def _poll_of(spec: dict[str, Any]) -> str | None:
    """The grid barrier's poll of a split-K or barrier case (None for the others)."""
    if spec.get("variant") == "barrier":
        return spec["poll"]
    if spec.get("variant") == "splitk":
        return spec.get("cfg", {}).get("poll", "all_threads")
    return None


PROGRAM = "looped_matmul_smoke"


def define_flags() -> None:
    flags.DEFINE_enum("suite", "table", sorted(SUITES), "Cases to run.")
    flags.DEFINE_string("case", "", "Run this one case in this process (no subprocess).")
    flags.DEFINE_bool("list", False, "Print the suite's case names and stop.")
    flags.DEFINE_list("only", [], "Case names to run; empty: the suite's.")
    flags.DEFINE_float("timeout", 75.0, "Seconds per case (each in its own process).")
    flags.DEFINE_float("budget", 560.0, "Stop launching cases that could end after this (s).")
    flags.DEFINE_integer("reps", 10, "Timed calls per case (median).")
    flags.DEFINE_integer(
        "calls", 0, "With --case: only call the kernel this many times, no timing (for ncu)."
    )
    flags.DEFINE_string(
        "profile_dir", "", "Split-K cases: also profile each step's phases, traces written here."
    )
    flags.DEFINE_string("json_out", "out/looped_matmul_smoke.json", "Results JSON (empty: none).")


def case_names(all_cases: dict[str, Any]) -> list[str]:
    """The case names to run; UserError for a bad value or a backend without a GPU (every
    kernel here is Mosaic GPU's), before any case starts."""
    names = [FLAGS.case] if FLAGS.case else list(FLAGS.only)
    unknown = [n for n in names if n not in all_cases]
    if unknown:
        raise UserError(f"unknown case {unknown[0]!r}; --list shows a suite's cases")
    if FLAGS.reps < 1:
        raise UserError(f"--reps={FLAGS.reps}: must be >= 1")
    if FLAGS.calls < 0:
        raise UserError(f"--calls={FLAGS.calls}: must be >= 0")
    for name in ("timeout", "budget"):
        value = FLAGS[name].value
        if not (math.isfinite(value) and value > 0):
            raise UserError(f"--{name}={value}: must be a number of seconds > 0")
    program.check_outputs(FLAGS.json_out)
    import jax

    platform = jax.devices()[0].platform
    if platform != "gpu":
        raise UserError(f"needs an sm_90 GPU (Mosaic GPU); the backend here is {platform}")
    return names or list(SUITES[FLAGS.suite])


def run_one(name: str, spec: dict[str, Any]) -> None:
    """--case: the case in this process; an exception prints its traceback and an ERROR row,
    and the process exits 1 (the parent shows both)."""
    try:
        run_case(name, spec, FLAGS.reps, calls=FLAGS.calls, profile_dir=FLAGS.profile_dir)
    except Exception:
        print(f"[{name}] EXCEPTION:")
        traceback.print_exc(file=sys.stdout)
        _result(name, spec, status="ERROR")
        sys.exit(1)


def run_suite(
    names: list[str], all_cases: dict[str, Any], *, reps: int, timeout: float, budget: float,
    profile_dir: str = "",
) -> list[dict[str, Any]]:  # fmt: skip
    """Each case in a process of its own (`--case`), one after another: its output printed as
    it ends, its RESULT row kept. A case that times out skips the later ones with its barrier
    poll; none starts that could end after `budget` seconds."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start, rows, hung_polls = time.perf_counter(), [], set()
    for name in names:
        spec = all_cases[name]
        if _poll_of(spec) in hung_polls:
            print(f"[{name}] SKIPPED: an earlier case with poll={_poll_of(spec)} timed out")
            rows.append(dict(case=name, steps=spec["steps"], status="SKIP"))
            continue
        if time.perf_counter() - start + timeout > budget:
            print(f"[{name}] SKIPPED: --budget {budget:.0f} s would be exceeded")
            rows.append(dict(case=name, steps=spec["steps"], status="BUDGET"))
            continue
        cmd = [
            sys.executable, "-m", "experiments.kernels.looped_matmul_smoke", f"--case={name}",
            f"--reps={reps}", f"--profile_dir={profile_dir}", "--json_out=",
        ]  # fmt: skip
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
            out = proc.stdout + (proc.stderr[-3000:] if proc.returncode else "")
            if proc.returncode:
                out += f"\n[{name}] exit code {proc.returncode}"
        except subprocess.TimeoutExpired as e:
            so = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            out = so + f"\n[{name}] TIMEOUT after {timeout:.0f} s (hang? grid barrier?)"
            rows.append(dict(case=name, steps=spec["steps"], status="TIMEOUT"))
            if _poll_of(spec):
                hung_polls.add(_poll_of(spec))
        lines = out.rstrip().splitlines()
        for line in lines:
            if line.startswith("RESULT "):
                rows.append(json.loads(line[len("RESULT ") :]))
        print("\n".join(ln for ln in lines if not ln.startswith("RESULT ")))
        print(f"[{name}] wall {time.perf_counter() - t:.1f} s", flush=True)
    return rows


def main(argv: list[str]) -> None:
    all_cases = {name: spec for suite in SUITES.values() for name, spec in suite.items()}
    if FLAGS.list:
        print("\n".join(SUITES[FLAGS.suite]))
        return
    names = case_names(all_cases)
    if FLAGS.case:
        run_one(FLAGS.case, all_cases[FLAGS.case])
        return
    import jax

    dev = jax.devices()[0]
    print(
        f"jax {jax.__version__}; device {dev.platform} {getattr(dev, 'device_kind', '')} "
        f"cc={getattr(dev, 'compute_capability', None)} sms={getattr(dev, 'core_count', None)}",
        flush=True,
    )
    rows = run_suite(
        names, all_cases, reps=FLAGS.reps, timeout=FLAGS.timeout, budget=FLAGS.budget,
        profile_dir=FLAGS.profile_dir,
    )  # fmt: skip
    if FLAGS.json_out:
        program.write_results(FLAGS.json_out, {"rows": rows})
    print_table(rows)
    if FLAGS.suite == "barrier":
        print_barrier_table(rows)


if __name__ == "__main__":
    program.run(PROGRAM, define_flags, main)
