"""Cycles per named scope from Mosaic GPU's on-device profiler, summed per worker.

A kernel built with a profile directory (`plgpu.CompilerParams(profile_space=...,
profile_dir=...)`) records the SM clock at each named scope's entry and exit, per warpgroup,
and writes one Chrome-trace JSON per call there (cycles written as ns, so `ts` * 1e3 is
cycles). `scope_cycles` reads the newest: per scope kind (the scope's last name, its digits
dropped: qkv0 .. qkv3 are one kind), each worker's total cycles over the call divided by
`per`, and their median, p10 and p90 over the workers. `spread` compares the workers within
each occurrence of a scope: how far the slowest is from the others, and whether the same
workers are slow every time. A worker is a block (one per SM in a persistent kernel); where
its block runs more than one warpgroup, each function reads one of them (`warpgroup`, 0 the
first), and worker w is numbered 1 + its block, as in a trace of one warpgroup per block.
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


def recorders(trace: dict) -> dict[int, tuple[int, int]]:
    """{tid: (worker, warpgroup)} of the traces that recorded a scope. Mosaic GPU's dump numbers
    a trace 1 + warpgroup + (warpgroups per block) x block and gives it its block's SM as pid,
    so the warpgroups of a block share a pid; worker = 1 + block."""
    tids_of_sm: dict[int, set[int]] = collections.defaultdict(set)
    for e in trace["traceEvents"]:
        if e.get("ph") == "B":
            tids_of_sm[e["pid"]].add(e["tid"])
    per_block = max((len(tids) for tids in tids_of_sm.values()), default=1)
    return {
        tid: (1 + (tid - 1) // per_block, (tid - 1) % per_block)
        for tids in tids_of_sm.values()
        for tid in tids
    }


def worker_events(trace: dict, warpgroup: int = 0):
    """(worker, event) of each B and E event of `warpgroup`'s traces, in the trace's order."""
    of = recorders(trace)
    for e in trace["traceEvents"]:
        if e.get("ph") in ("B", "E") and e["tid"] in of:
            worker, wg = of[e["tid"]]
            if wg == warpgroup:
                yield worker, e


def recording_workers(trace: dict, warpgroup: int = 0) -> int:
    """How many workers recorded any scope in `warpgroup`."""
    return len({w for w, e in worker_events(trace, warpgroup) if e["ph"] == "B"})


def closed_scopes(trace: dict, warpgroup: int = 0):
    """(worker, scope name, cycles) of each scope of `warpgroup` as its exit comes, in the
    trace's order; ValueError where a worker's exit does not close its innermost open scope."""
    opened: dict[int, list] = collections.defaultdict(list)
    for worker, e in worker_events(trace, warpgroup):
        if e["ph"] == "B":
            opened[worker].append((e["name"], e["ts"]))
        else:
            name, start = opened[worker].pop()
            if name != e["name"]:
                raise ValueError(f"unbalanced trace: {name!r} closed by {e['name']!r}")
            yield worker, name, (e["ts"] - start) * 1e3


def scope_cycles(trace: dict, per: float = 1.0, warpgroup: int = 0) -> dict[str, dict]:
    """{kind: {median, p10, p90}} of each worker's cycles in the scopes of that kind / `per`,
    over the workers that recorded any scope in `warpgroup`."""
    per_worker: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for worker, name, cycles in closed_scopes(trace, warpgroup):
        kind = re.sub(r"\d+$", "", name.split("/")[-1])
        per_worker[worker][kind] += cycles / per
    out = {}
    for kind in sorted({n for c in per_worker.values() for n in c}):
        vals = sorted(c.get(kind, 0.0) for c in per_worker.values())
        out[kind] = dict(
            median=statistics.median(vals), p10=vals[len(vals) // 10], p90=vals[9 * len(vals) // 10]
        )
    return out


def occurrences(trace: dict, warpgroup: int = 0) -> dict[str, list[dict[int, float]]]:
    """{scope name (its last name, digits kept: qkv0 and qkv1 apart): [{worker: cycles} of its
    k-th occurrence, k = 0, 1, ...]}: a worker's k-th scope of a name is occurrence k (so
    every worker must run the same scopes in the same order, as a persistent kernel's steps
    and barriers are); the scopes of `warpgroup`."""
    out: dict[str, list[dict[int, float]]] = collections.defaultdict(list)
    seen: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for worker, path, cycles in closed_scopes(trace, warpgroup):
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


def spread(trace: dict, per: float = 1.0, warpgroup: int = 0) -> dict[str, dict]:
    """Per scope kind (digits dropped), over the occurrences of its names that every
    recording worker ran, summed and divided by `per`: `late`, the slowest worker's cycles
    less the workers' mean (for a step ended by a grid barrier: the most that an even split
    of its work could take off), and `waited`, the median worker's cycles less the fewest (for
    a barrier, whose last arriver waits least: how long the median worker waits for the
    last); and `repeat`, over the kind's names (fc0 for fc0, once per iteration), the mean
    correlation over the workers between their mean excess over each occurrence's median in
    the even occurrences and in the odd ones (near 1: the same workers are slow every time).
    The scopes of `warpgroup`."""
    workers = recording_workers(trace, warpgroup)
    sums: dict[str, dict] = collections.defaultdict(lambda: dict(late=0.0, waited=0.0, r=[]))
    for name, occ in sorted(occurrences(trace, warpgroup).items()):
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
