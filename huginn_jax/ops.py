"""The kernels behind HuginnConfig's kernel choices, each chosen by its name here and nowhere else.

- `decode_attention(name)`: `decode_attention_impl`, one of config.DECODE_ATTENTION_IMPLS;
- `row_gemv(name)`: `decode_gemv`, one of config.DECODE_GEMV_IMPLS.

One branch per name. A kernel from `pallas_kernels` is imported in its branch, so it is loaded
only when a config asks for it, and adapted here to the model's layout and types:
`pallas_kernels` imports nothing of this package. A Pallas kernel runs compiled on a GPU and in
interpret mode elsewhere; a choice that cannot run on this backend (cuDNN without a GPU) is a
ValueError when the model is traced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from huginn_jax.config import DECODE_ATTENTION_IMPLS, DECODE_GEMV_IMPLS
from huginn_jax.kv_cache import KVCache


def decode_attention(name: str):
    """Decode attention `name` as fn(q [B, 1, H, K], cache, slot, q_pos_T [1]) -> [B, 1, H, K]:
    one new position per sequence over positions [0, q_pos_T[0]] of cache slot `slot`.

    The functions of `layers` take the slot as `cache.read` returns it; the Pallas kernel reads
    the stacked cache in place (XLA would copy a slot sliced out for a custom call)."""
    from huginn_jax import layers  # layers calls this module

    if name == "xla":
        return _over_slot(layers.attend)
    elif name == "xla_split":
        return _over_slot(layers.attend_decode_split)
    elif name == "cudnn":
        if jax.default_backend() != "gpu":
            raise ValueError(
                "decode_attention_impl='cudnn' needs an NVIDIA GPU (cuDNN's fused attention); "
                f"the backend here is {jax.default_backend()}"
            )
        return _over_slot(layers.attend_decode_cudnn)
    elif name == "pallas":
        from pallas_kernels.decode_attention import decode_attention as kernel

        def pallas(q_Bx1xHxK, cache: KVCache, slot, q_pos_T):
            out_BxHxK = kernel(q_Bx1xHxK[:, 0], cache.k, cache.v, slot, q_pos_T[0] + 1)
            return out_BxHxK[:, None]

        return pallas
    raise ValueError(f"decode_attention_impl={name!r} must be one of {DECODE_ATTENTION_IMPLS}")


def _over_slot(attention):
    """fn(q, cache, slot, q_pos_T) from attention(q, k [B, S, H, K], v, q_pos_T, k_pos_S)."""

    def read_slot(q_Bx1xHxK, cache: KVCache, slot, q_pos_T):
        k_BxSxHxK, v_BxSxHxK = cache.read(slot)
        k_pos_S = jnp.arange(k_BxSxHxK.shape[1], dtype=jnp.int32)
        return attention(q_Bx1xHxK, k_BxSxHxK, v_BxSxHxK, q_pos_T, k_pos_S)

    return read_slot


def row_gemv(name: str):
    """Row GEMV `name` as fn(w [K, N], x [K], *, silu=False, as_partials=False), the contract of
    `decode_row.row_gemv_xla`. "xla" is that function itself, which the model does not call:
    with decode_gemv="xla" a Core step runs the plain layer code (`decode_row.uses_rows`)."""
    if name == "xla":
        from huginn_jax.decode_row import row_gemv_xla

        return row_gemv_xla
    elif name == "xla_rows8":
        from huginn_jax.decode_row import row_gemv_padded

        return row_gemv_padded
    elif name == "pallas":
        from pallas_kernels.fused_gemv import fused_gemv

        return fused_gemv
    raise ValueError(f"decode_gemv={name!r} must be one of {DECODE_GEMV_IMPLS}")
