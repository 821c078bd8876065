"""Nsight Compute (ncu): run a measured range under the profiler and parse its CSV.

The parent re-runs a child Python command under
`ncu --clock-control none --cache-control none --profile-from-start off ...`; the child warms up
(compilation, autotuning and first-touch kernels run unprofiled), synchronises, opens the
profiler range with `cuda_profiler_range()` (cuProfilerStart/Stop on the primary context that JAX
and PyTorch share), runs the measured chains, synchronises and closes it. Only kernels inside
that range are profiled. `--cache-control none` keeps L2 warm between kernels, as in the
profiling study.

`parse_ncu_csv` reads ncu's `--csv` long format (one row per kernel x metric); `summarize` turns
rows into HBM bytes per chain and an L2 hit rate.
"""

from __future__ import annotations

import contextlib
import csv
import ctypes
import dataclasses
import glob
import math
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence

DRAM_READ = "dram__bytes_read.sum"
DRAM_WRITE = "dram__bytes_write.sum"
L2_HIT = "lts__t_sector_hit_rate.pct"
L2_SECTORS = "lts__t_sectors.sum"  # weights the per-kernel hit rates
METRICS = (DRAM_READ, DRAM_WRITE, L2_HIT, L2_SECTORS)

SKIP_LINE = "HBM counters need a GPU and Nsight Compute (ncu); skipped"

# ncu scales units with SI prefixes by default (1 Kbyte = 1000 byte); we also pass
# `--print-units base`, but a recorded CSV may have been made without it.
_UNIT_SCALE = {
    "byte": 1.0,
    "kbyte": 1e3,
    "mbyte": 1e6,
    "gbyte": 1e9,
    "tbyte": 1e12,
    "kibyte": 1024.0,
    "mibyte": 1024.0**2,
    "gibyte": 1024.0**3,
    "sector": 1.0,
    "%": 1.0,
    "": 1.0,
}


class NcuError(RuntimeError):
    """ncu ran but gave no usable result (the message is one line)."""


@dataclasses.dataclass(frozen=True)
class KernelMetrics:
    """One profiled kernel (or range): metric name -> value in base units (bytes, %, sectors)."""

    id: int
    name: str
    metrics: dict[str, float]


@dataclasses.dataclass(frozen=True)
class HbmSummary:
    """HBM traffic of the profiled range, per chain."""

    chains: int
    results: int  # profiled results summed (kernels in kernel replay, ranges in range replay)
    bytes_read_per_chain: float
    bytes_write_per_chain: float
    l2_hit_pct: float  # sector-weighted mean over kernels when sectors were read, else plain mean
    l2_hit_weighting: str  # "sectors" or "mean"


def find_ncu() -> str | None:
    """Path of ncu: PATH, then /usr/local/cuda/bin, then /opt/nvidia/nsight-compute/*/."""
    found = shutil.which("ncu")
    if found:
        return found
    candidates = ["/usr/local/cuda/bin/ncu"]
    candidates += sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"), reverse=True)
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


@contextlib.contextmanager
def cuda_profiler_range(device_ordinal: int = 0) -> Iterator[None]:
    """cuProfilerStart/Stop around the block, on the device's primary context. GPU only.

    Uses the driver library (libcuda), which every CUDA process has, rather than libcudart,
    whose file name depends on how JAX's CUDA wheels were installed. JAX (XLA) and PyTorch both
    run on the primary context, so pushing it makes the start/stop apply to their kernels.
    The caller synchronises the device before entering and before leaving.
    """
    lib = ctypes.CDLL("libcuda.so.1")

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise NcuError(f"{what} failed with CUresult {rc}")

    check(lib.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    check(lib.cuDeviceGet(ctypes.byref(dev), device_ordinal), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
    try:
        check(lib.cuProfilerStart(), "cuProfilerStart")
        try:
            yield
        finally:
            check(lib.cuProfilerStop(), "cuProfilerStop")
    finally:
        lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        lib.cuDevicePrimaryCtxRelease_v2(dev)


def ncu_command(
    ncu: str,
    child_argv: Sequence[str],
    *,
    log_file: str,
    replay_mode: str = "app-range",
    cache_control: str = "none",
) -> list[str]:
    """The ncu command line that profiles only the child's cuProfilerStart/Stop ranges.

    replay_mode "app-range" (default, as in the profiling study): each range runs natively,
    kernels back to back, and gives one result with the counters summed over the range; a metric
    set that needs several passes relaunches the child once per pass. "kernel": one result per
    kernel, but ncu serialises the kernels and does its own work between them, so a weight that
    fits in L2 is read from HBM again at every step: use it for per-kernel detail, not for the
    traffic of back-to-back chains.

    cache_control "none" keeps L2 warm, as in the profiling study's chain; "all" flushes every
    cache before each profiled range (the study's adapter measurement: L2 cleared before the
    call).

    Only the child itself is profiled ("application-only"): XLA runs ptxas as a subprocess for
    every kernel it compiles and autotunes, and with ncu injected into each of them (the default
    "all") the children of experiments.chain and experiments.core take too long to finish.
    What the H200 showed for both choices: docs/profiling_tools.md.
    """
    # Range replay takes its ranges from cuProfilerStart/Stop; kernel replay needs to be told.
    start = ["--profile-from-start", "off"] if replay_mode == "kernel" else []
    return [
        ncu,
        *("--clock-control", "none", "--cache-control", cache_control),
        *start,
        *("--replay-mode", replay_mode, "--target-processes", "application-only"),
        *("--metrics", ",".join(METRICS), "--print-units", "base"),
        *("--csv", "--log-file", log_file),
        *child_argv,
    ]


def run_ncu(
    child_argv: Sequence[str],
    *,
    ncu: str,
    log_file: str,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    timeout_s: float = 300.0,
    replay_mode: str = "app-range",
    cache_control: str = "none",
) -> str:
    """Runs `child_argv` under ncu; returns the CSV text ncu wrote to `log_file`."""
    cmd = ncu_command(
        ncu, child_argv, log_file=log_file, replay_mode=replay_mode, cache_control=cache_control
    )
    try:
        proc = subprocess.run(
            cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        raise NcuError(f"ncu did not finish within {timeout_s:.0f} s") from None
    text = ""
    if os.path.exists(log_file):
        with open(log_file, encoding="utf-8", errors="replace") as f:
            text = f.read()
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip() or text.strip()).splitlines()
        raise NcuError(f"ncu exited with {proc.returncode}: {tail[-1] if tail else 'no output'}")
    if not text.strip():
        text = proc.stdout  # an ncu that ignored --log-file printed the CSV on stdout
    return text


def _value(raw: str, unit: str) -> float:
    """'1,234,567' in 'Kbyte' -> 1234567e3; 'n/a' -> nan."""
    cleaned = raw.strip().replace(",", "")
    try:
        value = float(cleaned)
    except ValueError:
        return math.nan
    return value * _UNIT_SCALE.get(unit.strip().lower(), 1.0)


def parse_ncu_csv(text: str) -> list[KernelMetrics]:
    """Parses ncu `--csv` long-format output into one KernelMetrics per profiled result.

    Lines before the header (`==PROF==` messages, the program's own output) are skipped, as are
    later lines that are not rows of the table. Rows are grouped by their "ID" column. Values are
    converted to base units (bytes, %). Raises ValueError when no header is found.
    """
    lines = text.splitlines()
    start = next(
        (i for i, line in enumerate(lines) if line.startswith('"ID"') and "Metric Name" in line),
        None,
    )
    if start is None:
        raise ValueError('no ncu CSV header (a line starting with "ID" and naming Metric Name)')
    table = [line for line in lines[start:] if line.startswith('"')]
    reader = csv.reader(table)
    header = next(reader)
    col = {name.strip().lower(): i for i, name in enumerate(header)}
    name_col = next(
        (col[c] for c in ("kernel name", "range name", "function name", "name") if c in col), None
    )
    need = ("id", "metric name", "metric value")
    if name_col is None or any(c not in col for c in need):
        raise ValueError(f"ncu CSV header lacks a kernel name or one of {need}: {header}")
    unit_col = col.get("metric unit")

    by_id: dict[int, KernelMetrics] = {}
    for row in reader:
        if len(row) != len(header):
            continue
        try:
            rid = int(row[col["id"]])
        except ValueError:
            continue
        unit = row[unit_col] if unit_col is not None else ""
        entry = by_id.setdefault(rid, KernelMetrics(id=rid, name=row[name_col], metrics={}))
        entry.metrics[row[col["metric name"]].strip()] = _value(row[col["metric value"]], unit)
    return [by_id[k] for k in sorted(by_id)]


def summarize(kernels: Sequence[KernelMetrics], chains: int) -> HbmSummary:
    """Totals over all profiled results, divided by the number of chains in the range.

    The L2 hit rate is the mean of the per-kernel rates weighted by each kernel's L2 sectors
    (`lts__t_sectors.sum`) when every kernel has it, otherwise the plain mean over kernels.
    """
    if chains < 1:
        raise ValueError(f"{chains=} must be >= 1")
    if not kernels:
        raise NcuError("ncu profiled no kernels (was the profiler range empty?)")

    def total(metric: str) -> float:
        vals = [k.metrics.get(metric, math.nan) for k in kernels]
        return math.fsum(v for v in vals if not math.isnan(v))

    rates = [k.metrics.get(L2_HIT, math.nan) for k in kernels]
    sectors = [k.metrics.get(L2_SECTORS, math.nan) for k in kernels]
    pairs = [(r, s) for r, s in zip(rates, sectors, strict=True) if not math.isnan(r)]
    if pairs and all(not math.isnan(s) for _, s in pairs) and sum(s for _, s in pairs) > 0:
        hit = sum(r * s for r, s in pairs) / sum(s for _, s in pairs)
        weighting = "sectors"
    else:
        good = [r for r, _ in pairs]
        hit = sum(good) / len(good) if good else math.nan
        weighting = "mean"
    return HbmSummary(
        chains=chains,
        results=len(kernels),
        bytes_read_per_chain=total(DRAM_READ) / chains,
        bytes_write_per_chain=total(DRAM_WRITE) / chains,
        l2_hit_pct=hit,
        l2_hit_weighting=weighting,
    )
