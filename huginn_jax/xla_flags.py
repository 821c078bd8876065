"""XLA flags that a program chooses before JAX starts its backend.

`use_gemm("cublas")` turns XLA's Triton GEMM fusions off, so that every dot runs in cuBLAS. On the
H200 (2026-11-30, results/2026-11-30-h200/) XLA's Triton split-K GEMM for the 5280 x 5280
attention projection padded that weight to [5312, 5280] at every Core iteration of every layer
(138 us of a 1.34 ms decode iteration); with cuBLAS the iteration took 1.14 ms and the prefill
iteration 5.99 ms instead of 6.24 ms. "xla" keeps XLA's own choice.
"""

from __future__ import annotations

import os

GEMM_CHOICES = ("cublas", "xla")
TRITON_GEMM_OFF = "--xla_gpu_enable_triton_gemm=false"


def use_gemm(choice: str) -> None:
    """Selects how dots are compiled ("cublas" or "xla") for this process, through XLA_FLAGS.

    Raises ValueError for an unknown choice, and RuntimeError once the backend has started
    (XLA reads XLA_FLAGS only then).
    """
    from jax._src import xla_bridge

    if choice not in GEMM_CHOICES:
        raise ValueError(f"gemm={choice!r} must be one of {GEMM_CHOICES}")
    words = [w for w in os.environ.get("XLA_FLAGS", "").split() if w != TRITON_GEMM_OFF]
    if choice == "cublas":
        words.append(TRITON_GEMM_OFF)
    new = " ".join(words)
    if new == os.environ.get("XLA_FLAGS", ""):
        return
    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            f"gemm={choice!r} needs XLA_FLAGS set before JAX starts its backend; it has started"
        )
    os.environ["XLA_FLAGS"] = new
