"""Generation. For now: a minimal greedy loop over the KV cache (prefill, then one token a step)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from huginn_jax.kv_cache import KVCache
from huginn_jax.model import Huginn


def greedy(
    model: Huginn, prompt_ids: jax.Array, max_new_tokens: int, *, num_steps: int
) -> jax.Array:
    """Greedy decoding with a zero initial state and a `full` cache. Returns [B, max_new_tokens]."""
    prompt_ids = jnp.asarray(prompt_ids)
    batch, prompt_len = prompt_ids.shape
    cache = KVCache.create(
        model.config,
        batch=batch,
        max_len=prompt_len + max_new_tokens,
        num_steps=num_steps,
        dtype=model.dtype,
    )
    out = model(prompt_ids, num_steps=num_steps, init_scale=0.0, cache=cache, start=0)
    tokens = [jnp.argmax(out.logits[:, -1], axis=-1)]
    for position in range(prompt_len, prompt_len + max_new_tokens - 1):
        out = model(
            tokens[-1][:, None],
            num_steps=num_steps,
            init_scale=0.0,
            cache=out.cache,
            start=position,
        )
        tokens.append(jnp.argmax(out.logits[:, -1], axis=-1))
    return jnp.stack(tokens, axis=1)
