"""What a split of each product weighted by its workers' rates could take off the fused kernel's
unequal ends, estimated from an on-device profiler trace (as `experiments.kernels.scopes` reads
it) of huginn-0125's Core at batch 1:

    python3 tools/weighted_split.py TRACE.json[.gz]

Per product (qkv0, ..., one per layer), in each occurrence (iteration): its late, the slowest
worker's cycles less the workers' mean (what the grid barrier or hand-over after it waits for);
then the late if each worker had taken units in proportion to its rate in the product's other
occurrences (cross-validated), its cycles in this occurrence scaled by its new share of the
units, with the shares as fractions and as whole units. It assumes a worker's rate stays what it
was when its range moves, and that its time is all per unit (a product's fixed work and its
waits scale with it too), so it bounds what such a split could take off rather than predicts it.
"""

from __future__ import annotations

import statistics
import sys

from experiments.kernels import scopes
from experiments.measure.trace import load_trace
from huginn_jax.config import huginn_0125
from huginn_jax.persistent import fused_shape

SHAPE = fused_shape(huginn_0125, batch=1)


def whole_units(shares: list[float], units: int) -> list[int]:
    """`shares` (summing to `units`) rounded to whole units that sum to `units`: the largest
    remainders round up."""
    base = [int(s) for s in shares]
    by_remainder = sorted(range(len(shares)), key=lambda w: base[w] - shares[w])
    for w in by_remainder[: units - sum(base)]:
        base[w] += 1
    return base


def late(cycles: list[float]) -> float:
    return max(cycles) - statistics.fmean(cycles)


def estimate(occurrences: list[dict[int, float]], units: int) -> tuple[float, float, float]:
    """Mean over the occurrences of (late, late with fractional shares, with whole units)."""
    out = [0.0, 0.0, 0.0]
    for i, cycles in enumerate(occurrences):
        workers = sorted(cycles)
        others = [o for j, o in enumerate(occurrences) if j != i]
        rates = [1 / statistics.fmean(o[w] for o in others) for w in workers]
        shares = [units * r / sum(rates) for r in rates]
        even = units / len(workers)
        now = [cycles[w] for w in workers]
        for k, new in enumerate((shares, whole_units(shares, units))):
            out[k + 1] += late([c * n / even for c, n in zip(now, new, strict=True)])
        out[0] += late(now)
    return tuple(x / len(occurrences) for x in out)


def main(path: str) -> None:
    occurrences = scopes.occurrences(load_trace(path))
    total = [0.0, 0.0, 0.0]
    print(f"{'product':10s} {'units':>5s} {'late':>5s} {'fractional shares':>18s}", end="")
    print(f" {'whole units':>12s}")
    for phase in SHAPE.phases:
        units = phase.units(SHAPE.unit_cols)
        row = estimate(occurrences[phase.name], units)
        total = [t + r for t, r in zip(total, row, strict=True)]
        print(f"{phase.name:10s} {units:5d} {row[0]:5.0f} {row[1]:18.0f} {row[2]:12.0f}")
    print(
        f"per iteration: late {total[0]:.0f} cycles; weighted by rate {total[1]:.0f} "
        f"(fractional shares), {total[2]:.0f} (whole units)"
    )


if __name__ == "__main__":
    main(sys.argv[1])
