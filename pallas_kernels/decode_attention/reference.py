"""Plain-JAX reference of decode attention over one cache slot: what the kernel must match."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from huginn_jax.layers import attend


@jax.jit
def decode_attention_reference(q_BxHxK, k_cache, v_cache, slot, visible) -> jax.Array:
    """`huginn_jax.layers.attend` for one query over positions [0, visible) of `slot`.
    q [B, H, K]; k_cache, v_cache [slots, B, S, H, K] -> [B, H, K]."""
    k, v = k_cache[slot], v_cache[slot]
    positions = jnp.arange(k.shape[1], dtype=jnp.int32)
    out = attend(q_BxHxK[:, None].astype(k.dtype), k, v, jnp.reshape(visible - 1, (1,)), positions)
    return out[:, 0]
