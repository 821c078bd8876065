"""XLA flags that a program chooses before JAX starts its backend.

`use_gemm("cublas")` turns XLA's Triton GEMM fusions off, so that every dot runs in cuBLAS; "xla"
keeps XLA's own choice. Why cuBLAS is the programs' default: XLA's Triton split-K GEMM for the
5280 x 5280 attention projection pads that weight at every Core iteration of every layer.

`use_command_buffers(False)` turns XLA's command buffers (CUDA graphs) off, so that every kernel
is launched on its own. experiments.core keeps them on by default: the Core's decode iteration
is faster with them, although the first launch of a graph costs host time.

`add_flags("--name=value ...")` adds any other XLA flags (e.g. a program's `--xla_flags`), each
in place of a word of the same flag name already there, so that the last choice wins.

The measurements behind both defaults: docs/xla_flags.md.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

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


def add_flags(text: str) -> None:
    """Adds the words of `text` ("--name=value --other=value") to XLA_FLAGS for this process,
    each in place of any word there of the same flag name (one from `use_gemm` too), so that it
    wins. Raises ValueError for a word that is not "--name" or "--name=value", and RuntimeError
    once the backend has started."""
    words = text.split()
    for word in words:
        if not re.fullmatch(r"--\w+(=\S*)?", word):
            raise ValueError(f"{word!r} is not an XLA flag (--name or --name=value)")

    def edit(current: list[str]) -> list[str]:
        for word in words:
            name = word.partition("=")[0]
            current = [w for w in current if w.partition("=")[0] != name] + [word]
        return current

    _edit(edit, f"xla_flags={text!r}")


def _set_flag(word: str, present: bool, what: str) -> None:
    """Adds `word` to XLA_FLAGS (once) or removes it; a change after the backend started is an
    error naming `what`."""
    _edit(lambda words: [w for w in words if w != word] + ([word] if present else []), what)


def _edit(edit: Callable[[list[str]], list[str]], what: str) -> None:
    """XLA_FLAGS as `edit` makes its words; a change after the backend started is an error
    naming `what`."""
    from jax._src import xla_bridge

    old = os.environ.get("XLA_FLAGS", "")
    new = " ".join(edit(old.split()))
    if new == old:
        return
    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            f"{what} needs XLA_FLAGS set before JAX starts its backend; it has started"
        )
    os.environ["XLA_FLAGS"] = new
