"""What the pallas_kernels.looped_matmul test files share: the GPU marks, interpret mode, the
inputs, and the sizes that the GPU tests run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

ON_GPU = jax.devices()[0].platform == "gpu"
gpu = pytest.mark.gpu
requires_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (Mosaic GPU, sm_90)")
INTERPRET = plgpu.InterpretGPUParams()


def make_inputs(seed: int, m: int, d: int, steps: int | None = None):
    """x ~ N(0, 1), w ~ N(0, 1/d) (so |x| stays O(1) along the chain), both bf16."""
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, d), jnp.float32).astype(jnp.bfloat16)
    shape = (d, d) if steps is None else (steps, d, d)
    w = (jax.random.normal(kw, shape, jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
    return x, w


GPU_D = [
    2048,  # 32 blocks, every slice resident
    3520,  # 55 blocks: not a multiple of the SM count, nor of 128
    6144,  # 96 blocks, slices of 768 KiB: mostly streamed
    12288,  # 96 blocks x 128 columns, slices of 3 MiB
]
