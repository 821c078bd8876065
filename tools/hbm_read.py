"""How fast this GPU streams bytes it only reads: the ceiling a batch-1 decode GEMV can reach.

    python3 tools/hbm_read.py [--gib=2] [--reps=20]

Device time of the kernels of one call (CUPTI, median of `reps`) over bf16 weights, every call
reading HBM (each weight > L2, or the Core's weights rotated over > 2 x L2):
  sum       XLA's reduction of W [K, N] over K to [N], `gib` GiB (reads W once)
  gemv      x [1, K] @ W [K, N], XLA's dot in cuBLAS as experiments.core runs it, `gib` GiB
  copy      W + 1 written to a new array, `gib` GiB (read + write; shared/DEVICE.md's 4.25 TB/s
            is a device-to-device memcpy)
  gemv NAME xC  the GEMV at one of the Core's decode shapes (huginn-0125), C weight copies, each
            with its own x (with one x shared by 3 copies, the first run on the H200 ran the
            attention proj's GEMVs as 5 kernels at 1.58 TB/s; XLA can merge dots that share an
            operand)
Rates in TB/s of bytes moved.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from huginn_jax.xla_flags import use_gemm
from pallas_kernels.device_time import cupti_us

K = 8192
L2_BYTES = 60 * 2**20
CORE_SHAPES = {  # [K, N] of the Core's GEMVs: Wqkv, attention proj, fc, mlp proj, adapter
    "qkv": (5280, 15840),
    "attn_proj": (5280, 5280),
    "fc": (5280, 35840),
    "mlp_proj": (17920, 5280),
    "adapter": (10560, 5280),
}


def weights(rows: int, columns: int, total_bytes: int, key) -> list[jax.Array]:
    """bf16 [rows, columns] copies, enough of them to reach `total_bytes` (at least one)."""
    copies = max(1, -(-total_bytes // (rows * columns * 2)))
    return [
        jax.random.normal(k, (rows, columns), jnp.bfloat16) for k in jax.random.split(key, copies)
    ]


def report(name: str, fn, nbytes: int, reps: int, *args) -> None:
    jax.block_until_ready(fn(*args))
    us, kernels, note = cupti_us(fn, reps, *args)
    if us is None:
        print(f"{name:18s} {note}")
    else:
        print(f"{name:18s} {kernels:7d}  {us:11.1f}  {nbytes / us / 1e6:5.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    use_gemm("cublas")  # before the backend starts
    (w,) = weights(K, int(args.gib * 2**30 / 2 / K), 0, jax.random.key(0))
    x = jnp.ones((1, K), w.dtype)
    print(f"device {jax.devices()[0].device_kind}; bf16 weights, CUPTI device time")
    print("case               kernels  us (median)   TB/s")
    report(f"sum {w.nbytes / 1e9:.2f} GB", jax.jit(lambda w: jnp.sum(w, 0, jnp.float32)),
           w.nbytes, args.reps, w)  # fmt: skip
    report(f"gemv {w.nbytes / 1e9:.2f} GB", jax.jit(lambda x, w: x @ w), w.nbytes, args.reps, x, w)
    report(f"copy {w.nbytes / 1e9:.2f} GB", jax.jit(lambda w: w + 1), 2 * w.nbytes, args.reps, w)
    del w
    for name, (rows, columns) in CORE_SHAPES.items():
        ws = weights(rows, columns, 2 * L2_BYTES, jax.random.key(1))
        xs = [jnp.full((1, rows), i + 1, jnp.bfloat16) for i in range(len(ws))]
        gemvs = jax.jit(lambda xs, ws: [x @ w for x, w in zip(xs, ws, strict=True)])
        nbytes = sum(w.nbytes for w in ws)
        report(f"gemv {name} x{len(ws)}", gemvs, nbytes, args.reps, xs, ws)


if __name__ == "__main__":
    main()
