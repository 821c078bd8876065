"""The batch-1 row path of the Core with XLA's products (huginn_jax/decode_row.py): the padded
row GEMV computes what the plain one does, and the model decodes through it like the plain
layer code."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import core_step_jaxpr, micro_decode_runs

from huginn_jax.config import HuginnConfig
from huginn_jax.decode_row import PADDED_ROWS, row_gemv_padded, row_gemv_xla


@pytest.mark.parametrize("kw", [{}, {"silu": True}, {"as_partials": True}])
def test_padded_row_gemv_is_the_plain_one(kw):
    key = jax.random.key(3)
    w = jax.random.normal(key, (96, 64), jnp.float32)
    x = jax.random.normal(jax.random.fold_in(key, 1), (96,), jnp.float32)
    got, want = row_gemv_padded(w, x, **kw), row_gemv_xla(w, x, **kw)
    assert got.shape == want.shape and got.dtype == want.dtype
    # float32 sums of 96 products of unit normals in another order (a GEMM's on a GPU, the
    # GEMV's): about sqrt(96) roundings of sums near 10 apart
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=5e-5)


def test_padded_row_gemv_multiplies_eight_rows():
    """The compiled product is [PADDED_ROWS, K] @ [K, N], not folded back to one row (a GPU's
    XLA may compute it transposed: a [N, PADDED_ROWS] result)."""
    w, x = jnp.ones((96, 64), jnp.bfloat16), jnp.ones((96,), jnp.bfloat16)
    hlo = jax.jit(row_gemv_padded).lower(w, x).compile().as_text()
    dots = [line for line in hlo.splitlines() if " dot(" in line]
    shapes = (f"[{PADDED_ROWS},64]", f"[64,{PADDED_ROWS}]")
    assert dots and all(any(s in line for s in shapes) for line in dots), dots


def test_model_decodes_through_padded_rows():
    """decode_gemv="xla_rows8" decodes like "xla" at batch 1 (float32: the same products,
    summed in another order). (Batch 2 takes the plain path: the next test.)"""
    (want, want_cache), (got, got_cache) = micro_decode_runs(
        "decode_gemv", ("xla", "xla_rows8"), prompt_len=12, steps=2, max_len=16, seed=41, batch=1
    )
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got_cache.k, want_cache.k, rtol=1e-5, atol=1e-5)


def test_model_step_pads_rows_at_batch_one_only():
    """The Core step's jaxpr multiplies 8-row products at batch 1; at batch 2 it is the plain
    path's jaxpr, op for op."""
    micro = HuginnConfig.from_name("micro")

    def jaxpr(decode_gemv, batch):
        return core_step_jaxpr(dataclasses.replace(micro, decode_gemv=decode_gemv), batch)

    padded = f"f32[{PADDED_ROWS},{micro.n_embd}]"  # a row padded to PADDED_ROWS rows
    assert padded in jaxpr("xla_rows8", 1) and padded not in jaxpr("xla", 1)
    assert jaxpr("xla_rows8", 2) == jaxpr("xla", 2)
