"""The reference's own outputs (tests/data/huginn_tiny_a, made by the official PyTorch code)."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_A

import huginn_jax
from huginn_jax.generate import greedy

TOL = dict(rtol=1e-4, atol=1e-4)  # the tolerance the conformance README states


@pytest.fixture(scope="module")
def reference():
    return np.load(TINY_A / "reference.npz")


@pytest.fixture(scope="module")
def model():
    return huginn_jax.from_pretrained(TINY_A, dtype=jnp.float32)


def test_config_read_from_hf_json(model):
    cfg = model.config
    assert (cfg.n_embd, cfg.n_heads, cfg.head_dim, cfg.intermediate_size) == (96, 4, 24, 160)
    assert cfg.effective_expected_depth == 132
    assert cfg.embed_scale == pytest.approx(9.797958971132712)


def test_prelude_output(model, reference):
    from huginn_jax.model import embed, run_prelude

    ids = jnp.asarray(reference["input_ids"])
    prelude_out, _ = run_prelude(model, embed(model, ids), jnp.int32(0), None)
    np.testing.assert_allclose(prelude_out, reference["prelude_out"], **TOL)


@pytest.mark.parametrize("num_steps", [1, 4, 8])
def test_full_sequence_logits_and_latents(model, reference, num_steps):
    out = model(jnp.asarray(reference["input_ids"]), num_steps=num_steps, init_scale=0.0)
    assert out.logits.dtype == jnp.float32
    np.testing.assert_allclose(out.logits, reference[f"logits_steps{num_steps}"], **TOL)
    np.testing.assert_allclose(out.latents, reference[f"latents_steps{num_steps}"], **TOL)


def test_prefill_then_decode_matches_reference_and_full_sequence(model, reference):
    ids = jnp.asarray(reference["input_ids"])
    cache = huginn_jax.KVCache.create(model.config, batch=2, max_len=12, num_steps=4)
    out = model(ids[:, :8], num_steps=4, init_scale=0.0, cache=cache, start=0)
    np.testing.assert_allclose(out.logits, reference["logits_steps4"][:, :8], **TOL)
    decoded = []
    for position in range(8, 12):
        out = model(
            ids[:, position : position + 1],
            num_steps=4,
            init_scale=0.0,
            cache=out.cache,
            start=position,
        )
        decoded.append(out.logits[:, 0])
    decoded = np.stack(decoded, axis=1)
    np.testing.assert_allclose(decoded, reference["decode_logits_steps4"], **TOL)
    np.testing.assert_allclose(decoded, reference["logits_steps4"][:, 8:12], **TOL)


def test_greedy_tokens(model, reference):
    tokens = greedy(model, reference["input_ids"][:, :6], 6, num_steps=4)
    np.testing.assert_array_equal(tokens, reference["greedy_tokens"])
