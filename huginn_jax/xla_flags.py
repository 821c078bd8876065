"""XLA flags that a program chooses before JAX starts its backend.

`use_gemm("cublas")` turns XLA's Triton GEMM fusions off, so that every dot runs in cuBLAS. On the
H200 (2026-11-30, results/2026-11-30-h200/) XLA's Triton split-K GEMM for the 5280 x 5280
attention projection padded that weight to [5312, 5280] at every Core iteration of every layer
(138 us of a 1.34 ms decode iteration); with cuBLAS the iteration took 1.14 ms and the prefill
iteration 5.99 ms instead of 6.24 ms. "xla" keeps XLA's own choice.

`use_command_buffers(False)` turns XLA's command buffers (CUDA graphs) off, so that every kernel
is launched on its own. In a traced Core call (r = 8, decode) the first launch of the while
body's graph took 352 us on the host (later ones ~100 us), the GPU idle meanwhile
(`results/2026-11-30-h200/core_trace_xla_rows-decode-1-1024-8_session7.json.gz`); yet without
command buffers the decode iteration was 3-4 % slower (more time between kernels), so
experiments.core keeps them on by default (`core_{cb,nocb}_decode_session8.txt`).
"""

from __future__ import annotations

import os

GEMM_CHOICES = ("cublas", "xla")
TRITON_GEMM_OFF = "--xla_gpu_enable_triton_gemm=false"
COMMAND_BUFFERS_OFF = "--xla_gpu_enable_command_buffer="  # an empty list: no command buffers


def use_gemm(choice: str) -> None:
    """Selects how dots are compiled ("cublas" or "xla") for this process, through XLA_FLAGS.

    Raises ValueError for an unknown choice, and RuntimeError once the backend has started
    (XLA reads XLA_FLAGS only then).
    """
    if choice not in GEMM_CHOICES:
        raise ValueError(f"gemm={choice!r} must be one of {GEMM_CHOICES}")
    _set_flag(TRITON_GEMM_OFF, choice == "cublas", f"gemm={choice!r}")


def use_command_buffers(enabled: bool) -> None:
    """Keeps XLA's command buffers (its default) or turns them off for this process; raises
    RuntimeError once the backend has started."""
    _set_flag(COMMAND_BUFFERS_OFF, not enabled, f"command_buffers={enabled}")


def _set_flag(word: str, present: bool, what: str) -> None:
    """Adds `word` to XLA_FLAGS (once) or removes it; a change after the backend started is an
    error naming `what`."""
    from jax._src import xla_bridge

    old = os.environ.get("XLA_FLAGS", "")
    words = [w for w in old.split() if w != word]
    if present:
        words.append(word)
    new = " ".join(words)
    if new == old:
        return
    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            f"{what} needs XLA_FLAGS set before JAX starts its backend; it has started"
        )
    os.environ["XLA_FLAGS"] = new
