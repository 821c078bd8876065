"""Cycles per named scope from Mosaic GPU's on-device profiler, summed per worker.

A kernel built with a profile directory (`plgpu.CompilerParams(profile_space=...,
profile_dir=...)`) records the SM clock at each named scope's entry and exit, per warpgroup,
and writes one Chrome-trace JSON per call there (cycles written as ns, so `ts` * 1e3 is
cycles). `scope_cycles` reads the newest: per scope kind (the scope's last name, its digits
dropped: qkv0 .. qkv3 are one kind), each worker's total cycles over the call divided by
`per`, and their median, p10 and p90 over the workers.
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


def scope_cycles(trace: dict, per: float = 1.0) -> dict[str, dict]:
    """{kind: {median, p10, p90}} of each worker's cycles in the scopes of that kind / `per`,
    over the workers that recorded any scope."""
    per_worker: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    opened: dict[int, list] = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "B":
            opened[e["tid"]].append((e["name"], e["ts"]))
        elif e.get("ph") == "E":
            name, start = opened[e["tid"]].pop()
            if name != e["name"]:
                raise ValueError(f"unbalanced trace: {name!r} closed by {e['name']!r}")
            kind = re.sub(r"\d+$", "", name.split("/")[-1])
            per_worker[e["tid"]][kind] += (e["ts"] - start) * 1e3 / per
    out = {}
    for kind in sorted({n for c in per_worker.values() for n in c}):
        vals = sorted(c.get(kind, 0.0) for c in per_worker.values())
        out[kind] = dict(
            median=statistics.median(vals), p10=vals[len(vals) // 10], p90=vals[9 * len(vals) // 10]
        )
    return out
