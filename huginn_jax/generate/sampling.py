"""The next token from last-position logits: greedy, or temperature / top-k / top-p."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample_token(
    logits_BxV: jax.Array, key: jax.Array, *, temperature: float, top_k: int, top_p: float
) -> jax.Array:
    """Next token [B] int32: argmax when temperature == 0, else a draw from `key`.

    As the reference's `_sample_next_token`: softmax(logits / temperature); top-k zeroes
    probabilities below the k-th largest; top-p (on those probabilities, unrenormalised) drops
    tokens whose descending cumulative probability exceeds p, always keeping the most likely one;
    then renormalise and draw. top_k = 0 and top_p >= 1 switch those filters off.
    """
    if temperature == 0.0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    probs = jax.nn.softmax(logits_BxV.astype(jnp.float32) / temperature, axis=-1)
    if top_k > 0:
        kth_Bx1 = jax.lax.top_k(probs, top_k)[0][:, -1:]
        probs = jnp.where(probs < kth_Bx1, 0.0, probs)
    if top_p < 1.0:
        order_BxV = jnp.argsort(-probs, axis=-1)
        sorted_probs = jnp.take_along_axis(probs, order_BxV, axis=-1)
        drop_sorted = (jnp.cumsum(sorted_probs, axis=-1) > top_p).at[:, 0].set(False)
        rows = jnp.arange(probs.shape[0])[:, None]
        drop = jnp.zeros_like(drop_sorted).at[rows, order_BxV].set(drop_sorted)
        probs = jnp.where(drop, 0.0, probs)
    # categorical normalises, so the renormalisation is implicit; log(0) = -inf is never drawn.
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)
