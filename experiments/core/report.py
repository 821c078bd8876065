"""What `experiments.core` reports: the cost model of a case, one timed record, the agreement
checks between impls, the check / XLA / trace / scaling lines, and the table (printed last)."""

from __future__ import annotations

import dataclasses

import numpy as np

from experiments.cli import UserError
from experiments.core.cases import XLA_IMPLS, Case
from experiments.measure import ceilings as ceilings_lib
from experiments.measure import compare, timing
from experiments.measure import trace as trace_lib
from huginn_jax import costs

B2B_KEY = "back_to_back_ms_per_iteration"  # a record's median of `timing.time_back_to_back`
HOST_KEY = "host_ms_per_iteration"  # a waited call's median time until it returned


def cost_of(cfg, case: Case, dtype_bytes: int) -> dict:
    """The cost model's bytes and FLOPs for ONE iteration of `case`."""
    one = costs.totals(
        costs.core_iteration_ops(
            cfg, batch=case.batch, context=case.context, mode=case.mode, dtype_bytes=dtype_bytes
        )
    )
    return {
        "weight_bytes": one.weight_bytes,
        "kv_read_bytes": one.kv_read_bytes,
        "hbm_read_bytes": one.hbm_read_bytes,
        "hbm_bytes": one.hbm_bytes,
        "flops": one.flops,
    }


def device_ceilings(device_kind: str, path: str) -> ceilings_lib.Ceilings | None:
    """The project's measured ceilings for this device (`path`, else the device's results
    file); None where it has none, e.g. on a CPU."""
    try:
        return ceilings_lib.for_device(device_kind, path or None)
    except ceilings_lib.CeilingsError as e:
        raise UserError(f"--ceilings: {e}") from None


def check_tolerance(dtype_name: str, iterations: int) -> float:
    """Largest relative (Frobenius) difference allowed between two implementations' output
    states: rounding grows with the number of chained layers, roughly as its square root."""
    base = 6e-3 if dtype_name == "bf16" else 3e-5
    return base * max(1.0, iterations) ** 0.5


def record(
    case: Case,
    impl: str,
    samples: timing.Samples,
    cost: dict,
    ceilings,
    back_to_back: timing.Samples | None = None,
) -> dict:
    """One timed (case, impl): ms per iteration, its samples, the rates over the cost model's
    bytes and FLOPs, and with ceilings the % of the HBM floor and of the bf16 GEMM rate. The
    rates are the waited call's, and so is the host's part (`HOST_KEY`: until the call returned,
    `Samples.returned`); `back_to_back` (`timing.time_back_to_back`) adds its median and samples
    beside them."""
    t = samples.median  # seconds per iteration
    rec = {
        **dataclasses.asdict(case),
        "impl": impl,
        "ms_per_iteration": t * 1e3,
        "samples": samples.to_dict(),
        "weights_gbps": cost["weight_bytes"] / t / 1e9,
        "weights_kv_gbps": (cost["weight_bytes"] + cost["kv_read_bytes"]) / t / 1e9,
        "tflops": cost["flops"] / t / 1e12,
        "cost_model": cost,
    }
    if ceilings:
        floor = (cost["weight_bytes"] + cost["kv_read_bytes"]) / ceilings.read_bytes_per_s
        rec["pct_hbm_floor"] = 100 * floor / t
        rec["pct_bf16_gemm"] = 100 * (cost["flops"] / t) / ceilings.bf16_flops_per_s
    if samples.returned is not None:
        rec[HOST_KEY] = samples.returned_median * 1e3
    if back_to_back is not None:
        rec[B2B_KEY] = back_to_back.median * 1e3
        rec["back_to_back_samples"] = back_to_back.to_dict()
    return rec


def agreement_checks(cases, impls, outputs: dict, dtype_name: str) -> list[dict]:
    """Every impl's output state against the case's reference impl (`xla` when it ran, else the
    first XLA impl): relative Frobenius difference and whether it is within tolerance."""
    checks = []
    for case in cases:
        ran = [impl for impl in impls if (case, impl) in outputs]
        reference = next((impl for impl in ran if impl in XLA_IMPLS), None)
        if reference is None:
            continue
        ref = outputs[(case, reference)]
        tolerance = check_tolerance(dtype_name, case.iterations)
        for impl in ran:
            if impl == reference:
                continue
            got = outputs[(case, impl)]
            rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            checks.append(
                {
                    **dataclasses.asdict(case),
                    "impl": impl,
                    "reference": reference,
                    "rel_err": rel,
                    "tolerance": tolerance,
                    "passed": bool(rel <= tolerance),  # NaN fails
                }
            )
    return checks


def scaling_lines(records: list[dict]) -> list[str]:
    """r iterations in one executable against r × one iteration, per case and impl (and the
    same ratio of the back-to-back times, when measured)."""
    lines = []
    by_key = {}
    for r in records:
        by_key[(r["mode"], r["batch"], r["context"], r["impl"], r["iterations"])] = r
    for (mode, b, ctx, impl, it), r in sorted(by_key.items()):
        one = by_key.get((mode, b, ctx, impl, 1))
        if it > 1 and one:
            ratio = r["ms_per_iteration"] / one["ms_per_iteration"]
            line = f"{impl} {mode} B={b} ctx={ctx}: r={it} costs {ratio:.3f} x r x (r=1)"
            if B2B_KEY in r and B2B_KEY in one:
                line += f", back to back {r[B2B_KEY] / one[B2B_KEY]:.3f}"
            lines.append(line)
    return lines


def report_lines(result: dict) -> list[str]:
    """What is printed before the table: one line per agreement check, per record the
    persistent kernel's schedule or its XLA executable's summary and its per-kernel trace (when
    taken), then the scaling lines."""
    lines = []
    for check in result["checks"]:
        lines.append(
            f"check {check['impl']} vs {check['reference']}, {check['mode']} B={check['batch']} "
            f"ctx={check['context']} r={check['iterations']}: rel err {check['rel_err']:.2e} "
            f"(tolerance {check['tolerance']:.1e}){'' if check['passed'] else ' FAILED'}"
        )
    for rec in result["records"]:
        if "schedule" in rec:
            lines.append(
                f"{rec['impl']} {rec['mode']} r={rec['iterations']} B={rec['batch']} "
                f"ctx={rec['context']}: schedule {rec['schedule']}"
            )
        if "xla_report" in rec:
            rep = rec["xla_report"]
            lines.append(
                f"{rec['impl']} {rec['mode']} r={rec['iterations']} B={rec['batch']} "
                f"ctx={rec['context']}: "
                f"kernels/iteration {list(rep['kernels_per_iteration'].values())}, "
                f"cache copies {len(rep['big_buffer_copies'])}, "
                f"slot copies/iteration {len(rep.get('slice_copies_per_iteration', []))}, "
                f"temp {rep.get('temp_bytes', 0) / 2**20:.1f} MiB "
                f"({rep['temp_pct_of_weights_and_cache']:.2f} % of weights+cache), "
                f"alias {rep.get('alias_bytes', 0) / 2**20:.1f} MiB"
            )
        if rec.get("trace"):
            lines.append(f"trace {rec['impl']} {rec['mode']} r={rec['iterations']}:")
            rows = {rec["impl"]: [trace_lib.Row(**row) for row in rec["trace"]]}
            lines.append(trace_lib.side_by_side(rows, top=12, per="iter"))
            lines.append(
                trace_lib.per_unit_line(rec["trace_us_per_iteration"], "iteration (3 calls)")
            )
    return lines + scaling_lines(result["records"])


TABLE_LEGEND = """\
time/iter median time per Core iteration (a call's wall time / r), p10-p90 of the calls
b2b/iter  median time per iteration of calls dispatched back to back, one wait per --back_to_back
          calls (the host's dispatch overlapped with the device's work)
host/iter median time per iteration until a waited call returned, before its wait: the host's
          tracing checks, argument handling and launches (a CUDA graph's replay: its launch)
vs best   the other framework's fastest time/iter in the same case / this row's (> 1: ahead)
GB/s w+kv (Core weights + KV cache read) per iteration / time/iter
%floor    (weights + KV read) at the measured read-only streaming rate / time/iter
%gemm     TFLOP/s / the measured sustained bf16 GEMM rate
HBM/pred  bytes read (ncu, --hbm) / the cost model's
-         not measured: no ceilings file for this device, no rival of the other framework,
          no --hbm, or --back_to_back=0"""


def _optional(value: float | None, spec: str) -> str:
    return "-" if value is None or value != value else format(value, spec)  # None, NaN: "-"


def _ms_as_us(ms: float | None) -> str:
    return timing.format_us(None if ms is None else ms * 1e3)


def format_table(records: list[dict]) -> str:
    """One row per record, then the legend; "-" where a value was not measured."""
    head = (
        f"{'mode':<8}{'B':>4}{'ctx':>6}{'r':>4} {'impl':<16}{'time/iter':>10}{'p10-p90':>17}"
        f"{'b2b/iter':>10}{'host/iter':>10}"
        f"{'vs best':>8}{'GB/s w+kv':>10}{'%floor':>7}{'TFLOP/s':>9}{'%gemm':>6}{'HBM/pred':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        s = r["samples"]
        it = r["iterations"]
        spread = timing.format_us_range(s["p10_us"], s["p90_us"])
        hbm = r.get("hbm") or {}
        ratio = hbm.get("read_over_prediction")
        lines.append(
            f"{r['mode']:<8}{r['batch']:>4}{r['context']:>6}{it:>4} {r['impl']:<16}"
            f"{timing.format_us(r['ms_per_iteration'] * 1e3):>10}{spread:>17}"
            f"{_ms_as_us(r.get(B2B_KEY)):>10}{_ms_as_us(r.get(HOST_KEY)):>10}"
            f"{compare.format_vs_best(r.get('vs_best')):>8}"
            f"{_optional(r['weights_kv_gbps'], '.0f'):>10}"
            f"{_optional(r.get('pct_hbm_floor'), '.1f'):>7}{_optional(r['tflops'], '.1f'):>9}"
            f"{_optional(r.get('pct_bf16_gemm'), '.1f'):>6}"
            f"{_optional(ratio, '.3f'):>9}"
        )
    return "\n".join([*lines, TABLE_LEGEND])
