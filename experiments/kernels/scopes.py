"""Cycles per named scope from Mosaic GPU's on-device profiler, summed per worker.

A kernel built with a profile directory (`plgpu.CompilerParams(profile_space=...,
profile_dir=...)`) records the SM clock at each named scope's entry and exit, per warpgroup,
and writes one Chrome-trace JSON per call there (cycles written as ns, so `ts` * 1e3 is
cycles). `scope_cycles` reads the newest: per scope kind (the scope's last name, its digits
dropped: qkv0 .. qkv3 are one kind), each worker's total cycles over the call divided by
`per`, and their median, p10 and p90 over the workers. `spread` compares the workers within
each occurrence of a scope: how far the slowest is from the others, and whether the same
workers are slow every time.
"""

from __future__ import annotations

import collections
import json
import re
import statistics
from pathlib import Path


def newest_trace(profile_dir: str | Path) -> Path:
    """The newest profiler trace (*.json) in `profile_dir`."""
    found = sorted(Path(profile_dir).glob("*.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no profiler trace (*.json) in {profile_dir}")
    return found[-1]


def read_newest(profile_dir: str | Path) -> dict:
    """`newest_trace`, parsed."""
    return json.loads(newest_trace(profile_dir).read_text())


def recording_workers(trace: dict) -> int:
    """How many workers (warpgroups) recorded any scope."""
    return len({e["tid"] for e in trace["traceEvents"] if e.get("ph") == "B"})


def closed_scopes(trace: dict):
    """(worker, scope name, cycles) of each scope as its exit comes, in the trace's order;
    ValueError where a worker's exit does not close its innermost open scope."""
    opened: dict[int, list] = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "B":
            opened[e["tid"]].append((e["name"], e["ts"]))
        elif e.get("ph") == "E":
            name, start = opened[e["tid"]].pop()
            if name != e["name"]:
                raise ValueError(f"unbalanced trace: {name!r} closed by {e['name']!r}")
            yield e["tid"], name, (e["ts"] - start) * 1e3


def scope_cycles(trace: dict, per: float = 1.0) -> dict[str, dict]:
    """{kind: {median, p10, p90}} of each worker's cycles in the scopes of that kind / `per`,
    over the workers that recorded any scope."""
    per_worker: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for worker, name, cycles in closed_scopes(trace):
        kind = re.sub(r"\d+$", "", name.split("/")[-1])
        per_worker[worker][kind] += cycles / per
    out = {}
    for kind in sorted({n for c in per_worker.values() for n in c}):
        vals = sorted(c.get(kind, 0.0) for c in per_worker.values())
        out[kind] = dict(
            median=statistics.median(vals), p10=vals[len(vals) // 10], p90=vals[9 * len(vals) // 10]
        )
    return out


def occurrences(trace: dict) -> dict[str, list[dict[int, float]]]:
    """{scope name (its last name, digits kept: qkv0 and qkv1 apart): [{worker: cycles} of its
    k-th occurrence, k = 0, 1, ...]}: a worker's k-th scope of a name is occurrence k (so
    every worker must run the same scopes in the same order, as a persistent kernel's steps
    and barriers are)."""
    out: dict[str, list[dict[int, float]]] = collections.defaultdict(list)
    seen: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for worker, path, cycles in closed_scopes(trace):
        name = path.split("/")[-1]
        k = seen[worker][name]
        seen[worker][name] += 1
        while len(out[name]) <= k:
            out[name].append({})
        out[name][k][worker] = cycles
    return out


def excess(occurrences_of_a_name: list[dict[int, float]]) -> dict[int, list[float]]:
    """{worker: [its cycles less the occurrence's median, per occurrence]}."""
    out: dict[int, list[float]] = collections.defaultdict(list)
    for o in occurrences_of_a_name:
        median = statistics.median(o.values())
        for w, v in o.items():
            out[w].append(v - median)
    return out


def _correlation(a: list[float], b: list[float]) -> float:
    """Pearson's correlation of a and b; 0 where either is constant."""
    try:
        return statistics.correlation(a, b)
    except statistics.StatisticsError:
        return 0.0


def spread(trace: dict, per: float = 1.0) -> dict[str, dict]:
    """Per scope kind (digits dropped), over the occurrences of its names that every
    recording worker ran, summed and divided by `per`: `late`, the slowest worker's cycles
    less the workers' mean (for a step ended by a grid barrier: the most that an even split
    of its work could take off), and `waited`, the median worker's cycles less the fewest (for
    a barrier, whose last arriver waits least: how long the median worker waits for the
    last); and `repeat`, over the kind's names (fc0 for fc0, once per iteration), the mean
    correlation over the workers between their mean excess over each occurrence's median in
    the even occurrences and in the odd ones (near 1: the same workers are slow every time)."""
    workers = recording_workers(trace)
    sums: dict[str, dict] = collections.defaultdict(lambda: dict(late=0.0, waited=0.0, r=[]))
    for name, occ in sorted(occurrences(trace).items()):
        full = [o for o in occ if len(o) == workers]
        if len(full) < 2:
            continue
        kind = sums[re.sub(r"\d+$", "", name)]
        for o in full:
            vals = sorted(o.values())
            kind["late"] += (vals[-1] - statistics.fmean(vals)) / per
            kind["waited"] += (statistics.median(vals) - vals[0]) / per
        over = excess(full)
        ws = sorted(over)
        even = [statistics.fmean(over[w][0::2]) for w in ws]
        odd = [statistics.fmean(over[w][1::2]) for w in ws]
        kind["r"].append(_correlation(even, odd))
    return {
        kind: dict(late=c["late"], waited=c["waited"], repeat=statistics.fmean(c["r"]))
        for kind, c in sorted(sums.items())
    }
