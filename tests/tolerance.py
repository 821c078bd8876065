"""How close a GPU kernel's output must be to its reference: one rule for every such test.

The measure is ||out - ref|| / ||ref|| (Frobenius, float64), and the reference rounds where the
kernel rounds (the state to bf16 after each step, each step computed from the rounded state), so
only the order of the float32 sums differs. bf16 results: 3.5e-3 x sqrt(steps). After one step
only the outputs whose sum lands across a bf16 rounding boundary differ; in a chain each such
flip feeds the next step, and within a few steps the two chains round independently. Each step
then adds the difference of two independent bf16 roundings, 2^-7 sqrt(1/6) / sqrt(E[m^2])
~ 2.2e-3 RMS (2^-7: the spacing of bf16 mantissas m in [1, 2), E[m^2] = 3 / (2 ln 2)), and a
product with w ~ N(0, 1/d) keeps the norms of both state and error, so the errors add like a
random walk: ~2.2e-3 sqrt(steps). The bound allows 1.6 times that, for the spread of the norm
of a single-row state. float32 results: 2e-5, for sums of up to ~2e4 products in another order
(~sqrt(K) 2^-24 ~ 1e-6). A kernel that rounds where no reference can follow takes a `factor`,
justified where it is used. HUGINN_TOLERANCE_LOG=<file> appends "test error bound" per check.
"""

from __future__ import annotations

import math
import os

import numpy as np

BF16_STEP = 3.5e-3
FLOAT32_SUM = 2e-5
BASE = {"bfloat16": BF16_STEP, "float32": FLOAT32_SUM}


def rtol(steps: int = 1, *, dtype: str = "bfloat16", factor: float = 1.0) -> float:
    """The relative Frobenius bound for a result in `dtype` after `steps` chained roundings."""
    if steps < 1 or factor < 1:
        raise ValueError(f"need steps >= 1 and factor >= 1; got {steps=} {factor=}")
    return factor * BASE[dtype] * math.sqrt(steps)


def rel_fro(got, want) -> float:
    """||got - want|| / ||want||, both in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def assert_close(got, want, *, steps: int = 1, dtype: str = "bfloat16", factor: float = 1.0):
    """Fails unless rel_fro(got, want) <= rtol(steps, dtype=dtype, factor=factor)."""
    error, bound = rel_fro(got, want), rtol(steps, dtype=dtype, factor=factor)
    log = os.environ.get("HUGINN_TOLERANCE_LOG")
    if log:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"{test} {error:.3e} {bound:.3e}\n")
    assert error <= bound, (
        f"relative error {error:.3e} > {bound:.3e} ({steps=}, {dtype}, x{factor})"
    )


def bf16(a) -> np.ndarray:
    """`a` rounded to bfloat16 (to nearest, ties to even) and back to float64: a reference's
    rounding where the kernel rounds."""
    import ml_dtypes

    return np.asarray(a, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)
