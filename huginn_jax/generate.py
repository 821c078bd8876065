"""Generation: a prefill, then one compiled step per token, with adaptive exit, sampling, cache
strategies and continuous thought; and a command line (`python -m huginn_jax.generate --help`).

Each token is ONE compiled call of `step`: prelude → Core iterations (a `lax.scan` for a fixed
count, a `lax.while_loop` with per-sequence exit checks for a criterion) → coda → sampling. The
cache is donated, so every write is in place. The Python loop over tokens only dispatches and
waits (to time each token).

Shape letters: B batch, T positions of a step (the prompt for the prefill, 1 for a decode step),
D model width, V vocabulary, M most recurrence steps per token, N new tokens.

Adaptive exit (the reference's `generate_with_adaptive_compute`, per token): after every Core
iteration the criterion is evaluated on the last position; a sequence exits at the first step
where it holds (and at least `min_steps` steps ran), else after `num_steps`. In a batch each
sequence exits on its own: finished ones keep their state, logits and cache entries while the
others run on, and the loop ends when all have exited.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from huginn_jax import costs
from huginn_jax.config import HuginnConfig
from huginn_jax.kv_cache import KVCache, parse_strategy
from huginn_jax.model import (
    Huginn,
    core_step,
    embed,
    initial_state,
    run_coda,
    run_core,
    run_prelude,
)
from huginn_jax.xla_flags import use_gemm

# --------------------------------------------------------------------------------------------
# Exit criteria


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
    crit = _criterion(criterion)
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


def _criterion(name: str | None) -> Criterion:
    try:
        return CRITERIA[name]
    except KeyError:
        known = ", ".join(["none", *CRITERIA])
        raise ValueError(f"unknown exit criterion {name!r}; known: {known}") from None


# --------------------------------------------------------------------------------------------
# Sampling


def sample_token(
    logits_BxV: jax.Array, key: jax.Array, *, temperature: float, top_k: int, top_p: float
) -> jax.Array:
    """Next token [B] int32: argmax when temperature == 0, else a draw from `key`.

    As the reference's `_sample_next_token`: softmax(logits / temperature); top-k zeroes
    probabilities below the k-th largest; top-p (on those probabilities, unrenormalised) drops
    tokens whose descending cumulative probability exceeds p, always keeping the most likely one;
    then renormalise and draw. top_k = 0 and top_p >= 1 switch those filters off.
    """
    if temperature == 0.0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    probs = jax.nn.softmax(logits_BxV.astype(jnp.float32) / temperature, axis=-1)
    if top_k > 0:
        kth_Bx1 = jax.lax.top_k(probs, top_k)[0][:, -1:]
        probs = jnp.where(probs < kth_Bx1, 0.0, probs)
    if top_p < 1.0:
        order_BxV = jnp.argsort(-probs, axis=-1)
        sorted_probs = jnp.take_along_axis(probs, order_BxV, axis=-1)
        drop_sorted = (jnp.cumsum(sorted_probs, axis=-1) > top_p).at[:, 0].set(False)
        rows = jnp.arange(probs.shape[0])[:, None]
        drop = jnp.zeros_like(drop_sorted).at[rows, order_BxV].set(drop_sorted)
        probs = jnp.where(drop, 0.0, probs)
    # categorical normalises, so the renormalisation is implicit; log(0) = -inf is never drawn.
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)


# --------------------------------------------------------------------------------------------
# One token: the compiled step


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Static settings of the per-token step (hashable: part of the compilation key). The exit
    threshold and min_steps are arguments instead, so sweeping them does not recompile."""

    num_steps: int
    criterion: str | None = None  # None: always num_steps iterations
    init_scale: float = 1.0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    # The step's positions start at 0 (the prompt): `start` is then the constant 0, so attention
    # reads only the new positions, not the whole preallocated cache.
    from_zero: bool = False


class StepOutput(NamedTuple):
    token: jax.Array  # [B] int32
    steps: jax.Array  # [B] int32 recurrence steps run
    exit_values: jax.Array  # [B, M] float32 (NaN after the exit, all NaN without criterion)
    logits: jax.Array  # [B, V] float32, what the token was drawn from
    state: jax.Array  # [B, D] final raw state of the last position (continuous thought)
    cache: KVCache
    next_start: jax.Array  # int32: position of the next step's first token


def step(
    model: Huginn,
    ids_BxT: jax.Array,
    prev_state_BxD: jax.Array | None,
    cache: KVCache,
    start: jax.Array,
    key: jax.Array,
    exit_at: tuple[jax.Array, jax.Array],
    spec: StepSpec,
) -> StepOutput:
    """Prelude → recurrence (with exits) → coda → sampling for T new positions, traceable.

    The initial state is `prev_state_BxD` (continuous thought, T must be 1) when given, else the
    reference's s0 (zeros for init_scale 0, else drawn from `key` folded with `start`).
    `exit_at` = (threshold float32, min_steps int32) for `spec.criterion`.
    """
    cfg = model.config
    ids_BxT = ids_BxT[:, None] if ids_BxT.ndim == 1 else ids_BxT
    batch, tokens = ids_BxT.shape
    if spec.from_zero:
        start = 0
    init_key, sample_key = jax.random.split(jax.random.fold_in(key, start))
    if prev_state_BxD is not None:
        state0 = prev_state_BxD[:, None, :].astype(model.dtype)
    else:
        state0 = initial_state(
            cfg, (batch, tokens), init_scale=spec.init_scale, key=init_key, dtype=model.dtype
        )
    embedded, cache = run_prelude(model, embed(model, ids_BxT), start, cache)
    nan_values = jnp.full((batch, spec.num_steps), jnp.nan, jnp.float32)
    if spec.criterion is None:
        state, cache = run_core(model, state0, embedded, start, cache, spec.num_steps)
        logits, _, cache = run_coda(model, state, start, cache, last_only=True)
        steps, values = jnp.full((batch,), spec.num_steps, jnp.int32), nan_values
    else:
        crit = CRITERIA[spec.criterion]
        state, cache, ex = _adaptive_core(
            model, crit, spec, exit_at, state0, embedded, start, cache
        )
        if crit.needs_logits:
            logits = ex.logits
        else:  # the coda ran nowhere yet: once now, on every sequence's final state
            logits, _, cache = run_coda(model, state, start, cache, last_only=True)
        if not cache.compressed:
            cache = cache.fill_after_exit(ex.steps, start, tokens)
        steps, values = ex.steps, ex.values
    token = sample_token(
        logits, sample_key, temperature=spec.temperature, top_k=spec.top_k, top_p=spec.top_p
    )
    next_start = jnp.asarray(start + tokens, jnp.int32)  # int32 also when start is the constant 0
    return StepOutput(token, steps, values, logits, state[:, -1], cache, next_start)


def _adaptive_core(model, crit: Criterion, spec: StepSpec, exit_at, state0, embedded, start, cache):
    """Recurrence as a `lax.while_loop` with a per-sequence exit check after every iteration.

    Exited sequences keep their state (jnp.where) and logits, and in the end their cache entries:
    - full layout: their extra writes land in slots of iterations they did not run, which
      `fill_after_exit` overwrites afterwards;
    - compress-sN (slots shared across iterations): the loop carries the Core entries of the
      step's positions ([N, B, T, H, K], small), refreshed for the sequences that ran the
      previous iteration, and writes them back after the loop;
    - coda: rewritten with identical values (same frozen state, same history).
    """
    batch, tokens, _ = state0.shape
    graphdef, params = nnx.split(model)
    # With one sequence the loop simply stops at the exit, so nothing needs restoring.
    track = cache.compressed and batch > 1

    def cond(carry):
        i, _, _, ex, _ = carry
        return (i < spec.num_steps) & ~jnp.all(ex.done)

    def body(carry):
        i, state, cache, ex, saved = carry
        m = nnx.merge(graphdef, params)
        if track:
            saved, cache = _track_entries(saved, cache, start, tokens, ex.steps == i)
        new_state, cache = core_step(m, state, embedded, i, start, cache)
        new_state = jnp.where(ex.done[:, None, None], state, new_state)
        logits = None
        if crit.needs_logits:
            # The reference's check: coda on the current state, overwriting this position's coda
            # KV entries at every check (the ones left are from the exit step).
            logits, _, cache = run_coda(m, new_state, start, cache, last_only=True)
        ex = update_exit(crit, *exit_at, ex, i, logits, state, new_state)
        return i + 1, new_state, cache, ex, saved

    ex0 = init_exit(crit, batch, model.config.vocab_size, spec.num_steps)
    # Positions [start, start + T) are fresh, so their entries start as zeros.
    shape = (cache.num_core_slots, batch, tokens, *cache.k.shape[3:])
    saved0 = (jnp.zeros(shape, cache.k.dtype),) * 2 if track else None
    carry0 = (jnp.int32(0), state0, cache, ex0, saved0)
    last, state, cache, ex, saved = jax.lax.while_loop(cond, body, carry0)
    if track:
        saved, cache = _track_entries(saved, cache, start, tokens, ex.steps == last)
        cache = cache.write_core_positions(start, *saved)
    return state, cache, ex


def _track_entries(saved, cache: KVCache, start, tokens: int, ran_B):
    """Copies the Core entries of positions [start, start + T) into `saved` ([C, B, T, H, K]
    pairs) for the sequences that ran the last iteration; the others keep their exit entries."""
    # The barrier orders this read before any later write; without it XLA copies the whole
    # cache to keep the version read alive.
    current, cache = jax.lax.optimization_barrier((cache.core_positions(start, tokens), cache))
    ran = ran_B[None, :, None, None, None]
    return tuple(jnp.where(ran, c, o) for c, o in zip(current, saved, strict=True)), cache


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"), donate_argnames=("cache",))
def _step_jit(graphdef, params, ids, prev_state, cache, start, key, exit_at, *, spec):
    return step(nnx.merge(graphdef, params), ids, prev_state, cache, start, key, exit_at, spec)


_EXECUTABLES: dict = {}  # (graphdef, spec, argument avals) -> compiled step
_MAX_EXECUTABLES = 32


def _compiled(graphdef, spec: StepSpec, args: tuple) -> tuple[Any, float]:
    """The compiled step for these argument shapes, and the seconds spent compiling it now."""
    leaves, treedef = jax.tree.flatten(args)
    key = (graphdef, spec, treedef, tuple((x.shape, str(x.dtype)) for x in leaves))
    if key in _EXECUTABLES:
        return _EXECUTABLES[key], 0.0
    t0 = time.perf_counter()
    executable = _step_jit.lower(graphdef, *args, spec=spec).compile()
    seconds = time.perf_counter() - t0
    if len(_EXECUTABLES) >= _MAX_EXECUTABLES:
        _EXECUTABLES.pop(next(iter(_EXECUTABLES)))
    _EXECUTABLES[key] = executable
    return executable, seconds


# --------------------------------------------------------------------------------------------
# The token loop


@dataclasses.dataclass(frozen=True)
class Generation:
    """What `generate` returns. Token 0 of every sequence comes from the prefill."""

    tokens: np.ndarray  # [B, N] int32: the new tokens
    steps: np.ndarray  # [B, N] int32: recurrence steps run for each new token
    exit_values: np.ndarray  # [B, N, M] float32: criterion value after each step (NaN: not run)
    logits: np.ndarray | None  # [B, N, V] float32 with return_logits, else None
    stats: dict[str, Any]  # timings, throughput, memory (see `generate`)
    cache: KVCache  # the final cache


@dataclasses.dataclass(frozen=True)
class Plan:
    """A checked generation request: everything `generate` needs besides the weights."""

    ids: np.ndarray  # [B, T] int32 prompt
    max_new_tokens: int
    spec: StepSpec
    strategy: str
    cache_len: int
    continuous: bool
    seed: int
    threshold: float  # exit threshold (unused without a criterion)
    min_steps: int


def make_plan(
    config: HuginnConfig,
    input_ids,
    max_new_tokens: int,
    num_steps: int = 32,
    *,
    criterion: str | None = None,
    threshold: float | None = None,
    min_steps: int = 0,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    init_scale: float = 1.0,
    continuous: bool = False,
    strategy: str | None = None,
    cache_len: int | None = None,
) -> Plan:
    """Checks a request against `config` without touching weights (see `generate`).

    Raises ValueError with one clear sentence for an empty or out-of-vocabulary prompt, an
    unknown criterion or strategy, a prompt + max_new_tokens beyond the cache or block_size,
    and out-of-range settings."""
    ids = _check_prompt(input_ids, config)
    prompt_len = ids.shape[1]
    crit_name = None if criterion in (None, "none") else criterion
    crit = None if crit_name is None else _criterion(crit_name)
    strategy = strategy or ("latest-m4" if crit is not None else "full")
    parse_strategy(strategy)
    if crit is not None and strategy == "full":
        raise ValueError(
            "adaptive exit needs cache strategy 'latest-m4' (or 'compress-sN'): with 'full', "
            "tokens that exited early have no entries for later steps"
        )
    _check_settings(
        config,
        max_new_tokens=max_new_tokens,
        num_steps=num_steps,
        min_steps=min_steps,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        init_scale=init_scale,
    )
    needed = prompt_len + max_new_tokens
    what = f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {needed} positions"
    if needed > config.block_size:
        raise ValueError(f"{what} exceed the model's block_size={config.block_size}")
    cache_len = needed if cache_len is None else cache_len
    if cache_len > config.block_size:
        raise ValueError(
            f"cache_len={cache_len} exceeds the model's block_size={config.block_size}"
        )
    if needed > cache_len:
        raise ValueError(f"{what} exceed the cache's capacity of cache_len={cache_len}")
    if threshold is None:
        threshold = crit.default_threshold if crit is not None else 0.0
    spec = StepSpec(
        num_steps=num_steps,
        criterion=crit_name,
        init_scale=float(init_scale),
        temperature=float(temperature),
        top_k=top_k,
        top_p=float(top_p),
    )
    return Plan(
        ids,
        max_new_tokens,
        spec,
        strategy,
        cache_len,
        continuous,
        seed,
        float(threshold),
        min_steps,
    )


def generate(
    model: Huginn,
    input_ids,
    max_new_tokens: int,
    num_steps: int = 32,
    *,
    criterion: str | None = None,
    threshold: float | None = None,
    min_steps: int = 0,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    init_scale: float = 1.0,
    continuous: bool = False,
    strategy: str | None = None,
    cache_len: int | None = None,
    return_logits: bool = False,
    progress: bool = False,
) -> Generation:
    """Generates `max_new_tokens` tokens after `input_ids` ([T] or [B, T] int, no padding).

    - `num_steps`: recurrence steps per token; with a `criterion` ("kl", "entropy-diff",
      "latent-diff", "argmax-stability"; None or "none" for a fixed count) the most steps, and a
      sequence exits once the criterion's value drops below `threshold` (argmax-stability: the
      argmax was unchanged for `threshold` steps) after at least `min_steps` steps.
    - Sampling: greedy for temperature == 0, else temperature / top_k / top_p; all randomness
      (sampling, random initial states for init_scale > 0) comes from `seed`.
    - `continuous`: each decoded token's recurrence starts from the previous position's final
      state (the prefill starts from s0).
    - `strategy`: KV cache layout, "full", "latest-m4" or "compress-sN" (see kv_cache); default
      "latest-m4" with a criterion (what adaptive exits need), else "full". `cache_len`: positions
      to allocate (default prompt + max_new_tokens, at most the model's block_size).

    Every argument is checked before any work (`make_plan`); bad ones raise ValueError. `stats`
    holds compile seconds (apart), the prefill time, per-token decode latencies and their median,
    tokens/s, steps per token, achieved GB/s over the bytes a decode step must move
    (`decode_step_bytes`), cache and weight bytes, and the peak device memory where reported.
    """
    plan = make_plan(
        model.config,
        input_ids,
        max_new_tokens,
        num_steps,
        criterion=criterion,
        threshold=threshold,
        min_steps=min_steps,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        init_scale=init_scale,
        continuous=continuous,
        strategy=strategy,
        cache_len=cache_len,
    )
    return run_plan(model, plan, return_logits=return_logits, progress=progress)


def run_plan(
    model: Huginn, plan: Plan, *, return_logits: bool = False, progress: bool = False
) -> Generation:
    """Runs a checked request: compiles the prefill and decode steps, then the token loop."""
    cfg, spec = model.config, plan.spec
    batch, prompt_len = plan.ids.shape
    peak_before = peak_memory_bytes()  # weights loaded; tells a loading peak from a run's

    def new_cache():
        return KVCache.create(
            cfg,
            batch=batch,
            max_len=plan.cache_len,
            num_steps=spec.num_steps,
            dtype=model.dtype,
            strategy=plan.strategy,
        )

    # Compiled against the cache's shape before the cache exists: compilation (autotuning
    # scratch buffers included) never holds device memory next to it.
    cache_shape = jax.eval_shape(new_cache)
    graphdef, params = nnx.split(model)
    key = jax.random.key(plan.seed)
    exit_at = (jnp.float32(plan.threshold), jnp.int32(plan.min_steps))
    ids = jnp.asarray(plan.ids)
    prefill_spec = dataclasses.replace(spec, from_zero=True)
    prefill_args = (params, ids, None, cache_shape, jnp.int32(0), key, exit_at)
    prefill, compile_prefill = _compiled(graphdef, prefill_spec, prefill_args)
    compile_decode = 0.0
    temp_bytes = {"prefill": _temp_bytes(prefill)}
    prev_state = jnp.zeros((batch, cfg.n_embd), model.dtype) if plan.continuous else None
    if plan.max_new_tokens > 1:
        token = jnp.zeros((batch,), jnp.int32)
        decode_args = (params, token, prev_state, cache_shape, jnp.int32(0), key, exit_at)
        decode, compile_decode = _compiled(graphdef, spec, decode_args)
        temp_bytes["decode"] = _temp_bytes(decode)
    prefill_args = (params, ids, None, new_cache(), jnp.int32(0), key, exit_at)

    t0 = time.perf_counter()
    out = prefill(*prefill_args)
    out.token.block_until_ready()
    prefill_s = time.perf_counter() - t0
    records = [_record(out, return_logits)]
    latencies = []
    bar = _progress_bar(plan.max_new_tokens, progress)
    bar.update(1)
    for _ in range(1, plan.max_new_tokens):
        t0 = time.perf_counter()
        prev_state = out.state if plan.continuous else None
        out = decode(params, out.token, prev_state, out.cache, out.next_start, key, exit_at)
        out.token.block_until_ready()  # per-token latency; the next step needs it anyway
        latencies.append(time.perf_counter() - t0)
        records.append(_record(out, return_logits))
        bar.update(1)
    bar.close()

    tokens, steps, values, logits = (
        None if parts[0] is None else np.stack([np.asarray(p) for p in parts], axis=1)
        for parts in zip(*records, strict=True)
    )
    stats = _stats(
        model,
        plan,
        steps=steps,
        cache=out.cache,
        compile_s={"prefill": compile_prefill, "decode": compile_decode},
        prefill_s=prefill_s,
        latencies=latencies,
    )
    stats["peak_bytes_before_generation"] = peak_before
    stats["executable_temp_bytes"] = temp_bytes
    return Generation(tokens, steps, values, logits, stats, out.cache)


def _temp_bytes(executable) -> int | None:
    """Scratch memory XLA assigned to a compiled step (None where the backend does not say)."""
    try:
        return int(executable.memory_analysis().temp_size_in_bytes)
    except Exception:  # memory_analysis is optional for a backend
        return None


def _record(out: StepOutput, with_logits: bool):
    return out.token, out.steps, out.exit_values, out.logits if with_logits else None


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, enabled: bool):
    """A tqdm bar over tokens on stderr; a no-op when disabled or tqdm is missing."""
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, unit="tok", dynamic_ncols=True, leave=False)


def _check_prompt(input_ids, cfg: HuginnConfig) -> np.ndarray:
    ids = np.asarray(input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be [tokens] or [batch, tokens], got shape {ids.shape}")
    if ids.shape[0] < 1 or ids.shape[1] < 1:
        raise ValueError(
            f"the prompt is empty (input_ids shape {ids.shape}); give at least a token"
        )
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids must be integers, got {ids.dtype}")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(
            f"token ids must lie in [0, {cfg.vocab_size}), got [{ids.min()}, {ids.max()}]"
        )
    return ids.astype(np.int32)


def _check_settings(
    cfg: HuginnConfig,
    *,
    max_new_tokens,
    num_steps,
    min_steps,
    temperature,
    top_k,
    top_p,
    init_scale,
):
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1")
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps} must be at least 1")
    if not 0 <= min_steps <= num_steps:
        raise ValueError(f"min_steps={min_steps} must lie in [0, num_steps={num_steps}]")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy)")
    if not 0 <= top_k <= cfg.vocab_size:
        raise ValueError(f"top_k={top_k} must lie in [0, vocab_size={cfg.vocab_size}] (0: off)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must lie in (0, 1] (1: off)")
    if init_scale < 0:
        raise ValueError(f"init_scale={init_scale} must be >= 0")


# --------------------------------------------------------------------------------------------
# Statistics


def decode_step_bytes(
    config: HuginnConfig,
    *,
    batch: int,
    context: int,
    iterations: int,
    coda_runs: int = 1,
    dtype_bytes: int = 2,
) -> int:
    """HBM bytes one decode step must move (the cost model's counting rules, `costs`).

    `iterations` Core iterations (each re-reads Core + adapter weights and its KV entries of
    `context` cached positions), the prelude once, the coda and the tied head `coda_runs` times
    (an adaptive check runs them after every iteration). Each outer block counts like a Core
    layer: its weights, its K/V reads of `context` positions and its new K/V written.
    """
    core = costs.totals(
        costs.core_iteration_ops(
            config, batch=batch, context=context, mode="decode", dtype_bytes=dtype_bytes
        )
    )
    kv_entry = batch * config.n_heads * config.head_dim * dtype_bytes  # K or V, one position
    block = costs.block_param_count(config) * dtype_bytes + 2 * kv_entry * (context + 1)
    head = config.vocab_size * config.n_embd * dtype_bytes + batch * config.vocab_size * 4
    return (
        iterations * core.hbm_bytes
        + config.n_layers_in_prelude * block
        + coda_runs * (config.n_layers_in_coda * block + head)
    )


def peak_memory_bytes(device=None) -> int | None:
    """The allocator's peak bytes in use on `device` (default: the first), or None (e.g. CPU)."""
    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        return None
    return None if not stats else stats.get("peak_bytes_in_use")


def _stats(model: Huginn, plan: Plan, *, steps, cache, compile_s, prefill_s, latencies):
    cfg, spec, prompt_len = model.config, plan.spec, plan.ids.shape[1]
    batch, new_tokens = steps.shape
    dtype_bytes = jnp.dtype(model.dtype).itemsize
    needs_logits = spec.criterion is not None and CRITERIA[spec.criterion].needs_logits
    # The batch runs as many iterations as its slowest sequence.
    iterations = steps.max(axis=0)
    step_bytes = [
        decode_step_bytes(
            cfg,
            batch=batch,
            context=prompt_len + n - 1,
            iterations=int(iterations[n]),
            coda_runs=int(iterations[n]) if needs_logits else 1,
            dtype_bytes=dtype_bytes,
        )
        for n in range(1, new_tokens)
    ]
    decode_s = sum(latencies)
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "num_steps": spec.num_steps,
        "criterion": spec.criterion or "none",
        "threshold": plan.threshold if spec.criterion else None,
        "min_steps": plan.min_steps,
        "strategy": plan.strategy,
        "continuous": plan.continuous,
        "temperature": spec.temperature,
        "top_k": spec.top_k,
        "top_p": spec.top_p,
        "seed": plan.seed,
        "init_scale": spec.init_scale,
        "dtype": str(jnp.dtype(model.dtype)),
        "cache_len": cache.max_len,
        "cache_bytes": cache.nbytes,
        "weight_bytes": weights,
        "compile_s": compile_s,
        "prefill_s": prefill_s,
        "decode_latency_s": latencies,
        "latency_median_s": statistics.median(latencies) if latencies else None,
        "tokens_per_s": batch * len(latencies) / decode_s if latencies else None,
        "steps_per_token": float(steps.mean()),
        "decode_steps_per_token": float(steps[:, 1:].mean()) if new_tokens > 1 else None,
        "decode_step_bytes": step_bytes,
        "achieved_gb_s": sum(step_bytes) / decode_s / 1e9 if latencies else None,
        "peak_bytes_in_use": peak_memory_bytes(),
        "device": jax.local_devices()[0].device_kind,
    }


def greedy(
    model: Huginn, prompt_ids: jax.Array, max_new_tokens: int, *, num_steps: int
) -> jax.Array:
    """Greedy decoding with a zero initial state and a `full` cache. Returns [B, max_new_tokens]."""
    out = generate(model, prompt_ids, max_new_tokens, num_steps, init_scale=0.0, strategy="full")
    return jnp.asarray(out.tokens)


# --------------------------------------------------------------------------------------------
# Per-part timing (what a token's latency should be made of)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _prelude_jit(graphdef, params, ids_BxT, cache, start):
    m = nnx.merge(graphdef, params)
    return run_prelude(m, embed(m, ids_BxT), start, cache)


@functools.partial(jax.jit, static_argnames=("graphdef", "n"), donate_argnames=("cache",))
def _core_iterations_jit(graphdef, params, state, embedded, cache, start, *, n):
    return run_core(nnx.merge(graphdef, params), state, embedded, start, cache, n)


CORE_TIMING_ITERATIONS = 8  # Core iterations in the executable whose time is divided by them


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _coda_jit(graphdef, params, state, cache, start):
    logits, _, cache = run_coda(nnx.merge(graphdef, params), state, start, cache, last_only=True)
    return logits, cache


def time_parts(
    model: Huginn, cache: KVCache, position: int, *, warmup: int = 3, repeats: int = 20
) -> tuple[dict[str, float], KVCache]:
    """Median seconds of one decode token's parts at `position`: prelude and coda + head, each
    one compiled call, and ONE Core iteration (adapter + Core layers) as 1/n of an executable
    that runs n = CORE_TIMING_ITERATIONS of them (as experiments.core measures it: one dispatch
    per token-iteration would time the launch, not the GPU). Each call is timed until its
    outputs are ready, after `warmup` untimed calls; caches are not flushed. Overwrites the
    cache's entries at `position`; returns the cache (it is donated)."""
    graphdef, params = nnx.split(model)
    batch = cache.k.shape[1]
    start = jnp.int32(position)
    ids = jnp.zeros((batch, 1), jnp.int32)
    state = jnp.ones((batch, 1, model.config.n_embd), model.dtype)

    def timed(fn, *args, **static):
        nonlocal cache
        samples = []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            out, cache = fn(graphdef, params, *args, cache, start, **static)
            jax.block_until_ready((out, cache))
            if i >= warmup:
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples), out

    n = min(CORE_TIMING_ITERATIONS, cache.max_steps)
    prelude_s, embedded = timed(_prelude_jit, ids)
    core_s, _ = timed(_core_iterations_jit, state, embedded, n=n)
    coda_s, _ = timed(_coda_jit, state)
    core_s /= n
    return {"prelude_s": prelude_s, "core_iteration_s": core_s, "coda_head_s": coda_s}, cache


# --------------------------------------------------------------------------------------------
# Command line

_DTYPES = {
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "f32": jnp.float32,
    "float32": jnp.float32,
}

_FLAGS = (  # (kind, name, default, help); defined only by `cli`, so importing defines nothing
    ("string", "checkpoint", None, "Hugging Face checkpoint directory (config.json, safetensors)."),
    ("string", "config", None, "Preset name instead of --checkpoint; needs --random_weights."),
    ("bool", "random_weights", False, "Random weights (the reference's init) for --config."),
    ("string", "dtype", "bf16", "Parameter dtype: bf16 or f32."),
    ("string", "gemm", "cublas", "Dots: cublas (XLA's Triton GEMMs off) or xla (XLA's choice)."),
    ("string", "prompt", None, "Prompt text, tokenized with --checkpoint's tokenizer.json."),
    ("list", "prompt_ids", None, "Prompt token ids, e.g. 1,2,3."),
    ("integer", "prompt_len", 0, "A random prompt of this many ids (drawn from --seed)."),
    ("integer", "batch", 1, "Sequences: copies of the prompt."),
    ("integer", "max_new_tokens", 32, "Tokens to generate."),
    ("integer", "num_steps", 32, "Recurrence steps per token (the most, with --criterion)."),
    ("string", "criterion", "none", "Exit: none, kl, entropy-diff, latent-diff, argmax-stability."),
    ("float", "threshold", None, "Exit threshold (default: the criterion's)."),
    ("integer", "min_steps", 0, "No exit before this many steps."),
    ("float", "temperature", 0.0, "Sampling temperature; 0: greedy."),
    ("integer", "top_k", 0, "Keep only the k most likely tokens; 0: off."),
    ("float", "top_p", 1.0, "Nucleus sampling mass; 1: off."),
    ("integer", "seed", 0, "Seed of weights, random prompt, initial states and sampling."),
    ("float", "init_scale", 1.0, "Scale of the random initial state; 0: zeros."),
    ("string", "strategy", None, "KV cache: full, latest-m4, compress-sN (default: by criterion)."),
    ("bool", "continuous", False, "Start each token's recurrence from the previous final state."),
    ("integer", "cache_len", 0, "Cache positions to allocate; 0: prompt + max_new_tokens."),
    ("bool", "breakdown", False, "Also time the prelude, one Core iteration and the coda alone."),
    ("string", "roofline_device", "h200_measured", "costs.DEVICES entry for % of roofline."),
    ("bool", "progress", True, "Progress bar on stderr."),
    ("string", "json_out", None, "Write the results JSON here."),
)


class UsageError(ValueError):
    """A bad command line: one line on stderr, exit status 2."""


def _config(F) -> HuginnConfig:
    """The model's shape from --checkpoint's config.json or --config, without loading weights."""
    from pathlib import Path

    if F.dtype not in _DTYPES:
        raise UsageError(f"--dtype={F.dtype} must be one of {', '.join(_DTYPES)}")
    if F.checkpoint and F.config:
        raise UsageError("give --checkpoint or --config, not both")
    if F.checkpoint:
        path = Path(F.checkpoint) / "config.json"
        if not path.exists():
            raise UsageError(f"--checkpoint: {path} does not exist")
        return HuginnConfig.from_hf_json(path)
    if F.config:
        if not F.random_weights:
            raise UsageError("--config has no weights of its own: add --random_weights")
        return HuginnConfig.from_name(F.config)
    raise UsageError("give --checkpoint=DIR, or --config=PRESET --random_weights")


def _load_model(F, config: HuginnConfig) -> Huginn:
    from huginn_jax.checkpoint import from_pretrained
    from huginn_jax.model import random_init

    if F.checkpoint:
        return from_pretrained(F.checkpoint, dtype=_DTYPES[F.dtype])
    return random_init(config, jax.random.key(F.seed), dtype=_DTYPES[F.dtype])


def _tokenizer(checkpoint: str | None, required: bool):
    """The checkpoint's tokenizer.json through the optional `tokenizers` package, or None."""
    import importlib.util
    from pathlib import Path

    path = Path(checkpoint) / "tokenizer.json" if checkpoint else None
    if path is None or not path.exists() or importlib.util.find_spec("tokenizers") is None:
        if required:
            raise UsageError(
                "--prompt needs --checkpoint with a tokenizer.json and the `tokenizers` package; "
                "otherwise pass --prompt_ids=1,2,3"
            )
        return None
    import tokenizers

    return tokenizers.Tokenizer.from_file(str(path))


def _prompt(F, vocab: int) -> tuple[np.ndarray, Any]:
    """[batch, T] prompt ids from --prompt, --prompt_ids or --prompt_len, and the tokenizer."""
    if sum([F.prompt is not None, F.prompt_ids is not None, F.prompt_len > 0]) != 1:
        raise UsageError("give exactly one of --prompt, --prompt_ids, --prompt_len")
    if F.batch < 1:
        raise UsageError(f"--batch={F.batch} must be at least 1")
    tokenizer = _tokenizer(F.checkpoint, required=F.prompt is not None)
    if F.prompt is not None:
        ids = tokenizer.encode(F.prompt).ids
    elif F.prompt_ids is not None:
        try:
            ids = [int(x) for x in F.prompt_ids]
        except ValueError:
            raise UsageError(f"--prompt_ids must be integers: {','.join(F.prompt_ids)}") from None
    else:
        ids = np.random.default_rng(F.seed).integers(0, vocab, F.prompt_len).tolist()
    return np.tile(np.asarray(ids, np.int64).reshape(1, -1), (F.batch, 1)), tokenizer


def _versions() -> dict[str, str | None]:
    import importlib.metadata
    import platform

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "flax", "numpy", "tokenizers"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _bounds(F, gen: Generation, model: Huginn, prompt_len: int) -> dict[str, Any]:
    """% of the roofline's bandwidth, and the issue's latency and memory bounds."""
    out: dict[str, Any] = {}
    stats = gen.stats
    device = costs.get_device(F.roofline_device)
    if stats["achieved_gb_s"] is not None:
        out["roofline_device"] = device.name
        out["pct_of_roofline_bandwidth"] = 100 * stats["achieved_gb_s"] * 1e9 / device.hbm_bandwidth
        out["roofline_latency_s"] = (
            statistics.median(stats["decode_step_bytes"]) / device.hbm_bandwidth
        )
    if F.breakdown:
        position = min(prompt_len + F.max_new_tokens - 1, gen.cache.max_len - 1)
        parts, _ = time_parts(model, gen.cache, position)
        budget = F.num_steps * parts["core_iteration_s"] + parts["prelude_s"] + parts["coda_head_s"]
        out["parts"] = parts
        out["latency_budget_s"] = 1.05 * budget  # r x Core iteration + prelude + coda, + 5 %
        if stats["latency_median_s"] is not None:
            out["within_latency_budget"] = stats["latency_median_s"] <= out["latency_budget_s"]
    if stats["peak_bytes_in_use"] is not None:
        out["memory_bound_bytes"] = 1.10 * (stats["weight_bytes"] + stats["cache_bytes"])
        out["within_memory_bound"] = stats["peak_bytes_in_use"] <= out["memory_bound_bytes"]
    return out


def _print_table(stats: dict) -> None:
    def fmt(value, scale=1.0, unit=""):
        return "-" if value is None else f"{value * scale:.4g}{unit}"

    compile_s = stats["compile_s"]
    achieved = fmt(stats["achieved_gb_s"], 1, " GB/s")
    if "pct_of_roofline_bandwidth" in stats:
        achieved += f" ({stats['pct_of_roofline_bandwidth']:.1f} % of {stats['roofline_device']})"
    rows = [
        ("compile prefill / decode", f"{compile_s['prefill']:.2f} s / {compile_s['decode']:.2f} s"),
        ("prefill", f"{fmt(stats['prefill_s'], 1e3, ' ms')} ({stats['prompt_len']} tokens)"),
        ("decode latency (median)", fmt(stats["latency_median_s"], 1e3, " ms/token")),
        ("latency budget", fmt(stats.get("latency_budget_s"), 1e3, " ms/token")),
        ("tokens/s", fmt(stats["tokens_per_s"])),
        ("steps/token", fmt(stats["steps_per_token"])),
        ("achieved", achieved),
        (
            "cache / weights",
            f"{stats['cache_bytes'] / 1e9:.3f} GB / {stats['weight_bytes'] / 1e9:.3f} GB",
        ),
        ("peak device memory", fmt(stats["peak_bytes_in_use"], 1e-9, " GB")),
        ("peak before generation", fmt(stats.get("peak_bytes_before_generation"), 1e-9, " GB")),
        (
            "XLA temp prefill / decode",
            " / ".join(
                fmt(stats.get("executable_temp_bytes", {}).get(n), 1e-9, " GB")
                for n in ("prefill", "decode")
            ),
        ),
        ("memory bound", fmt(stats.get("memory_bound_bytes"), 1e-9, " GB")),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def _main(argv, F, flag_names) -> None:
    import json
    from pathlib import Path

    if len(argv) > 1:
        raise UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    use_gemm(F.gemm)  # before anything starts the backend
    costs.get_device(F.roofline_device)
    # Everything a user can get wrong fails here, before any weights are loaded or compiled.
    config = _config(F)
    ids, tokenizer = _prompt(F, config.vocab_size)
    plan = make_plan(
        config,
        ids,
        F.max_new_tokens,
        F.num_steps,
        criterion=F.criterion,
        threshold=F.threshold,
        min_steps=F.min_steps,
        temperature=F.temperature,
        top_k=F.top_k,
        top_p=F.top_p,
        seed=F.seed,
        init_scale=F.init_scale,
        continuous=F.continuous,
        strategy=F.strategy,
        cache_len=F.cache_len or None,
    )
    model = _load_model(F, config)
    gen = run_plan(model, plan, progress=F.progress)
    stats = {**gen.stats, **_bounds(F, gen, model, ids.shape[1])}
    for b, tokens in enumerate(gen.tokens.tolist()):
        print(f"[{b}] {tokenizer.decode(tokens)!r}" if tokenizer else f"[{b}] {tokens}")
    if F.json_out:
        result = {
            "program": "huginn_jax.generate",
            "flags": {name: F[name].value for name in flag_names},
            "env": {
                "device": jax.local_devices()[0].device_kind,
                "platform": jax.default_backend(),
                "versions": _versions(),
                "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            },
            "stats": stats,
            "tokens": gen.tokens.tolist(),
            "steps": gen.steps.tolist(),
        }
        path = Path(F.json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
    _print_table(stats)


def cli(argv: list[str] | None = None) -> None:
    """`python -m huginn_jax.generate --flag=...`; bad input ends in one line and exit status 2."""
    import sys

    from absl import app, flags, logging

    fv = flags.FLAGS
    for kind, name, default, help_text in _FLAGS:
        getattr(flags, f"DEFINE_{kind}")(name, default, help_text, flag_values=fv)
    flag_names = [name for _, name, _, _ in _FLAGS]

    def fail(error: Exception):
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)

    def parse(args):
        try:
            return fv(args)
        except flags.Error as e:
            fail(e)

    def main(args):
        logging.set_verbosity(logging.WARNING)  # no backend-probing chatter around the output
        try:
            _main(args, fv, flag_names)
        except ValueError as e:  # UsageError, bad settings, CheckpointError
            fail(e)

    app.run(main, argv=argv, flags_parser=parse)


if __name__ == "__main__":
    cli()
