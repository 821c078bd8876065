"""How fast this GPU streams bytes it only reads: the ceiling a batch-1 decode GEMV can reach.

    python3 tools/hbm_read.py [--gib=2] [--reps=20] [--tma_cols=128,256] [--tma_rings=2,3,4,6]

Device time of the kernels of one call (median of `reps`; CUPTI, or wall time where CUPTI is
unavailable, as the method column says) over bf16 weights, every call reading HBM (each weight
> L2, or the Core's weights rotated over > 2 x L2). The first cases are those of
`python -m experiments.ceilings` (the same code, experiments.measure.probes), which stores the
ceiling; this tool adds the TMA stream's other shapes and the Core's GEMVs:
  gemv      x [1, K] @ W [K, N], XLA's dot in cuBLAS as experiments.core runs it, `gib` GiB
  sum       XLA's reduction of W [K, N] over K to [N], `gib` GiB (reads W once)
  copy      W + 1 written to a new array, `gib` GiB (read + write)
  tma       (Hopper) W's bytes copied by TMA into every SM's shared memory, [64, 256] units,
            4 in flight per SM, nothing else done (`pallas_kernels.tma_read`)
  tma [64, C] xR  the same with [64, C] units, R in flight per SM, for each of --tma_cols and
            --tma_rings that fits in shared memory: the rate per bytes in flight
  gemv NAME xC  the GEMV at one of the Core's decode shapes (huginn-0125), C weight copies, each
            with its own x (XLA can merge dots that share an operand, so a shared x would time
            another kernel)
Rates in TB/s of bytes moved.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from experiments.measure import probes
from huginn_jax.xla_flags import use_gemm

K = 8192
L2_BYTES = 60 * 2**20
CORE_SHAPES = {  # [K, N] of the Core's GEMVs: Wqkv, attention proj, fc, mlp proj, adapter
    "qkv": (5280, 15840),
    "attn_proj": (5280, 5280),
    "fc": (5280, 35840),
    "mlp_proj": (17920, 5280),
    "adapter": (10560, 5280),
}


def report(name: str, probe: probes.Probe, reps: int) -> None:
    measured = probes.probe_time(probe, reps)
    if measured is None:
        return
    us, nbytes = measured.median_us, probe.nbytes
    kernels = "-" if measured.kernels is None else str(measured.kernels)
    print(f"{name:18s} {kernels:>7s}  {measured.method:>6s}  {us:11.1f}  {nbytes / us / 1e6:5.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--tma_cols", default="128,256", help="columns of the TMA probe's units")
    parser.add_argument("--tma_rings", default="2,3,4,6", help="TMA units in flight per SM")
    args = parser.parse_args()
    use_gemm("cublas")  # before the backend starts
    w = probes.stream_weight(int(args.gib * 2**30), K, jax.random.key(0))
    print(f"device {jax.devices()[0].device_kind}; bf16 weights, device time per call")
    print("case               kernels  method  us (median)   TB/s")
    for probe in probes.read_probes(w):
        name = f"{probe.name} {w.nbytes / 1e9:.2f} GB"
        report(name, probe, args.reps)
    for cols in map(int, args.tma_cols.split(",")):
        for ring in map(int, args.tma_rings.split(",")):
            try:
                probe = probes.tma_probe(w, cols=cols, ring=ring)
            except ValueError as e:  # a ring that does not fit
                print(f"tma [64, {cols}] x{ring}: {e}")
                continue
            if probe is not None:
                report(f"tma [64, {cols}] x{ring}", probe, args.reps)
    del w, probe
    for name, (rows, columns) in CORE_SHAPES.items():
        ws = probes.weights(rows, columns, 2 * L2_BYTES, jax.random.key(1))
        xs = [jnp.full((1, rows), i + 1, jnp.bfloat16) for i in range(len(ws))]
        gemvs = jax.jit(lambda xs, ws: [x @ w for x, w in zip(xs, ws, strict=True)])
        nbytes = sum(w.nbytes for w in ws)
        what = f"{len(ws)} GEMVs at the Core's {name} shape"
        report(
            f"gemv {name} x{len(ws)}",
            probes.Probe(name, gemvs, (xs, ws), nbytes, True, what),
            args.reps,
        )


if __name__ == "__main__":
    main()
