"""Evaluating a trained model on a task: accuracy against test-time Core iterations, and when the
reference's `kl` criterion would exit (adaptive-exit statistics).

Shape letters: B batch, T positions, D model width, V vocabulary, A answer positions, R iterations,
N examples.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from huginn_jax.model import Huginn, embed, initial_state, run_coda, run_prelude
from huginn_jax.tasks import Task
from huginn_jax.train import iterate, split_core


@functools.partial(jax.jit, static_argnames=("graphdef", "max_iters", "positions"))
def _trajectory(graphdef, params, tokens_BxT, state0_BxTxD, *, max_iters: int, positions: tuple):
    """Runs `max_iters` Core iterations, decoding with the coda after every one.

    Returns per iteration and answer position: correct [R, B, A] bool, and kl [R, B, A] float32 =
    KL(p_{i-1} ‖ p_i) of the next-token distributions (iteration 1: against uniform).
    """
    model = nnx.merge(graphdef, params)
    ids, targets = tokens_BxT[:, :-1], tokens_BxT[:, 1:]
    pos_A = jnp.asarray(positions, jnp.int32)
    start = jnp.int32(0)
    embedded, _ = run_prelude(model, embed(model, ids), start, None)
    core_graphdef, core_params = split_core(model)
    targets_BxA = targets[:, pos_A]

    def body(carry, _):
        state, prev_logp = carry
        state = iterate(core_graphdef, core_params, state, embedded)
        logits, _, _ = run_coda(model, state, start, None)
        logp_BxAxV = jax.nn.log_softmax(logits[:, pos_A], axis=-1)
        kl = jnp.sum(jnp.exp(prev_logp) * (prev_logp - logp_BxAxV), axis=-1)
        correct = jnp.argmax(logp_BxAxV, axis=-1) == targets_BxA
        return (state, logp_BxAxV), (correct, kl)

    vocab = model.config.vocab_size
    uniform = jnp.full((*targets_BxA.shape, vocab), -jnp.log(jnp.float32(vocab)))
    _, (correct, kl) = jax.lax.scan(body, (state0_BxTxD, uniform), None, length=max_iters)
    return correct, kl


def evaluate(
    model: Huginn,
    task: Task,
    key: jax.Array,
    *,
    iterations: Sequence[int],
    num_examples: int = 1024,
    batch: int = 256,
    init_scale: float = 0.0,
    kl_threshold: float = 5e-4,
) -> dict[str, Any]:
    """Accuracy against test-time iterations, and adaptive-exit statistics, on fresh task samples.

    One compiled scan per batch runs max(iterations) Core iterations and decodes after each, so the
    whole curve costs about one run at the largest count. Initial state: zeros for init_scale 0,
    else a draw from `key`.
    Adaptive exit (the reference's `kl` criterion, threshold `kl_threshold`): an answer token exits
    at the first iteration i >= 2 with KL(p_{i-1} ‖ p_i) < threshold, else at max(iterations).
    Here all positions iterate in lockstep (a full-sequence forward), so an exit is where that
    token's prediction settles, not a per-token schedule with a KV cache.
    """
    iterations = sorted({int(r) for r in iterations})
    if not iterations or iterations[0] < 1:
        raise ValueError(f"iterations={iterations} must be positive")
    max_iters = iterations[-1]
    graphdef, params = nnx.split(model)
    correct_chunks, kl_chunks, difficulty_chunks = [], [], []
    positions = None
    for b, first in enumerate(range(0, num_examples, batch)):
        size = min(batch, num_examples - first)
        k_data, k_state = jax.random.split(jax.random.fold_in(key, b))
        data = task.sample(k_data, size)
        mask = np.asarray(data.loss_mask[:, 1:])
        if positions is None:
            positions = tuple(int(p) for p in np.flatnonzero(mask[0]))
        if not all(np.array_equal(np.flatnonzero(row), positions) for row in mask):
            raise ValueError(f"task {task.name} puts its answers at varying positions")
        state0 = initial_state(
            model.config,
            (size, task.seq_len - 1),
            init_scale=init_scale,
            key=k_state,
            dtype=model.dtype,
        )
        correct, kl = _trajectory(
            graphdef, params, data.tokens, state0, max_iters=max_iters, positions=positions
        )
        correct_chunks.append(np.asarray(correct))
        kl_chunks.append(np.asarray(kl))
        difficulty_chunks.append(np.asarray(data.difficulty[:, 1:])[:, list(positions)])
    correct_RxNxA = np.concatenate(correct_chunks, axis=1)  # N examples, A answers each
    kl_RxNxA = np.concatenate(kl_chunks, axis=1)
    difficulty_NxA = np.concatenate(difficulty_chunks, axis=0)

    rows = [r - 1 for r in iterations]
    by_difficulty = {}
    for d in task.difficulties:
        sel = difficulty_NxA == d
        if sel.any():
            by_difficulty[str(d)] = {
                "count": int(sel.sum()),
                "accuracy": [float(correct_RxNxA[r][sel].mean()) for r in rows],
            }
    return {
        "iterations": iterations,
        "init_scale": init_scale,
        "num_examples": num_examples,
        "answers_per_example": len(positions),
        "accuracy": [float(correct_RxNxA[r].mean()) for r in rows],
        "sequence_accuracy": [float(correct_RxNxA[r].all(axis=-1).mean()) for r in rows],
        "accuracy_every_iteration": [float(c.mean()) for c in correct_RxNxA],
        "by_difficulty": by_difficulty,
        "adaptive_exit": adaptive_exit_stats(correct_RxNxA, kl_RxNxA, difficulty_NxA, kl_threshold),
    }


def adaptive_exit_stats(
    correct_RxNxA: np.ndarray, kl_RxNxA: np.ndarray, difficulty_NxA: np.ndarray, threshold: float
) -> dict[str, Any]:
    """Exit iteration per answer token under the `kl` criterion and what it costs in accuracy."""
    num_iters = correct_RxNxA.shape[0]
    below = kl_RxNxA < threshold
    below[0] = False  # iteration 1 has no previous prediction to compare with
    exited = below.any(axis=0)
    exit_NxA = np.where(exited, below.argmax(axis=0) + 1, num_iters)  # 1-based iteration
    at_exit = np.take_along_axis(correct_RxNxA, (exit_NxA - 1)[None], axis=0)[0]
    by_difficulty = {
        str(int(d)): float(exit_NxA[difficulty_NxA == d].mean()) for d in np.unique(difficulty_NxA)
    }
    return {
        "criterion": "kl",
        "threshold": threshold,
        "max_iterations": num_iters,
        "mean_exit": float(exit_NxA.mean()),
        "median_exit": float(np.median(exit_NxA)),
        "p90_exit": float(np.percentile(exit_NxA, 90)),
        "fraction_exited": float(exited.mean()),
        "accuracy_at_exit": float(at_exit.mean()),
        "accuracy_at_max": float(correct_RxNxA[-1].mean()),
        "mean_exit_by_difficulty": by_difficulty,
        "exit_histogram": np.bincount(exit_NxA.ravel(), minlength=num_iters + 1)[1:].tolist(),
    }
