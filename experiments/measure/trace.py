"""Profiler traces: run a function under the JAX (or PyTorch) profiler, parse a per-kernel table.

JAX: `jax.profiler.trace(dir, create_perfetto_trace=True)` writes `*.xplane.pb` (opens in
XProf / TensorBoard) and `*.trace.json.gz` (Chrome trace-event JSON) that `parse_trace` reads.
On GPU the kernels are complete ("ph": "X") events on the stream threads ("Stream #N...") of a
process named "/device:GPU:N"; on CPU, where there are no kernels, the XLA ops the CPU runtime
executed (events carrying an "hlo_op" argument) are used instead. Durations ("dur") are in µs.
Command buffers: XLA (jax 0.11.2) still launches its command buffers as CUDA graphs while the
profiler runs, `cuGraphLaunch` on the host rows and the graphs' kernels one by one on the stream
rows, so the per-kernel table covers them (docs/profiling_tools.md).
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

# Rows that XProf derives from the kernels; counting them too would count each kernel twice.
_DERIVED_THREADS = ("XLA Modules", "XLA Ops", "Steps", "Framework", "Source", "XLA TraceMe")


@dataclasses.dataclass(frozen=True)
class Row:
    """One kernel (or XLA op on CPU): launches and time inside the traced range."""

    name: str
    launches: int
    total_us: float
    us_per_chain: float


def profile_jax(fn: Callable[[], Any], log_dir: str | os.PathLike) -> Path:
    """Runs `fn()` under the JAX profiler; the *.trace.json.gz it wrote under `log_dir`."""
    import jax

    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    before = set(log_dir.rglob("*.trace.json.gz"))
    with jax.profiler.trace(str(log_dir), create_perfetto_trace=True):
        fn()
    new = set(log_dir.rglob("*.trace.json.gz")) - before
    if not new:
        raise FileNotFoundError(f"the JAX profiler wrote no *.trace.json.gz under {log_dir}")
    return latest_trace_file(log_dir)


def latest_trace_file(log_dir: str | os.PathLike) -> Path:
    """The newest *.trace.json.gz under `log_dir` (where `profile_jax` wrote its trace)."""
    found = sorted(Path(log_dir).rglob("*.trace.json.gz"), key=os.path.getmtime)
    if not found:
        raise FileNotFoundError(f"no *.trace.json.gz under {log_dir}")
    return found[-1]


def load_trace(path: str | os.PathLike) -> dict[str, Any]:
    """Reads a Chrome trace-event JSON file, gzipped or not."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def kernel_events(trace: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The complete events that are device kernels (GPU) or, failing that, XLA ops (CPU).

    Picked in order: events on "Stream" threads of "/device:GPU" processes; other non-derived
    threads of those processes; events with "cat": "kernel" (PyTorch's Chrome traces); events
    with an "hlo_op" argument (XLA's CPU runtime).
    """
    events = trace["traceEvents"] if isinstance(trace, Mapping) else trace
    process: dict[Any, str] = {}
    thread: dict[tuple[Any, Any], str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            process[e.get("pid")] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            thread[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]

    gpu = [e for e in complete if process.get(e.get("pid"), "").startswith("/device:GPU")]
    on_stream = [
        e for e in gpu if thread.get((e.get("pid"), e.get("tid")), "").startswith("Stream")
    ]
    if on_stream:
        return on_stream
    not_derived = [
        e
        for e in gpu
        if not thread.get((e.get("pid"), e.get("tid")), "").startswith(_DERIVED_THREADS)
    ]
    if not_derived:
        return not_derived
    torch_kernels = [e for e in complete if e.get("cat") == "kernel"]
    if torch_kernels:
        return torch_kernels
    return [
        e
        for e in complete
        if "hlo_op" in e.get("args", {}) and not str(e.get("name", "")).startswith("end: ")
    ]


def breakdown(events: Iterable[Mapping[str, Any]], *, chains: int) -> list[Row]:
    """Groups events by name: launches, total µs, µs per chain; longest total first."""
    if chains < 1:
        raise ValueError(f"{chains=} must be >= 1")
    count: collections.Counter[str] = collections.Counter()
    total: collections.defaultdict[str, float] = collections.defaultdict(float)
    for e in events:
        count[e["name"]] += 1
        total[e["name"]] += float(e["dur"])
    rows = [Row(n, count[n], total[n], total[n] / chains) for n in count]
    return sorted(rows, key=lambda r: (-r.total_us, r.name))


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Where the traced time went, in µs: `span` from the first event's start to the last one's
    end; `busy` the time covered by at least one event (nested or overlapping events, such as
    XLA's CPU ops inside a while op, count once); `gaps` = span - busy: launch latency, host
    dispatch and synchronisation between kernels."""

    span: float
    busy: float

    @property
    def gaps(self) -> float:
        return self.span - self.busy


def per_unit(spent: Timeline, units: int) -> dict[str, float]:
    """The timeline in µs per unit of work (a chain, a Core iteration): span, busy, gaps."""
    if units < 1:
        raise ValueError(f"{units=} must be >= 1")
    return {"span": spent.span / units, "busy": spent.busy / units, "gaps": spent.gaps / units}


def per_unit_line(spent: Mapping[str, float], unit: str) -> str:
    """`per_unit`'s dict as one line: 'traced span S µs per UNIT: B busy, G between kernels'."""
    return (
        f"traced span {spent['span']:.1f} µs per {unit}: {spent['busy']:.1f} busy, "
        f"{spent['gaps']:.1f} between kernels"
    )


def timeline(events: Iterable[Mapping[str, Any]]) -> Timeline:
    intervals = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events)
    if not intervals:
        return Timeline(0.0, 0.0)
    busy, (start, end) = 0.0, intervals[0]
    for lo, hi in intervals[1:]:
        if lo > end:
            busy, start, end = busy + end - start, lo, hi
        else:
            end = max(end, hi)
    busy += end - start
    return Timeline(span=max(hi for _, hi in intervals) - intervals[0][0], busy=busy)


def trace_run(
    fn: Callable[[], Any], path: str | os.PathLike, *, torch: bool, units: int
) -> tuple[list[Row], dict[str, float]]:
    """Runs `fn()` (which finishes its device work) under the JAX profiler (`path`: its log
    directory) or, `torch`, under torch.profiler (`path`: the Chrome trace written); returns the
    per-kernel rows and the timeline (`per_unit`), both per unit of work `fn` ran `units` of."""
    if torch:
        rows = trace_torch(fn, chains=units, export_path=path)
        events = kernel_events(load_trace(path))
    else:
        events = kernel_events(load_trace(profile_jax(fn, path)))
        rows = breakdown(events, chains=units)
    return rows, per_unit(timeline(events), units)


def parse_trace(path_or_trace: str | os.PathLike | Mapping[str, Any], *, chains: int) -> list[Row]:
    """Per-kernel breakdown of a Chrome trace (a path to *.trace.json[.gz] or the loaded dict)."""
    if isinstance(path_or_trace, Mapping):
        trace = path_or_trace
    else:
        trace = load_trace(path_or_trace)
    return breakdown(kernel_events(trace), chains=chains)


def trace_torch(
    fn: Callable[[], Any], *, chains: int, export_path: str | os.PathLike | None = None
) -> list[Row]:
    """Runs `fn()` under torch.profiler (CPU + CUDA) and returns its CUDA kernels as Rows.

    `fn` must synchronise the device before returning. Rows come from `key_averages()` (device
    events only); `export_path` also writes the Chrome trace (opens in Perfetto).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
    if export_path is not None:
        Path(export_path).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(export_path))
    rows = []
    for avg in prof.key_averages():
        if avg.device_type != torch.autograd.DeviceType.CUDA:
            continue
        # Renamed from *cuda_time_total in torch 2.4; both in µs.
        total = getattr(avg, "self_device_time_total", None)
        if total is None:
            total = getattr(avg, "self_cuda_time_total", 0.0)
        rows.append(Row(avg.key, int(avg.count), float(total), float(total) / chains))
    return sorted(rows, key=lambda r: (-r.total_us, r.name))


def _table(rows: Sequence[Row], title: str, name_width: int, top: int | None, per: str):
    shown, rest = (rows, []) if top is None else (rows[:top], rows[top:])
    lines = [title, f"{'kernel':<{name_width}} {'launches':>8} {'µs/' + per:>9}"]
    for r in shown:
        name = r.name if len(r.name) <= name_width else r.name[: name_width - 1] + "…"
        lines.append(f"{name:<{name_width}} {r.launches:>8d} {r.us_per_chain:>9.2f}")
    if rest:
        other = f"({len(rest)} other kernels)"
        lines.append(
            f"{other:<{name_width}} {sum(r.launches for r in rest):>8d} "
            f"{sum(r.us_per_chain for r in rest):>9.2f}"
        )
    lines.append(
        f"{'total':<{name_width}} {sum(r.launches for r in rows):>8d} "
        f"{sum(r.us_per_chain for r in rows):>9.2f}"
    )
    return lines


def side_by_side(
    breakdowns: Mapping[str, Sequence[Row]],
    *,
    name_width: int = 44,
    top: int | None = None,
    per: str = "chain",
) -> str:
    """The breakdowns as tables placed next to each other, one column block per key: the `top`
    longest kernels (all by default), the rest as one row, and the total of all."""
    blocks = [_table(rows, title, name_width, top, per) for title, rows in breakdowns.items()]
    if not blocks:
        return ""
    width = name_width + 19
    height = max(len(b) for b in blocks)
    lines = []
    for i in range(height):
        cells = [(b[i] if i < len(b) else "").ljust(width) for b in blocks]
        lines.append(" | ".join(cells).rstrip())
    return "\n".join(lines)
