"""The small ChainConfig that the experiments.chain test files build their chains from."""

from __future__ import annotations

from experiments.chain import options


def small_config(d: int = 128, steps: int = 4, dtype: str = "bfloat16") -> options.ChainConfig:
    return options.ChainConfig(d=d, steps=steps, batch=1, dtype=dtype, seed=0, size_bytes=0)
