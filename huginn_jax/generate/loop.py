"""The token loop: a checked request (`make_plan`), compiled prefill and decode steps, and the
Python loop that dispatches one step per token and times it."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from huginn_jax.config import HuginnConfig
from huginn_jax.generate.exits import criterion_named
from huginn_jax.generate.stats import generation_stats, peak_memory_bytes
from huginn_jax.generate.step import StepOutput, StepSpec, compiled_step
from huginn_jax.kv_cache import KVCache, parse_strategy
from huginn_jax.model import Huginn


@dataclasses.dataclass(frozen=True)
class Generation:
    """What `generate` returns. Token 0 of every sequence comes from the prefill."""

    tokens: np.ndarray  # [B, N] int32: the new tokens
    steps: np.ndarray  # [B, N] int32: recurrence steps run for each new token
    exit_values: np.ndarray  # [B, N, M] float32: criterion value after each step (NaN: not run)
    logits: np.ndarray | None  # [B, N, V] float32 with return_logits, else None
    stats: dict[str, Any]  # timings, throughput, memory (see `generate`)
    cache: KVCache  # the final cache


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
) -> Plan:
    """Checks a request against `config` without touching weights (see `generate`).

    Raises ValueError with one clear sentence for an empty or out-of-vocabulary prompt, an
    unknown criterion or strategy, a prompt + max_new_tokens beyond the cache or block_size,
    and out-of-range settings."""
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
    cache_len = needed if cache_len is None else cache_len
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
    )


def generate(
    model: Huginn,
    input_ids,
    max_new_tokens: int,
    num_steps: int = 32,
    *,
    return_logits: bool = False,
    progress: bool = False,
    **settings,
) -> Generation:
    """Generates `max_new_tokens` tokens after `input_ids` ([T] or [B, T] int, no padding).

    `num_steps` and `settings` (`make_plan`'s keyword arguments):
    - `num_steps`: recurrence steps per token; with a `criterion` ("kl", "entropy-diff",
      "latent-diff", "argmax-stability"; None or "none" for a fixed count) the most steps, and a
      sequence exits once the criterion's value drops below `threshold` (argmax-stability: the
      argmax was unchanged for `threshold` steps) after at least `min_steps` steps.
    - Sampling: greedy for temperature == 0, else temperature / top_k / top_p; all randomness
      (sampling, random initial states for init_scale > 0) comes from `seed`.
    - `continuous`: each decoded token's recurrence starts from the previous position's final
      state (the prefill starts from s0).
    - `strategy`: KV cache layout, "full", "latest-m4" or "compress-sN" (see kv_cache); default
      "latest-m4" with a criterion (what adaptive exits need), else "full". `cache_len`: positions
      to allocate (default prompt + max_new_tokens, at most the model's block_size).
    - `attention_window`: a decode step reads the cache's filled positions rounded up to a
      multiple of this (one compiled decode step per window reached), not all cache_len of them;
      0 reads the whole cache at every step.

    Every argument is checked before any work (`make_plan`); bad ones raise ValueError. `stats`
    holds compile seconds (apart), the prefill time, per-token decode latencies and their median,
    tokens/s, steps per token, achieved GB/s over the bytes a decode step must move
    (`decode_step_bytes`), cache and weight bytes, and the peak device memory where reported.
    """
    plan = make_plan(model.config, input_ids, max_new_tokens, num_steps, **settings)
    return run_plan(model, plan, return_logits=return_logits, progress=progress)


def run_plan(
    model: Huginn, plan: Plan, *, return_logits: bool = False, progress: bool = False
) -> Generation:
    """Runs a checked request: compiles the prefill and decode steps, then the token loop."""
    cfg, spec = model.config, plan.spec
    batch, prompt_len = plan.ids.shape
    peak_before = peak_memory_bytes()  # weights loaded; tells a loading peak from a run's

    def new_cache():
        return KVCache.create(
            cfg,
            batch=batch,
            max_len=plan.cache_len,
            num_steps=spec.num_steps,
            dtype=model.dtype,
            strategy=plan.strategy,
        )

    # Compiled against the cache's shape before the cache exists: compilation (autotuning
    # scratch buffers included) never holds device memory next to it.
    cache_shape = jax.eval_shape(new_cache)
    graphdef, params = nnx.split(model)
    key = jax.random.key(plan.seed)
    exit_at = (jnp.float32(plan.threshold), jnp.int32(plan.min_steps))
    ids = jnp.asarray(plan.ids)
    prefill_spec = dataclasses.replace(spec, from_zero=True)
    prefill_args = (params, ids, None, cache_shape, jnp.int32(0), key, exit_at)
    prefill, compile_prefill = compiled_step(graphdef, prefill_spec, prefill_args)
    compile_decode = 0.0
    temp_bytes = {"prefill": _temp_bytes(prefill)}
    windows = plan.decode_windows()
    decode_steps = {}  # window -> compiled decode step
    if windows:
        prev_state = jnp.zeros((batch, cfg.n_embd), model.dtype) if plan.continuous else None
        token = jnp.zeros((batch,), jnp.int32)
        for window in sorted(set(windows)):
            decode_args = (
                params, token, prev_state, cache_shape.with_read_len(window), jnp.int32(0), key,
                exit_at,
            )  # fmt: skip
            decode_steps[window], seconds = compiled_step(graphdef, spec, decode_args)
            compile_decode += seconds
        reported = [t for t in map(_temp_bytes, decode_steps.values()) if t is not None]
        temp_bytes["decode"] = max(reported) if reported else None
    cache = new_cache()

    t0 = time.perf_counter()
    out = prefill(params, ids, None, cache, jnp.int32(0), key, exit_at)
    out.token.block_until_ready()
    prefill_s = time.perf_counter() - t0
    records = [_record(out, return_logits)]
    latencies = []
    bar = _progress_bar(plan.max_new_tokens, progress)
    bar.update(1)
    for window in windows:
        t0 = time.perf_counter()
        prev_state = out.state if plan.continuous else None
        cache, decode = out.cache.with_read_len(window), decode_steps[window]
        out = decode(params, out.token, prev_state, cache, out.next_start, key, exit_at)
        out.token.block_until_ready()  # per-token latency; the next step needs it anyway
        latencies.append(time.perf_counter() - t0)
        records.append(_record(out, return_logits))
        bar.update(1)
    bar.close()

    tokens, steps, values, logits = (
        None if parts[0] is None else np.stack([np.asarray(p) for p in parts], axis=1)
        for parts in zip(*records, strict=True)
    )
    stats = generation_stats(
        model,
        plan,
        steps=steps,
        cache=out.cache,
        compile_s={"prefill": compile_prefill, "decode": compile_decode},
        prefill_s=prefill_s,
        latencies=latencies,
    )
    stats["peak_bytes_before_generation"] = peak_before
    stats["executable_temp_bytes"] = temp_bytes
    stats["attention_windows"] = sorted(set(windows))
    return Generation(tokens, steps, values, logits, stats, out.cache.with_read_len(0))


def _temp_bytes(executable) -> int | None:
    """Scratch memory XLA assigned to a compiled step (None where the backend does not say)."""
    try:
        return int(executable.memory_analysis().temp_size_in_bytes)
    except Exception:  # memory_analysis is optional for a backend
        return None


def _record(out: StepOutput, with_logits: bool):
    return out.token, out.steps, out.exit_values, out.logits if with_logits else None


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, enabled: bool):
    """A tqdm bar over tokens on stderr; a no-op when disabled or tqdm is missing."""
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, unit="tok", dynamic_ncols=True, leave=False)


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
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy)")
    if not 0 <= top_k <= cfg.vocab_size:
        raise ValueError(f"top_k={top_k} must lie in [0, vocab_size={cfg.vocab_size}] (0: off)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must lie in (0, 1] (1: off)")
    if init_scale < 0:
        raise ValueError(f"init_scale={init_scale} must be >= 0")


def greedy(
    model: Huginn, prompt_ids: jax.Array, max_new_tokens: int, *, num_steps: int
) -> jax.Array:
    """Greedy decoding with a zero initial state and a `full` cache. Returns [B, max_new_tokens]."""
    out = generate(model, prompt_ids, max_new_tokens, num_steps, init_scale=0.0, strategy="full")
    return jnp.asarray(out.tokens)
