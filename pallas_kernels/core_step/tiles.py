"""Register tiles of the fused Core kernel: [rows, 8] float32 arrays in the wgmma layout (rows a
multiple of 64; column = a sequence of the batch), their per-column ([8], a reduction over rows)
and per-row vectors."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.core_step.fused_plan import N_PAD

WGMMA = plgpu.Layout.WGMMA


def bcast_rows(col_vec, rows: int):
    """[8] (a reduction over rows) -> [rows, 8]."""
    return lax.broadcast_in_dim(col_vec, (rows, N_PAD), [1])


def row_of(tile, row: int, rows: int):
    """Row `row` of a [64, 8] tile, broadcast to [rows, 8]."""
    idx = plgpu.broadcasted_iota(jnp.int32, tile.shape, 0, layout=WGMMA)
    return bcast_rows(jnp.sum(jnp.where(idx == row, tile, 0.0), axis=0), rows)


def col_of(tile, col: int):
    """Column `col` of a [64, 8] tile broadcast across the columns (a per-row gain)."""
    idx = plgpu.broadcasted_iota(jnp.int32, tile.shape, 1, layout=WGMMA)
    picked = jnp.sum(jnp.where(idx == col, tile, 0.0), axis=1)
    return lax.broadcast_in_dim(picked, tile.shape, [0])


def in_row(col_vec, row: int, rows: int = 64):
    """A [rows, 8] tile that is `col_vec` ([8]) in row `row` and 0 elsewhere."""
    idx = plgpu.broadcasted_iota(jnp.int32, (rows, N_PAD), 0, layout=WGMMA)
    return jnp.where(idx == row, bcast_rows(col_vec, rows), 0.0)


def round_bf16(x):
    return x.astype(jnp.bfloat16).astype(jnp.float32)
