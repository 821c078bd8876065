"""The cases and implementations of `experiments.core`, from its flags, and the Core's config."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import jax.numpy as jnp
from absl import flags

from experiments import cli
from experiments.cli import UserError
from experiments.torch_ref.core_runner import CUDA_ONLY_IMPLS, TORCH_IMPLS  # imports no torch
from huginn_jax.config import HuginnConfig

FLAGS = flags.FLAGS

# XLA impls that are `xla` with other attention / decode settings of the model config.
XLA_VARIANTS = {
    "xla_cudnn": {"attention_impl": "cudnn", "decode_attention_impl": "cudnn"},
    "xla_split": {"decode_attention_impl": "xla_split"},
    "xla_pallas": {"decode_attention_impl": "pallas"},
    "xla_row_gemv": {"decode_attention_impl": "pallas", "decode_gemv": "pallas"},
    "xla_mgpu": {"attention_impl": "mgpu", "decode_attention_impl": "pallas"},
}
GPU_ONLY_IMPLS = (*CUDA_ONLY_IMPLS, "xla_cudnn", "xla_mgpu")
XLA_IMPLS = ("xla", *XLA_VARIANTS)
IMPLS = (*XLA_IMPLS, *TORCH_IMPLS)


@dataclasses.dataclass(frozen=True)
class Case:
    """One measured shape: decode (one new position over `context` cached ones) or prefill
    (`context` new positions from 0), `batch` sequences, `iterations` Core iterations a call."""

    mode: str
    batch: int
    context: int
    iterations: int

    @property
    def new_tokens(self) -> int:
        return 1 if self.mode == "decode" else self.context

    @property
    def start(self) -> int:
        return self.context if self.mode == "decode" else 0

    @property
    def max_len(self) -> int:
        return self.context + self.new_tokens if self.mode == "decode" else self.context

    def spec(self) -> str:
        """ "mode:batch:context:iterations", as `--ncu_child` and file names carry it."""
        return f"{self.mode}:{self.batch}:{self.context}:{self.iterations}"


def cases_from_flags() -> list[Case]:
    """Every mode x batch x context x iterations of the flags; UserError for a bad value."""
    for mode in FLAGS.mode:
        if mode not in ("decode", "prefill"):
            raise UserError(f"--mode={mode}: expected decode or prefill")
    grid = itertools.product(
        FLAGS.mode,
        cli.positive_ints("batch", FLAGS.batch),
        cli.positive_ints("context", FLAGS.context),
        cli.positive_ints("iterations", FLAGS.iterations),
    )
    return [Case(*values) for values in grid]


def impls_from_flags() -> list[str]:
    """`--impls` without repeats, "torch" expanded to the five torch impls; UserError for an
    unknown name."""
    names = []
    for name in FLAGS.impls:
        expanded = TORCH_IMPLS if name == "torch" else (name,)
        for impl in expanded:
            if impl not in IMPLS:
                raise UserError(f"--impls: unknown {impl!r}; known: torch, {', '.join(IMPLS)}")
            names.append(impl)
    return list(dict.fromkeys(names))


def core_config(preset: str) -> HuginnConfig:
    """The preset's (or checkpoint directory's) config without prelude and coda layers, so that
    caches hold Core slots only. RoPE is computed on the fly, so positions may run past the
    preset's block_size (decode at 4096)."""
    if Path(preset).is_dir():
        if not (Path(preset) / "config.json").exists():
            raise UserError(f"--config={preset} is a directory without config.json")
        cfg = HuginnConfig.from_hf_json(Path(preset) / "config.json")
    else:
        try:
            cfg = HuginnConfig.from_name(preset)
        except ValueError as e:
            raise UserError(f"{e} (or pass a from_pretrained directory)") from None
    return dataclasses.replace(
        cfg, n_layers_in_prelude=0, n_layers_in_coda=0, block_size=max(cfg.block_size, 1 << 20)
    )


def jax_dtype(name: str):
    """The JAX dtype of `--dtype` (bf16 or fp32)."""
    return jnp.bfloat16 if name == "bf16" else jnp.float32
