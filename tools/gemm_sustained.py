"""The bf16 GEMM rate in a burst and sustained: N back-to-back 8192^3 matmuls, for each N.

    python3 tools/gemm_sustained.py [--counts=10,100,400] [--phases=phases.txt]

A short burst (a few matmuls after warm-up) runs faster than a long prefill or a timing loop of
seconds: the SM clock falls once the tensor cores stay busy (with --phases, tools/smi_phases.py
shows clock and power per phase). Each N: matmuls dispatched back to back, then one wait;
TFLOP/s over the wall time, median of 5 repeats with a second of idle before each. The same
measurement as the sustained ceiling of `python -m experiments.ceilings`
(experiments.measure.probes.gemm_times). With --phases, writes 'HH:MM:SS.micro N=... start|end'
lines for tools/smi_phases.py.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics

import jax

from experiments.measure import probes

SIZE = 8192
REPEATS = 5


def mark(path: str | None, count: int, edge: str) -> None:
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{datetime.datetime.now().strftime('%H:%M:%S.%f')} N={count} {edge}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="10,100,400")
    parser.add_argument("--phases", default=None)
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    times = probes.gemm_times(
        SIZE, counts, repeats=REPEATS, idle_s=1.0, on_edge=functools.partial(mark, args.phases)
    )
    print(f"device {jax.devices()[0].device_kind}; {SIZE}^3 bf16 matmuls, back to back")
    print("N matmuls  busy ms  TFLOP/s median (min-max) of 5")
    for n, seconds in times.items():
        rates = [probes.gemm_flops(SIZE, n) / s / 1e12 for s in seconds]
        busy_ms = statistics.median(seconds) * 1e3
        print(
            f"{n:9d}  {busy_ms:7.1f}  {statistics.median(rates):6.1f} "
            f"({min(rates):.1f}-{max(rates):.1f})"
        )


if __name__ == "__main__":
    main()
