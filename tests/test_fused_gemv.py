"""pallas_kernels.fused_gemv: the kernel against its plain-JAX reference on fresh random inputs
(interpret mode on CPU; compiled on the GPU, also against a float64 product rounded where the
kernel rounds and the model's row_gemv_xla, within tests/tolerance.py's bound), that reference
against huginn_jax.decode_row.row_gemv_xla, and the model decoding through the kernel."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import core_step_jaxpr, micro_decode_runs
from tolerance import assert_close, bf16

from huginn_jax.config import HuginnConfig
from huginn_jax.decode_row import PendingRow, row_gemv_xla
from pallas_kernels.fused_gemv import GemvConfig, fused_gemv, fused_gemv_reference, pick_config


def fresh(seed, rows, columns, dtype):
    kw, kx = jax.random.split(jax.random.key(seed))
    w = (jax.random.normal(kw, (rows, columns)) / np.sqrt(rows)).astype(dtype)
    return w, jax.random.normal(kx, (rows,)).astype(dtype)


def both(w, x, config, **kw):
    want = fused_gemv_reference(w, x, **kw)
    got = fused_gemv(w, x, config=config, **kw)
    if kw.get("as_partials"):
        assert got.shape == (config.split_k, want.shape[1]) and got.dtype == jnp.float32
        got, want = got.sum(axis=0), want.sum(axis=0)
    assert got.shape == want.shape
    return np.asarray(got, np.float32), np.asarray(want, np.float32)


CASES = [
    ({}, GemvConfig(block_n=16, block_k=16)),
    ({"silu": True}, GemvConfig(block_n=8, block_k=32)),
    ({"as_partials": True}, GemvConfig(block_n=16, block_k=16, split_k=3)),
    ({"as_partials": True}, GemvConfig(block_n=32, block_k=16, split_k=7)),  # 2 ranges empty
    ({"silu": True}, GemvConfig(block_n=16, block_k=16, use_dot=True)),
    ({"as_partials": True}, GemvConfig(block_n=16, block_k=32, split_k=2, use_dot=True)),
]


@pytest.mark.parametrize("kw, config", CASES)
def test_kernel_matches_reference_float32(kw, config):
    # 70 rows, 2 x 45 columns: neither a multiple of any block
    w, x = fresh(hash(config) % 1000, 70, 90, jnp.float32)
    got, want = both(w, x, config, **kw)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw, config", CASES)
def test_kernel_matches_reference_bf16(kw, config):
    """bf16 weights: the kernel rounds where the model rounds, so outputs agree to ~1 bf16 ulp
    (partials: float32 sums against a bf16-rounded product)."""
    w, x = fresh(7, 200, 96, jnp.bfloat16)
    got, want = both(w, x, config, **kw)
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=2**-7 * np.abs(want).max())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kw", [{}, {"silu": True}, {"as_partials": True}])
def test_reference_is_the_models_row_gemv(kw, dtype):
    """The kernel's reference (plain JAX, beside the kernel) computes what the model's
    row_gemv_xla computes, bit for bit."""
    w, x = fresh(11, 70, 90, dtype)
    want = row_gemv_xla(w, x, **kw)
    got = fused_gemv_reference(w, x, **kw)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_pending_row_builds_what_the_plain_block_computes():
    """norm(base + sum(partials)) in bf16, as SandwichBlock computes norm_2(x + attn_out)."""
    from huginn_jax.layers import rms_norm

    keys = jax.random.split(jax.random.key(3), 4)
    partials = jax.random.normal(keys[0], (3, 64))
    base = jax.random.normal(keys[1], (64,)).astype(jnp.bfloat16)
    norm_a, norm_b = (1 + 0.2 * jax.random.normal(k, (64,)) for k in keys[2:])
    norm_a, norm_b = norm_a.astype(jnp.bfloat16), norm_b.astype(jnp.bfloat16)
    h, v = PendingRow(partials, base, norm_a).build(eps=1e-6, dtype=jnp.bfloat16, norm_b=norm_b)
    want_h = rms_norm(base + partials.sum(0).astype(jnp.bfloat16), norm_a, 1e-6)
    np.testing.assert_array_equal(h, want_h)
    np.testing.assert_array_equal(v, rms_norm(want_h, norm_b, 1e-6))


def test_pick_config_fills_the_gpu():
    assert pick_config(5280, 5280, as_partials=True).split_k == 13  # 42 blocks x 13 >= 4 x 132
    assert pick_config(17920, 5280, as_partials=True).split_k == 13
    assert pick_config(128, 16, as_partials=True).split_k == 2  # no more ranges than blocks
    whole = pick_config(5280, 15840, as_partials=False)
    assert (whole.split_k, whole.block_k) == (1, 256)
    assert pick_config(5280, 17920, as_partials=False, silu=True).block_k == 64
    assert pick_config(5280, 5280, as_partials=True, block_n=64).block_n == 64  # overrides


def test_bad_input_fails_clearly():
    w, x = fresh(0, 16, 8, jnp.float32)
    with pytest.raises(ValueError, match=r"need w \[K, N\] and x \[K\]"):
        fused_gemv(w, x[:8])
    with pytest.raises(ValueError, match="silu needs"):
        fused_gemv(w, x, silu=True, as_partials=True)
    with pytest.raises(ValueError, match="silu needs"):
        fused_gemv(w[:, :7], x, silu=True)
    with pytest.raises(ValueError, match="ask for as_partials"):
        fused_gemv(w, x, config=GemvConfig(split_k=2))


def test_model_decodes_through_the_kernel():
    """decode_gemv="pallas" decodes like "xla" at batch 1 (row GEMVs, interpret mode on CPU).
    (Batch 2 takes the plain path: test_model_step_uses_the_kernel_at_batch_one_only.)"""
    (want, want_cache), (got, got_cache) = micro_decode_runs(
        "decode_gemv", ("xla", "pallas"), prompt_len=20, steps=2, max_len=24, seed=40, batch=1
    )
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got_cache.k, want_cache.k, rtol=1e-5, atol=1e-5)


def test_model_step_uses_the_kernel_at_batch_one_only():
    """The Core step's jaxpr holds the row kernels at batch 1; at batch 2 it holds none and is
    the plain path's jaxpr, op for op."""
    micro = HuginnConfig.from_name("micro")

    def jaxpr(decode_gemv, batch):
        return core_step_jaxpr(dataclasses.replace(micro, decode_gemv=decode_gemv), batch)

    kernels = "name=fused_gemv_kernel"  # one jitted call per GEMV
    assert jaxpr("pallas", 1).count(kernels) == 1 + 4 * micro.n_core  # adapter + 4 per block
    batch2 = jaxpr("pallas", 2)
    assert kernels not in batch2 and batch2 == jaxpr("xla", 2)


def kernel_rounding(y, *, silu: bool) -> np.ndarray:
    """The row the kernel writes, from the exact product y [N] (float64): y rounded to bf16, or
    with `silu` silu(gate) * up with the kernel's roundings (gate, up, silu(gate) and the
    product each rounded to bf16)."""
    if not silu:
        return bf16(y)
    gate, up = (bf16(half) for half in np.split(y, 2))
    return bf16(bf16(gate / (1 + np.exp(-gate))) * up)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "rows, columns, kw",
    [
        (5280, 15840, {}),  # Wqkv
        (5280, 5280, {"as_partials": True}),  # attention proj
        (5280, 35840, {"silu": True}),  # fc
        (17920, 5280, {"as_partials": True}),  # mlp proj
        (10560, 5280, {"as_partials": True}),  # adapter
    ],
)
def test_kernel_at_huginn_size_against_float64(rows, columns, kw):
    """huginn-0125's GEMVs in bf16, compiled with the default config, against the float64
    product of the same inputs rounded where the kernel rounds (partial sums: float32, summed
    here), and against the model's own row_gemv_xla in bf16."""
    w, x = fresh(rows + columns, rows, columns, jnp.bfloat16)
    got = fused_gemv(w, x, **kw)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    model = row_gemv_xla(w, x, **kw)
    if kw.get("as_partials"):
        assert got.dtype == jnp.float32 and got.shape[1] == columns
        total = np.asarray(got, np.float64).sum(axis=0)
        assert_close(total, exact, dtype="float32")
        # the model's product is rounded to bf16 before it becomes float32 partials
        assert_close(total, np.asarray(model, np.float64).sum(axis=0))
        return
    assert got.dtype == jnp.bfloat16
    assert_close(got, kernel_rounding(exact, silu=kw.get("silu", False)))
    # XLA fuses the model's silu(gate) * up and keeps float32 through it (excess precision),
    # where the kernel rounds gate, up and silu(gate) as the model's code is written: three
    # roundings (~1.5e-3 RMS relative each) more than the model's path before the last.
    assert_close(got, model, factor=2.0 if kw.get("silu") else 1.0)
