"""The table `experiments.kernels.core_fused` prints last, and the line each of its processes
prints as it ends."""

from __future__ import annotations

import dataclasses


def format_table(rows: list[dict], profiles: list[dict]) -> str:
    """A row per (batch, impl, schedule, context): ms per iteration, the floor and % of it, the
    error against the reference ("bound" for a row without some barriers); then each profile's
    cycles per iteration and spread, and what each bound left out."""
    from pallas_kernels.core_step.fused_plan import Schedule

    fields = dataclasses.fields(Schedule)  # rows of older runs lack the later fields

    def schedule(r: dict) -> str:
        if "kv_stages" not in r:
            return str(r["ring"])  # the bare stream's
        return str(Schedule(*(r.get(f.name, f.default) for f in fields)))

    width = max([24] + [len(schedule(r)) + 2 for r in rows])
    head = (
        f"{'batch':>5}  {'impl':<8}{'unit':>6}{'schedule':>{width}}{'context':>8}{'ms/iter':>9}"
        f"{'floor ms':>10}{'% floor':>9}  err"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        ms, floor = r.get("ms_per_iteration"), r.get("floor_ms")
        cells = f"{ms:9.3f}" if ms else f"{'-':>9}"
        cells += f"{floor:10.3f}{r['pct_floor']:8.1f}%" if floor and ms else f"{'-':>10}{'-':>9}"
        err = f"{r['rel_err']:.1e}" if "rel_err" in r else "-"
        if r.get("skip_barriers"):
            err = "bound"
        unit = f"{r['unit_cols']:>6}"
        lines.append(
            f"{r['batch']:>5}  {r['impl']:<8}{unit}{schedule(r):>{width}}{r['context']:>8}{cells}"
            f"  {err}"
        )
    for prof in profiles:
        lines.append(
            f"\ncycles per iteration (median over {prof['workers']} workers, p10-p90), "
            f"context {prof['context']}, batch {prof.get('batch', 1)}, "
            f"[64, {prof['unit_cols']}] units, "
            f"schedule {prof['schedule']}:"
        )
        for kind, c in prof["cycles_per_iteration"].items():
            lines.append(f"  {kind:<10}{c['median']:>12.0f}   {c['p10']:.0f}-{c['p90']:.0f}")
        lines.append(
            "  per iteration, over each step's or barrier's occurrences: slowest worker - mean "
            "(late), median - fewest (waited); repeat: whether the same workers are slow"
        )
        for kind, c in prof["spread_per_iteration"].items():
            lines.append(
                f"  {kind:<16}late {c['late']:>8.0f}  waited {c['waited']:>8.0f}  "
                f"repeat {c['repeat']:+.2f}"
            )
        second = prof.get("second_warpgroup_cycles_per_iteration")  # older runs lack it
        if second:
            lines.append(
                f"  the second warpgroup (median over the {prof['second_warpgroup_workers']} "
                "workers with an attention item, p10-p90):"
            )
            for kind, c in second.items():
                lines.append(f"  {kind:<10}{c['median']:>12.0f}   {c['p10']:.0f}-{c['p90']:.0f}")
    skipped = sorted(
        {
            (", ".join(r["skip_barriers"]), bool(r.get("dataflow")))
            for r in rows
            if r.get("skip_barriers")
        }
    )
    for kinds, dataflow in skipped:
        if dataflow:  # one grid barrier per iteration: the units' waits on counters instead
            what = f"no unit waits on the output tiles of {kinds} (one grid barrier per iteration)"
            left_out = "those waits"
        else:
            what = f"no grid barrier after {kinds} (the last of an iteration kept)"
            left_out = "those barriers"
        lines.append(
            f"bound: {what}; the results are wrong, the time is what the kernel takes without "
            f"{left_out}"
        )
    return "\n".join(lines)


def row_times(rows: list[dict]) -> str:
    """A finished case's rows in a line (so that a run stopped from outside has printed them):
    each timed row's impl, context and ms per iteration."""
    timed = [r for r in rows if "ms_per_iteration" in r]
    return (
        "; ".join(
            f"{r['impl']} context {r['context']} {r['ms_per_iteration']:.3f} ms/iteration"
            for r in timed
        )
        or "no row timed"
    )
