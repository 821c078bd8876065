"""A checked generation request: `make_plan` turns a prompt and settings into a `Plan` (or one
ValueError naming the bad value) without touching weights, so that every argument is refused
before any compilation; `loop.run_plan` runs it and `stats` reports on it."""

from __future__ import annotations

import dataclasses

import numpy as np

from huginn_jax.config import CORE_DECODE_IMPLS, HuginnConfig
from huginn_jax.generate.exits import criterion_named
from huginn_jax.generate.step import StepSpec
from huginn_jax.kv_cache import parse_strategy

# A decode step attends over the filled part of the preallocated cache rounded up to this many
# positions, not over all of it: one compiled decode step per window the request reaches.
ATTENTION_WINDOW = 512


@dataclasses.dataclass(frozen=True)
class Plan:
    """A checked generation request: everything `generate` needs besides the weights."""

    ids: np.ndarray  # [B, T] int32 prompt
    max_new_tokens: int
    spec: StepSpec
    strategy: str
    cache_len: int
    continuous: bool
    seed: int
    threshold: float  # exit threshold (unused without a criterion)
    min_steps: int
    attention_window: int = ATTENTION_WINDOW  # decode reads the cache in windows of this many
    core_decode: str = "xla"  # the decode steps' Core: one of config.CORE_DECODE_IMPLS
    persistent_schedule: str = ""  # the persistent kernel's schedule ('' = the case's default)

    def decode_windows(self) -> list[int]:
        """Cache positions each decode step reads, in order: the positions visible to it (all
        before and including its own) rounded up to `attention_window`, at most cache_len; all
        of them with attention_window 0."""
        prompt_len = self.ids.shape[1]
        return [
            attention_window(prompt_len + i, self.cache_len, self.attention_window)
            for i in range(1, self.max_new_tokens)
        ]


def attention_window(visible: int, cache_len: int, granule: int) -> int:
    """`visible` positions rounded up to a multiple of `granule`, at most cache_len (granule 0:
    cache_len)."""
    if granule == 0:
        return cache_len
    return min(cache_len, -(-visible // granule) * granule)


def make_plan(
    config: HuginnConfig,
    input_ids,
    max_new_tokens: int,
    num_steps: int = 32,
    *,
    criterion: str | None = None,
    threshold: float | None = None,
    min_steps: int = 0,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    init_scale: float = 1.0,
    continuous: bool = False,
    strategy: str | None = None,
    cache_len: int | None = None,
    attention_window: int = ATTENTION_WINDOW,
    core_decode: str = "xla",
    persistent_schedule: str = "",
) -> Plan:
    """Checks a request against `config` without touching weights (see `generate`).

    Raises ValueError with one clear sentence for an empty or out-of-vocabulary prompt, an
    unknown criterion, strategy or core_decode, a persistent_schedule without core_decode
    "persistent" or that does not parse, a prompt + max_new_tokens beyond the cache or
    block_size, and out-of-range settings."""
    if core_decode not in CORE_DECODE_IMPLS:
        raise ValueError(f"core_decode={core_decode!r} must be one of {CORE_DECODE_IMPLS}")
    schedule = None  # the persistent kernel's, which reads whole blocks of cached positions
    if core_decode == "persistent":
        from huginn_jax.persistent import cache_positions, schedule_named

        try:
            schedule = schedule_named(persistent_schedule)
        except ValueError as e:
            raise ValueError(f"persistent_schedule: {e}") from None
    elif persistent_schedule:
        raise ValueError(
            f"persistent_schedule={persistent_schedule!r} needs core_decode='persistent'"
        )
    ids = _check_prompt(input_ids, config)
    prompt_len = ids.shape[1]
    crit_name = None if criterion in (None, "none") else criterion
    crit = None if crit_name is None else criterion_named(crit_name)
    strategy = strategy or ("latest-m4" if crit is not None else "full")
    parse_strategy(strategy)
    if crit is not None and strategy == "full":
        raise ValueError(
            "adaptive exit needs cache strategy 'latest-m4' (or 'compress-sN'): with 'full', "
            "tokens that exited early have no entries for later steps"
        )
    _check_settings(
        config,
        max_new_tokens=max_new_tokens,
        num_steps=num_steps,
        min_steps=min_steps,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        init_scale=init_scale,
    )
    needed = prompt_len + max_new_tokens
    what = f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {needed} positions"
    if needed > config.block_size:
        raise ValueError(f"{what} exceed the model's block_size={config.block_size}")
    if cache_len is None:
        cache_len = needed
        if core_decode == "persistent":  # schedule None: the case's default
            cache_len = min(config.block_size, cache_positions(needed, schedule))
    if cache_len > config.block_size:
        raise ValueError(
            f"cache_len={cache_len} exceeds the model's block_size={config.block_size}"
        )
    if needed > cache_len:
        raise ValueError(f"{what} exceed the cache's capacity of cache_len={cache_len}")
    if attention_window < 0:
        raise ValueError(f"attention_window={attention_window} must be >= 0 (0: the whole cache)")
    if threshold is None:
        threshold = crit.default_threshold if crit is not None else 0.0
    spec = StepSpec(
        num_steps=num_steps,
        criterion=crit_name,
        init_scale=float(init_scale),
        temperature=float(temperature),
        top_k=top_k,
        top_p=float(top_p),
    )
    return Plan(
        ids,
        max_new_tokens,
        spec,
        strategy,
        cache_len,
        continuous,
        seed,
        float(threshold),
        min_steps,
        attention_window,
        core_decode,
        persistent_schedule,
    )


def _check_prompt(input_ids, cfg: HuginnConfig) -> np.ndarray:
    ids = np.asarray(input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be [tokens] or [batch, tokens], got shape {ids.shape}")
    if ids.shape[0] < 1 or ids.shape[1] < 1:
        raise ValueError(
            f"the prompt is empty (input_ids shape {ids.shape}); give at least a token"
        )
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids must be integers, got {ids.dtype}")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(
            f"token ids must lie in [0, {cfg.vocab_size}), got [{ids.min()}, {ids.max()}]"
        )
    return ids.astype(np.int32)


def _check_settings(
    cfg: HuginnConfig,
    *,
    max_new_tokens,
    num_steps,
    min_steps,
    temperature,
    top_k,
    top_p,
    init_scale,
):
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1")
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps} must be at least 1")
    if not 0 <= min_steps <= num_steps:
        raise ValueError(f"min_steps={min_steps} must lie in [0, num_steps={num_steps}]")
    if not temperature >= 0:  # NaN too
        raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy)")
    if not 0 <= top_k <= cfg.vocab_size:
        raise ValueError(f"top_k={top_k} must lie in [0, vocab_size={cfg.vocab_size}] (0: off)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must lie in (0, 1] (1: off)")
    if not init_scale >= 0:
        raise ValueError(f"init_scale={init_scale} must be >= 0")
