"""Properties of the model on fresh random weights and inputs (never zeros)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_A, prefill_then_decode
from tolerance import assert_close, bf16

import huginn_jax
from huginn_jax.config import HuginnConfig
from huginn_jax.layers import apply_rope
from huginn_jax.model import (
    core_step,
    embed,
    initial_state,
    run_coda,
    run_core,
    run_prelude,
)

MICRO = HuginnConfig.from_name("micro")


@pytest.fixture(scope="module")
def model():
    return huginn_jax.random_init(MICRO, jax.random.key(0))


def random_ids(key, batch, tokens, vocab=MICRO.vocab_size):
    return jax.random.randint(jax.random.key(key), (batch, tokens), 0, vocab)


@pytest.mark.parametrize("dtype, rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_rope_rotates_each_adjacent_pair_like_a_complex_product(dtype, rtol):
    """Pair (2i, 2i+1) of position p, as a complex number, times exp(1j p base^(-2i/K)):
    the float64 reference on random inputs and positions far from 0."""
    b, t, h, k, base = 2, 5, 3, 8, 10000.0
    x = jax.random.normal(jax.random.key(11), (b, t, h, k), jnp.float32).astype(dtype)
    positions = jnp.array([0, 3, 17, 250, 4095], jnp.int32)
    got = np.asarray(apply_rope(x, positions, base).astype(jnp.float32), np.float64)
    xs = np.asarray(x.astype(jnp.float32), np.float64)
    pairs = xs[..., 0::2] + 1j * xs[..., 1::2]
    angle = np.asarray(positions, np.float64)[:, None] * base ** (-np.arange(0, k, 2) / k)
    want = pairs * np.exp(1j * angle)[None, :, None, :]
    want = np.stack([want.real, want.imag], axis=-1).reshape(xs.shape)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())
    assert np.abs(got[:, 1:] - xs[:, 1:]).max() > 0.1  # positions > 0 rotate


def test_causality(model):
    ids = random_ids(1, 2, 10)
    changed = ids.at[:, 6].set((ids[:, 6] + 1) % MICRO.vocab_size)
    state = initial_state(MICRO, (2, 10), init_scale=1.0, key=jax.random.key(2), dtype=jnp.float32)
    a = model(ids, num_steps=3, init_state=state).logits
    b = model(changed, num_steps=3, init_state=state).logits
    np.testing.assert_array_equal(a[:, :6], b[:, :6])
    assert (
        np.abs(np.asarray(a[:, 6:] - b[:, 6:])).max() > 1e-3
    )  # the change did reach later positions


def test_scanned_core_equals_unrolled_loop(model):
    ids = random_ids(3, 2, 7)
    start = jnp.int32(0)
    embedded, _ = run_prelude(model, embed(model, ids), start, None)
    state0 = initial_state(MICRO, (2, 7), init_scale=1.0, key=jax.random.key(4), dtype=jnp.float32)
    scanned, _ = jax.jit(lambda s: run_core(model, s, embedded, start, None, 5))(state0)
    unrolled = state0
    for iteration in range(5):
        unrolled, _ = core_step(model, unrolled, embedded, iteration, start, None)
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(scanned - state0)).max() > 1e-2


def test_core_loop_compiles_to_one_loop(model):
    """r iterations are one while loop in the HLO, not r copies of the Core."""
    ids = random_ids(5, 1, 4)
    embedded, _ = run_prelude(model, embed(model, ids), jnp.int32(0), None)
    state0 = jnp.ones_like(embedded)

    def hlo(num_steps):
        return (
            jax.jit(lambda s: run_core(model, s, embedded, jnp.int32(0), None, num_steps))
            .lower(state0)
            .as_text()
        )

    # The Core has 4 blocks × 4 matmuls + the adapter = 17 weight products, and 2 attention
    # einsums per block: 25 products in the loop body, whatever the number of iterations.
    for num_steps in (1, 16):
        text = hlo(num_steps)
        assert text.count("stablehlo.while") == 1
        assert text.count("stablehlo.dot_general") == 17 + 2 * MICRO.n_core


def test_bf16_forward_close_to_float32():
    f32 = huginn_jax.from_pretrained(TINY_A, dtype=jnp.float32)
    bf16 = huginn_jax.from_pretrained(TINY_A, dtype=jnp.bfloat16)
    ids = jax.random.randint(jax.random.key(6), (2, 12), 0, 256)
    ref = np.asarray(f32(ids, num_steps=4, init_scale=0.0).logits)
    got = np.asarray(bf16(ids, num_steps=4, init_scale=0.0).logits)
    assert got.dtype == np.float32
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert rel < 3e-2, rel
    # Mostly the same top-1 predictions.
    assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.8


def test_bf16_head_is_a_bf16_product_without_a_float32_weight():
    """The head multiplies in the weights' dtype; asking for a float32 product of bf16 operands
    made XLA's GPU build convert the whole [V, D] embedding to float32 at every decode step."""
    bf16 = huginn_jax.from_pretrained(TINY_A, dtype=jnp.bfloat16)
    cfg = bf16.config
    state = jax.random.normal(jax.random.key(9), (1, 3, cfg.n_embd), jnp.bfloat16)
    text = str(jax.make_jaxpr(lambda s: run_coda(bf16, s, 0, None, last_only=True)[0])(state))
    head = f"{cfg.vocab_size},{cfg.n_embd}"
    assert f"f32[{head}]" not in text and f"f32[{cfg.n_embd},{cfg.vocab_size}]" not in text
    products = [line for line in text.splitlines() if f"[1,{cfg.vocab_size}] = dot_general" in line]
    assert products and all("bf16[1," in line for line in products), products


def test_cache_after_prefill_and_decode_equals_one_prefill(model):
    ids = random_ids(7, 2, 9)
    state = initial_state(MICRO, (2, 9), init_scale=1.0, key=jax.random.key(8), dtype=jnp.float32)

    def new_cache():
        return huginn_jax.KVCache.create(MICRO, batch=2, max_len=12, num_steps=3)

    whole = model(ids, num_steps=3, init_state=state, cache=new_cache()).cache
    out = model(ids[:, :6], num_steps=3, init_state=state[:, :6], cache=new_cache())
    for position in range(6, 9):
        step_state = state[:, position : position + 1]
        out = model(
            ids[:, position : position + 1],
            num_steps=3,
            init_state=step_state,
            cache=out.cache,
            start=position,
        )
    np.testing.assert_allclose(out.cache.k, whole.k, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.cache.v, whole.v, rtol=1e-5, atol=1e-5)
    k = np.asarray(whole.k)
    # Every slot holds keys at every position of the sequence, and nothing beyond it.
    assert np.all(np.abs(k[:, :, :9]).max(axis=(3, 4)) > 0)
    assert np.all(k[:, :, 9:] == 0)
    # The first prelude layer's keys are those of its input, in float64: RoPE(norm_1(embedded)
    # @ W_k + bias_k) at positions 0..8.
    np.testing.assert_allclose(k[0, :, :9], first_layer_keys(model, ids), rtol=1e-5, atol=1e-5)


def first_layer_keys(model, ids) -> np.ndarray:
    """The keys the first prelude layer writes for `ids` at positions 0..T-1, in float64 NumPy:
    embedding times embed_scale, RMS norm, the K third of Wqkv, qk_bias, RoPE by pairs."""
    cfg = model.config
    block = model.prelude[0]
    f64 = functools.partial(np.asarray, dtype=np.float64)
    x = f64(model.wte[...])[np.asarray(ids)] * cfg.embed_scale
    x = (
        x
        / np.sqrt((x * x).mean(-1, keepdims=True) + block.norm_1.eps)
        * f64(block.norm_1.weight[...])
    )
    b, t, _ = x.shape
    key = (x @ f64(block.attn.Wqkv.kernel[...])).reshape(b, t, 3, cfg.n_heads, cfg.head_dim)[
        :, :, 1
    ]
    if cfg.qk_bias:
        key = key + f64(block.attn.qk_bias[...])[1]
    half = np.arange(0, cfg.head_dim, 2) / cfg.head_dim
    angle = np.arange(t)[:, None] * cfg.rope_base ** (-half)
    pairs = (key[..., 0::2] + 1j * key[..., 1::2]) * np.exp(1j * angle)[None, :, None, :]
    return np.stack([pairs.real, pairs.imag], axis=-1).reshape(key.shape)


def test_cache_slots_hold_each_iteration_separately(model):
    ids = random_ids(9, 1, 5)
    cache = huginn_jax.KVCache.create(MICRO, batch=1, max_len=5, num_steps=2)
    state = initial_state(MICRO, (1, 5), init_scale=1.0, key=jax.random.key(10), dtype=jnp.float32)
    cache = model(ids, num_steps=2, init_state=state, cache=cache).cache
    k = np.asarray(cache.k)
    assert k.shape[0] == 2 + 2 * 4 + 2
    # Every slot was written and the two iterations of one Core layer differ.
    assert np.all(np.abs(k).reshape(k.shape[0], -1).max(axis=1) > 0)
    assert np.abs(k[cache.core_slot(0, 1)] - k[cache.core_slot(1, 1)]).max() > 1e-4


def test_initial_state_distribution():
    cfg = HuginnConfig.from_name("tiny")
    s = np.asarray(
        initial_state(cfg, (1, 4096), init_scale=1.0, key=jax.random.key(11), dtype=jnp.float32)
    )
    assert abs(s.std() - 0.624) < 0.01
    assert abs(s.mean()) < 0.01
    assert np.abs(s).max() <= 1.8974 + 1e-5
    assert not np.any(initial_state(cfg, (1, 3), init_scale=0.0, key=None, dtype=jnp.float32))


def test_bad_inputs_fail_clearly(model):
    ids = random_ids(12, 1, 4)
    with pytest.raises(ValueError, match="PRNG"):
        model(ids, num_steps=2, init_scale=1.0)
    with pytest.raises(ValueError, match="num_steps"):
        model(ids, num_steps=0, init_scale=0.0)
    cache = huginn_jax.KVCache.create(MICRO, batch=1, max_len=4, num_steps=2)
    with pytest.raises(ValueError, match="Core slots"):
        model(ids, num_steps=3, init_scale=0.0, cache=cache)
    with pytest.raises(ValueError, match="max_len"):
        model(ids, num_steps=2, init_scale=0.0, cache=cache, start=2)


def test_split_decode_attention_equals_attend():
    """Blocks of 8 over 37 positions (a 5-position block last); positions after 20 masked, so
    two blocks are partly or wholly masked; then every position visible."""
    from huginn_jax.layers import attend, attend_decode_split

    kq, kk, kv = jax.random.split(jax.random.key(21), 3)
    q = jax.random.normal(kq, (2, 1, 3, 8), jnp.float32)
    k, v = (jax.random.normal(key, (2, 37, 3, 8), jnp.float32) for key in (kk, kv))
    k_pos = jnp.arange(37)
    for q_pos in (jnp.array([20]), jnp.array([36])):
        want = attend(q, k, v, q_pos, k_pos)
        for block in (8, 64):  # 64 > S: the remainder block alone
            got = attend_decode_split(q, k, v, q_pos, k_pos, block=block)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(attend(q, k, v, jnp.array([20]), k_pos), want, atol=1e-3)


def test_split_decode_attention_in_the_model():
    """decode_attention_impl="xla_split" decodes like "xla": same weights, a 200-position prompt
    in a 300-position cache (two full blocks of 128 and a short one, the positions past the
    prompt's end masked), three decode steps; logits and cache agree."""
    cfg = dataclasses.replace(MICRO, block_size=512)
    split_cfg = dataclasses.replace(cfg, decode_attention_impl="xla_split")
    run = functools.partial(prefill_then_decode, prompt_len=200, steps=3, max_len=300, seed=22)
    (want, want_cache), (got, got_cache) = run(cfg), run(split_cfg)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_cache.k, want_cache.k, rtol=1e-5, atol=1e-5)
    assert np.abs(want[:, 0] - want[:, 2]).max() > 1e-3  # the steps differ


def test_unknown_attention_impls_fail_clearly():
    with pytest.raises(ValueError, match="decode_attention_impl='flash' must be one of"):
        dataclasses.replace(MICRO, decode_attention_impl="flash")
    with pytest.raises(ValueError, match="attention_impl='flash' must be one of"):
        dataclasses.replace(MICRO, attention_impl="flash")
    with pytest.raises(ValueError, match="decode_gemv='cublas' must be one of"):
        dataclasses.replace(MICRO, decode_gemv="cublas")


def test_every_kernel_choice_of_the_config_has_its_code():
    """The config accepts exactly its lists of names, and `ops` maps each name to a function
    (cuDNN without a GPU: a ValueError that says so) and refuses any other."""
    from huginn_jax import ops
    from huginn_jax.config import DECODE_ATTENTION_IMPLS, DECODE_GEMV_IMPLS

    for name in DECODE_ATTENTION_IMPLS:
        assert dataclasses.replace(MICRO, decode_attention_impl=name).decode_attention_impl == name
        if name == "cudnn" and jax.default_backend() != "gpu":
            with pytest.raises(ValueError, match="'cudnn' needs an NVIDIA GPU"):
                ops.decode_attention(name)
        else:
            assert callable(ops.decode_attention(name))
    for name in DECODE_GEMV_IMPLS:
        assert dataclasses.replace(MICRO, decode_gemv=name).decode_gemv == name
        assert callable(ops.row_gemv(name))
    with pytest.raises(ValueError, match="decode_attention_impl='flash' must be one of"):
        ops.decode_attention("flash")
    with pytest.raises(ValueError, match="decode_gemv='cublas' must be one of"):
        ops.row_gemv("cublas")


def test_with_config_changes_the_kernel_choices_only(model):
    """A model's weights under other kernel choices: the same parameters, the new choices in
    every block; any other difference is refused."""
    from flax import nnx

    from huginn_jax.model import with_config

    cfg = dataclasses.replace(MICRO, decode_attention_impl="xla_split", decode_gemv="pallas")
    other = with_config(model, cfg)
    assert other.config == cfg
    assert all(b.attn.cfg == cfg for b in [*other.prelude, *other.core_block, *other.coda])
    for got, want in zip(
        jax.tree.leaves(nnx.state(other)), jax.tree.leaves(nnx.state(model)), strict=True
    ):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="differs from the model's in more than"):
        with_config(model, dataclasses.replace(MICRO, mean_recurrence=4))


# cuDNN's fused attention rounds the softmax weights to bf16 before the product with V, where
# the float32 reference keeps them: each output is off by about one bf16 rounding (~1.5e-3 RMS
# relative) before its own rounding, as much again as the one-step bound allows for.
CUDNN_WEIGHTS = 2.0


@pytest.mark.gpu
def test_cudnn_attention_matches_xla_attention():
    """The fused prefill path (attention_impl="cudnn") against the reference einsum path in
    float32 on the same bf16 values, rounded to bf16 once, with queries that start past
    position 0 so the mask is not plain causal."""
    from huginn_jax.layers import attend, attend_cudnn

    keys = jax.random.split(jax.random.key(13), 3)
    q = jax.random.normal(keys[0], (2, 128, 55, 96), jnp.bfloat16)
    k = jax.random.normal(keys[1], (2, 256, 55, 96), jnp.bfloat16)
    v = jax.random.normal(keys[2], (2, 256, 55, 96), jnp.bfloat16)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    q_pos, k_pos = jnp.arange(64, 192), jnp.arange(256)
    ref = bf16(attend(*f32, q_pos, k_pos))
    got = jax.jit(attend_cudnn)(q, k, v, q_pos, k_pos)
    assert got.dtype == jnp.bfloat16
    assert_close(got, ref, factor=CUDNN_WEIGHTS)
    # causal=True (keys are the queries' own positions): cuDNN's causal kernel, no mask operand.
    pos = jnp.arange(256)
    ref = bf16(attend(f32[1], f32[1], f32[2], pos, pos))
    got = jax.jit(functools.partial(attend_cudnn, causal=True))(k, k, v, pos, pos)
    assert_close(got, ref, factor=CUDNN_WEIGHTS)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cudnn", "xla_split"])
def test_decode_attention_impls_match_xla_attention(impl):
    """One query over a 1000-position bf16 cache of which the first 701 are visible, against
    `attend` in float32 rounded to bf16 once; the visible length is traced, as in a decode
    step."""
    from huginn_jax.layers import attend, attend_decode_cudnn, attend_decode_split

    keys = jax.random.split(jax.random.key(14), 3)
    q = jax.random.normal(keys[0], (2, 1, 55, 96), jnp.bfloat16)
    k = jax.random.normal(keys[1], (2, 1000, 55, 96), jnp.bfloat16)
    v = jax.random.normal(keys[2], (2, 1000, 55, 96), jnp.bfloat16)
    k_pos = jnp.arange(1000)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    for position in (700, 999):
        q_pos = jnp.array([position])
        ref = np.asarray(attend(*f32, q_pos, k_pos))
        attention = {"cudnn": attend_decode_cudnn, "xla_split": attend_decode_split}[impl]
        got = jax.jit(attention)(q, k, v, q_pos, k_pos)
        assert_close(got, bf16(ref), factor=CUDNN_WEIGHTS if impl == "cudnn" else 1.0)
    masked = np.asarray(attend(*f32, jnp.array([700]), k_pos))
    assert np.linalg.norm(masked - ref) / np.linalg.norm(ref) > 0.1  # the length matters


def test_mgpu_wrapper_pads_scales_and_slices(monkeypatch):
    """attend_mgpu_causal around a stand-in for jax's Mosaic GPU kernel (CPU): the kernel gets
    float16, T padded to a multiple of 256, K to a multiple of 64, q pre-scaled; unscaled
    causal attention of the padded data, sliced back, equals scaled causal attention of the
    original (both in float64)."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    from huginn_jax.layers import attend_mgpu_causal

    seen = {}

    def stand_in(q, k, v, config):
        seen.update(dtype=q.dtype, shape=q.shape, causal=config.causal)
        return jnp.asarray(causal_attention_f64(q, k, v, scale=1.0), q.dtype)  # no scaling

    monkeypatch.setattr(attention_mgpu, "attention", stand_in)
    keys = jax.random.split(jax.random.key(15), 3)
    q, k, v = (jax.random.normal(key, (2, 100, 3, 24), jnp.bfloat16) for key in keys)
    got = np.asarray(attend_mgpu_causal(q, k, v), np.float32)
    assert seen == {"dtype": jnp.float16, "shape": (2, 256, 3, 64), "causal": True}
    want = causal_attention_f64(q, k, v)
    assert got.shape == want.shape
    # q scaled in bf16 and the result rounded to bf16: within one bf16 step of float64
    assert_close(got, want)


def causal_attention_f64(q, k, v, scale: float | None = None) -> np.ndarray:
    """Causal softmax attention of T positions over themselves in float64 NumPy, scores times
    `scale` (default 1/sqrt(K)): [B, T, H, K] each -> [B, T, H, K]. Written apart from
    `layers.attend`."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    t = q.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = np.einsum("bthk,bshk->bhts", q, k) * scale
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhts,bshk->bthk", probs, v)


def test_mgpu_attention_in_the_model_prefill(monkeypatch):
    """attention_impl="mgpu" routes attention over the new positions alone (no cache, or a
    prefill known to start at 0) through the Mosaic GPU wrapper, once per layer. With a stand-in
    that computes causal attention in float64 (apart from `attend`) the logits are the xla
    path's; with one that returns v (every position attending to itself alone) they are not,
    so the wrapper's output is what the model uses."""
    from huginn_jax import layers

    calls = []

    def faithful(q, k, v):
        calls.append(q.shape[1])
        shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
        return jax.pure_callback(
            lambda *a: causal_attention_f64(*a).astype(shape.dtype), shape, q, k, v
        )

    ids = random_ids(50, 2, 12)
    state = initial_state(MICRO, (2, 12), init_scale=1.0, key=jax.random.key(51), dtype=jnp.float32)

    def logits(cfg):
        model = huginn_jax.random_init(cfg, jax.random.key(52))
        return np.asarray(model(ids, num_steps=2, init_state=state).logits)

    mgpu = dataclasses.replace(MICRO, attention_impl="mgpu")
    want = logits(MICRO)
    monkeypatch.setattr(layers, "attend_mgpu_causal", faithful)
    jax.clear_caches()  # the stand-in is read at trace time: trace again after each swap
    np.testing.assert_allclose(logits(mgpu), want, rtol=1e-5, atol=1e-5)
    # traced once per layer: the prelude, the Core's scan body, the coda
    n_layers = MICRO.n_layers_in_prelude + MICRO.n_core + MICRO.n_layers_in_coda
    assert calls == [12] * n_layers
    monkeypatch.setattr(layers, "attend_mgpu_causal", lambda q, k, v: v)
    jax.clear_caches()
    assert np.abs(logits(mgpu) - want).max() > 1e-2


@pytest.mark.gpu
def test_mgpu_attention_matches_xla_attention():
    """jax's Mosaic GPU kernel through attend_mgpu_causal, huginn-0125 heads, bf16 in, T = 200
    (padded to 256), against causal attention in float64 of the queries the kernel sees (q
    times bf16(1/sqrt(K)), rounded to bf16 by the wrapper), rounded to bf16 once. The kernel's
    float16 weights are 8 times finer than bf16: no factor."""
    from huginn_jax.layers import attend_mgpu_causal

    keys = jax.random.split(jax.random.key(16), 3)
    q, k, v = (jax.random.normal(key, (1, 200, 55, 96), jnp.bfloat16) for key in keys)
    scaled = q * jnp.asarray(96**-0.5, jnp.bfloat16)
    ref = bf16(causal_attention_f64(scaled, k, v, scale=1.0))
    got = jax.jit(attend_mgpu_causal)(q, k, v)
    assert got.dtype == jnp.bfloat16
    assert_close(got, ref)
