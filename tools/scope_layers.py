"""Whether a fused kernel's slow workers are the same in every layer: from an on-device
profiler trace (Mosaic GPU's, as `experiments.kernels.scopes` reads it), per product kind.

    python3 tools/scope_layers.py TRACE.json[.gz] [LAYERS]

Per kind (qkv, proj, fc, mlp_proj): the correlation over the workers of their mean excess
over each occurrence's median between the kind's layers (qkv0 against qkv1, ...: the mean and
range over the pairs), and in layer 0 the standard deviation of a worker's excess from one
iteration to the next (mean over the workers) against that of the workers' means.
"""

from __future__ import annotations

import itertools
import statistics
import sys

from experiments.kernels import scopes
from experiments.measure.trace import load_trace

KINDS = ("qkv", "proj", "fc", "mlp_proj")


def main(path: str, layers: int = 4) -> None:
    occ = scopes.occurrences(load_trace(path))
    for kind in KINDS:
        by_layer = [scopes.excess(occ[f"{kind}{j}"]) for j in range(layers)]
        means = [{w: statistics.fmean(v) for w, v in e.items()} for e in by_layer]
        ws = sorted(means[0])
        pairs = [
            statistics.correlation([a[w] for w in ws], [b[w] for w in ws])
            for a, b in itertools.combinations(means, 2)
        ]
        within = statistics.fmean(statistics.pstdev(v) for v in by_layer[0].values())
        between = statistics.pstdev(means[0].values())
        print(
            f"{kind:9s} between layers: mean correlation {statistics.fmean(pairs):.2f} (pairs "
            f"{min(pairs):.2f} to {max(pairs):.2f}); layer 0: sd within a worker {within:.0f}, "
            f"between the workers' means {between:.0f} cycles"
        )


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
