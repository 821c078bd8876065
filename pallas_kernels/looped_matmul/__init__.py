"""Looped matmul x <- x @ w, `steps` times, in one persistent Mosaic GPU kernel.

Public entry points (jitted, shapes and `steps`/`config`/`interpret` static):
- `looped_matmul(x, w, steps)`: x [M, d] bf16 (1 <= M <= 64), w [d, d] bf16 -> [M, d] bf16.
- `looped_matmul_copies(x, w_stacked)`: w_stacked [steps, d, d] bf16, step s uses w_stacked[s].
Each step accumulates in float32 and rounds the state to bf16, as the unfused chain
(`reference.py`) does. Two kernels, chosen by the config's type:
- `LoopedMatmulConfig` -> `kernel.py` ("resident"): blocks own whole columns, weight resident in
  shared memory or streamed; also runs stacked weights.
- `SplitKConfig` -> `splitk_kernel.py` ("splitk", the default): 2-D split over all SMs, weight
  in registers + shared memory + L2, f32 partial sums reduced by TMA; its schedule is
  `splitk_plan.py`, its picker `splitk_pick.py`.
See each kernel's module docstring for its design and traffic per step, and
docs/looped_matmul.md for the measurements behind both.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.looped_matmul.config import (
    DeviceInfo,
    LoopedMatmulConfig,
    check_state_rows,
    describe,
    pick_config,
)
from pallas_kernels.looped_matmul.kernel import looped_matmul_kernel
from pallas_kernels.looped_matmul.reference import (
    looped_matmul_copies_reference,
    looped_matmul_reference,
)
from pallas_kernels.looped_matmul.splitk_config import SplitKConfig, describe_splitk
from pallas_kernels.looped_matmul.splitk_kernel import looped_matmul_splitk
from pallas_kernels.looped_matmul.splitk_pick import pick_splitk_config

# The kernel `config=None` runs: split-K, faster than the resident kernel at every measured
# shape (docs/looped_matmul.md); the resident kernel where no split-K tiling fits (e.g. M=64 at
# d=6144) and for stacked weights.
DEFAULT_VARIANT = "splitk"
VARIANTS = ("resident", "splitk")

__all__ = [
    "DEFAULT_VARIANT",
    "VARIANTS",
    "DeviceInfo",
    "LoopedMatmulConfig",
    "SplitKConfig",
    "describe",
    "describe_config",
    "device_supported",
    "looped_matmul",
    "looped_matmul_copies",
    "looped_matmul_copies_reference",
    "looped_matmul_reference",
    "pick_any_config",
    "pick_config",
    "pick_splitk_config",
]

AnyConfig = LoopedMatmulConfig | SplitKConfig


def pick_any_config(
    m: int,
    d: int,
    *,
    stacked: bool = False,
    device: DeviceInfo | None = None,
    variant: str | None = None,
) -> AnyConfig:
    """The frozen tuning of `variant` ("resident" or "splitk"); None: DEFAULT_VARIANT's, or the
    resident kernel's where no tiling of the default fits."""
    if variant is None:
        try:
            return pick_any_config(m, d, stacked=stacked, device=device, variant=DEFAULT_VARIANT)
        except ValueError:  # no tiling of the default kernel fits: the other one
            return pick_config(m, d, stacked=stacked, device=device)
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} must be one of {VARIANTS}")
    if variant == "splitk" and not stacked:
        return pick_splitk_config(m, d, device=device)
    return pick_config(m, d, stacked=stacked, device=device)


def describe_config(cfg: AnyConfig, m: int, d: int) -> str:
    """One line for either kernel's config."""
    if isinstance(cfg, SplitKConfig):
        return describe_splitk(cfg, m, d)
    return "resident: " + describe(cfg, m, d)


def device_supported(dev: Any = None) -> bool:
    """True on a GPU that Mosaic GPU compiles for (sm_90 or newer: wgmma, TMA)."""
    dev = dev or jax.devices()[0]
    cc = getattr(dev, "compute_capability", None)
    return dev.platform == "gpu" and cc is not None and int(str(cc).split(".")[0]) >= 9


def _check_device(interpret: Any) -> None:
    if interpret is not None:
        return
    dev = jax.devices()[0]
    if not device_supported(dev):
        raise ValueError(
            "looped_matmul needs a GPU with Mosaic GPU (sm_90 or newer: wgmma, TMA); found "
            f"{dev.platform} {getattr(dev, 'device_kind', '')!r}. Pass "
            "interpret=plgpu.InterpretGPUParams() to run it on CPU (one block or one step)."
        )


def _check_inputs(x: jax.Array, w: jax.Array, steps: int, stacked: bool) -> tuple[int, int]:
    if x.ndim != 2:
        raise ValueError(f"x must be [M, d], got shape {x.shape}")
    m, d = x.shape
    want = (steps, d, d) if stacked else (d, d)
    if w.shape != want:
        name = "w_stacked" if stacked else "w"
        raise ValueError(f"{name} must have shape {want} for x of shape {x.shape}, got {w.shape}")
    for name, a in (("x", x), ("w", w)):
        if a.dtype != jnp.bfloat16:
            raise ValueError(
                f"{name} must be bfloat16 (the kernel's wgmma and state are bf16), got {a.dtype}"
            )
    check_state_rows(m)
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} must be an int >= 1")
    if d % 64:
        raise ValueError(f"d={d} must be a multiple of 64 (64-column wgmma tiles)")
    return m, d


def _run(
    x: jax.Array,
    w: jax.Array,
    steps: int,
    config: AnyConfig | None,
    interpret: Any,
    stacked: bool,
) -> jax.Array:
    m, d = _check_inputs(x, w, steps, stacked)
    _check_device(interpret)
    device = DeviceInfo.current() if interpret is None else DeviceInfo()
    cfg = config or pick_any_config(m, d, stacked=stacked, device=device)
    cfg.validate(m, d, steps, stacked=stacked, device=device)
    if isinstance(cfg, SplitKConfig):
        return looped_matmul_splitk(x, w, steps=steps, cfg=cfg, interpret=interpret)
    return looped_matmul_kernel(x, w, steps=steps, cfg=cfg, stacked=stacked, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("steps", "config", "interpret"))
def looped_matmul(
    x: jax.Array,
    w: jax.Array,
    steps: int,
    *,
    config: AnyConfig | None = None,
    interpret: Any = None,
) -> jax.Array:
    """x <- x @ w, `steps` times, one launch. x [M, d] bf16, w [d, d] bf16 -> [M, d] bf16.

    `config=None` picks the frozen tuning of DEFAULT_VARIANT for (M, d) (`pick_any_config`);
    a `SplitKConfig` runs the split-K kernel. Raises ValueError naming the broken limit (shape,
    dtype, M range, d multiple of 64, SM count, shared memory, registers, no GPU).
    """
    return _run(x, w, steps, config, interpret, stacked=False)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def looped_matmul_copies(
    x: jax.Array,
    w_stacked: jax.Array,
    *,
    config: AnyConfig | None = None,
    interpret: Any = None,
) -> jax.Array:
    """x <- x @ w_stacked[s] for s in range(steps). w_stacked [steps, d, d] bf16; one launch."""
    if w_stacked.ndim != 3:
        raise ValueError(f"w_stacked must be [steps, d, d], got shape {w_stacked.shape}")
    return _run(x, w_stacked, w_stacked.shape[0], config, interpret, stacked=True)
