"""The two timing measures the experiments use, and how their times are summarized and printed.

Method: call `fn` `warmup` times (compilation, autotuning and first-touch costs land there), then
`repeats` timed samples with `time.perf_counter`; a sample's time is divided by the units of work
it covers (`per_call` per call, e.g. chains), and the summary is the median with the p10-p90 and
min-max spread. Waiting means `jax.block_until_ready` on what `fn` returns, or a `sync` callable
such as `torch.cuda.synchronize`.
- `time_fn`, the waited call: one call, from the call until its results are ready. It includes
  the host's dispatch of the call and the wait; it also records when the call returned (the
  host's part: tracing checks, argument handling and launches, which a waited call pays before
  the device starts unless it launches as it goes).
- `time_back_to_back`: `calls` calls dispatched one after another, then one wait. Each call's
  dispatch overlaps the device's work of the calls before it (as in a decode loop that dispatches
  the next step before reading the last), so when the host is faster than the device it
  approaches the device's time per call.
Caches are NOT flushed between calls: data such as a weight matrix may stay in L2 from one call
to the next. That is deliberate: it is the warm-cache condition the profiling study measured.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Samples:
    """Per-repeat wall times in seconds per unit (one unit = `per_call`-th of a call);
    `returned`: for each repeat, the time until the call returned, before the wait (`time_fn`
    only), in the same unit."""

    seconds: list[float]
    warmup: int
    per_call: int = 1
    returned: list[float] | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def quantile(self, q: float) -> float:
        """Linear-interpolated quantile, q in [0, 1]."""
        xs = sorted(self.seconds)
        pos = q * (len(xs) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    @property
    def p10(self) -> float:
        return self.quantile(0.10)

    @property
    def p90(self) -> float:
        return self.quantile(0.90)

    def summary_us(self) -> dict[str, float]:
        """Median, p10, p90, min and max in microseconds per unit."""
        return {
            "median_us": self.median * 1e6,
            "p10_us": self.p10 * 1e6,
            "p90_us": self.p90 * 1e6,
            "min_us": min(self.seconds) * 1e6,
            "max_us": max(self.seconds) * 1e6,
        }

    @property
    def returned_median(self) -> float | None:
        """Median time until the call returned, seconds per unit; None where not recorded."""
        return None if self.returned is None else statistics.median(self.returned)

    def to_dict(self) -> dict[str, Any]:
        d = {
            "seconds": list(self.seconds),
            "warmup": self.warmup,
            "repeats": len(self.seconds),
            "per_call": self.per_call,
            **self.summary_us(),
        }
        if self.returned is not None:
            d["returned_seconds"] = list(self.returned)
            d["returned_median_us"] = self.returned_median * 1e6
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Samples:
        returned = d.get("returned_seconds")
        return cls(
            seconds=list(d["seconds"]),
            warmup=int(d["warmup"]),
            per_call=d["per_call"],
            returned=None if returned is None else list(returned),
        )


def wait(out: Any, sync: Callable[[], None] | None = None) -> None:
    """Blocks until the device work behind `out` is done: `sync()` when given (torch), else
    `jax.block_until_ready(out)`."""
    if sync is not None:
        sync()
        return
    import jax  # imported here so that torch-only callers need no JAX backend

    jax.block_until_ready(out)


def time_fn(
    fn: Callable[[], Any],
    *,
    warmup: int,
    repeats: int,
    sync: Callable[[], None] | None = None,
    per_call: int = 1,
) -> Samples:
    """Times `fn()`; returns seconds per unit for each of `repeats` calls after `warmup` calls,
    with the time until each call returned (`Samples.returned`).

    `sync`: called after `fn()` to wait for the device (e.g. `torch.cuda.synchronize`); when None,
    the JAX arrays `fn` returns are waited on with `jax.block_until_ready`.
    `per_call`: units of work one call performs (e.g. N chains in one executable); each sample is
    divided by it.
    """
    if warmup < 0 or repeats < 1 or per_call < 1:
        raise ValueError(
            f"need warmup >= 0, repeats >= 1, per_call >= 1; got {warmup=} {repeats=} {per_call=}"
        )

    for _ in range(warmup):
        wait(fn(), sync)
    seconds, returned = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        wait(out, sync)
        seconds.append((time.perf_counter() - t0) / per_call)
        returned.append((t1 - t0) / per_call)
    return Samples(seconds=seconds, warmup=warmup, per_call=per_call, returned=returned)


def time_back_to_back(
    fn: Callable[[], Any],
    *,
    warmup: int,
    repeats: int,
    calls: int,
    sync: Callable[[], None] | None = None,
    per_call: int = 1,
) -> Samples:
    """Times `calls` calls of `fn()` dispatched back to back, with one wait (`wait`, as in
    `time_fn`) on the last call's output; returns seconds per unit for each of `repeats` such
    runs, after `warmup` waited calls. A sample is the run's wall time / (`calls` * `per_call`).

    The wait covers the earlier calls only where the device runs the calls in order: one stream
    (torch, `sync`), or each call's input being the last call's output (a donated JAX cache).
    """
    if warmup < 0 or repeats < 1 or calls < 2 or per_call < 1:
        raise ValueError(
            "need warmup >= 0, repeats >= 1, calls >= 2, per_call >= 1; got "
            f"{warmup=} {repeats=} {calls=} {per_call=}"
        )
    for _ in range(warmup):
        wait(fn(), sync)
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls - 1):
            fn()
        wait(fn(), sync)
        seconds.append((time.perf_counter() - t0) / (calls * per_call))
    return Samples(seconds=seconds, warmup=warmup, per_call=per_call)


_TIME_UNITS = (("s", 1e6), ("ms", 1e3), ("µs", 1.0), ("ns", 1e-3))


def _time_unit(us: float) -> tuple[str, float]:
    """The largest unit in which `us` microseconds is at least 1 (ns below 1 ns)."""
    return next(((u, scale) for u, scale in _TIME_UNITS if abs(us) >= scale), _TIME_UNITS[-1])


def _digits(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def format_us(us: float | None) -> str:
    """A time given in µs, 3 significant digits in the unit its size calls for: 852101 ->
    '852 ms', 20.34 -> '20.3 µs'; '-' for None or NaN."""
    if us is None or us != us:
        return "-"
    unit, scale = _time_unit(us)
    return f"{_digits(us / scale)} {unit}"


def format_us_range(lo_us: float | None, hi_us: float | None) -> str:
    """Two times in µs as one range in the unit of the larger: (538, 855) -> '538-855 µs',
    (538, 1200) -> '0.538-1.2 ms'; '-' when either is missing."""
    if lo_us is None or hi_us is None or lo_us != lo_us or hi_us != hi_us:
        return "-"
    unit, scale = _time_unit(max(lo_us, hi_us))
    return f"{_digits(lo_us / scale)}-{_digits(hi_us / scale)} {unit}"
