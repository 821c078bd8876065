"""The token loop: compiled prefill and decode steps for a checked request (`plan.make_plan`), and
the Python loop that dispatches one step per token, each before the token of the step before is
read, and times the tokens."""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from huginn_jax.generate.plan import ATTENTION_WINDOW, Plan, make_plan
from huginn_jax.generate.stats import generation_stats, peak_memory_bytes
from huginn_jax.generate.step import StepOutput, compiled_step
from huginn_jax.kv_cache import KVCache
from huginn_jax.model import Huginn

# Re-exported: `cli` imports ATTENTION_WINDOW and make_plan from here.
__all__ = ["ATTENTION_WINDOW", "Generation", "Plan", "generate", "greedy", "make_plan", "run_plan"]


@dataclasses.dataclass(frozen=True)
class Generation:
    """What `generate` returns. Token 0 of every sequence comes from the prefill."""

    tokens: np.ndarray  # [B, N] int32: the new tokens
    steps: np.ndarray  # [B, N] int32: recurrence steps run for each new token
    exit_values: np.ndarray  # [B, N, M] float32: criterion value after each step (NaN: not run)
    logits: np.ndarray | None  # [B, N, V] float32 with return_logits, else None
    stats: dict[str, Any]  # timings, throughput, memory (see `generate`)
    cache: KVCache  # the final cache


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
    - `core_decode`: "xla" (`run_core`) or "persistent": the decode steps' Core iterations in
      the persistent kernel (`huginn_jax.persistent`; the Core's weights packed once per call,
      cache_len rounded up to whole blocks of the schedule's cached positions, 64 by default).
      `persistent_schedule`: the kernel's schedule as `fused_plan.Schedule.parse` reads it ('':
      the case's, `persistent.default_schedule`). Where it cannot run (an exit criterion, the
      device, the shapes: `why_not_persistent`) the decode steps run "xla" and one line on
      stderr says why.

    Every argument is checked before any work (`make_plan`); bad ones raise ValueError. `stats`
    holds compile seconds (apart), the prefill time, per-token decode latencies (the time between
    consecutive tokens being ready, each step dispatched before the token before it is read) and
    their median, tokens/s, steps per token, achieved GB/s over the bytes a decode step must move
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
    persistent, fallback = persistent_core(model, plan, cache_shape) if windows else (None, None)
    if windows:
        prev_state = jnp.zeros((batch, cfg.n_embd), model.dtype) if plan.continuous else None
        token = jnp.zeros((batch,), jnp.int32)
        for window in sorted(set(windows)):
            decode_args = (
                params, token, prev_state, cache_shape.with_read_len(window), jnp.int32(0), key,
                exit_at, persistent,
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
    # Each step is dispatched before the token of the step before is read, so the host's
    # dispatch runs while the device decodes; a token's latency is the time from the token
    # before it being ready to it being ready (inter-token latency).
    ready = time.perf_counter()
    pending = None
    for window in windows:
        prev_state = out.state if plan.continuous else None
        cache, decode = out.cache.with_read_len(window), decode_steps[window]
        out = decode(params, out.token, prev_state, cache, out.next_start, key, exit_at, persistent)
        records.append(_record(out, return_logits))
        if pending is not None:
            ready = _wait(pending, ready, latencies, bar)
        pending = out
    if pending is not None:
        _wait(pending, ready, latencies, bar)
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
    stats["core_decode"] = "xla" if persistent is None else "persistent"
    stats["core_decode_fallback"] = fallback
    stats["persistent_schedule"] = None if persistent is None else str(persistent.schedule)
    return Generation(tokens, steps, values, logits, stats, out.cache.with_read_len(0))


def persistent_core(model: Huginn, plan: Plan, cache) -> tuple[Any, str | None]:
    """(the Core packed for the persistent decode steps, None) when the plan asks for them and
    they can run; else (None, why not), the reason also printed as one line on stderr. `cache`:
    the cache's shape (`jax.eval_shape`)."""
    if plan.core_decode != "persistent":
        return None, None
    from huginn_jax import persistent

    batch = plan.ids.shape[0]
    schedule = persistent.schedule_named(plan.persistent_schedule)
    if plan.spec.criterion is not None:
        reason = (
            f"the exit criterion {plan.spec.criterion!r} runs a number of iterations per "
            "sequence; the persistent Core runs a fixed count"
        )
    else:
        reason = persistent.why_not_persistent(
            model.config, batch, cache, num_steps=plan.spec.num_steps, schedule=schedule
        )
    if reason is not None:
        print(f"core_decode=persistent: decoding with xla instead: {reason}", file=sys.stderr)
        return None, reason
    prepared = persistent.PersistentCore.prepare(model, batch, schedule=schedule)
    if prepared.interpret is not None:
        print("core_decode=persistent: no GPU, the kernel runs interpreted (slow)", file=sys.stderr)
    return prepared, None


def _wait(out: StepOutput, ready: float, latencies: list[float], bar) -> float:
    """Waits for `out`'s token; appends the time since `ready` (the token before it was ready)
    to `latencies` and returns the time now."""
    out.token.block_until_ready()
    now = time.perf_counter()
    latencies.append(now - ready)
    bar.update(1)
    return now


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
    """A tqdm bar over tokens on stderr; a no-op when disabled."""
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="tok", dynamic_ncols=True, leave=False)


def greedy(
    model: Huginn, prompt_ids: jax.Array, max_new_tokens: int, *, num_steps: int
) -> jax.Array:
    """Greedy decoding with a zero initial state and a `full` cache. Returns [B, max_new_tokens]."""
    out = generate(model, prompt_ids, max_new_tokens, num_steps, init_scale=0.0, strategy="full")
    return jnp.asarray(out.tokens)
