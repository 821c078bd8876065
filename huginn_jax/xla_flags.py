"""XLA flags that a program chooses before JAX starts its backend.

`use_gemm("cublas")` turns XLA's Triton GEMM fusions off, so that every dot runs in cuBLAS; "xla"
keeps XLA's own choice. Why cuBLAS is the programs' default: XLA's Triton split-K GEMM for the
5280 x 5280 attention projection pads that weight at every Core iteration of every layer.

`use_command_buffers(False)` turns XLA's command buffers (CUDA graphs) off, so that every kernel
is launched on its own. experiments.core keeps them on by default: the Core's decode iteration
is faster with them, although the first launch of a graph costs host time.

The measurements behind both defaults: docs/xla_flags.md.
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
