"""How the kernel programs (experiments.kernels) and the device probes time one call.

`cupti_us`: the device time of the kernels one call launches, summed, median over `reps` calls
(CUPTI through Mosaic GPU's profiler); `wall_us`: the wall time per call of `reps` calls issued
back to back, after 2 warm-up calls, where CUPTI is unavailable or sees no kernel;
`torch_us`: a PyTorch call's time per call, CUDA events around calls issued back to back.
"""

from __future__ import annotations

import statistics
import time


def cupti_us(fn, reps: int, *args) -> tuple[float | None, int | None, str]:
    """(median us of the summed kernel time of one call `fn(*args)`, kernels per call, a note);
    None, None and the reason where CUPTI measured nothing. Pass large arrays as `args`: the
    profiler traces `fn`, so arrays it closes over become constants of the executable."""
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, runs = profiler.measure(fn, aggregate=False, iterations=reps)(*args)
        if not runs:
            return None, None, "CUPTI saw no kernels"
        if isinstance(runs[0], tuple):  # iterations=1: one run's (name, ms) pairs, not nested
            runs = [runs]
        total = statistics.median(sum(t for _, t in run) for run in runs) * 1e3
        return total, len(runs[0]), f"{len(runs[0])} kernel(s)"
    except Exception as e:  # CUPTI can be unavailable; wall-clock still prints
        return None, None, f"{type(e).__name__}: {e}"


def wall_us(fn, reps: int) -> float:
    """Wall time per call of `reps` calls issued back to back (us), after 2 warm-up calls."""
    import jax

    for _ in range(2):
        jax.block_until_ready(fn())
    t = time.perf_counter()
    outs = [fn() for _ in range(reps)]
    jax.block_until_ready(outs)
    return (time.perf_counter() - t) / reps * 1e6


def torch_us(fn, reps: int, *, warmup: int, calls: int, cuda: bool) -> list[float]:
    """`reps` samples of the time per call of `fn()` (PyTorch), after `warmup` calls: each the
    time between CUDA events recorded around `calls` calls issued back to back on the current
    stream, divided by `calls` (`cuda`), else their wall time. One untimed call before each
    sample keeps the stream busy, so that the first timed kernel is queued before the start
    event fires and the host's launch time is not counted."""
    import torch

    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        if not cuda:
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - t) / calls * 1e6)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls * 1e3)
    return samples
