"""pallas_kernels.core_step.step_program: the Core decode iteration as barrier-separated steps
against the model's own Core decode step (run_core over a cache, one new position), float32."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from huginn_jax.config import HuginnConfig
from huginn_jax.kv_cache import KVCache
from huginn_jax.model import Core, run_core
from huginn_jax.persistent import step_weights  # also what test_core_step_fused imports
from pallas_kernels.core_step import (
    Pending,
    barriers_per_iteration,
    core_iteration,
    core_phases,
    rope_row,
    step_names,
)
from tests.tolerance import rel_fro

CFG = HuginnConfig.from_name("tiny")  # D 96, 4 heads of 24, F 160, 4 Core layers
BATCH, SLOT = 2, 16  # positions per cache slot
RTOL = 1e-5  # float32: the same sums, the norms' scales applied after the products


@functools.cache
def core() -> Core:
    """Random weights, with random norm gains and qk_bias (the reference init makes them 1 and 0,
    which would hide a misplaced norm or bias)."""
    model = Core(CFG, rngs=nnx.Rngs(params=jax.random.key(0)))
    keys = iter(jax.random.split(jax.random.key(1), 5 * CFG.n_core))
    for block in model.core_block:
        for norm in (block.norm_1, block.norm_2, block.norm_3, block.norm_4):
            norm.weight[...] = 1 + 0.3 * jax.random.normal(next(keys), norm.weight.shape)
        bias = block.attn.qk_bias
        bias[...] = 0.5 * jax.random.normal(next(keys), bias.shape)
    return model


def inputs(iterations: int):
    """state, embedded [B, 1, D] and a cache whose every position of every slot is random
    (those after the new position must stay invisible)."""
    keys = jax.random.split(jax.random.key(2), 4)
    shape = (BATCH, 1, CFG.n_embd)
    state, embedded = (jax.random.normal(k, shape) for k in keys[:2])
    cache = KVCache.create(CFG, batch=BATCH, max_len=SLOT, num_steps=iterations)
    k, v = (jax.random.normal(key, cache.k.shape) for key in keys[2:])
    return (
        state,
        embedded,
        KVCache(k, v, cache.num_prelude, cache.num_core_layers, cache.num_core_slots),
    )


@functools.cache
def model_run(iterations: int, pos: int):
    """The model's Core decode step: (state [B, D], cache k, cache v)."""
    graphdef, params = nnx.split(core())

    @jax.jit
    def run(params, state, embedded, cache, start):
        return run_core(nnx.merge(graphdef, params), state, embedded, start, cache, iterations)

    state, embedded, cache = inputs(iterations)
    out, cache = run(params, state, embedded, cache, jnp.int32(pos))
    return np.asarray(out[:, 0]), np.asarray(cache.k), np.asarray(cache.v)


def program_run(iterations: int, pos: int, kv_splits, trace=None):
    """step_program's iterations chained, each on its own Core slots: (state, k, v)."""
    state, embedded, cache = inputs(iterations)
    w, (cos, sin) = step_weights(core()), rope_row(pos, CFG.head_dim, CFG.rope_base)
    pending, e_part, k, v = Pending(state[:, 0]), None, cache.k, cache.v
    for i in range(iterations):
        slots = slice(cache.core_slot(i, 0), cache.core_slot(i, CFG.n_core - 1) + 1)
        pending, k_new, v_new, e_part = core_iteration(
            w,
            pending,
            embedded[:, 0],
            k[slots],
            v[slots],
            pos,
            cos,
            sin,
            e_part=e_part,
            kv_splits=kv_splits,
            trace=trace,
        )
        k, v = k.at[slots].set(k_new), v.at[slots].set(v_new)
    return np.asarray(pending.value(CFG.norm_eps)), np.asarray(k), np.asarray(v)


@pytest.mark.parametrize(
    "iterations, pos, kv_splits",
    [(1, 9, None), (1, 0, None), (1, SLOT - 1, 4), (3, 9, None), (3, 9, 4)],
)
def test_equals_the_model_core_decode_step(iterations, pos, kv_splits):
    want_state, want_k, want_v = model_run(iterations, pos)
    state, k, v = program_run(iterations, pos, kv_splits)
    assert rel_fro(state, want_state) <= RTOL
    for got, want in ((k, want_k), (v, want_v)):
        core_slots = slice(
            CFG.n_layers_in_prelude, CFG.n_layers_in_prelude + CFG.n_core * iterations
        )
        assert rel_fro(got[core_slots, :, pos], want[core_slots, :, pos]) <= RTOL
        untouched = np.ones(got.shape[:3], bool)
        untouched[core_slots, :, pos] = False
        np.testing.assert_array_equal(got[untouched], want[untouched])
    np.testing.assert_array_equal(k[0], inputs(iterations)[2].k[0])  # the history, the prelude


@pytest.mark.parametrize("kv_splits", [None, 4])
def test_one_barrier_per_step_and_only_vectors_and_row_scalars_cross(kv_splits):
    trace = []
    program_run(1, 9, kv_splits, trace)
    names = tuple(name for name, _ in trace)
    assert names == step_names(CFG.n_core, kv_splits)
    assert len(names) == barriers_per_iteration(CFG.n_core, kv_splits)
    assert len(names) == 1 + (4 if kv_splits is None else 5) * CFG.n_core
    heads = CFG.n_heads
    for name, values in trace:
        for value, shape in values.items():
            if value.startswith(("k_slot", "v_slot")):  # the cache write, to memory
                assert name.startswith("attn") and shape == (BATCH, SLOT, heads, CFG.head_dim)
            elif value.startswith(("max", "sum", "acc")):  # split-KV partials, per row and head
                assert name.startswith("attn") and shape[:3] == (BATCH, heads, kv_splits)
            else:  # vectors and per-row scalars
                assert len(shape) == 2 and shape[0] == BATCH, (name, value, shape)


def test_barriers_match_the_weight_stream_at_huginn_0125():
    """One barrier per product, as the weight stream has: the same products in the same order
    (the attention adds no barrier; split-KV adds one per layer)."""
    phases = core_phases(5280, 17920, 3 * 5280, 4)
    assert barriers_per_iteration(4) == len(phases) == 17
    assert barriers_per_iteration(4, kv_splits=8) == 21
    assert [n.replace("attn_proj", "proj") for n in step_names(4)] == [p.name for p in phases]
    split = [n for n in step_names(4, kv_splits=8) if not n.startswith("attn")]
    assert split == [p.name for p in phases]
