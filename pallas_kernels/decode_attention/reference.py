"""Plain-JAX reference of decode attention over one cache slot: what the kernel must match."""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASKED_SCORE = -1e30  # finite, so a row with nothing visible cannot produce NaN


@jax.jit
def decode_attention_reference(q_BxHxK, k_cache, v_cache, slot, visible) -> jax.Array:
    """softmax(q K^T / sqrt(K)) V for one query per sequence over positions [0, visible) of cache
    slot `slot`. q [B, H, K]; k_cache, v_cache [slots, B, S, H, K] -> [B, H, K], the caches'
    dtype.

    q is cast to the caches' dtype; scores and softmax in float32, the probabilities cast to the
    value dtype for the second product (float32 operands: full float32 products, no TF32)."""
    k_BxSxHxK, v_BxSxHxK = k_cache[slot], v_cache[slot]
    q_BxHxK = q_BxHxK.astype(k_BxSxHxK.dtype)
    precision = jax.lax.Precision.HIGHEST if k_BxSxHxK.dtype == jnp.float32 else None
    scale = 1.0 / jnp.sqrt(jnp.float32(q_BxHxK.shape[-1]))
    scores_BxHxS = jnp.einsum(
        "bhk,bshk->bhs",
        q_BxHxK,
        k_BxSxHxK,
        precision=precision,
        preferred_element_type=jnp.float32,
    )
    inside_S = jnp.arange(k_BxSxHxK.shape[1]) < visible
    scores_BxHxS = jnp.where(inside_S, scores_BxHxS * scale, MASKED_SCORE)
    probs = jax.nn.softmax(scores_BxHxS, axis=-1).astype(v_BxSxHxK.dtype)
    return jnp.einsum("bhs,bshk->bhk", probs, v_BxSxHxK, precision=precision)
