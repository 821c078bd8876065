"""What a generation reports: bytes a decode step must move, peak memory, the statistics of a
run, and the per-part timing of one token (prelude, one Core iteration, coda + head)."""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from huginn_jax import costs
from huginn_jax.config import HuginnConfig
from huginn_jax.generate.exits import CRITERIA
from huginn_jax.generate.plan import Plan
from huginn_jax.kv_cache import KVCache
from huginn_jax.model import Huginn, embed, run_coda, run_core, run_prelude


def decode_step_bytes(
    config: HuginnConfig,
    *,
    batch: int,
    context: int,
    iterations: int,
    coda_runs: int = 1,
    dtype_bytes: int = 2,
) -> int:
    """HBM bytes one decode step must move (the cost model's counting rules, `costs`).

    `iterations` Core iterations (each re-reads Core + adapter weights and its KV entries of
    `context` cached positions), the prelude once, the coda and the tied head `coda_runs` times
    (an adaptive check runs them after every iteration). Each outer block counts like a Core
    layer: its weights, its K/V reads of `context` positions and its new K/V written.

    K/V count the heads the cache holds, `config.attention_heads`: under a mesh the zero-padded
    heads are stored, read and written like the others. Weights count once for the whole mesh
    (the checkpoint's parameters, without padding or replicas).
    """
    core = costs.totals(
        costs.core_iteration_ops(
            config, batch=batch, context=context, mode="decode", dtype_bytes=dtype_bytes
        )
    )  # K/V of n_heads
    per_head = batch * config.head_dim * dtype_bytes  # K or V of one head, one position
    padding = 2 * per_head * (config.attention_heads - config.n_heads) * (context + 1)
    kv_entry = per_head * config.attention_heads  # K or V, one position
    block = costs.block_param_count(config) * dtype_bytes + 2 * kv_entry * (context + 1)
    head = config.vocab_size * config.n_embd * dtype_bytes + batch * config.vocab_size * 4
    return (
        iterations * (core.hbm_bytes + config.n_core * padding)
        + config.n_layers_in_prelude * block
        + coda_runs * (config.n_layers_in_coda * block + head)
    )


def peak_memory_bytes(device=None) -> int | None:
    """The allocator's peak bytes in use on `device` (default: the first), or None (e.g. CPU)."""
    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        return None
    return None if not stats else stats.get("peak_bytes_in_use")


def generation_stats(
    model: Huginn, plan: Plan, *, steps, cache, compile_s, prefill_s, latencies
) -> dict[str, Any]:
    """Timings, throughput, bytes and memory of a finished run (the `stats` of a Generation)."""
    cfg, spec, prompt_len = model.config, plan.spec, plan.ids.shape[1]
    batch, new_tokens = steps.shape
    dtype_bytes = jnp.dtype(model.dtype).itemsize
    needs_logits = spec.criterion is not None and CRITERIA[spec.criterion].needs_logits
    # The batch runs as many iterations as its slowest sequence.
    iterations = steps.max(axis=0)
    step_bytes = [
        decode_step_bytes(
            cfg,
            batch=batch,
            context=prompt_len + n - 1,
            iterations=int(iterations[n]),
            coda_runs=int(iterations[n]) if needs_logits else 1,
            dtype_bytes=dtype_bytes,
        )
        for n in range(1, new_tokens)
    ]
    decode_s = sum(latencies)
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "num_steps": spec.num_steps,
        "criterion": spec.criterion or "none",
        "threshold": plan.threshold if spec.criterion else None,
        "min_steps": plan.min_steps,
        "strategy": plan.strategy,
        "continuous": plan.continuous,
        "temperature": spec.temperature,
        "top_k": spec.top_k,
        "top_p": spec.top_p,
        "seed": plan.seed,
        "init_scale": spec.init_scale,
        "dtype": str(jnp.dtype(model.dtype)),
        "cache_len": cache.max_len,
        "cache_bytes": cache.nbytes,
        "model_shards": cfg.model_shards,
        "kv_heads": cfg.attention_heads,  # the cache's heads, padded under a mesh: counted in bytes
        "weight_bytes": weights,
        "compile_s": compile_s,
        "prefill_s": prefill_s,
        "decode_latency_s": latencies,
        "latency_median_s": statistics.median(latencies) if latencies else None,
        "tokens_per_s": batch * len(latencies) / decode_s if latencies else None,
        "steps_per_token": float(steps.mean()),
        "decode_steps_per_token": float(steps[:, 1:].mean()) if new_tokens > 1 else None,
        "decode_step_bytes": step_bytes,
        "achieved_gb_s": sum(step_bytes) / decode_s / 1e9 if latencies else None,
        "peak_bytes_in_use": peak_memory_bytes(),
        "device": jax.local_devices()[0].device_kind,
    }


# --------------------------------------------------------------------------------------------
# Per-part timing (what a token's latency should be made of)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _prelude_jit(graphdef, params, ids_BxT, cache, start):
    m = nnx.merge(graphdef, params)
    return run_prelude(m, embed(m, ids_BxT), start, cache)


@functools.partial(jax.jit, static_argnames=("graphdef", "n"), donate_argnames=("cache",))
def _core_iterations_jit(graphdef, params, state, embedded, cache, start, *, n):
    return run_core(nnx.merge(graphdef, params), state, embedded, start, cache, n)


CORE_TIMING_ITERATIONS = 8  # Core iterations in the executable whose time is divided by them


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _coda_jit(graphdef, params, state, cache, start):
    logits, _, cache = run_coda(nnx.merge(graphdef, params), state, start, cache, last_only=True)
    return logits, cache


def time_parts(
    model: Huginn, cache: KVCache, position: int, *, warmup: int = 3, repeats: int = 20
) -> tuple[dict[str, float], KVCache]:
    """Median seconds of one decode token's parts at `position`: prelude and coda + head, each
    one compiled call, and ONE Core iteration (adapter + Core layers) as 1/n of an executable
    that runs n = CORE_TIMING_ITERATIONS of them (as experiments.core measures it: one dispatch
    per token-iteration would time the launch, not the GPU). Each call is timed until its
    outputs are ready, after `warmup` untimed calls; caches are not flushed. Overwrites the
    cache's entries at `position`; returns the cache (it is donated)."""
    graphdef, params = nnx.split(model)
    batch = cache.k.shape[1]
    start = jnp.int32(position)
    ids = jnp.zeros((batch, 1), jnp.int32)
    state = jnp.ones((batch, 1, model.config.n_embd), model.dtype)

    def timed(fn, *args, **static):
        nonlocal cache
        samples = []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            out, cache = fn(graphdef, params, *args, cache, start, **static)
            jax.block_until_ready((out, cache))
            if i >= warmup:
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples), out

    n = min(CORE_TIMING_ITERATIONS, cache.max_steps)
    prelude_s, embedded = timed(_prelude_jit, ids)
    core_s, _ = timed(_core_iterations_jit, state, embedded, n=n)
    coda_s, _ = timed(_coda_jit, state)
    core_s /= n
    return {"prelude_s": prelude_s, "core_iteration_s": core_s, "coda_head_s": coda_s}, cache
