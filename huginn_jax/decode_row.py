"""Batch-1 decode of the Core through row GEMVs (`HuginnConfig(decode_gemv="pallas"` or
`"xla_rows8")`).

At batch 1 a decode iteration is 17 matrix-vector products. In the plain code XLA runs each
split-K GEMV (cuBLAS) with its own reduction kernel and the gated MLP's SiLU as another kernel,
between the fusions that add the residual and apply the norms. Here a row GEMV kernel returns
its split-K partial sums unreduced, or the SiLU gate applied, and XLA adds the partials up in
the fusion that builds the next row anyway:

    x, v  = row.build(norm_b=norm_1)          row: norm_4(base + sum(partials)) of the block before
    qkv   = gemv(Wqkv, v)
    out   = attention(qkv)                    qk_bias, RoPE, cache write as in `Attention`
    o     = gemv(proj, out, as_partials)      [S, D] float32
    x1, v = PendingRow(o, base=x, norm=norm_2).build(norm_b=norm_3)
    a     = gemv(fc, v, silu)                 silu(gate) * up
    m     = gemv(mlp.proj, a, as_partials)    -> the next block's row: norm_4(x1 + sum(m))

The roundings are the plain code's (each Linear output, residual sum and norm in the weight
dtype), so the two paths agree to bf16 rounding. `row_gemv_xla` is the plain-JAX definition of
one product, the contract of every row GEMV that `ops.row_gemv` chooses by name.
Timings against the cuBLAS path: docs/fused_gemv.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from huginn_jax import ops
from huginn_jax.kv_cache import KVCache
from huginn_jax.layers import SandwichBlock, dot_precision, rms_norm


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingRow:
    """The row norm(base + sum_s partials[s]) before it is built: partials [S, D] float32 from a
    row GEMV, base [D] (None: no residual), norm [D] (None: no norm)."""

    partials: jax.Array
    base: jax.Array | None = None
    norm: jax.Array | None = None

    def build(self, *, eps: float, dtype, norm_b=None):
        """(h, v): h = norm(base + sum(partials)) in `dtype`, the residual stream; v = norm_b(h)
        (h without norm_b), the row the next GEMV multiplies."""
        h = self.partials.sum(axis=0).astype(dtype)
        if self.base is not None:
            h = h + self.base
        if self.norm is not None:
            h = rms_norm(h, self.norm, eps)
        return h, (h if norm_b is None else rms_norm(h, norm_b, eps))


# Rows a one-row product is padded to by `row_gemv_padded` (the wgmma and cuBLAS tile height
# of a small GEMM).
PADDED_ROWS = 8


def row_gemv_xla(w, x, *, silu=False, as_partials=False):
    """x [K] @ w [K, N]: [1, N] float32 partial sums (`as_partials`), the [N / 2] row
    silu(gate) * up (`silu`, w = [gate | up]) or the [N] row, in w's dtype, as `Linear` and
    `GatedMLP` compute them."""
    return _finish(jnp.matmul(x, w, precision=dot_precision(w.dtype)), silu, as_partials)


def row_gemv_padded(w, x, *, silu=False, as_partials=False):
    """`row_gemv_xla` with x as the first of PADDED_ROWS rows, the others zero: XLA compiles
    a one-row product as a reduction of its own, and an [8, K] @ [K, N] product as a GEMM
    (cuBLAS on a GPU); the extra rows cost no extra weight bytes."""
    rows = jnp.zeros((PADDED_ROWS, x.shape[0]), x.dtype).at[0].set(x)
    return _finish(jnp.matmul(rows, w, precision=dot_precision(w.dtype))[0], silu, as_partials)


def _finish(y, silu: bool, as_partials: bool):
    """The row y [N] as `row_gemv_xla` returns it."""
    if as_partials:
        return y.astype(jnp.float32)[None]
    if silu:
        gate, up = jnp.split(y, 2)
        y = jax.nn.silu(gate) * up
    return y


def uses_rows(block: SandwichBlock, x_BxTxD: jax.Array) -> bool:
    """Whether a Core step on x takes this path: a row GEMV chosen and one position at batch 1."""
    return block.attn.cfg.decode_gemv != "xla" and x_BxTxD.shape[:2] == (1, 1)


def block_rows(block: SandwichBlock, row: PendingRow, start, cache: KVCache | None, slot, gemv):
    """One sandwich block on a pending row; returns the next pending row and the cache."""
    w_qkv = block.attn.Wqkv.kernel[...]
    eps, dtype = block.norm_1.eps, w_qkv.dtype
    x, v = row.build(eps=eps, dtype=dtype, norm_b=block.norm_1.weight[...])
    out, cache = block.attn.attend_qkv(gemv(w_qkv, v)[None, None], start, cache, slot)
    o_parts = gemv(block.attn.proj.kernel[...], out[0, 0], as_partials=True)
    row = PendingRow(o_parts, base=x, norm=block.norm_2.weight[...])
    x1, v = row.build(eps=eps, dtype=dtype, norm_b=block.norm_3.weight[...])
    act = gemv(block.mlp.fc.kernel[...], v, silu=True)
    m_parts = gemv(block.mlp.proj.kernel[...], act, as_partials=True)
    return PendingRow(m_parts, base=x1, norm=block.norm_4.weight[...]), cache


def core_step_rows(adapter, core_block, state, embedded, iteration, start, cache):
    """`model.core_step` for one position at batch 1, through row GEMVs."""
    gemv = ops.row_gemv(core_block[0].attn.cfg.decode_gemv)
    joined = jnp.concatenate([state, embedded], axis=-1)[0, 0]
    row = PendingRow(gemv(adapter.kernel[...], joined, as_partials=True))
    for j, block in enumerate(core_block):
        slot = None if cache is None else cache.core_slot(iteration, j)
        row, cache = block_rows(block, row, start, cache, slot, gemv)
    _, x = row.build(eps=core_block[0].norm_1.eps, dtype=state.dtype)
    return x[None, None], cache
