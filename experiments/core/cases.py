"""The cases and implementations of `experiments.core`, from its flags, and the Core's config."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import jax.numpy as jnp
from absl import flags

from experiments import cli
from experiments.cli import UserError
from experiments.measure import memory
from experiments.torch_ref.core_runner import CUDA_ONLY_IMPLS, TORCH_IMPLS  # imports no torch
from huginn_jax import costs
from huginn_jax.config import PRESETS, HuginnConfig

FLAGS = flags.FLAGS

# XLA impls that are `xla` with other attention / decode settings of the model config.
XLA_VARIANTS = {
    "xla_cudnn": {"attention_impl": "cudnn", "decode_attention_impl": "cudnn"},
    "xla_split": {"decode_attention_impl": "xla_split"},
    "xla_pallas": {"decode_attention_impl": "pallas"},
    "xla_row_gemv": {"decode_attention_impl": "pallas", "decode_gemv": "pallas"},
    "xla_rows8": {"decode_attention_impl": "pallas", "decode_gemv": "xla_rows8"},
    "xla_mgpu": {"attention_impl": "mgpu", "decode_attention_impl": "pallas"},
}
GPU_ONLY_IMPLS = (*CUDA_ONLY_IMPLS, "xla_cudnn", "xla_mgpu")
XLA_IMPLS = ("xla", *XLA_VARIANTS)
# The Core's decode step in one persistent kernel (huginn_jax.persistent): decode cases only,
# where `why_not_persistent` lets it run (Pallas' GPU interpreter on a CPU).
PERSISTENT = "persistent"
JAX_IMPLS = (*XLA_IMPLS, PERSISTENT)
IMPLS = (*JAX_IMPLS, *TORCH_IMPLS)
MAX_POSITIONS = 1 << 20  # the Core's cache length limit (RoPE is computed, not tabled)


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
    grid = itertools.product(
        cli.names_in("mode", FLAGS.mode, ("decode", "prefill")),
        cli.positive_ints("batch", FLAGS.batch),
        cli.positive_ints("context", FLAGS.context),
        cli.positive_ints("iterations", FLAGS.iterations),
    )
    return [Case(*values) for values in grid]


def impls_from_flags() -> list[str]:
    """`--impls` without repeats, "torch" expanded to the five torch impls; UserError for an
    unknown name."""
    if not FLAGS.impls:
        raise UserError(f"--impls is empty: give one or more of torch, {', '.join(IMPLS)}")
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
    preset's block_size (decode at 4096), up to MAX_POSITIONS."""
    path, presets = Path(preset), ", ".join(PRESETS)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise UserError(f"--config={preset} is a directory without config.json")
        try:
            cfg = HuginnConfig.from_hf_json(path / "config.json")
        except ValueError as e:
            raise UserError(f"--config: {e}") from None
    elif path.exists():
        raise UserError(f"--config={preset} is a file; give its directory or a preset: {presets}")
    elif preset not in PRESETS and ("/" in preset or preset.startswith(".")):
        raise UserError(f"--config={preset}: no such directory (presets: {presets})")
    else:
        try:
            cfg = HuginnConfig.from_name(preset)
        except ValueError as e:
            raise UserError(f"--config: {e} (or a from_pretrained directory)") from None
    block_size = max(cfg.block_size, MAX_POSITIONS)
    return dataclasses.replace(
        cfg, n_layers_in_prelude=0, n_layers_in_coda=0, block_size=block_size
    )


def check_cases(cfg: HuginnConfig, cases: list[Case], impls: list[str], dtype_bytes: int) -> None:
    """UserError, before anything is allocated, for a case whose positions exceed the Core's
    cache (`block_size`) or whose largest case cannot fit in memory (`bytes_needed`)."""
    for case in cases:
        if case.max_len > cfg.block_size:
            raise UserError(
                f"--context={case.context}: a {case.mode} case holds {case.max_len} positions; "
                f"the Core's cache takes at most {cfg.block_size}"
            )
    worst = max(cases, key=lambda c: bytes_needed(cfg, c, impls, dtype_bytes))
    memory.check_fits(
        f"--context={worst.context}",
        f"{worst.mode} at batch {worst.batch} with {worst.iterations} iteration(s) (weights, "
        "KV cache, activations)",
        bytes_needed(cfg, worst, impls, dtype_bytes),
        hint="use a smaller --context, --batch or --iterations",
    )


def bytes_needed(cfg: HuginnConfig, case: Case, impls: list[str], dtype_bytes: int) -> int:
    """Device bytes one case needs, estimated: the adapter and Core weights, the KV cache (twice
    with a torch impl, which may copy it), and the largest temporaries: XLA's float32 attention
    scores and probabilities [B, H, T, T] in prefill, the MLP's [B, T, I] and one cache slot
    drawn in float32 in decode; with `persistent`, the weights' packed copy."""
    one = costs.totals(
        costs.core_iteration_ops(
            cfg, batch=case.batch, context=case.context, mode=case.mode, dtype_bytes=dtype_bytes
        )
    )
    slot = case.batch * case.max_len * cfg.n_heads * cfg.head_dim
    cache = 2 * slot * case.iterations * cfg.n_core * dtype_bytes
    tokens = case.batch * case.new_tokens
    scores = 2 * 4 * case.batch * cfg.n_heads * case.new_tokens * case.max_len
    temporaries = max(scores + 3 * tokens * cfg.intermediate_size * 4, 4 * slot)
    copies = 2 if any(i in TORCH_IMPLS for i in impls) else 1
    packed = one.param_bytes if PERSISTENT in impls else 0  # the weights packed for the kernel
    return one.param_bytes + packed + copies * cache + temporaries


def jax_dtype(name: str):
    """The JAX dtype of `--dtype` (bf16 or fp32)."""
    return jnp.bfloat16 if name == "bf16" else jnp.float32
