"""Checks and report of experiments.chain: from outputs and run records to verdicts, the
"vs best" column, the table, the lines that make a run fail, and the traces' summaries.

Everything here works on numpy arrays and on the results dict as the JSON holds it, so that a
table can be redrawn from a results file, and all of it can be tested without a device.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from experiments.measure import compare, timing
from experiments.measure import trace as trace_lib

# Unit roundoff of the chain's dtype; fp32 uses 2^-20 because accumulation order dominates.
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-20}
# A case of the "vs best" column: the same weight size and layout.
VS_BEST_GROUP = ("weight_bytes", "layout")


def size_label(n_bytes: int) -> str:
    """75497472 -> '72MiB'; 32768 -> '32KiB' (largest binary unit that divides it)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale and n_bytes % scale == 0:
            return f"{n_bytes // scale}{unit}"
    return f"{n_bytes / 2**20:.2f}MiB" if n_bytes >= 2**20 else f"{n_bytes}B"


# ---------------------------------------------------------------- checks


def reference_chain(x_host: np.ndarray, w_host: np.ndarray, steps: int) -> np.ndarray:
    """float32 numpy reference: fp32 products, state rounded to the input dtype at each step."""
    dtype = x_host.dtype
    w = w_host.astype(np.float32)
    x = x_host.astype(np.float32)
    for _ in range(steps):
        x = (x @ w).astype(dtype).astype(np.float32)
    return x


def tolerance(dtype: str, total_steps: int) -> float:
    """Allowed max|y - ref| / max|ref|: twice the unit roundoff times sqrt(steps), a random walk
    of one rounding per step."""
    return 2.0 * UNIT_ROUNDOFF[dtype] * math.sqrt(total_steps)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-for-bit equality of two float32 arrays (0.0 and -0.0 differ)."""
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@dataclasses.dataclass(frozen=True)
class Outputs:
    """What one (layout, impl) produced, as float32 [batch, d]: `y` after `chains` chains (the
    output of one call), and `one_chain` after exactly one chain."""

    y: np.ndarray
    chains: int
    one_chain: np.ndarray


def agreement(y: np.ndarray, ref: np.ndarray, dtype: str, total_steps: int) -> dict[str, Any]:
    """max|y - ref|, its ratio to max|ref|, the tolerance for `total_steps`, and the verdict."""
    err = float(np.max(np.abs(y - ref)))
    rel = err / float(np.max(np.abs(ref)))
    tol = tolerance(dtype, total_steps)
    return {"max_abs_err": err, "rel_err": rel, "tol": tol, "ok": bool(rel <= tol)}


def add_checks(
    data: dict[str, Any],
    cfg: Any,
    x_host: np.ndarray,
    w_host: np.ndarray,
    outputs: Mapping[tuple[str, str], Outputs],
    not_comparable: Mapping[str, str],
) -> None:
    """Appends to data["checks"]: per impl, shared and copies bit-identical ("layouts"; an impl
    in `not_comparable` gets identical=None and the reason); every output of one call against
    the numpy reference ("agreement"); every output after one chain ("one_chain")."""
    w = cfg.weight_bytes
    checks = data["checks"]
    for impl in sorted({i for _, i in outputs}):
        if ("shared", impl) in outputs and ("copies", impl) in outputs:
            check: dict[str, Any] = {"weight_bytes": w, "impl": impl}
            if impl in not_comparable:
                check.update(identical=None, note=not_comparable[impl])
            else:
                check["identical"] = same_bits(
                    outputs[("shared", impl)].y, outputs[("copies", impl)].y
                )
            checks["layouts"].append(check)
    refs: dict[int, np.ndarray] = {}

    def ref(chains: int) -> np.ndarray:
        if chains not in refs:
            refs[chains] = reference_chain(x_host, w_host, cfg.steps * chains)
        return refs[chains]

    for (layout, impl), out in outputs.items():
        head = {"weight_bytes": w, "layout": layout, "impl": impl}
        checks["agreement"].append(
            {
                **head,
                "chains": out.chains,
                **agreement(out.y, ref(out.chains), cfg.dtype, cfg.steps * out.chains),
            }
        )
        checks["one_chain"].append(
            {**head, "chains": 1, **agreement(out.one_chain, ref(1), cfg.dtype, cfg.steps)}
        )


def failed_checks(data: Mapping[str, Any]) -> list[str]:
    """One line per failed check: outputs that differ between layouts, outputs off the
    reference by more than the tolerance."""
    checks = data.get("checks", {})
    lines = [
        f"{c['impl']} W={size_label(c['weight_bytes'])}: shared and copies outputs differ"
        for c in checks.get("layouts", [])
        if c.get("identical") is False
    ]
    for kind in ("one_chain", "agreement"):
        for c in checks.get(kind, []):
            if not c["ok"]:
                lines.append(
                    f"{c['impl']} {c['layout']} W={size_label(c['weight_bytes'])}: output after "
                    f"{c['chains']} chain(s) is off the float32 reference by {c['rel_err']:.3g} "
                    f"of max|ref|, tolerance {c['tol']:.3g}"
                )
    return lines


# ---------------------------------------------------------------- vs best


def add_vs_best(runs: list[dict[str, Any]]) -> None:
    """Sets `vs_best` (and `best_rival`) of every run: the other framework's fastest median at
    the same weight size and layout, divided by this run's median."""
    compare.add_vs_best(runs, group_keys=VS_BEST_GROUP, time_key="median_us")


# ---------------------------------------------------------------- table


def _fmt(value: float | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def _identical_cell(check: Mapping[str, Any] | None) -> str:
    if check is None:
        return "-"
    if check.get("identical") is None:
        return "n/a"  # the layouts run different kernels
    return "yes" if check["identical"] else "NO"


def _err_over_tol(*checks: Mapping[str, Any] | None) -> float | None:
    ratios = [c["rel_err"] / c["tol"] for c in checks if c]
    return max(ratios) if ratios else None


def format_table(data: Mapping[str, Any]) -> str:
    """The table, from the results dict: one row per size x layout x impl, in run order."""
    steps = data["config"]["steps"]
    by_key = {(r["weight_bytes"], r["layout"], r["impl"]): r for r in data["runs"]}
    checks = data["checks"]
    agree = {(c["weight_bytes"], c["layout"], c["impl"]): c for c in checks["agreement"]}
    one = {(c["weight_bytes"], c["layout"], c["impl"]): c for c in checks.get("one_chain", [])}
    same = {(c["weight_bytes"], c["impl"]): c for c in checks["layouts"]}
    head = (
        f"{'W':>9} {'d':>6} {'layout':<7} {'impl':<18} {'time/chain':>10} {'p10-p90':>17} "
        f"{'vs best':>7} {'GB/s':>7} {'%floor W':>8} {f'%floor {steps}W':>10} {'shared x':>8} "
        f"{'HBM xW':>7} {'L2 hit%':>7} {'=bits':>5} {'err/tol':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in data["runs"]:
        key = (r["weight_bytes"], r["layout"], r["impl"])
        copies = by_key.get((r["weight_bytes"], "copies", r["impl"]))
        speedup = (
            copies["median_us"] / r["median_us"] if r["layout"] == "shared" and copies else None
        )
        hbm = r.get("hbm") or {}
        ident = same.get((r["weight_bytes"], r["impl"])) if r["layout"] == "shared" else None
        lines.append(
            f"{size_label(r['weight_bytes']):>9} {r['d']:>6d} {r['layout']:<7} {r['impl']:<18} "
            f"{timing.format_us(r['median_us']):>10} "
            f"{timing.format_us_range(r['p10_us'], r['p90_us']):>17} "
            f"{compare.format_vs_best(r.get('vs_best')):>7} {r['gbps']:>7.0f} "
            f"{_fmt(r['pct_floor_once'], '.1f'):>8} {_fmt(r['pct_floor_steps'], '.1f'):>10} "
            f"{_fmt(speedup, '.2f'):>8} {_fmt(hbm.get('read_x_w'), '.2f'):>7} "
            f"{_fmt(hbm.get('l2_hit_pct'), '.1f'):>7} {_identical_cell(ident):>5} "
            f"{_fmt(_err_over_tol(agree.get(key), one.get(key)), '.2f'):>7}"
        )
    ceilings = data["env"].get("ceilings")
    floor = (
        f"{ceilings['read_bytes_per_s'] / 1e12:.2f} TB/s (read-only streaming, "
        f"{ceilings['source']})"
        if ceilings
        else "- (no ceilings measured for this device)"
    )
    lines += [
        f"time/chain: median of {data['config']['repeats']} calls (p10-p90), per chain; vs best "
        "= the other framework's fastest time/chain at this W and layout / this row's.",
        f"GB/s = {steps}·W / time; %floor W ({steps}W) = time to read W ({steps}·W) at {floor} "
        "/ time.",
        "shared x = copies time / shared time; HBM xW = HBM bytes read per chain / W; "
        "L2 hit% = lts__t_sector_hit_rate over the profiled chains.",
        "=bits: shared and copies outputs bit-identical (n/a: the layouts run different kernels); "
        "err/tol: max|y-ref| / max|ref| against the fp32 numpy reference over its tolerance, the "
        "worse of one chain and one call's chains (<= 1 passes).",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- traces


@dataclasses.dataclass(frozen=True)
class ChainTrace:
    """One impl's trace: the per-kernel rows, and the GPU's time per chain in µs (`span` from
    the first kernel's start to the last one's end, `busy` in kernels, `gaps` idle between
    them: launches, host work, waits)."""

    rows: list[trace_lib.Row]
    per_chain: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {"rows": [dataclasses.asdict(r) for r in self.rows], "per_chain": self.per_chain}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ChainTrace:
        return cls([trace_lib.Row(**r) for r in d["rows"]], dict(d["per_chain"]))


def format_per_chain(traced: Mapping[str, ChainTrace]) -> str:
    """One line per impl: the traced GPU time per chain, kernels and idle gaps between them."""
    return "\n".join(
        f"{impl}: GPU span {t.per_chain['span']:.1f} µs per chain = kernels "
        f"{t.per_chain['busy']:.1f} + idle between them {t.per_chain['gaps']:.1f}"
        for impl, t in traced.items()
    )


def format_traces(
    weight_bytes: int, layout: str, traced: Mapping[str, ChainTrace], chains: int, per_row: int = 3
) -> str:
    """The kernels per chain of every traced impl of one size and layout (`per_row` tables side
    by side), then their timelines per chain."""
    lines = [
        f"\nkernels per chain, W = {size_label(weight_bytes)}, {layout} "
        f"({chains} chains traced, the profiler on):"
    ]
    names = list(traced)
    for i in range(0, len(names), per_row):
        lines.append(trace_lib.side_by_side({n: traced[n].rows for n in names[i : i + per_row]}))
    lines.append(format_per_chain(traced))
    return "\n".join(lines)
