"""Adaptive exit: the criteria, the per-sequence exit bookkeeping carried through the
recurrence loop, and a replay of that logic for tests and analysis."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Criterion(NamedTuple):
    """An exit criterion: `update(aux, logits_BxV, prev_state, state) -> (value_B, aux)`.

    A sequence exits when `value < threshold` (or `value >= threshold` if `exit_when_at_least`).
    `logits_BxV` are last-position logits (None when `needs_logits` is False, i.e. the coda is not
    run inside the loop); states are [B, T, D]. `aux` is a pytree with leading axis B.
    """

    name: str
    default_threshold: float
    needs_logits: bool
    exit_when_at_least: bool
    init: Callable[[int, int], Any]  # (batch, vocab) -> aux
    update: Callable[..., tuple[jax.Array, Any]]


def _kl_update(prev_logp_BxV, logits_BxV, prev_state, state):
    # KL(prev || cur) = sum exp(prev) (prev - cur), as F.kl_div(cur, prev, log_target=True).
    logp = jax.nn.log_softmax(logits_BxV.astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.exp(prev_logp_BxV) * (prev_logp_BxV - logp), axis=-1), logp


def _entropy_update(prev_entropy_B, logits_BxV, prev_state, state):
    probs = jax.nn.softmax(logits_BxV.astype(jnp.float32), axis=-1)
    entropy = -jnp.sum(probs * jnp.log(probs + 1e-10), axis=-1)
    return jnp.abs(entropy - prev_entropy_B), entropy


def _latent_update(aux, logits_BxV, prev_state_BxTxD, state_BxTxD):
    # ||s_i - s_{i-1}|| / ||s_i|| on the raw state, averaged over the step's positions.
    prev, cur = prev_state_BxTxD.astype(jnp.float32), state_BxTxD.astype(jnp.float32)
    diff_BxT = jnp.linalg.norm(prev - cur, axis=-1) / jnp.linalg.norm(cur, axis=-1)
    return jnp.mean(diff_BxT, axis=-1), aux


def _argmax_update(aux, logits_BxV, prev_state, state):
    prev_argmax_B, stable_B = aux
    argmax_B = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    stable_B = jnp.where(argmax_B == prev_argmax_B, stable_B + 1, 0)
    return stable_B.astype(jnp.float32), (argmax_B, stable_B)


CRITERIA: dict[str, Criterion] = {
    "kl": Criterion(
        "kl",
        5e-4,
        True,
        False,
        # prev starts as the uniform distribution over the vocabulary
        lambda b, v: jnp.full((b, v), -math.log(v), jnp.float32),
        _kl_update,
    ),
    "entropy-diff": Criterion(
        "entropy-diff",
        1e-3,
        True,
        False,
        lambda b, v: jnp.full((b,), 100.0, jnp.float32),
        _entropy_update,
    ),
    "latent-diff": Criterion(
        "latent-diff", 0.03, False, False, lambda b, v: jnp.zeros((b,), jnp.float32), _latent_update
    ),
    "argmax-stability": Criterion(
        "argmax-stability",
        5,
        True,
        True,  # exits once the argmax was unchanged for `threshold` consecutive steps
        lambda b, v: (jnp.full((b,), -1, jnp.int32), jnp.zeros((b,), jnp.int32)),
        _argmax_update,
    ),
}


class ExitState(NamedTuple):
    """Per-sequence exit bookkeeping carried through the recurrence loop."""

    done: jax.Array  # [B] bool: exited (state, logits and cache frozen from then on)
    steps: jax.Array  # [B] int32: recurrence steps run
    aux: Any  # criterion memory (previous log-probs, entropy, argmax), leading axis B
    values: jax.Array  # [B, M] float32: criterion value after each step, NaN once exited
    logits: jax.Array | None  # [B, V] float32: last-position logits at the latest step run


def init_exit(criterion: Criterion, batch: int, vocab: int, max_steps: int) -> ExitState:
    logits = jnp.zeros((batch, vocab), jnp.float32) if criterion.needs_logits else None
    return ExitState(
        done=jnp.zeros((batch,), bool),
        steps=jnp.zeros((batch,), jnp.int32),
        aux=criterion.init(batch, vocab),
        values=jnp.full((batch, max_steps), jnp.nan, jnp.float32),
        logits=logits,
    )


def update_exit(
    criterion: Criterion,
    threshold: float,
    min_steps: int,
    ex: ExitState,
    step,
    logits_BxV: jax.Array | None,
    prev_state_BxTxD: jax.Array,
    state_BxTxD: jax.Array,
) -> ExitState:
    """Bookkeeping after recurrence step `step` (0-based; `step + 1` steps have run).

    Only sequences still running change: they record the value, count the step, remember the
    logits, and exit if the criterion holds and `step + 1 >= min_steps`.
    """
    value_B, aux = criterion.update(ex.aux, logits_BxV, prev_state_BxTxD, state_BxTxD)
    running_B = ~ex.done
    holds_B = value_B >= threshold if criterion.exit_when_at_least else value_B < threshold
    exits_B = running_B & holds_B & (step + 1 >= min_steps)

    def keep_running(new, old):
        return jnp.where(running_B.reshape(-1, *([1] * (new.ndim - 1))), new, old)

    return ExitState(
        done=ex.done | exits_B,
        steps=jnp.where(running_B, step + 1, ex.steps),
        aux=jax.tree.map(keep_running, aux, ex.aux),
        values=ex.values.at[:, step].set(jnp.where(running_B, value_B, jnp.nan)),
        logits=None if logits_BxV is None else keep_running(logits_BxV, ex.logits),
    )


def exit_schedule(
    criterion: str,
    logits_SxBxV,
    states_SxBxTxD,
    *,
    threshold: float | None = None,
    min_steps: int = 0,
    init_state_BxTxD=None,
) -> ExitState:
    """Replays the loop's exit logic on given per-step logits and states (for tests and analysis).

    Step s (0-based) sees logits_SxBxV[s] and the states before/after it; the replay stops when
    every sequence has exited or after S steps, as the recurrence loop does.
    """
    crit = criterion_named(criterion)
    threshold = crit.default_threshold if threshold is None else threshold
    logits_SxBxV = jnp.asarray(logits_SxBxV, jnp.float32)
    states = jnp.asarray(states_SxBxTxD, jnp.float32)
    num, batch, vocab = logits_SxBxV.shape
    prev = jnp.zeros_like(states[0]) if init_state_BxTxD is None else jnp.asarray(init_state_BxTxD)
    ex = init_exit(crit, batch, vocab, num)
    for step in range(num):
        if bool(jnp.all(ex.done)):
            break
        logits = logits_SxBxV[step] if crit.needs_logits else None
        state = jnp.where(ex.done[:, None, None], prev, states[step])
        ex = update_exit(crit, threshold, min_steps, ex, step, logits, prev, state)
        prev = state
    return ex


def criterion_named(name: str | None) -> Criterion:
    try:
        return CRITERIA[name]
    except KeyError:
        known = ", ".join(["none", *CRITERIA])
        raise ValueError(f"unknown exit criterion {name!r}; known: {known}") from None
