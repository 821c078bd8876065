"""The device probes behind the ceilings: how fast a device streams bytes it reads, and how fast
it multiplies bf16 matrices for a long time.

One implementation for `experiments.ceilings` (which stores the ceilings) and the tools that
print the same probes with extra cases (tools/hbm_read.py, tools/gemm_sustained.py):
  `device_time`   device time per call: CUPTI's kernel time (`experiments.measure.device_time`),
                  or, where CUPTI measures nothing (a CPU, a driver without it), the
                  wall time of calls dispatched back to back; the method is recorded either way;
  `read_probes`   over a bf16 weight W [K, N]: XLA's reduction of W over K, the GEMV
                  x [1, K] @ W (both read W once) and W + 1 into a new array (read + write);
                  on a Hopper GPU also W's bytes copied by TMA into every SM's shared memory
                  and nothing else done with them (`pallas_kernels.tma_read`, `tma_probe`);
  `gemm_times`    N square bf16 matmuls dispatched back to back, then one wait: the wall time
                  of the whole run, repeated after an idle pause (the clock recovers), for each N.
Sizes are the caller's: a weight much larger than L2 so that every call reads HBM, and enough
matmuls to keep the tensor cores busy for about as long as a long prefill does (the rate over a
short burst is higher: the clock has not yet settled).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from experiments.measure.device_time import cupti_us, wall_us

CUPTI = "cupti"
WALL = "wall"
# Calls per CUPTI sample (its median over them, i.e. their mean). Two, not one: with one
# iteration, jax 0.11.2's profiler.measure returns one call's kernel list unnested, which
# experiments.measure.device_time.cupti_us cannot read.
CUPTI_CALLS = 2


@dataclasses.dataclass(frozen=True)
class DeviceTime:
    """Per-call device time of one probe: `samples_us` (one per sample), how they were taken
    (`method`: "cupti", each sample the mean summed kernel time of `calls_per_sample` calls;
    "wall", each sample the wall time of `calls_per_sample` calls dispatched back to back, per
    call), kernels per call (CUPTI only) and a note."""

    samples_us: list[float]
    method: str
    kernels: int | None
    note: str
    calls_per_sample: int = 1

    def describe(self) -> str:
        """How the samples were taken, in words (for a results file)."""
        calls, samples = self.calls_per_sample, len(self.samples_us)
        if self.method == CUPTI:
            return f"CUPTI kernel time per call (mean of {calls} calls), median of {samples}"
        return f"wall time per call of {calls} calls back to back, median of {samples}"

    @property
    def median_us(self) -> float:
        return statistics.median(self.samples_us)


def probe_time(probe: Probe, reps: int) -> DeviceTime | None:
    """`device_time` of `probe`; None, with a line on stdout, where an optional probe fails."""
    try:
        return device_time(probe.fn, probe.args, reps)
    except Exception as e:  # an optional probe's failure is reported, not fatal
        if not probe.optional:
            raise
        print(f"{probe.name} left out: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return None


def device_time(
    fn: Callable[..., Any], args: Sequence[Any], reps: int, *, wall_calls: int = 10
) -> DeviceTime:
    """`reps` samples of the device time of one call `fn(*args)`: CUPTI when it measures the
    call, else wall time (the note says why CUPTI did not). Pass large arrays in `args`, not
    closed over, so that they stay arguments of the compiled function."""
    if reps < 1 or wall_calls < 1:
        raise ValueError(f"need reps >= 1 and wall_calls >= 1; got {reps=} {wall_calls=}")
    jax.block_until_ready(fn(*args))  # compile outside any measurement
    samples, kernels, note = [], None, ""
    for _ in range(reps):
        us, kernels, note = cupti_us(fn, CUPTI_CALLS, *args)
        if us is None:
            break
        samples.append(us)
    else:
        return DeviceTime(samples, CUPTI, kernels, note, CUPTI_CALLS)
    walls = [wall_us(lambda: fn(*args), wall_calls) for _ in range(reps)]
    return DeviceTime(walls, WALL, None, f"CUPTI unavailable ({note})", wall_calls)


def weights(rows: int, columns: int, total_bytes: int, key: jax.Array) -> list[jax.Array]:
    """Random bf16 [rows, columns] matrices, enough of them to reach `total_bytes` (at least
    one), each from its own key."""
    copies = max(1, -(-total_bytes // (rows * columns * 2)))
    return [
        jax.random.normal(k, (rows, columns), jnp.bfloat16) for k in jax.random.split(key, copies)
    ]


def stream_weight(nbytes: int, k: int, key: jax.Array) -> jax.Array:
    """A random bf16 W [k, N] of about `nbytes` (N = nbytes / 2 / k, at least 1)."""
    columns = max(1, nbytes // (2 * k))
    return jax.random.normal(key, (k, columns), jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class Probe:
    """One streaming probe: `fn(*args)`, and the bytes one call moves through HBM that count
    towards its rate (`read_only`: it writes next to nothing). `optional`: a probe whose
    failure (e.g. a kernel that does not compile on this device) is reported and left out,
    not one that stops the run."""

    name: str
    fn: Callable[..., Any]
    args: tuple
    nbytes: int
    read_only: bool
    what: str
    optional: bool = False


TMA_COLS, TMA_RING = 256, 4  # the persistent kernels' [64, 256] weight units, 128 KiB in flight


def tma_probe(w: jax.Array, *, cols: int = TMA_COLS, ring: int = TMA_RING) -> Probe | None:
    """W's bytes as [64, cols] units copied by TMA, `ring` in flight per SM, one worker per SM
    (`pallas_kernels.tma_read`); None where that cannot run: not a Hopper (or later) GPU, or W
    not whole units, or a GPU that does not report its SM count. W is reshaped inside the call
    (a bitcast: no copy)."""
    from pallas_kernels.tma_read import UNIT_ROWS, check_read, tma_read

    device = jax.devices()[0]
    capability = float(getattr(device, "compute_capability", None) or 0)
    workers = getattr(device, "core_count", None)
    if device.platform != "gpu" or capability < 9.0 or not workers or w.size % (UNIT_ROWS * cols):
        return None
    units = w.size // (UNIT_ROWS * cols)
    check_read(units, cols, workers, ring)
    fn = jax.jit(lambda w: tma_read(w.reshape(units, UNIT_ROWS, cols), workers=workers, ring=ring))
    what = f"W [{w.shape[0]}, {w.shape[1]}] bf16 as [{UNIT_ROWS}, {cols}] units, {ring} per SM"
    return Probe(
        "tma", fn, (w,), w.nbytes, True, f"{what} in flight by TMA, {workers} SMs", optional=True
    )


def read_probes(w: jax.Array) -> list[Probe]:
    """The probes over one weight W [K, N]: "sum" (W summed over K in float32, [N] out),
    "gemv" (x [1, K] @ W, x all ones), "copy" (W + 1 into a new array) and, where it runs,
    "tma" (`tma_probe`). Bytes counted: W for the read-only probes, 2 W for the copy; x and
    the [N] outputs are left out."""
    k, n = w.shape
    x = jnp.ones((1, k), w.dtype)
    shape = f"[{k}, {n}] bf16"
    return [
        Probe(
            "gemv",
            jax.jit(lambda x, w: x @ w),
            (x, w),
            w.nbytes,
            True,
            f"x [1, {k}] @ W {shape}",
        ),
        Probe(
            "sum",
            jax.jit(lambda w: jnp.sum(w, 0, jnp.float32)),
            (w,),
            w.nbytes,
            True,
            f"sum of W {shape} over K",
        ),
        Probe("copy", jax.jit(lambda w: w + 1), (w,), 2 * w.nbytes, False, f"W {shape} + 1"),
    ] + [probe for probe in (tma_probe(w),) if probe]


def square_operands(size: int, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two random bf16 [size, size] matrices (random, not zeros: the tensor cores draw less
    power on zeros and would run faster than on real data)."""
    ka, kb = jax.random.split(key)
    return (
        jax.random.normal(ka, (size, size), jnp.bfloat16),
        jax.random.normal(kb, (size, size), jnp.bfloat16),
    )


def gemm_times(
    size: int,
    counts: Sequence[int],
    *,
    repeats: int,
    idle_s: float,
    key: jax.Array | None = None,
    on_edge: Callable[[int, str], None] | None = None,
) -> dict[int, list[float]]:
    """{N: [seconds of one run, per repeat]} for each N in `counts`: a run dispatches N
    [size, size] @ [size, size] bf16 matmuls back to back and waits once at the end; before each
    repeat the device idles `idle_s` seconds. `on_edge(N, "start" | "end")` is called around the
    repeats of each N (e.g. to mark phases for a clock log)."""
    if size < 1 or repeats < 1 or idle_s < 0 or not counts or min(counts) < 1:
        raise ValueError(f"bad gemm probe: {size=} {counts=} {repeats=} {idle_s=}")
    a, b = square_operands(size, jax.random.key(0) if key is None else key)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, b).block_until_ready()
    times: dict[int, list[float]] = {}
    for n in counts:
        if on_edge:
            on_edge(n, "start")
        runs = []
        for _ in range(repeats):
            time.sleep(idle_s)
            t0 = time.perf_counter()
            for _ in range(n):
                out = matmul(a, b)
            out.block_until_ready()
            runs.append(time.perf_counter() - t0)
        if on_edge:
            on_edge(n, "end")
        times[n] = runs
    return times


def gemm_flops(size: int, count: int = 1) -> int:
    """FLOPs of `count` [size, size] @ [size, size] products (2 size^3 each)."""
    return 2 * size**3 * count
