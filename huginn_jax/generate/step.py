"""One token as one compiled call: prelude, Core iterations (with exits), coda, sampling."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from huginn_jax.generate.exits import CRITERIA, Criterion, init_exit, update_exit
from huginn_jax.generate.sampling import sample_token
from huginn_jax.kv_cache import KVCache
from huginn_jax.model import (
    Huginn,
    core_step,
    embed,
    initial_state,
    run_coda,
    run_core,
    run_prelude,
)

if TYPE_CHECKING:
    from huginn_jax.persistent import PersistentCore


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
    persistent: PersistentCore | None = None,
) -> StepOutput:
    """Prelude → recurrence (with exits) → coda → sampling for T new positions, traceable.

    The initial state is `prev_state_BxD` (continuous thought, T must be 1) when given, else the
    reference's s0 (zeros for init_scale 0, else drawn from `key` folded with `start`).
    `exit_at` = (threshold float32, min_steps int32) for `spec.criterion`. With `persistent`
    (a decode step of a fixed iteration count), the Core iterations run in the persistent
    kernel (`huginn_jax.persistent.run_core_persistent`) instead of `run_core`.
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
    if persistent is not None and spec.criterion is not None:
        raise ValueError("the persistent Core runs a fixed iteration count, not an exit criterion")
    if spec.criterion is None:
        if persistent is not None:
            from huginn_jax.persistent import run_core_persistent

            state, cache = run_core_persistent(
                persistent, state0, embedded, start, cache, spec.num_steps
            )
        else:
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
def _step_jit(
    graphdef, params, ids, prev_state, cache, start, key, exit_at, persistent=None, *, spec
):
    model = nnx.merge(graphdef, params)
    return step(model, ids, prev_state, cache, start, key, exit_at, spec, persistent)


_EXECUTABLES: dict = {}  # (graphdef, spec, argument avals) -> compiled step
_MAX_EXECUTABLES = 32


def compiled_step(graphdef, spec: StepSpec, args: tuple) -> tuple[Any, float]:
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
