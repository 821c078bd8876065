"""Decode attention over the model's stacked KV cache, read in place (Pallas, Triton backend).

Public entry point: `decode_attention(q, k_cache, v_cache, slot, visible)`: one query per
sequence, q [B, H, K], over positions [0, visible) of cache slot `slot` (k_cache, v_cache
[slots, B, S, H, K]) -> [B, H, K]. On a machine without a GPU the kernel runs in interpret mode.
Its plain-JAX reference: `reference.py`. The model calls it for
`HuginnConfig(decode_attention_impl="pallas")` (`huginn_jax.ops`); this package imports nothing
of the model. Design and traffic: `kernel.py`.
"""

from __future__ import annotations

import dataclasses

import jax

from pallas_kernels.decode_attention.kernel import decode_attention_kernel
from pallas_kernels.decode_attention.reference import decode_attention_reference

__all__ = [
    "DecodeAttentionConfig",
    "decode_attention",
    "decode_attention_reference",
    "pick_config",
]

MAX_HEAD_DIM = 256  # a block's K and V rows are held in registers, padded to a power of two


@dataclasses.dataclass(frozen=True)
class DecodeAttentionConfig:
    """Frozen tuning (NVIDIA H200, 132 SMs): `splits` chunks of the cache per (b, h), each
    walked in blocks of `block_s` positions by `num_warps` warps, Triton pipelining the loads
    over `num_stages` blocks."""

    splits: int
    block_s: int = 32
    num_warps: int = 4
    num_stages: int = 2


# Tuned on the H200: 4 programs per SM with DecodeAttentionConfig's defaults (blocks of 32, 4
# warps, 2 stages) stays close to the best tuning at B = 1, 8 x S = 1024, 4096
# (docs/decode_attention.md).
PROGRAMS_PER_SM = 4
H200_SMS = 132


def pick_config(
    batch: int,
    heads: int,
    max_len: int,
    *,
    programs_per_sm: int = PROGRAMS_PER_SM,
    sms: int = H200_SMS,
    **tuning,
) -> DecodeAttentionConfig:
    """Splits so that batch * heads * splits fills `programs_per_sm` programs per SM, no more
    splits than blocks of positions; `tuning`: the other fields of DecodeAttentionConfig."""
    block_s = tuning.get("block_s", DecodeAttentionConfig.block_s)
    wanted = -(-programs_per_sm * sms // (batch * heads))
    splits = max(1, min(wanted, -(-max_len // block_s)))
    return DecodeAttentionConfig(splits=splits, **tuning)


def decode_attention(q_BxHxK, k_cache, v_cache, slot, visible, *, config=None) -> jax.Array:
    """softmax(q K^T / sqrt(K)) V over positions [0, visible) of `slot`; see the module doc."""
    if q_BxHxK.ndim != 3 or k_cache.ndim != 5 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"decode_attention: q must be [B, H, K] and both caches [slots, B, S, H, K] of one "
            f"shape; got q {q_BxHxK.shape}, k {k_cache.shape}, v {v_cache.shape}"
        )
    batch, heads, head_dim = q_BxHxK.shape
    if k_cache.shape[1] != batch or k_cache.shape[3:] != (heads, head_dim):
        raise ValueError(
            f"decode_attention: cache {k_cache.shape} does not hold q's B={batch}, H={heads}, "
            f"K={head_dim}"
        )
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"decode_attention: head_dim={head_dim} > {MAX_HEAD_DIM} (a row is loaded whole "
            "into registers)"
        )
    config = config or pick_config(batch, heads, k_cache.shape[2])
    return decode_attention_kernel(
        q_BxHxK,
        k_cache,
        v_cache,
        slot,
        visible,
        splits=config.splits,
        block_s=config.block_s,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        interpret=jax.default_backend() != "gpu",
    )
