"""Decode attention read straight from the stacked KV cache (Pallas, Triton backend).

One new position per sequence attends over the first `visible` positions of one cache slot.
The kernel takes the whole cache [slots, B, S, H * K] (a free reshape of the model's
[slots, B, S, H, K]) and the slot as a scalar, so no slot is sliced out: XLA materializes a
dynamic slice of the cache as a copy for any custom call (cuDNN's attention pays that copy at
every Core iteration), while `pallas_call` here reads the cache buffer in place.

Split-KV ("flash-decoding"): program (b, h, split) walks positions
[split * chunk, min((split + 1) * chunk, visible)) in blocks of `block_s` rows of K and V
(one row: the head's K contiguous values, loaded as the next power of two with the tail masked),
keeping a float32 online softmax (running max m, sum l, weighted values acc). The splits are
combined in XLA: out = sum_j acc_j e^(m_j - M) / sum_j l_j e^(m_j - M), M = max_j m_j.
Traffic: K and V of the visible positions read once from HBM (2 * visible * K * itemsize bytes
per (b, h)); q, the per-split partials and the output are negligible. Positions past `visible`
are not read at all. On chip: a block's K and V tiles, [block_s, next_pow2(K)] float32 each, in
registers. Triton pipelines the loads only within a split. Streaming rates against PyTorch's
SDPA: docs/decode_attention.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MASKED_SCORE = -1e30  # finite: a split with no visible position gets weight e^(-1e30 - M) = 0


def _kernel(slot_ref, visible_ref, q_ref, k_ref, v_ref, acc_ref, stats_ref, *, chunk, block_s):
    """q_ref [B, H, Kp] float32 (scaled, zero past K); k_ref, v_ref [slots, B, S, H * K];
    acc_ref [B, H, splits, Kp] float32; stats_ref [B, H, splits, 2] float32 (max, sum)."""
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    head_dim = k_ref.shape[-1] // q_ref.shape[1]
    padded = q_ref.shape[-1]
    slot, visible = slot_ref[()], visible_ref[()]
    cols = jnp.arange(padded)
    q = plgpu.load(q_ref.at[b, h, pl.ds(0, padded)])
    start = split * chunk
    stop = jnp.minimum(start + chunk, visible)
    blocks = pl.cdiv(jnp.maximum(stop - start, 0), block_s)

    def body(i, carry):
        acc, m, total = carry
        rows = start + i * block_s + jnp.arange(block_s)
        inside = (rows < stop)[:, None] & (cols < head_dim)[None, :]
        index = (slot, b, pl.ds(start + i * block_s, block_s), pl.ds(h * head_dim, padded))
        k = plgpu.load(k_ref.at[index], mask=inside, other=0.0).astype(jnp.float32)
        v = plgpu.load(v_ref.at[index], mask=inside, other=0.0).astype(jnp.float32)
        scores = jnp.where(rows < stop, jnp.sum(k * q[None, :], axis=1), MASKED_SCORE)
        m_next = jnp.maximum(m, jnp.max(scores))
        correction = jnp.exp(m - m_next)
        p = jnp.exp(scores - m_next)
        acc = acc * correction + jnp.sum(p[:, None] * v, axis=0)
        return acc, m_next, total * correction + jnp.sum(p)

    init = (jnp.zeros((padded,), jnp.float32), jnp.float32(MASKED_SCORE), jnp.float32(0.0))
    acc, m, total = lax.fori_loop(0, blocks, body, init)
    plgpu.store(acc_ref.at[b, h, split, pl.ds(0, padded)], acc)
    plgpu.store(stats_ref.at[b, h, split, pl.ds(0, 2)], jnp.where(jnp.arange(2) == 0, m, total))


@functools.partial(
    jax.jit, static_argnames=("splits", "block_s", "num_warps", "num_stages", "interpret")
)
def decode_attention_kernel(
    q_BxHxK: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    slot: jax.Array,
    visible: jax.Array,
    *,
    splits: int,
    block_s: int,
    num_warps: int = 4,
    num_stages: int = 1,
    interpret: bool = False,
) -> jax.Array:
    """softmax(q K^T / sqrt(K)) V over positions [0, visible) of cache slot `slot`.

    q [B, H, K]; k_cache, v_cache [slots, B, S, H, K] (any float dtype, read in place);
    slot, visible: int32 scalars. Returns [B, H, K] in the cache's dtype."""
    batch, heads, head_dim = q_BxHxK.shape
    num_slots, _, max_len, _, _ = k_cache.shape
    padded = pl.next_power_of_2(head_dim)
    chunk = pl.cdiv(pl.cdiv(max_len, splits), block_s) * block_s
    scale = 1.0 / jnp.sqrt(jnp.float32(head_dim))
    q = jnp.pad(q_BxHxK.astype(jnp.float32) * scale, ((0, 0), (0, 0), (0, padded - head_dim)))
    flat = (num_slots, batch, max_len, heads * head_dim)
    acc, stats = pl.pallas_call(
        functools.partial(_kernel, chunk=chunk, block_s=block_s),
        grid=(batch, heads, splits),
        out_shape=(
            jax.ShapeDtypeStruct((batch, heads, splits, padded), jnp.float32),
            jax.ShapeDtypeStruct((batch, heads, splits, 2), jnp.float32),
        ),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="decode_attention",
    )(
        jnp.asarray(slot, jnp.int32),
        jnp.asarray(visible, jnp.int32),
        q,
        k_cache.reshape(flat),
        v_cache.reshape(flat),
    )
    m, total = stats[..., 0], stats[..., 1]
    weight = jnp.exp(m - m.max(axis=-1, keepdims=True))
    out = (acc * weight[..., None]).sum(axis=2) / (total * weight).sum(axis=-1)[..., None]
    return out[..., :head_dim].astype(k_cache.dtype)
