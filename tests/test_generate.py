"""Generation: conformance with the reference, exit criteria, batches, sampling, errors, CLI.

Compilations dominate the run time, so tests share settings (and thus executables) on purpose.
"""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_A
from flax import nnx

import huginn_jax
from huginn_jax.config import HuginnConfig
from huginn_jax.generate import (
    CRITERIA,
    StepSpec,
    decode_step_bytes,
    exit_schedule,
    generate,
    make_plan,
    sample_token,
    time_parts,
)
from huginn_jax.generate.step import _step_jit

MICRO = HuginnConfig.from_name("micro")
EXIT_AT = (jnp.float32(5e-4), jnp.int32(0))
# The reference's adaptive run (README (e)); cache_len fixed so that every use shares executables.
ADAPTIVE = dict(num_steps=16, criterion="kl", threshold=5e-4, init_scale=0.0, cache_len=12)


@pytest.fixture(scope="module")
def reference():
    return np.load(TINY_A / "reference.npz")


@pytest.fixture(scope="module")
def tiny():
    return huginn_jax.from_pretrained(TINY_A, dtype=jnp.float32)


@pytest.fixture(scope="module")
def micro():
    return huginn_jax.random_init(MICRO, jax.random.key(0))


def micro_prompt(batch, tokens, seed=1):
    return np.asarray(
        jax.random.randint(jax.random.key(seed), (batch, tokens), 0, MICRO.vocab_size)
    )


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


# ---------------------------------------------------------------- exit criteria


def test_kl_exits_at_first_small_step_after_min_steps():
    a, b = np.log([0.7, 0.2, 0.1]), np.log([0.2, 0.7, 0.1])
    # row 0: A, B, B, B, B, B (KL 0 from step 2 on); row 1: A, A, B, B, B, B
    logits = np.stack([[a, a], [b, a], [b, b], [b, b], [b, b], [b, b]])
    states = np.ones((6, 2, 1, 4))
    ex = exit_schedule("kl", logits, states)
    np.testing.assert_array_equal(ex.steps, [3, 2])  # row 1: step 2 repeats A, so KL = 0
    assert np.isnan(ex.values[0, 3:]).all() and np.isnan(ex.values[1, 2:]).all()
    uniform = np.full(3, -np.log(3))
    first = np.sum(np.exp(uniform) * (uniform - a))  # KL(uniform || A)
    np.testing.assert_allclose(ex.values[:, 0], [first, first], rtol=1e-5)
    np.testing.assert_array_equal(exit_schedule("kl", logits, states, min_steps=5).steps, [5, 5])
    never = exit_schedule("kl", logits, states, threshold=-1.0)
    np.testing.assert_array_equal(never.steps, [6, 6])  # the cap


def test_entropy_diff_looks_at_entropy_only():
    a = np.log([0.7, 0.2, 0.1])
    permuted, flat = a[[2, 0, 1]], np.zeros(3)
    # a permutation keeps the entropy: row 0 exits at step 2 although its argmax changed
    logits = np.stack([[a, a], [permuted, flat], [permuted, flat]])
    ex = exit_schedule("entropy-diff", logits, np.ones((3, 2, 1, 4)))
    np.testing.assert_array_equal(ex.steps, [2, 3])
    entropy = -np.sum(np.exp(a) * a)
    np.testing.assert_allclose(ex.values[0, :2], [100 - entropy, 0.0], atol=1e-5)


def test_latent_diff_is_relative_change_averaged_over_positions():
    u = np.random.default_rng(0).normal(size=(2, 8))  # 2 positions
    scales = [1.0, 1.5, 1.51, 1.52]
    states = np.stack([[s * u] for s in scales])  # [S, B=1, T=2, D]
    ex = exit_schedule("latent-diff", np.zeros((4, 1, 3)), states, threshold=0.03)
    np.testing.assert_allclose(ex.values[0, :3], [1.0, 0.5 / 1.5, 0.01 / 1.51], rtol=1e-5)
    np.testing.assert_array_equal(ex.steps, [3])
    # the mean over positions: at step 2 position 0 changes by 0.01 / 1.51, 1 by 0.05 / 1.05
    mixed = states.copy()
    mixed[2, 0, 1] = mixed[1, 0, 1] * 1.05
    mixed[3] = mixed[2]
    mean = (0.01 / 1.51 + 0.05 / 1.05) / 2  # 2.7 %
    for threshold, steps in ((0.03, 3), (0.02, 4)):
        ex = exit_schedule("latent-diff", np.zeros((4, 1, 3)), mixed, threshold=threshold)
        np.testing.assert_allclose(ex.values[0, 2], mean, rtol=1e-5)
        np.testing.assert_array_equal(ex.steps, [steps])


def test_argmax_stability_counts_unchanged_steps():
    def onehot(i):
        return np.eye(4)[i] * 5

    sequence = [1, 2, 2, 2, 2, 0, 0]  # argmax unchanged at steps 2, 3, 4 -> count 3 at step 4
    logits = np.stack([[onehot(i)] for i in sequence])
    ex = exit_schedule("argmax-stability", logits, np.ones((7, 1, 1, 2)), threshold=3)
    np.testing.assert_array_equal(ex.values[0, :5], [0, 0, 1, 2, 3])
    np.testing.assert_array_equal(ex.steps, [5])
    assert CRITERIA["argmax-stability"].default_threshold == 5


@pytest.mark.parametrize("criterion", list(CRITERIA))
def test_loop_exits_where_its_recorded_values_say(micro, criterion):
    """The compiled loop, per criterion: run without exit to record the values, pick a threshold,
    and check each sequence stops at the first step its value passes it (and not before
    min_steps). Threshold and min_steps are arguments: these runs share one executable."""
    prompts = micro_prompt(2, 5)
    settings = dict(num_steps=12, criterion=criterion, init_scale=0.0, cache_len=8)
    at_least = CRITERIA[criterion].exit_when_at_least
    never = generate(micro, prompts, 1, threshold=1e9 if at_least else -1.0, **settings)
    values = never.exit_values[:, 0]  # [B, 12] from the prefill
    assert not np.isnan(values).any() and np.all(never.steps == 12)
    threshold = 3.0 if at_least else float(np.sort(values[0])[5]) * 1.0001
    for min_steps in (0, 4):
        out = generate(micro, prompts, 1, threshold=threshold, min_steps=min_steps, **settings)
        passes = values >= threshold if at_least else values < threshold
        passes[:, : max(min_steps - 1, 0)] = False
        expected = np.where(passes.any(axis=1), passes.argmax(axis=1) + 1, 12)
        np.testing.assert_array_equal(out.steps[:, 0], expected)
        ran = ~np.isnan(out.exit_values[:, 0])
        np.testing.assert_array_equal(out.exit_values[:, 0][ran], values[ran])


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


# ---------------------------------------------------------------- command line


def _cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "huginn_jax.generate", "--noprogress", *args],
        capture_output=True,
        text=True,
        cwd=cwd or Path(__file__).parents[1],
        timeout=300,
    )


def test_cli_bad_input_exits_2_with_one_line():
    result = _cli("--config=micro", "--random_weights", "--prompt_ids=", "--max_new_tokens=2")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "generate: the prompt is empty (input_ids shape (1, 0)); give at least a token"
    ]


def test_cli_help_lists_its_flags_with_defaults():
    out = " ".join(_cli("--help").stdout.split())  # absl wraps the help text
    assert "--prompt_len: A random prompt of this many token ids" in out
    assert "--max_new_tokens: Tokens to generate per sequence (>= 1). (default: '32')" in out
    assert "kl 0.0005" in out and "argmax-stability 5" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt_len=-4"], "--prompt_len=-4: must be positive"),
        (["--prompt_len=3", "--criterion=kl", "--threshold=-1"], "needs > 0"),
        (["--prompt_len=3", "--criterion=argmax-stability", "--threshold=0"], "needs >= 1"),
        (["--prompt_len=3", "--threshold=0.1"], "--threshold applies to an adaptive exit"),
        (["--prompt_len=3", "--min_steps=2"], "--min_steps applies to an adaptive exit"),
        (["--prompt_len=3", "--criterion=kl", "--min_steps=40"], "--min_steps=40: must lie in"),
        (["--prompt_len=3", "--cache_len=-5"], "--cache_len=-5: must be >= 0"),
        (["--prompt_len=3", "--seed=-1"], "--seed=-1: must be >= 0"),
        (["--prompt_len=3", "--batch=0"], "--batch=0: must be at least 1"),
        (["--prompt_len=3", "--temperature=nan"], "--temperature=nan: must be a number >= 0"),
        (["--prompt_len=3", "--top_k=5"], "need --temperature > 0"),
        (["--prompt_len=3", "--temperature=1", "--top_p=0"], r"--top_p=0.0: must lie in \(0, 1\]"),
        (["--prompt_ids=1,-2"], "token ids >= 0"),
        (["--prompt_len=3", "--checkpoint=x", "--random_weights"], "goes with --config"),
        (
            ["--prompt_len=3", "--json_out=/proc/none/x.json"],
            "--json_out=/proc/none/x.json: cannot",
        ),
        (["--prompt_len=3", "--mesh=data:2"], "--mesh=data:2: expected model:N"),
        (["--prompt_len=3", "--mesh=model:0"], "--mesh=model:0: expected model:N"),
        (
            ["--prompt_len=3", "--mesh=model:1", "--decode_attention=pallas"],
            "--decode_attention=pallas runs on one device",
        ),
        (
            ["--prompt_len=3", "--mesh=model:1", "--decode_gemv=xla_rows8"],
            "--decode_gemv=xla_rows8 is a batch-1 path of one device",
        ),
    ],
)
def test_cli_refuses_bad_values_before_any_loading(args, message):
    """Every flag is checked against its range before a config, weights or a compile."""
    from absl import flags

    from huginn_jax.generate import options

    fv = flags.FlagValues()
    options.define_flags(fv)
    fv(["prog", "--config=micro", *args])
    with pytest.raises(options.UsageError, match=message):
        options.check_flags(fv)


def test_cli_kernel_flags_offer_the_configs_names():
    """--decode_attention and --decode_gemv accept exactly HuginnConfig's lists of names."""
    from absl import flags

    from huginn_jax.config import DECODE_ATTENTION_IMPLS, DECODE_GEMV_IMPLS
    from huginn_jax.generate import cli

    fv = flags.FlagValues()
    cli.define_flags(fv)
    assert fv["decode_attention"].parser.enum_values == list(DECODE_ATTENTION_IMPLS)
    assert fv["decode_gemv"].parser.enum_values == list(DECODE_GEMV_IMPLS)
    fv(["prog", "--decode_attention=pallas", "--decode_gemv=pallas"])
    assert (fv.decode_attention, fv.decode_gemv) == ("pallas", "pallas")


def test_cli_kernel_choices(tmp_path):
    """Every --decode_attention and --decode_gemv generates the default's float32 tokens (the
    Pallas kernels in interpret mode without a GPU); cuDNN (bf16 only) runs in bf16 on a GPU and
    ends in one line saying so without one; an unknown name ends in one line listing the known
    ones."""
    from huginn_jax.config import DECODE_ATTENTION_IMPLS, DECODE_GEMV_IMPLS

    on_gpu = jax.default_backend() == "gpu"
    runs = [(impl, "xla") for impl in DECODE_ATTENTION_IMPLS] + [
        ("xla", gemv) for gemv in DECODE_GEMV_IMPLS if gemv != "xla"
    ]
    tokens = {}
    for attention, gemv in runs:
        out = tmp_path / f"{attention}_{gemv}.json"
        dtype = "bf16" if attention == "cudnn" else "f32"
        result = _cli(
            "--config=micro", "--random_weights", f"--dtype={dtype}", "--prompt_len=20",
            "--max_new_tokens=4", "--num_steps=3", f"--decode_attention={attention}",
            f"--decode_gemv={gemv}", f"--json_out={out}",
        )  # fmt: skip
        if attention == "cudnn" and not on_gpu:
            assert result.returncode == 2
            assert result.stderr.strip().splitlines() == [
                "generate: decode_attention_impl='cudnn' needs an NVIDIA GPU (cuDNN's fused "
                f"attention); the backend here is {jax.default_backend()}"
            ]
            continue
        assert result.returncode == 0, result.stderr
        if dtype != "f32":  # other roundings, other tokens
            continue
        data = json.loads(out.read_text())
        flags = data["flags"]
        assert (flags["decode_attention"], flags["decode_gemv"]) == (attention, gemv)
        tokens[attention, gemv] = data["tokens"]
    assert len(tokens["xla", "xla"][0]) == 4
    assert all(t == tokens["xla", "xla"] for t in tokens.values()), tokens
    refused = _cli("--config=micro", "--random_weights", "--decode_attention=flash")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "generate: flag --decode_attention=flash: value should be one of "
        f"<{'|'.join(DECODE_ATTENTION_IMPLS)}>"
    ]


def test_cli_checkpoint_takes_the_kernel_choices(micro, tmp_path):
    """A --checkpoint model runs with the flags' kernel choices, not its config.json's defaults:
    without a GPU cuDNN is refused as with --config; on a GPU the Pallas kernels generate the
    default's tokens."""
    checkpoint = tmp_path / "ckpt"
    huginn_jax.save_pretrained(micro, checkpoint)
    args = [f"--checkpoint={checkpoint}", "--dtype=f32", "--prompt_ids=1,2,3", "--num_steps=2"]
    args.append("--max_new_tokens=3")
    if jax.default_backend() != "gpu":
        result = _cli(*args, "--decode_attention=cudnn")
        assert result.returncode == 2
        assert "generate: decode_attention_impl='cudnn' needs an NVIDIA GPU" in result.stderr
        return
    tokens = []
    for impl in ("xla", "pallas"):
        out = tmp_path / f"{impl}.json"
        kernels = [f"--decode_attention={impl}", f"--decode_gemv={impl}"]
        result = _cli(*args, *kernels, f"--json_out={out}")
        assert result.returncode == 0, result.stderr
        tokens.append(json.loads(out.read_text())["tokens"])
    assert tokens[0] == tokens[1]


def test_cli_runs_and_writes_json(micro, tmp_path):
    tokenizers = pytest.importorskip(
        "tokenizers", reason='needs tokenizers: pip install -e ".[text]"'
    )
    checkpoint = tmp_path / "ckpt"
    huginn_jax.save_pretrained(micro, checkpoint)
    vocab = {f"w{i}": i for i in range(MICRO.vocab_size)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(checkpoint / "tokenizer.json"))
    out = tmp_path / "out.json"
    result = _cli(
        f"--checkpoint={checkpoint}",
        "--dtype=f32",
        "--prompt=w3 w5 w7",
        "--max_new_tokens=3",
        "--num_steps=2",
        "--criterion=kl",
        "--threshold=1e-3",
        f"--json_out={out}",
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert data["flags"]["prompt"] == "w3 w5 w7" and data["flags"]["criterion"] == "kl"
    stats = data["stats"]
    assert stats["prompt_len"] == 3 and stats["strategy"] == "latest-m4"
    assert len(data["tokens"][0]) == 3 and all(1 <= s <= 2 for s in data["steps"][0])
    for key in ("latency_median_s", "tokens_per_s", "achieved_gb_s", "cache_bytes"):
        assert stats[key] is not None
    assert result.stdout.startswith("[0] 'w")  # the decoded text, then the table
    assert "tokens/s" in result.stdout
