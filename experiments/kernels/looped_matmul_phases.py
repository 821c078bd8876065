"""Where a split-K step goes: the kernel's phases recorded by Mosaic GPU's on-device profiler.

`build_splitk(..., profile_dir=DIR)` wraps each step and its phases in named scopes; with a
profile buffer the kernel records the SM clock (%clock, cycles) at every phase's entry and exit,
per warpgroup, and writes one Chrome-trace JSON per call into DIR. `phase_table` reads the
newest one: per phase, cycles per step (median over workers), and the rest of the step that
no phase covers (wgmma issue, loop control). The clock is each SM's own; durations are exact
in cycles, and the table converts them to us with the clock rate given.

The phases, in a step's order, are the kernel's (`PHASES`, defined and described in
pallas_kernels/looped_matmul/splitk_plan.py).
"""

from __future__ import annotations

import collections
import json
import statistics
from pathlib import Path

from experiments.kernels.scopes import newest_trace
from pallas_kernels.looped_matmul.splitk_plan import PHASES

__all__ = ["PHASES", "phase_cycles", "phase_table"]


def phase_cycles(trace: dict) -> dict[str, list[float]]:
    """Per phase (and "step"), each worker's cycles per step; "other" = step - phases."""
    totals: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    open_ranges: dict[int, list[tuple[str, float]]] = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        tid = e["tid"]
        if e["ph"] == "B":
            open_ranges[tid].append((e["name"], e["ts"]))
            continue
        name, start = open_ranges[tid].pop()
        if name != e["name"]:
            raise ValueError(f"unbalanced trace: {name!r} closed by {e['name']!r}")
        # The dump writes cycles as ns and divides by 1e3 into "ts".
        totals[tid][name] += (e["ts"] - start) * 1e3
        if name == "step":
            totals[tid]["steps"] += 1
    out: dict[str, list[float]] = collections.defaultdict(list)
    for counts in totals.values():
        steps = counts.pop("steps", 0)
        if not steps:
            continue
        step = counts.pop("step")
        out["step"].append(step / steps)
        for name in PHASES:
            out[name].append(counts.get(name, 0.0) / steps)
        out["other"].append((step - sum(counts.get(n, 0.0) for n in PHASES)) / steps)
    return dict(out)


def phase_table(profile_dir: str | Path, *, clock_ghz: float) -> str:
    """The newest trace in `profile_dir` as a table: cycles and us per step, median over
    workers, with the p10-p90 spread."""
    cycles = phase_cycles(json.loads(newest_trace(profile_dir).read_text()))
    if not cycles:
        raise ValueError(f"{profile_dir}: the trace has no complete step")
    lines = [f"{'phase':<14}{'cycles/step':>12}{'us/step':>9}{'p10-p90 cycles':>18}"]
    for name in (*PHASES, "other", "step"):
        vals = sorted(cycles[name])
        mid = statistics.median(vals)
        p10, p90 = vals[int(0.1 * (len(vals) - 1))], vals[int(0.9 * (len(vals) - 1))]
        lines.append(
            f"{name:<14}{mid:>12.0f}{mid / clock_ghz / 1e3:>9.2f}{f'{p10:.0f}-{p90:.0f}':>18}"
        )
    lines.append(f"workers {len(cycles['step'])}, clock {clock_ghz} GHz")
    return "\n".join(lines)
