"""Generation: conformance with the reference, per-sequence exits in a batch, prefill and
attention windows, sampling, continuous thought, errors, statistics and the cost model.

Compilations dominate the run time, so tests share settings (and thus executables) on purpose.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import MICRO, TINY_A, micro_prompt
from flax import nnx

import huginn_jax
from huginn_jax.config import HuginnConfig
from huginn_jax.generate import (
    StepSpec,
    decode_step_bytes,
    generate,
    make_plan,
    sample_token,
    time_parts,
)
from huginn_jax.generate.step import _step_jit

EXIT_AT = (jnp.float32(5e-4), jnp.int32(0))
# The reference's adaptive run (README (e)); cache_len fixed so that every use shares executables.
ADAPTIVE = dict(num_steps=16, criterion="kl", threshold=5e-4, init_scale=0.0, cache_len=12)


@pytest.fixture(scope="module")
def reference():
    return np.load(TINY_A / "reference.npz")


@pytest.fixture(scope="module")
def tiny():
    return huginn_jax.from_pretrained(TINY_A, dtype=jnp.float32)


# ---------------------------------------------------------------- conformance (README (d), (e))


def test_greedy_tokens_match_reference(tiny, reference):
    out = generate(tiny, reference["input_ids"][:, :6], 6, 4, init_scale=0.0)
    np.testing.assert_array_equal(out.tokens, reference["greedy_tokens"])
    assert np.all(out.steps == 4)
    assert out.stats["strategy"] == "full" and out.stats["new_tokens"] == 6


def test_adaptive_exit_matches_reference(tiny, reference):
    out = generate(tiny, reference["input_ids"][0:1, :6], 6, **ADAPTIVE, return_logits=True)
    np.testing.assert_array_equal(out.tokens, reference["adaptive_tokens"])
    np.testing.assert_array_equal(out.steps[0], reference["adaptive_steps"])  # [14, 9, 11, ...]
    values, expected = out.exit_values[0], reference["adaptive_exit_values"]
    np.testing.assert_array_equal(np.isnan(values), np.isnan(expected))
    np.testing.assert_allclose(values, expected, rtol=1e-2)
    np.testing.assert_allclose(out.logits[0], reference["adaptive_logits"], rtol=1e-4, atol=1e-4)
    assert out.stats["strategy"] == "latest-m4"
    assert out.stats["steps_per_token"] == pytest.approx(np.mean([14, 9, 11, 9, 11, 11]))


# ---------------------------------------------------------------- per-sequence exits in a batch


@pytest.mark.parametrize(
    "settings",
    [
        ADAPTIVE,
        {**ADAPTIVE, "criterion": "latent-diff", "threshold": 0.03, "strategy": "compress-s4"},
    ],
    ids=["latest-m4-kl", "compress-s4-latent-diff"],
)
def test_each_sequence_exits_on_its_own_and_then_stays_unchanged(tiny, reference, settings):
    """A batch gives each sequence exactly what it gets alone: the same steps, tokens, exit
    values and KV entries, although the loop runs on until the slowest sequence exits."""
    prompts = reference["input_ids"][:, :6]
    both = generate(tiny, prompts, 4, **settings)
    assert np.any(both.steps[0] != both.steps[1])  # the rows exit at different steps
    for b in range(2):
        alone = generate(tiny, prompts[b : b + 1], 4, **settings)
        np.testing.assert_array_equal(both.steps[b], alone.steps[0])
        np.testing.assert_array_equal(both.tokens[b], alone.tokens[0])
        np.testing.assert_allclose(both.exit_values[b], alone.exit_values[0], rtol=1e-2, atol=1e-6)
        # NaN exactly after each exit: nothing recorded once a sequence is done
        ran = ~np.isnan(both.exit_values[b])
        np.testing.assert_array_equal(ran.sum(axis=-1), both.steps[b])
        for name in ("k", "v"):
            got = np.asarray(getattr(both.cache, name))[:, b]
            want = np.asarray(getattr(alone.cache, name))[:, 0]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- sampling


def test_prefill_from_zero_attends_to_the_prompt_alone_and_agrees(micro):
    """The prefill's spec has from_zero: start is the constant 0, so attention scores only the
    prompt's T positions, not [T, cache_len]; same result as reading the whole cache slot
    (filled with noise beyond the prompt, which the mask must hide)."""
    t, cache_len = 6, 16
    ids = jnp.asarray(micro_prompt(2, t, seed=5))
    spec = StepSpec(num_steps=3, init_scale=1.0)
    graphdef, params = nnx.split(micro)

    def prefill(spec):
        cache = huginn_jax.KVCache.create(MICRO, batch=2, max_len=cache_len, num_steps=3)
        noise = jax.random.normal(jax.random.key(13), cache.k.shape)
        cache = dataclasses.replace(cache, k=noise, v=-noise)
        args = (params, ids, None, cache, jnp.int32(0), jax.random.key(1), EXIT_AT)
        text = _step_jit.lower(graphdef, *args, spec=spec).as_text()
        return _step_jit(graphdef, *args, spec=spec), text.replace(", ", "x")

    (read, read_hlo) = prefill(spec)
    (alone, alone_hlo) = prefill(dataclasses.replace(spec, from_zero=True))
    np.testing.assert_allclose(alone.logits, read.logits, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(alone.cache.k, read.cache.k, rtol=2e-5, atol=2e-5)
    assert int(alone.next_start) == t and alone.next_start.dtype == jnp.int32
    scores = f"{t}x{cache_len}xf32"  # [B, H, T, S] scores end in "6x16xf32" in StableHLO
    assert scores in read_hlo and scores not in alone_hlo


def test_attention_windows_read_only_the_filled_cache_and_agree(micro):
    """Decode steps read the filled positions rounded up to attention_window, one executable per
    window; tokens, logits and the final cache equal reading the whole (larger) cache, whose
    unfilled positions the mask hides anyway."""
    prompt = micro_prompt(2, 5, seed=9)
    kwargs = dict(num_steps=3, init_scale=1.0, seed=4, cache_len=28, return_logits=True)
    whole = generate(micro, prompt, 9, attention_window=0, **kwargs)
    windowed = generate(micro, prompt, 9, attention_window=4, **kwargs)
    # decode step i sees 5 + i positions (i = 1..8): 6..13 rounded up to 4 -> 8, 12, 16
    assert windowed.stats["attention_windows"] == [8, 12, 16]
    assert whole.stats["attention_windows"] == [28]
    np.testing.assert_array_equal(windowed.tokens, whole.tokens)
    np.testing.assert_allclose(windowed.logits, whole.logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(windowed.cache.k, whole.cache.k, rtol=1e-5, atol=1e-5)
    assert windowed.cache.read_len == 0  # the returned cache reads everything again
    cache = windowed.cache.with_read_len(8)
    k, v = cache.read(cache.core_slot(0, 0))
    assert k.shape[1] == v.shape[1] == 8
    np.testing.assert_array_equal(k, windowed.cache.k[cache.core_slot(0, 0), :, :8])
    with pytest.raises(ValueError, match="read_len=29"):
        windowed.cache.with_read_len(29)


def test_time_parts_times_each_part_and_keeps_the_cache(micro):
    cache = huginn_jax.KVCache.create(MICRO, batch=1, max_len=8, num_steps=3)
    parts, cache2 = time_parts(micro, cache, position=5, warmup=1, repeats=2)
    assert set(parts) == {"prelude_s", "core_iteration_s", "coda_head_s"}
    assert all(0 < v < 60 for v in parts.values())
    assert cache2.k.shape == cache.k.shape  # (the input cache was donated)
    # the Core iterations wrote their own slots at position 5 (3 slots: min(8, max_steps))
    written = np.abs(np.asarray(cache2.k[:, :, 5])).reshape(cache2.k.shape[0], -1).max(axis=1)
    assert np.all(written[cache2.core_slot(0, 0) : cache2.core_slot(2, 3) + 1] > 0)


def test_sample_token_filters():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 4000)

    def draws(**kw):
        return np.asarray(jax.vmap(lambda k: sample_token(logits, k, **kw)[0])(keys))

    assert int(sample_token(logits, keys[0], temperature=0.0, top_k=0, top_p=1.0)[0]) == 0
    assert set(draws(temperature=1.0, top_k=1, top_p=1.0)) == {0}
    assert set(draws(temperature=1.0, top_k=2, top_p=1.0)) == {0, 1}
    # top-p as the reference: drop tokens whose cumulative probability exceeds p
    assert set(draws(temperature=1.0, top_k=0, top_p=0.85)) == {0, 1}
    assert set(draws(temperature=1.0, top_k=0, top_p=0.01)) == {0}
    freq = np.bincount(draws(temperature=1.0, top_k=0, top_p=1.0), minlength=4) / 4000
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)
    cold = np.bincount(draws(temperature=0.5, top_k=0, top_p=1.0), minlength=4) / 4000
    np.testing.assert_allclose(cold, np.array([25, 9, 2.25, 0.25]) / 36.5, atol=0.03)


def test_sampling_is_reproducible_from_the_seed(micro):
    prompts = micro_prompt(2, 4)
    settings = dict(num_steps=3, temperature=1.0, top_k=20, top_p=0.9)
    first = generate(micro, prompts, 6, seed=7, **settings)
    again = generate(micro, prompts, 6, seed=7, **settings)
    other = generate(micro, prompts, 6, seed=8, **settings)
    np.testing.assert_array_equal(first.tokens, again.tokens)
    assert not np.array_equal(first.tokens, other.tokens)
    assert again.stats["compile_s"] == {"prefill": 0.0, "decode": 0.0}  # reused executables


# ---------------------------------------------------------------- continuous thought, strategies


def test_continuous_thought_starts_from_the_previous_final_state(micro):
    """generate(continuous=True) equals a hand-written loop over model(...) that feeds each
    position's final raw state into the next token. The generate side runs compress-s8, which
    for 2 steps maps every (iteration, layer) to its own slot, i.e. the full layout."""
    prompts = micro_prompt(1, 5, seed=2)
    out = generate(micro, prompts, 4, 2, init_scale=0.0, continuous=True, strategy="compress-s8")
    assert out.cache.k.shape[0] == 2 + 8 + 2
    cache = huginn_jax.KVCache.create(MICRO, batch=1, max_len=9, num_steps=2)
    step = micro(jnp.asarray(prompts), num_steps=2, init_scale=0.0, cache=cache)
    tokens = [int(step.logits[0, -1].argmax())]
    for position in range(5, 8):
        step = micro(
            jnp.array([[tokens[-1]]]),
            num_steps=2,
            init_state=step.state[:, -1:],
            cache=step.cache,
            start=position,
        )
        tokens.append(int(step.logits[0, -1].argmax()))
    np.testing.assert_array_equal(out.tokens[0], tokens)
    plain = generate(micro, prompts, 4, 2, init_scale=0.0, strategy="compress-s8")
    assert not np.array_equal(plain.tokens, out.tokens)  # the warm start matters here


# ---------------------------------------------------------------- errors and statistics


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(input_ids=np.zeros((1, 0), int)), "prompt is empty"),
        (dict(input_ids=[]), "prompt is empty"),
        (dict(input_ids=[[1, 64]]), r"token ids must lie in \[0, 64\)"),
        (dict(criterion="cosine"), "unknown exit criterion 'cosine'"),
        (dict(strategy="compress-x"), "unknown cache strategy"),
        (dict(criterion="kl", strategy="full"), "needs cache strategy 'latest-m4'"),
        (dict(max_new_tokens=30), r"= 33 positions exceed the model's block_size=32"),
        (dict(cache_len=4), "exceed the cache's capacity of cache_len=4"),
        (dict(cache_len=64), "cache_len=64 exceeds the model's block_size=32"),
        (dict(max_new_tokens=0), "max_new_tokens=0 must be at least 1"),
        (dict(num_steps=0), "num_steps=0"),
        (dict(min_steps=5), r"min_steps=5 must lie in \[0, num_steps=4\]"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=65), "top_k"),
        (dict(attention_window=-1), "attention_window=-1 must be >= 0"),
    ],
)
def test_bad_inputs_fail_clearly_before_any_work(kwargs, message):
    request = dict(input_ids=[[1, 2, 3]], max_new_tokens=2, num_steps=4) | kwargs
    with pytest.raises(ValueError, match=message):
        make_plan(MICRO, **request)


def test_bad_input_fails_in_generate_too(micro):
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(micro, [[]], 4)


def test_each_step_is_dispatched_before_the_token_before_it_is_read(micro, monkeypatch):
    """The token loop dispatches decode step n + 1 before it waits for token n, so the host's
    dispatch runs while the device decodes; it waits once per decode token."""
    from huginn_jax.generate import loop

    events = []
    compile_step, wait = loop.compiled_step, loop._wait

    def counted_step(*args):
        step, seconds = compile_step(*args)

        def call(*step_args):
            events.append("dispatch")
            return step(*step_args)

        return call, seconds

    def counted_wait(*args):
        events.append("wait")
        return wait(*args)

    monkeypatch.setattr(loop, "compiled_step", counted_step)
    monkeypatch.setattr(loop, "_wait", counted_wait)
    out = generate(micro, micro_prompt(2, 4), 4, 3)
    # the prefill, then decode tokens 1 and 2 before token 1 is waited for, ...
    assert events == ["dispatch"] * 3 + ["wait", "dispatch", "wait", "wait"]
    assert len(out.stats["decode_latency_s"]) == 3 and min(out.stats["decode_latency_s"]) > 0


def test_stats_and_cost_model(micro):
    out = generate(micro, micro_prompt(2, 4), 6, 3, temperature=1.0, top_k=20, top_p=0.9, seed=7)
    stats = out.stats
    assert stats["new_tokens"] == 6 and len(stats["decode_latency_s"]) == 5
    assert stats["steps_per_token"] == 3 and stats["cache_len"] == 10
    assert stats["cache_bytes"] == out.cache.nbytes
    assert (stats["model_shards"], stats["kv_heads"]) == (1, MICRO.n_heads)
    assert stats["weight_bytes"] == 4 * sum(x.size for x in jax.tree.leaves(nnx.state(micro)))
    assert stats["tokens_per_s"] == pytest.approx(2 * 5 / sum(stats["decode_latency_s"]))
    assert stats["achieved_gb_s"] > 0
    json.dumps(stats)  # JSON-ready
    # Cost model, huginn-0125, one token at context 1024 with 32 iterations: Core + adapter
    # 32 x 3.275 GB, prelude + coda 4 x 0.791 GB, head 0.692 GB, KV 132 entries x 1024 x 21,120 B.
    big = HuginnConfig.from_name("huginn_0125")
    total = decode_step_bytes(big, batch=1, context=1024, iterations=32)
    kv = 132 * 1024 * 21_120
    assert total == pytest.approx(104.79e9 + 3.163e9 + 0.692e9 + kv, rel=1e-3)
    no_kv = decode_step_bytes(big, batch=1, context=0, iterations=32)
    assert total - no_kv == pytest.approx(kv, rel=1e-3)


def test_decode_step_bytes_count_the_cache_s_padded_heads():
    """Under a mesh the cache holds n_heads padded to a multiple of its "model" axis (55 -> 56
    on 2 devices); the padded head's K/V are read and written like the others'."""
    from jax.sharding import AbstractMesh

    big = HuginnConfig.from_name("huginn_0125")
    split = dataclasses.replace(big, mesh=AbstractMesh((2,), ("model",)))
    assert split.attention_heads == 56
    kw = dict(batch=2, context=100, iterations=5, coda_runs=3)
    extra = decode_step_bytes(split, **kw) - decode_step_bytes(big, **kw)
    layers = 5 * split.n_core + split.n_layers_in_prelude + 3 * split.n_layers_in_coda
    one_head = 2 * 2 * split.head_dim * 2  # K and V, batch 2, bf16, one position
    assert extra == layers * one_head * (100 + 1)
