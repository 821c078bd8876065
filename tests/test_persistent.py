"""huginn_jax.persistent: the persistent Core decode (the fused kernel, one worker in GPU
interpret mode on CPU) against the model's `run_core`, on the tiny preset with random norm gains
and qk bias; and the reasons `why_not_persistent` gives for what must take the XLA path."""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from huginn_jax import parallel
from huginn_jax.config import HuginnConfig
from huginn_jax.kv_cache import KVCache
from huginn_jax.model import Core, run_core
from huginn_jax.persistent import (
    DATAFLOW_OVERLAP,
    PersistentCore,
    cache_positions,
    core_target,
    default_schedule,
    last_writers,
    run_core_persistent,
    schedule_named,
    why_not_persistent,
    workers_for,
)
from pallas_kernels.core_step.fused_plan import Schedule
from tests.tolerance import rel_fro

CFG = HuginnConfig.from_name("tiny")  # D 96, 4 heads of 24, 4 Core layers; 2 prelude, 2 coda
POS = 40  # positions [0, 40) are the history; those after it must stay invisible
# tiny: 4 to 12 [64, 64] units; the kernel in interpret mode on the CPU, also where a GPU is
# JAX's default device (the tiny Core's heads of 24 cannot take the compiled kernel)
SCHEDULE = dict(unit_cols=64, schedule=Schedule(ring=3), device=jax.devices("cpu")[0])
# The kernel multiplies bf16 operands (the reference's weights are bf16-valued, its activations
# float32) and keeps its activations in float32 where the model rounds none: 5 L chained steps.
RTOL = 2e-2
H200 = types.SimpleNamespace(
    platform="gpu", compute_capability="9.0", device_kind="NVIDIA H200", core_count=132
)


@pytest.fixture(autouse=True)
def _on_cpu():
    """Arrays on the CPU, where the interpreter runs the kernel."""
    with jax.default_device(SCHEDULE["device"]):
        yield


@functools.cache
def core() -> Core:
    """Random norm gains and qk_bias (the reference init makes them 1 and 0, which would hide a
    misplaced norm or bias); every product's weight rounded to bf16, as the kernel reads it."""
    model = Core(CFG, rngs=nnx.Rngs(params=jax.random.key(0)))
    keys = iter(jax.random.split(jax.random.key(1), 5 * CFG.n_core))

    def rounded(param):
        param[...] = param[...].astype(jnp.bfloat16).astype(jnp.float32)

    rounded(model.adapter.kernel)
    for block in model.core_block:
        for norm in (block.norm_1, block.norm_2, block.norm_3, block.norm_4):
            norm.weight[...] = 1 + 0.3 * jax.random.normal(next(keys), norm.weight.shape)
        block.attn.qk_bias[...] = 0.5 * jax.random.normal(next(keys), block.attn.qk_bias.shape)
        for linear in (block.attn.Wqkv, block.attn.proj, block.mlp.fc, block.mlp.proj):
            rounded(linear.kernel)
    return model


def inputs(iterations: int, batch: int):
    """state, embedded [B, 1, D] and a bf16 cache (prelude, Core and coda slots) whose every
    position is random."""
    keys = jax.random.split(jax.random.key(2), 4)
    state, embedded = (jax.random.normal(k, (batch, 1, CFG.n_embd)) for k in keys[:2])
    cache = KVCache.create(CFG, batch=batch, max_len=64, num_steps=iterations, dtype=jnp.bfloat16)
    k, v = (jax.random.normal(key, cache.k.shape).astype(jnp.bfloat16) for key in keys[2:])
    return state, embedded, dataclasses.replace(cache, k=k, v=v)


@functools.cache
def prepared(batch: int) -> PersistentCore:
    return PersistentCore.prepare(core(), batch, **SCHEDULE)


@pytest.mark.parametrize("iterations, batch", [(2, 1)])  # batch 2: tests/test_core_step_fused.py
def test_equals_run_core(iterations, batch):
    """The state and the written rows agree with the XLA path; every other cache entry is left
    as it was."""
    state, embedded, cache = inputs(iterations, batch)
    graphdef, params = nnx.split(core())

    @jax.jit
    def xla(params, state, embedded, cache):
        model = nnx.merge(graphdef, params)
        return run_core(model, state, embedded, jnp.int32(POS), cache, iterations)

    persistent = jax.jit(run_core_persistent, static_argnames="num_steps")
    want_state, want = xla(params, state, embedded, cache)
    got_state, got = persistent(
        prepared(batch), state, embedded, jnp.int32(POS), cache, num_steps=iterations
    )
    assert got_state.shape == state.shape and got_state.dtype == state.dtype
    assert rel_fro(np.asarray(got_state), np.asarray(want_state)) <= RTOL
    written = np.zeros(cache.k.shape[:3], bool)
    written[np.unique(cache.slot_table(iterations)), :, POS] = True
    for name in ("k", "v"):
        before, g, w = (np.asarray(getattr(c, name), np.float32) for c in (cache, got, want))
        assert rel_fro(g[written], w[written]) <= RTOL, name
        np.testing.assert_array_equal(g[~written], before[~written])
        np.testing.assert_array_equal(w[~written], before[~written])


def test_shared_slots_keep_their_last_row():
    """compress-s3 with 2 iterations of 4 layers: slot P + s is used by (i, j) with 4 i + j = s
    mod 3; each keeps the row of its last user, as run_core's writes in order leave it."""
    cache = abstract_cache(CFG, steps=2)
    compressed = dataclasses.replace(cache, num_core_slots=3, strategy="compress-s3")
    table = compressed.slot_table(2)  # [[2, 3, 4, 2], [3, 4, 2, 3]]
    writers = last_writers(table)
    np.testing.assert_array_equal(writers, [5, 6, 7])  # (1, 1), (1, 2), (1, 3)
    np.testing.assert_array_equal(table.reshape(-1)[writers], [4, 2, 3])
    np.testing.assert_array_equal(last_writers(cache.slot_table(2)), np.arange(8))


def test_refuses_more_than_one_position():
    state, embedded, cache = inputs(1, 1)
    two = jnp.concatenate([state, state], axis=1)
    with pytest.raises(ValueError, match="one new position"):
        run_core_persistent(prepared(1), two, jnp.concatenate([embedded] * 2, 1), 5, cache, 1)
    with pytest.raises(ValueError, match="batch 1 != "):
        run_core_persistent(prepared(2), state, embedded, 5, cache, 1)


def abstract_cache(cfg=CFG, *, batch=1, max_len=64, dtype=jnp.bfloat16, steps=2):
    return jax.eval_shape(
        lambda: KVCache.create(cfg, batch=batch, max_len=max_len, num_steps=steps, dtype=dtype)
    )


def test_why_not_gives_a_reason_for_each_refused_case():
    def why(cfg=CFG, batch=1, cache=None, **kw):
        cache = abstract_cache(cfg, batch=batch) if cache is None else cache
        return why_not_persistent(cfg, batch, cache, num_steps=2, **{**SCHEDULE, **kw})

    assert why() is None  # the tiny Core in interpret mode
    assert "one position" in why(tokens=5)
    mesh_cfg = dataclasses.replace(CFG, mesh=parallel.make_mesh({parallel.MODEL_AXIS: 1}))
    assert "mesh" in why(mesh_cfg, cache=abstract_cache())
    assert "batch" in why(batch=9)  # at most 8 columns
    assert "bfloat16" in why(cache=abstract_cache(dtype=jnp.float32))
    assert "64" in why(cache=abstract_cache(max_len=60))  # blocks of 64 positions
    assert "not the batch" in why(batch=2, cache=abstract_cache(batch=1))
    assert "ring" in why(unit_cols=128, schedule=Schedule(ring=4))  # the adapter: 2 units of 128
    a100 = types.SimpleNamespace(**{**vars(H200), "compute_capability": "8.0"})
    a100.device_kind = "NVIDIA A100"
    assert "needs an sm_90 GPU (Hopper); NVIDIA A100 is sm_80" in why(device=a100)
    assert "CUDA kernel" in why(device=types.SimpleNamespace(platform="tpu"))
    # on an H200, the kernel copies a head's cache columns in tiles of 16: head_dim 24 cannot
    assert "16" in why(device=H200, workers=1)
    with pytest.raises(ValueError, match="sm_90"):
        PersistentCore.prepare(core(), 1, device=a100)


def test_why_not_passes_huginn_0125_on_an_h200():
    """huginn-0125's shapes pass every check of the kernel's schedule with 132 workers."""
    cfg = HuginnConfig.from_name("huginn_0125")
    cache = abstract_cache(cfg, max_len=1024, steps=32)
    assert why_not_persistent(cfg, 1, cache, num_steps=32, device=H200) is None
    assert why_not_persistent(cfg, 8, abstract_cache(cfg, batch=8, max_len=1024, steps=32),
                              num_steps=32, device=H200) is None  # fmt: skip


def test_the_default_schedule_is_the_second_warpgroup_at_batch_1_where_it_fits():
    """huginn-0125 on an H200: the cached blocks in a second warpgroup and one grid barrier
    per iteration at batch 1 (its 110 attention items one per worker), the kernel's default
    at batch 8; `small` (one worker fits) and 4 workers given for huginn-0125 take the
    kernel's default; a schedule given is kept. Every default reads the same blocks, so a
    cache's length does not depend on it."""
    small, huginn = (HuginnConfig.from_name(name) for name in ("small", "huginn_0125"))
    assert default_schedule(huginn, 1, 132) == DATAFLOW_OVERLAP
    assert DATAFLOW_OVERLAP.overlap and DATAFLOW_OVERLAP.dataflow
    assert default_schedule(huginn, 8, 132) == Schedule()
    assert default_schedule(huginn, 1, 4) == default_schedule(small, 1, 132) == Schedule()
    target, reason = core_target(huginn, 1, device=H200)
    assert reason is None and (target.workers, target.schedule) == (132, DATAFLOW_OVERLAP)
    assert core_target(huginn, 8, device=H200)[0].schedule == Schedule()
    assert core_target(huginn, 1, schedule=Schedule(ring=4), device=H200)[0].schedule.ring == 4
    assert core_target(small, 1, device=SCHEDULE["device"])[0].schedule == Schedule()
    assert schedule_named("") is None and schedule_named("3:2") == Schedule(kv_stages=2)
    assert cache_positions(1000) == cache_positions(1000, DATAFLOW_OVERLAP) == 1024


def test_workers_on_a_gpu_are_its_sms_capped_for_the_shapes():
    """`small`'s fewest units (8 of [64, 128], 16 of [64, 64]) hold the default ring of 6 for one
    worker, a ring of 3 for 4; huginn-0125 keeps every SM given (`fused_fit.most_workers`).
    Where not even one worker fits, one is taken so that the kernel's check says why."""
    small, huginn = (HuginnConfig.from_name(name) for name in ("small", "huginn_0125"))
    assert workers_for(small, 1, 132) == 1
    assert workers_for(small, 1, 132, Schedule(ring=3), unit_cols=64) == 4
    assert workers_for(small, 1, 2, Schedule(ring=3), unit_cols=64) == 2
    assert workers_for(huginn, 1, 132) == workers_for(huginn, 8, 132) == 132
    assert workers_for(small, 1, 132, Schedule(ring=8)) == 1


def test_why_not_and_prepare_take_the_capped_workers_on_a_gpu():
    """On an H200 (132 SMs), `small` runs on the one worker its shapes allow; workers given are
    kept, and the kernel's check refuses 132 of them; a ring that not even one worker fits is
    refused with the check's reason. A CPU runs one worker."""
    small = HuginnConfig.from_name("small")
    cache = abstract_cache(small)
    assert core_target(small, 1, device=H200)[0].workers == 1
    assert core_target(small, 1, workers=132, device=H200)[0].workers == 132
    assert core_target(small, 1, device=SCHEDULE["device"])[0].workers == 1
    assert why_not_persistent(small, 1, cache, num_steps=2, device=H200) is None
    refused = why_not_persistent(small, 1, cache, num_steps=2, workers=132, device=H200)
    assert "with 132 workers" in refused and "(1 workers at most fit)" in refused
    tight = why_not_persistent(small, 1, cache, num_steps=2, schedule=Schedule(8, 2), device=H200)
    assert "with 1 workers" in tight and "not even one worker fits" in tight
    assert "batch=9" in core_target(small, 9, device=H200)[1]
