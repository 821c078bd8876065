"""Generation's exit criteria: each criterion's values and exit steps on made-up logits and
states, and the compiled loop stopping where its recorded values say."""

import numpy as np
import pytest
from conftest import micro_prompt

from huginn_jax.generate import CRITERIA, exit_schedule, generate


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
