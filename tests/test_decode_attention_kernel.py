"""pallas_kernels.decode_attention: the kernel against its plain-JAX reference on fresh random
inputs (interpret mode on CPU; compiled on the GPU within tests/tolerance.py's bound), that
reference against the model's `attend`, and the model decoding through the kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import micro_decode_runs
from tolerance import assert_close, bf16

from huginn_jax.layers import attend
from pallas_kernels.decode_attention import (
    DecodeAttentionConfig,
    decode_attention,
    decode_attention_reference,
    pick_config,
)


def fresh(seed, slots, batch, max_len, heads, head_dim, dtype):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    cache_shape = (slots, batch, max_len, heads, head_dim)
    return (
        jax.random.normal(kq, (batch, heads, head_dim), dtype),
        jax.random.normal(kk, cache_shape, dtype),
        jax.random.normal(kv, cache_shape, dtype),
    )


@pytest.mark.parametrize(
    "visible, splits, block_s",
    [(37, 3, 8), (70, 3, 8), (1, 4, 8), (70, 1, 16), (50, 8, 8)],  # 8 splits: some empty
)
def test_kernel_matches_reference_float32(visible, splits, block_s):
    q, k, v = fresh(visible, 3, 2, 70, 3, 24, jnp.float32)
    config = DecodeAttentionConfig(splits=splits, block_s=block_s)
    for slot in (0, 2):
        want = decode_attention_reference(q, k, v, slot, visible)
        got = decode_attention(q, k, v, jnp.int32(slot), jnp.int32(visible), config=config)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Another slot's data gives another answer: the slot index is honoured.
    other = decode_attention_reference(q, k, v, 1, visible)
    assert np.abs(np.asarray(other - want)).max() > 1e-3


@pytest.mark.parametrize("visible", [1, 37, 70])
def test_reference_is_the_models_attention_float32(visible):
    """The kernel's reference (plain JAX, beside the kernel) computes `huginn_jax.layers.attend`
    for one query at position visible - 1 over the keys at positions 0 .. S-1 of one slot."""
    q, k, v = fresh(100 + visible, 3, 2, 70, 3, 24, jnp.float32)
    positions = jnp.arange(70, dtype=jnp.int32)
    for slot in (0, 2):
        want = attend(q[:, None], k[slot], v[slot], jnp.array([visible - 1]), positions)[:, 0]
        got = decode_attention_reference(q, k, v, slot, visible)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_pick_config_fills_the_gpu_without_empty_work():
    assert pick_config(1, 55, 1025).splits == 10  # 550 programs >= 4 x 132
    assert pick_config(8, 55, 4097).splits == 2
    assert pick_config(1, 2, 40).splits == 2  # no more splits than blocks of 32 positions


def test_bad_shapes_fail_clearly():
    q, k, v = fresh(0, 2, 1, 16, 2, 8, jnp.float32)
    with pytest.raises(ValueError, match=r"q must be \[B, H, K\]"):
        decode_attention(q[0], k, v, 0, 4)
    with pytest.raises(ValueError, match="does not hold q's"):
        decode_attention(q[:, :1], k, v, 0, 4)
    big = jnp.zeros((1, 1, 512), jnp.float32)
    with pytest.raises(ValueError, match="head_dim=512 > 256"):
        decode_attention(big, jnp.zeros((1, 1, 4, 1, 512)), jnp.zeros((1, 1, 4, 1, 512)), 0, 1)


def test_model_decodes_through_the_kernel():
    """decode_attention_impl="pallas" decodes like "xla": same weights, a 40-position prompt, three
    decode steps (kernel in interpret mode on CPU)."""
    (want, want_cache), (got, got_cache) = micro_decode_runs(
        "decode_attention_impl", ("xla", "pallas"), prompt_len=40, steps=3, max_len=48, seed=30
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_cache.v, want_cache.v, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "batch, max_len, visible", [(1, 1025, 1025), (1, 1025, 700), (8, 4097, 4097)]
)
def test_kernel_matches_reference_at_huginn_size(batch, max_len, visible):
    """bf16 caches of huginn-0125's heads (55 x 96), compiled, against the float32 reference of
    the same values rounded to bf16 once, as the kernel rounds its float32 result."""
    q, k, v = fresh(batch + visible, 3, batch, max_len, 55, 96, jnp.bfloat16)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = np.asarray(decode_attention_reference(*f32, 1, visible))
    got = decode_attention(q, k, v, jnp.int32(1), jnp.int32(visible))
    assert got.dtype == jnp.bfloat16 and got.shape == want.shape
    assert_close(got, bf16(want))
    # Another slot holds other values: a kernel reading the wrong slot would fail above.
    other = np.asarray(decode_attention_reference(*f32, 2, visible))
    assert np.linalg.norm(other - want) / np.linalg.norm(want) > 0.1
