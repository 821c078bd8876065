"""What a pool of each worker's last units, taken one at a time by whichever worker is free
first, would leave of the fused kernel's unequal ends, estimated from an on-device profiler trace
(as `experiments.kernels.scopes` reads it) of huginn-0125's Core at batch 1:

    python3 tools/pool_estimate.py TRACE.json[.gz] [--pools=1,2,4] [--grabs=0,450,900,1800,3600]

In each occurrence of a product a worker's rate is its measured cycles over its units. It takes
its share but its last `pool` units at that rate; the pooled units (`pool` per worker) then go
one at a time to the worker that is free first, each at that worker's rate plus `grab` cycles
(the grab's round trip on the worker's path, the unit's copy issued only then, and its partial
sums added into its tile alone), and every worker's last grab finds the pool empty. The
product's late is its last worker's end less the workers' mean measured cycles (as
`weighted_split.py` counts it); per iteration, the sum over the 17 products, mean over the
iterations. Rates do not change with the units taken, so this estimates rather than bounds.
"""

from __future__ import annotations

import argparse
import heapq
import statistics

from experiments.kernels import scopes
from experiments.measure.trace import load_trace
from huginn_jax.config import huginn_0125
from huginn_jax.persistent import fused_shape
from pallas_kernels.core_step.plan import even_share

SHAPE = fused_shape(huginn_0125, batch=1)


def pooled_end(cycles: list[float], shares: list[int], pool: int, grab: float) -> float:
    """The last worker's end with a pool of each worker's last `pool` units (`pool` 0: the
    measured end, the slowest worker's cycles)."""
    rates = [c / n for c, n in zip(cycles, shares, strict=True)]
    free = [(r * (n - min(pool, n)), w) for w, (r, n) in enumerate(zip(rates, shares, strict=True))]
    heapq.heapify(free)
    for _ in range(sum(min(pool, n) for n in shares)):
        time, w = heapq.heappop(free)
        heapq.heappush(free, (time + grab + rates[w], w))
    empty = grab if pool else 0.0  # each worker's last grab finds the pool empty
    return max(time for time, _ in free) + empty


def late_per_iteration(occ: dict, pool: int, grab: float) -> float:
    """Sum over the products of (end - the workers' mean cycles), mean over the iterations."""
    total = 0.0
    for phase in SHAPE.phases:
        workers = sorted(occ[phase.name][0])
        units = phase.units(SHAPE.unit_cols)
        shares = [
            e - f for f, e in (even_share(units, len(workers), w) for w in range(len(workers)))
        ]
        for o in occ[phase.name]:
            cycles = [o[w] for w in workers]
            total += pooled_end(cycles, shares, pool, grab) - statistics.fmean(cycles)
    return total / len(occ["adapter"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--pools", default="1,2,4", help="units pooled per worker, a list")
    parser.add_argument("--grabs", default="0,450,900,1800,3600", help="cycles per grab, a list")
    args = parser.parse_args()
    occ = scopes.occurrences(load_trace(args.trace))
    pools = [int(x) for x in args.pools.split(",")]
    grabs = [float(x) for x in args.grabs.split(",")]
    measured = late_per_iteration(occ, 0, 0.0)
    print(f"late per iteration (cycles, sum over the 17 products): measured {measured:.0f}")
    print(f"{'pool':>4s} " + " ".join(f"{f'grab {g:.0f}':>10s}" for g in grabs))
    for pool in pools:
        row = " ".join(f"{late_per_iteration(occ, pool, g):10.0f}" for g in grabs)
        print(f"{pool:4d} {row}")


if __name__ == "__main__":
    main()
