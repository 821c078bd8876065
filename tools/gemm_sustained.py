"""The bf16 GEMM rate in a burst and sustained: N back-to-back 8192^3 matmuls, for each N.

    python3 tools/gemm_sustained.py [--counts=10,100,400] [--phases=phases.txt]

shared/DEVICE.md's ceiling (~790 TFLOP/s) is the mean of ten matmuls after warm-up: a burst of
~14 ms. A Core prefill call at r = 8 keeps the tensor cores busy for ~45 ms, and a timing
loop for seconds, long enough for the board's power limit to lower the clock. Each N: matmuls
dispatched back to back, then one wait; TFLOP/s over the wall time, median of 5 repeats with a
second of idle before each. With --phases, writes 'HH:MM:SS.micro N=... start|end' lines for
tools/smi_phases.py.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import jax
import jax.numpy as jnp

SIZE = 8192
REPEATS = 5


def mark(path: str | None, name: str, edge: str) -> None:
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{datetime.datetime.now().strftime('%H:%M:%S.%f')} {name} {edge}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="10,100,400")
    parser.add_argument("--phases", default=None)
    args = parser.parse_args()
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (SIZE, SIZE), jnp.bfloat16)
    b = jax.random.normal(kb, (SIZE, SIZE), jnp.bfloat16)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, b).block_until_ready()
    flop = 2 * SIZE**3
    print(f"device {jax.devices()[0].device_kind}; {SIZE}^3 bf16 matmuls, back to back")
    print("N matmuls  busy ms  TFLOP/s median (min-max) of 5")
    for n in (int(c) for c in args.counts.split(",")):
        rates = []
        mark(args.phases, f"N={n}", "start")
        for _ in range(REPEATS):
            time.sleep(1.0)  # idle: the clock recovers between repeats
            t0 = time.perf_counter()
            for _ in range(n):
                out = matmul(a, b)
            out.block_until_ready()
            rates.append(n * flop / (time.perf_counter() - t0) / 1e12)
        mark(args.phases, f"N={n}", "end")
        busy_ms = n * flop / statistics.median(rates) / 1e9
        print(
            f"{n:9d}  {busy_ms:7.1f}  {statistics.median(rates):6.1f} "
            f"({min(rates):.1f}-{max(rates):.1f})"
        )


if __name__ == "__main__":
    main()
