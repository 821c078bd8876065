"""The fused Core decode kernel (pallas_kernels/core_step/fused.py) against the plain-JAX
specification of the iteration (`step_program.core_iteration`), on the tiny preset with random
norm gains and qk bias: one worker in GPU interpret mode on CPU, lowering for sm_90 with every
SM at huginn-0125's shapes, and on a GPU with every SM."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from huginn_jax.config import HuginnConfig
from pallas_kernels.core_step import Pending, StepWeights, core_iteration, rope_row
from pallas_kernels.core_step.fused import build_fused_core
from pallas_kernels.core_step.fused_blocks import _SequenceBlocks
from pallas_kernels.core_step.fused_counters import Counters
from pallas_kernels.core_step.fused_fit import check_fused
from pallas_kernels.core_step.fused_plan import STEP_KINDS, FusedShape, Schedule
from pallas_kernels.core_step.fused_products import Products
from pallas_kernels.core_step.fused_ring import WeightRing
from pallas_kernels.core_step.fused_step import (
    fused_core_decode,
    interleave_halves,
    lowered_for_hopper,
    pack_weights,
    random_step_weights,
    write_new_rows,
)
from tests.test_core_step_program import core, step_weights
from tests.tolerance import rel_fro

CFG = HuginnConfig.from_name("tiny")  # D 96, 4 heads of 24, F 160, 4 Core layers
SLOT = 128  # positions per cache slot: two blocks of 64
LAYERS = 2  # of the tiny Core's 4: interpret mode's time grows with them
ON_GPU = jax.devices()[0].platform == "gpu"
gpu = pytest.mark.gpu
requires_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (Mosaic GPU, sm_90)")
# bf16 products, q and the softmax weights in bf16 for the wgmmas, over 5 L steps per iteration
RTOL = 2e-2


def bf16_weights(w: StepWeights) -> StepWeights:
    """The weights the kernel multiplies by: each product's matrix rounded to bf16."""

    def rounded(x):
        return x.astype(jnp.bfloat16).astype(jnp.float32)

    layers = tuple(
        lw.__class__(**{
            **{f: getattr(lw, f) for f in lw.__dataclass_fields__},
            **{f: rounded(getattr(lw, f)) for f in ("wqkv", "proj", "fc", "mlp_proj")},
        })
        for lw in w.layers
    )  # fmt: skip
    return StepWeights(rounded(w.adapter), layers, head_dim=w.head_dim, eps=w.eps)


@functools.cache
def inputs(batch: int, iterations: int, slot: int = SLOT):
    keys = jax.random.split(jax.random.key(3), 4)
    state, embedded = (jax.random.normal(k, (batch, CFG.n_embd)) for k in keys[:2])
    cache_shape = (iterations * LAYERS, batch, slot, CFG.n_heads, CFG.head_dim)
    k, v = (jax.random.normal(key, cache_shape).astype(jnp.bfloat16) for key in keys[2:])
    slots = jnp.arange(iterations * LAYERS, dtype=jnp.int32).reshape(iterations, LAYERS)
    return state, embedded, k, v, slots


def reference(w, batch, iterations, pos, slot=SLOT):
    """(state value [B, D], k rows, v rows [iterations, L, B, H, K]) of step_program."""
    state, embedded, k, v, slots = inputs(batch, iterations, slot)
    cos, sin = rope_row(pos, CFG.head_dim, CFG.rope_base)
    pending, e_part, k_rows, v_rows = Pending(state), None, [], []
    for i in range(iterations):
        idx = slots[i]
        pending, k_new, v_new, e_part = core_iteration(
            w, pending, embedded, k[idx].astype(jnp.float32), v[idx].astype(jnp.float32), pos,
            cos, sin, e_part=e_part,
        )  # fmt: skip
        k_rows.append(k_new[:, :, pos])
        v_rows.append(v_new[:, :, pos])
    return pending.value(w.eps), jnp.stack(k_rows), jnp.stack(v_rows)


def kernel_run(w, batch, iterations, pos, *, workers, interpret, schedule, slot=SLOT):
    state, embedded, k, v, slots = inputs(batch, iterations, slot)
    fw = pack_weights(w, heads=CFG.n_heads, batch=batch, rope_base=CFG.rope_base, unit_cols=64)
    pending, k_new, v_new = fused_core_decode(
        fw, Pending(state), embedded, k, v, slots, jnp.int32(pos),
        iterations=iterations, workers=workers, schedule=schedule, interpret=interpret,
    )  # fmt: skip
    return pending.value(w.eps), k_new, v_new


# kv_stages 3 over 2 sequences x 2 blocks: the copies run ahead across a sequence's end; the L2
# prefetches (no-ops when interpreted) are traced where they reach into the next product, per
# unit or as each product ends (the last one's into the next iteration's adapter); blocks of 128
# positions over 2 sequences x 2 blocks, the last one partly masked; a wgmma lag of 0 (a unit's
# slot refilled as soon as its wgmma is done, one B tile); the input copies ahead issued after
# each unit's wgmma and slot release (`late_inputs`), with grid barriers and with one per
# iteration; key and value blocks in flight to different depths (`value_stages`), either deeper
@pytest.mark.parametrize(
    "batch,iterations,pos,schedule,slot",
    [
        (1, 2, 0, Schedule(ring=3, kv_stages=2), SLOT),
        (2, 1, SLOT - 1, Schedule(ring=2, kv_stages=3, l2_units=1, l2_blocks=2), SLOT),
        (1, 2, 5, Schedule(ring=2, kv_stages=2, l2_barrier=1, l2_attention=1), SLOT),
        (2, 1, 200, Schedule(ring=2, kv_stages=2, kv_block=128), 2 * SLOT),
        (2, 3, 70, Schedule(ring=3, kv_stages=2, dataflow=1), SLOT),
        (2, 2, 70, Schedule(ring=2, kv_stages=2, dataflow=1, lag=0), SLOT),
        (1, 2, 5, Schedule(ring=2, kv_stages=2, late_inputs=1), SLOT),
        (2, 2, 70, Schedule(ring=3, kv_stages=2, dataflow=1, late_inputs=1), SLOT),
        (2, 2, 70, Schedule(ring=3, kv_stages=2, dataflow=1, counter_tiles=2), SLOT),
        (2, 1, SLOT - 1, Schedule(ring=2, kv_stages=3, value_stages=2), SLOT),
        (2, 2, 70, Schedule(ring=3, kv_stages=2, dataflow=1, value_stages=3), SLOT),
        (1, 3, 5, Schedule(ring=2, kv_stages=2, dataflow=1, l2_keep=2), SLOT),
    ],
)
def test_interpret_one_worker_matches_the_step_program(batch, iterations, pos, schedule, slot):
    w = bf16_weights(step_weights(core()))
    w = StepWeights(w.adapter, w.layers[:LAYERS], head_dim=w.head_dim, eps=w.eps)
    want = reference(w, batch, iterations, pos, slot)
    got = kernel_run(
        w, batch, iterations, pos, workers=1, interpret=plgpu.InterpretGPUParams(),
        schedule=schedule, slot=slot,
    )  # fmt: skip
    for g, r in zip(got, want, strict=True):
        assert g.shape == r.shape
        assert rel_fro(np.asarray(g, np.float32), np.asarray(r, np.float32)) <= RTOL


def test_packed_weights_are_one_array_per_kind_of_product():
    """One array per kind (one TMA descriptor each, whatever the layers): the adapter's two
    versions, then every layer's qkv, proj, fc and mlp proj, as the kernel's shapes say."""
    w = bf16_weights(step_weights(core()))
    fw = pack_weights(w, heads=CFG.n_heads, batch=1, rope_base=CFG.rope_base, unit_cols=64)
    assert tuple(p.shape for p in fw.products) == fw.shape.weight_shapes()
    assert [p.shape[0] for p in fw.products] == [2] + [len(w.layers)] * 4
    raw = np.asarray(fw.products[0][1], np.float32).transpose(1, 0, 2).reshape(fw.shape.k_d, -1)
    d = w.adapter.shape[1]
    np.testing.assert_array_equal(raw[:d, :d], np.asarray(w.adapter[:d], np.float32))


def test_new_rows_land_in_their_slots():
    _, _, k, v, slots = inputs(2, 2)
    k_new = jnp.ones((2, LAYERS, 2, CFG.n_heads, CFG.head_dim), k.dtype)
    k2, v2 = write_new_rows(k, v, slots, 5, k_new, 2 * k_new)
    np.testing.assert_array_equal(k2[:, :, 5], 1)
    np.testing.assert_array_equal(v2[:, :, 5], 2)
    np.testing.assert_array_equal(
        np.delete(np.asarray(k2), 5, axis=2), np.delete(np.asarray(k), 5, axis=2)
    )


SMALL = (512, 8, 768, 2)  # d, heads (of 64), MLP width, layers: 16 workers, 2 splits per head
HUGINN = (5280, 55, 17920, 4)
# shape, workers, batch, iterations, position, positions per slot, (unit_cols, schedule): at
# huginn-0125 the kernel's default units and schedule at batch 1 and 8, and [64, 128] units with
# the longest ring and L2 lookahead that fit; on the small shape [64, 64] units, so that every
# worker owns more units than the ring, with 3 cached blocks in flight; each shape also with
# blocks of 128 positions; the small shape also with a grid barrier after every product (no
# hand-over on tile counters); huginn-0125 at batch 8 also with 4 cached blocks in flight; each
# shape with the attention's blocks in a second warpgroup (`Schedule.overlap`); each shape with
# one grid barrier per iteration (`Schedule.dataflow`), with and without the second warpgroup,
# over 2 and 3 iterations (both sets of buffers, each used twice); then each later schedule
# field beside the defaults it changes, the last fewer value blocks in flight than key blocks
# (`Schedule.value_stages`), with one head per item and two
SMALL_SCHEDULE = (64, Schedule(3, 3, 0, 0))
OVERLAP = Schedule(3, 2, overlap=1)
DATAFLOW, DATAFLOW_OVERLAP = Schedule(3, 3, dataflow=1), Schedule(3, 2, overlap=1, dataflow=1)
PAIRS = Schedule(3, 2, head_pairs=1)  # two-head items: 4 splits of each pair window
LAG0 = Schedule(3, 2, overlap=1, dataflow=1, lag=0)  # the batch-1 default, a slot freed at once
LATE = Schedule(3, 2, overlap=1, dataflow=1, late_inputs=1)  # the batch-1 default, inputs late
GROUPED = Schedule(3, 2, overlap=1, dataflow=1, counter_tiles=4)  # 4 tiles per counter
# the batch-1 default with a third key block in flight beside two value blocks
THIRD_KEY = Schedule(3, 3, overlap=1, dataflow=1, value_stages=2)
KEPT = Schedule(3, 2, overlap=1, dataflow=1, l2_keep=10)  # the batch-1 default, 41 MiB kept in L2
KNOWN = Schedule(3, 2, overlap=1, dataflow=1, known_complete=1)  # the batch-1 default, fewer waits
GPU_CASES = [
    (SMALL, 16, 1, 2, 130, 192, SMALL_SCHEDULE),
    (SMALL, 16, 1, 2, 130, 192, (64, Schedule(3, 3, handover=0))),
    (SMALL, 16, 8, 1, 63, 128, SMALL_SCHEDULE),
    (SMALL, 16, 8, 1, 200, 256, (64, Schedule(3, 2, kv_block=128))),
    (HUGINN, 132, 1, 2, 1000, 1024, (256, Schedule())),
    (HUGINN, 132, 8, 1, 200, 256, (256, Schedule())),
    (HUGINN, 132, 8, 1, 200, 256, (128, Schedule(8, 2, 16, 8))),
    (HUGINN, 132, 1, 2, 1000, 1024, (128, Schedule(4, 2, kv_block=128))),
    (HUGINN, 132, 8, 1, 200, 256, (256, Schedule(3, 4))),
    (SMALL, 16, 1, 2, 130, 192, (64, OVERLAP)),
    (SMALL, 16, 8, 1, 200, 256, (64, OVERLAP)),
    (HUGINN, 132, 1, 2, 1000, 1024, (256, OVERLAP)),
    (HUGINN, 132, 8, 1, 200, 256, (256, OVERLAP)),
    (SMALL, 16, 8, 2, 200, 256, (64, DATAFLOW)),
    (SMALL, 16, 1, 3, 130, 192, (64, DATAFLOW_OVERLAP)),
    (HUGINN, 132, 8, 2, 200, 256, (256, DATAFLOW)),
    (HUGINN, 132, 1, 3, 1000, 1024, (256, DATAFLOW_OVERLAP)),
    (SMALL, 16, 8, 1, 200, 256, (64, PAIRS)),
    (HUGINN, 132, 8, 2, 200, 256, (256, PAIRS)),
    (HUGINN, 132, 1, 1, 1000, 1024, (256, PAIRS)),
    (SMALL, 16, 1, 3, 130, 192, (64, LAG0)),
    (HUGINN, 132, 1, 2, 1000, 1024, (256, LAG0)),
    (HUGINN, 132, 8, 2, 200, 256, (256, Schedule(3, 3, lag=0))),
    (SMALL, 16, 1, 3, 130, 192, (64, LATE)),
    (HUGINN, 132, 1, 2, 1000, 1024, (256, LATE)),
    (HUGINN, 132, 8, 2, 200, 256, (256, Schedule(3, 3, late_inputs=1))),
    (SMALL, 16, 1, 3, 130, 192, (64, Schedule(3, 2, overlap=1, dataflow=1, counter_tiles=3))),
    (HUGINN, 132, 1, 2, 1000, 1024, (256, GROUPED)),
    (HUGINN, 132, 1, 2, 1000, 1024, (256, dataclasses.replace(GROUPED, late_inputs=1))),
    (HUGINN, 132, 8, 2, 200, 256, (256, Schedule(3, 3, counter_tiles=4))),
    (HUGINN, 132, 8, 2, 200, 256, (256, Schedule(4, 3))),  # fits without the one-worker tile
    (SMALL, 16, 1, 3, 130, 192, (64, THIRD_KEY)),
    (HUGINN, 132, 1, 2, 1000, 1024, (256, THIRD_KEY)),
    (HUGINN, 132, 8, 2, 200, 256, (256, Schedule(3, 4, value_stages=3))),
    (SMALL, 16, 8, 1, 200, 256, (64, Schedule(3, 3, head_pairs=1, value_stages=2))),
    (HUGINN, 132, 8, 2, 200, 256, (256, Schedule(3, 3, head_pairs=1, value_stages=2))),
    (HUGINN, 132, 1, 3, 1000, 1024, (256, KEPT)),
    (SMALL, 16, 1, 3, 130, 192, (64, KNOWN)),
    (HUGINN, 132, 1, 3, 1000, 1024, (256, KNOWN)),
]


def check_against_the_step_program(
    dims, workers, batch, iterations, pos, slot_len, schedule, interpret=None
):
    """The kernel on random weights of `dims` (d, heads, MLP width, layers) against
    `core_iteration`: the state and the new k and v rows within RTOL."""
    d, heads, f, layers = dims
    w = random_step_weights(*dims)
    keys = jax.random.split(jax.random.key(6), 4)
    state, embedded = (jax.random.normal(k, (batch, d)) for k in keys[:2])
    cache_shape = (iterations * layers, batch, slot_len, heads, d // heads)
    k, v = (jax.random.normal(key, cache_shape).astype(jnp.bfloat16) for key in keys[2:])
    slots = jnp.arange(iterations * layers, dtype=jnp.int32).reshape(iterations, layers)
    cols, sched = schedule
    fw = pack_weights(w, heads=heads, batch=batch, rope_base=10000.0, unit_cols=cols)
    got = fused_core_decode(
        fw, Pending(state), embedded, k, v, slots, jnp.int32(pos),
        iterations=iterations, workers=workers, schedule=sched, interpret=interpret,
    )  # fmt: skip
    cos, sin = rope_row(pos, d // heads, 10000.0)
    pending, e_part, k_rows, v_rows = Pending(state), None, [], []
    for i in range(iterations):
        idx = slots[i]
        pending, k_new, v_new, e_part = jax.jit(core_iteration)(
            w, pending, embedded, k[idx].astype(jnp.float32), v[idx].astype(jnp.float32),
            pos, cos, sin, e_part=e_part,
        )  # fmt: skip
        k_rows.append(k_new[:, :, pos])
        v_rows.append(v_new[:, :, pos])
    want = (pending.value(w.eps), jnp.stack(k_rows), jnp.stack(v_rows))
    got = (got[0].value(w.eps), got[1], got[2])
    for g, r in zip(got, want, strict=True):
        assert rel_fro(np.asarray(g, np.float32), np.asarray(r, np.float32)) <= RTOL


def case_id(case) -> str:
    """huginn-b8-it1-u256-3:2:0:0:64:0:0:8:0:0:1: the shape, batch, iterations, units, schedule."""
    dims, _, batch, iterations, _, _, (cols, schedule) = case
    return f"{'huginn' if dims == HUGINN else 'small'}-b{batch}-it{iterations}-u{cols}-{schedule}"


@gpu
@requires_gpu
@pytest.mark.parametrize(
    "dims,workers,batch,iterations,pos,slot_len,schedule",
    GPU_CASES,
    ids=[case_id(c) for c in GPU_CASES],
)
def test_matches_the_step_program_gpu(dims, workers, batch, iterations, pos, slot_len, schedule):
    check_against_the_step_program(dims, workers, batch, iterations, pos, slot_len, schedule)


@gpu
@requires_gpu
def test_profile_records_both_warpgroups_gpu(tmp_path):
    """The small shape on 16 workers with two warpgroups and one grid barrier per iteration,
    profiled over 2 iterations: each warpgroup's trace holds its scopes (the second's parts
    for every worker's item, the first's steps and each qkv's wait for the partials), and the
    profiled kernel's state is the unprofiled one's (up to the order of the workers' f32
    reduce-adds)."""
    from experiments.kernels import scopes

    d, heads, f, layers = SMALL
    w = random_step_weights(*SMALL)
    fw = pack_weights(w, heads=heads, batch=1, rope_base=10000.0, unit_cols=64)
    keys = jax.random.split(jax.random.key(6), 4)
    state, embedded = (jax.random.normal(k, (1, d)) for k in keys[:2])
    cache_shape = (2 * layers, 1, 192, heads, d // heads)
    k, v = (jax.random.normal(key, cache_shape).astype(jnp.bfloat16) for key in keys[2:])
    slots = jnp.arange(2 * layers, dtype=jnp.int32).reshape(2, layers)

    def run(profile_dir=""):
        pending, _, _ = fused_core_decode(
            fw, Pending(state), embedded, k, v, slots, jnp.int32(130), iterations=2,
            workers=16, schedule=DATAFLOW_OVERLAP, profile_dir=profile_dir,
        )  # fmt: skip
        return np.asarray(pending.value(w.eps))

    profiled = run(str(tmp_path))
    jax.effects_barrier()  # the trace is written by a host callback
    trace = scopes.read_newest(tmp_path)
    assert scopes.recording_workers(trace) == 16
    assert scopes.recording_workers(trace, warpgroup=1) == 16  # 8 heads x 2 splits
    second = scopes.scope_cycles(trace, per=2, warpgroup=1)
    own = set(second) - {"Init"}  # Mosaic GPU's own region: the kernel's setup
    assert own == {"ahead", "wait_q", "rope", "blocks", "partials_out"}
    assert second["blocks"]["median"] > 0
    first = scopes.scope_cycles(trace, per=2)
    assert {"qkv", "wait_parts", "combine", "barrier"} <= set(first)
    assert "ahead" not in first and "wait_q" not in first
    assert rel_fro(profiled, run()) <= 1e-3


def test_interpret_key_blocks_of_the_heads_own_columns():
    """Heads of 32 in windows of 64 (d 128): the key blocks are the heads' own 32 columns
    (`FusedShape.key_cols`), the last head's key window passes d and its value window starts
    32 columns before it. One worker in interpret mode, two sequences, a partial last block."""
    dims = (128, 4, 160, 2)
    shape = FusedShape(128, 4, 32, 160, 2, 2, 64)
    assert shape.key_cols == 32 and shape.key_window(3) == (96, 0)
    assert shape.head_window(3) == (64, 32) and shape.table_rows == 160
    check_against_the_step_program(
        dims, 1, 2, 1, 100, 128, (64, Schedule(2, 2)), interpret=plgpu.InterpretGPUParams()
    )


@pytest.mark.parametrize("dims,batch", [((256, 4, 256, 1), 2), ((320, 5, 256, 1), 1)])
def test_interpret_two_head_items(dims, batch):
    """Two-head items (`Schedule.head_pairs`) on heads of 64: each pair window's key blocks
    split at 64 columns, its value blocks read as the window's first and last 64; 5 heads:
    the last window ends at d and also holds head 3, which the window before combines. One
    worker in interpret mode (one split per window)."""
    check_against_the_step_program(
        dims, 1, batch, 1, 100, 128, (64, Schedule(2, 2, head_pairs=1)),
        interpret=plgpu.InterpretGPUParams(),
    )  # fmt: skip


def test_gpu_configurations_fit():
    """The GPU tests' schedules pass the checks (ring, shared memory) on CPU."""
    for (d, heads, f, layers), workers, batch, _, _, _, (cols, sched) in GPU_CASES:
        shape = FusedShape(d, heads, d // heads, f, layers, batch, cols)
        check_fused(shape, workers, sched)


# the batch is a loop bound: 1 lowers the same code
@pytest.mark.parametrize(
    "batch,schedule",
    [
        (8, Schedule()), (8, OVERLAP), (8, DATAFLOW), (1, DATAFLOW_OVERLAP), (8, PAIRS), (1, LAG0),
        (1, LATE), (1, GROUPED), (1, THIRD_KEY), (1, KNOWN),
    ],
)  # fmt: skip
def test_lowers_for_cuda_with_every_sm(batch, schedule):
    """Traces and lowers the kernel for sm_90 at huginn-0125's shapes (one Core layer, to keep
    the test short): catches API misuse, unprovable tile alignment and smem overflow."""
    shape = FusedShape(5280, 55, 96, 17920, 1, batch)
    text = lowered_for_hopper(shape, 2, 1024, workers=132, schedule=schedule).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("late", [0, 1])
def test_late_inputs_issue_the_input_copy_after_the_wgmma_and_release(monkeypatch, late):
    """A unit's body, as traced for sm_90 (the small shape's batch-1 default, one iteration):
    with `Schedule.late_inputs` its input copy ahead comes after its wgmma and its slot's
    release, without it before the wgmma; each range then releases its last slot."""
    events = []

    def recorded(name, fn):
        def call(*args, **kwargs):
            events.append(name)
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(plgpu, "wgmma", recorded("wgmma", plgpu.wgmma))
    monkeypatch.setattr(WeightRing, "release", recorded("release", WeightRing.release))
    monkeypatch.setattr(Products, "_copy_input", recorded("input", Products._copy_input))
    shape = FusedShape(512, 8, 64, 768, 1, 1, 64)
    schedule = Schedule(3, 2, overlap=1, dataflow=1, late_inputs=late)
    lowered_for_hopper(shape, 1, 192, workers=16, schedule=schedule)
    text = " ".join(events)
    bodies = 6  # the adapter's, the qkv's two ranges (q's tiles first), proj's, fc's, mlp proj's
    late_body, early_body = "wgmma release input release", "input wgmma release release"
    assert text.count(late_body) == (bodies if late else 0)  # the last: the range's end
    assert text.count(early_body) == (0 if late else bodies)


@pytest.mark.parametrize("known", [0, 1])
def test_known_complete_leaves_out_the_head_steps_wait_on_the_norms(monkeypatch, known):
    """`Schedule.known_complete`: a head's step, as traced for sm_90 (the small shape's batch-1
    default, one layer), waits on the counter of the layer input's norms only without it (the
    products' own waits on it are traced either way)."""
    in_head, owned = [], []
    wait_head, wait_owned = Counters.wait_head, Counters.wait_owned

    def head(self, *args):
        in_head.append(True)
        wait_head(self, *args)
        in_head.pop()

    def norms(self, *args):
        owned.append(bool(in_head))
        wait_owned(self, *args)

    monkeypatch.setattr(Counters, "wait_head", head)
    monkeypatch.setattr(Counters, "wait_owned", norms)
    shape = FusedShape(512, 8, 64, 768, 1, 1, 64)
    schedule = dataclasses.replace(KNOWN, known_complete=known)
    lowered_for_hopper(shape, 1, 192, workers=16, schedule=schedule)
    assert owned.count(True) == (0 if known else 1)  # one layer's head step
    assert owned.count(False) >= 1  # the qkv's wait before its units


@pytest.mark.parametrize("keep", [0, 1])
def test_adapter_units_kept_in_l2_are_marked_in_the_kernel(keep):
    """`Schedule.l2_keep`: the kernel lowered for sm_90 (the small shape on 16 workers, 4
    adapter units each) holds the PTX prefetch that marks lines evict_last only where units
    are kept (interpret mode, which has no L2 to mark, leaves it out: the interpret cases)."""
    shape = FusedShape(512, 8, 64, 768, 1, 1, 64)
    schedule = Schedule(3, 2, overlap=1, dataflow=1, l2_keep=keep)
    text = lowered_for_hopper(shape, 2, 192, workers=16, schedule=schedule).as_text()
    assert ("prefetch.global.L2::evict_last" in text) == bool(keep)


@pytest.mark.parametrize("pairs", [0, 1])
def test_a_softmax_step_waits_for_its_value_block_after_its_scores(monkeypatch, pairs):
    """A cached block's step, as traced for sm_90 (the small shape at batch 8, one iteration,
    [64, 128] weight units, so that only the attention's wgmmas have 64 rows): it waits for the
    key block, takes the scores' wgmma, then waits for the value block before the weighted
    values' wgmma (with two-head items, once for both head slots)."""
    events = []
    stream, wgmma = _SequenceBlocks.stream, plgpu.wgmma

    def recorded_stream(self, starts, s):
        keys, values = stream(self, starts, s)

        def record(name, fn):
            return lambda f: (events.append(name), fn(f))[1]

        return record("keys", keys), record("values", values)

    def recorded_wgmma(acc, *args, **kwargs):
        if acc.shape[0] == 64:
            events.append("wgmma")
        return wgmma(acc, *args, **kwargs)

    monkeypatch.setattr(_SequenceBlocks, "stream", recorded_stream)
    monkeypatch.setattr(plgpu, "wgmma", recorded_wgmma)
    shape = FusedShape(512, 8, 64, 768, 1, 8, 128)
    schedule = Schedule(3, 3, value_stages=2, head_pairs=pairs)
    lowered_for_hopper(shape, 1, 256, workers=8, schedule=schedule)
    steps = " ".join(events).split("keys")[1:]
    want = "wgmma values wgmma" + " wgmma wgmma" * pairs
    assert steps and all(step.strip() == want for step in steps)


def test_profile_of_both_warpgroups_lowers_for_cuda(monkeypatch, tmp_path):
    """The model's batch-1 default (two warpgroups, one grid barrier per iteration) lowers for
    sm_90 with the on-device profiler's records in it (huginn-0125's shapes, one layer). The
    profile's dump, a host callback, needs a GPU backend, so it is left out here."""
    monkeypatch.setattr(jax.debug, "callback", lambda *args, **kwargs: None)
    shape = FusedShape(5280, 55, 96, 17920, 1, 1)
    profiled = lowered_for_hopper(
        shape, 2, 1024, workers=132, schedule=DATAFLOW_OVERLAP, profile_dir=str(tmp_path)
    )
    assert "%clock" in profiled.as_text()  # the profiler's records of the SM clock


def test_barriers_are_left_out_only_after_kinds_of_step():
    """The timing bound (`skip_barriers`) lowers without the barriers after proj and the
    attention, and refuses a kind of step that has none."""
    shape = FusedShape(5280, 55, 96, 17920, 1, 1)
    bound = lowered_for_hopper(shape, 2, 256, workers=132, skip_barriers=("proj", "attn"))
    assert "mosaic_gpu" in bound.as_text()
    with pytest.raises(ValueError, match="each must be one of"):
        build_fused_core(shape, 2, eps=1e-6, workers=132, skip_barriers=("mlp",))


def test_counter_waits_are_left_out_with_one_barrier_per_iteration():
    """With one grid barrier per iteration the bound (`skip_barriers`) leaves out the units'
    waits on the listed steps' output tiles: the lowered kernel is smaller than the one with
    them, and every product but the adapter reads a step of one of the listed kinds."""
    shape = FusedShape(5280, 55, 96, 17920, 1, 1)
    kernel = lowered_for_hopper(shape, 2, 1024, workers=132, schedule=DATAFLOW_OVERLAP)
    bound = lowered_for_hopper(
        shape, 2, 1024, workers=132, schedule=DATAFLOW_OVERLAP, skip_barriers=STEP_KINDS
    )
    assert len(bound.as_text()) < len(kernel.as_text())
    two_layers = FusedShape(5280, 55, 96, 17920, 2, 1)
    before = [two_layers.step_before(p) for p in range(len(two_layers.phases))]
    assert before == ["", "adapter", "attn", "proj", "fc", "mlp_proj", "attn", "proj", "fc"]


def test_tma_descriptors_do_not_grow_with_the_layers(monkeypatch):
    """Mosaic GPU builds every TMA descriptor on the host at each call and passes it in the
    kernel's parameters: one weight array per kind of product keeps their number the same at 1
    layer and at 2."""
    from jax.experimental.mosaic.gpu import launch_context

    made = []
    build = launch_context.LaunchContext._get_tma_desc

    def counting(self, *args):
        before = len(self.tma_descriptors)
        desc = build(self, *args)
        made.append(len(self.tma_descriptors) > before)
        return desc

    monkeypatch.setattr(launch_context.LaunchContext, "_get_tma_desc", counting)
    counts = []
    for layers in (1, 2):
        made.clear()
        shape = FusedShape(512, 8, 64, 1024, layers, 1, 64)
        lowered_for_hopper(shape, 2, 128, workers=16, schedule=Schedule(3, 3))
        counts.append(sum(made))
    assert counts[0] == counts[1] and 0 < counts[0] <= 20


def test_fc_halves_interleave_by_chunks():
    """The fc's columns [gate | up] become gate chunk 0, up chunk 0, gate chunk 1, ...: the
    MLP proj's input chunk c is the fc output's rows [128 c, 128 c + 128)."""
    x = jnp.arange(2 * 3 * 64).reshape(1, -1)
    got = np.asarray(interleave_halves(x)).reshape(6, 64)
    gate, up = np.arange(192).reshape(3, 64), 192 + np.arange(192).reshape(3, 64)
    np.testing.assert_array_equal(got[0::2], gate)
    np.testing.assert_array_equal(got[1::2], up)


def test_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="heads \\* head_dim"):
        FusedShape(100, 3, 32, 64, 1, 1)
    with pytest.raises(ValueError, match="batch"):
        FusedShape(256, 4, 64, 688, 1, 9)
    with pytest.raises(ValueError, match="multiples of 16"):
        build_fused_core(
            FusedShape(96, 4, 24, 160, 1, 1), 1, workers=1, eps=1e-6, schedule=Schedule(ring=1)
        )
    with pytest.raises(ValueError, match="smem"):
        check_fused(FusedShape(5280, 55, 96, 17920, 1, 1), 132, Schedule(ring=9))
    huginn = FusedShape(5280, 55, 96, 17920, 1, 1)
    with pytest.raises(ValueError, match="L2 lookahead"):  # 13 units of the adapter per worker
        check_fused(huginn, 132, Schedule(ring=3, l2_units=10))
    with pytest.raises(ValueError, match="lag=2 < ring=2"):  # a slot reused before its wgmma
        check_fused(huginn, 132, Schedule(ring=2, lag=2))
    with pytest.raises(ValueError, match="late_inputs must be 0 or 1"):
        check_fused(huginn, 132, Schedule(late_inputs=2))
    with pytest.raises(ValueError, match="counter_tiles must be >= 1"):
        check_fused(huginn, 132, Schedule(counter_tiles=0))
    with pytest.raises(ValueError, match="known_complete must be 0 or 1"):
        check_fused(huginn, 132, dataclasses.replace(KNOWN, known_complete=2))
    with pytest.raises(ValueError, match="known_complete leaves out waits"):
        check_fused(huginn, 132, Schedule(3, 3, dataflow=1, known_complete=1))
    check_fused(huginn, 132, Schedule(l2_keep=10))  # 13 adapter units per worker, a ring of 3
    with pytest.raises(ValueError, match="l2_keep must be in \\[0, 10\\]"):
        check_fused(huginn, 132, Schedule(l2_keep=11))
    # the on-device profiler's records of 32 iterations of 4 layers take 37.6 KiB, of 36 42.3
    # KiB: 3:3 leaves 37.8 (key blocks of 96 columns, the tile of zeros in the products' scope)
    four_layers = FusedShape(5280, 55, 96, 17920, 4, 1)
    check_fused(four_layers, 132, Schedule(3, 3), profiled_iterations=32)
    with pytest.raises(ValueError, match="for the profiler's records of 36 iterations"):
        check_fused(four_layers, 132, Schedule(3, 3), profiled_iterations=36)
    with pytest.raises(ValueError, match="multiple of the schedule's blocks \\(128\\)"):
        w = step_weights(core())
        w = StepWeights(w.adapter, w.layers[:LAYERS], head_dim=w.head_dim, eps=w.eps)
        kernel_run(
            w, 1, 1, 0, workers=1, interpret=plgpu.InterpretGPUParams(),
            schedule=Schedule(2, 2, kv_block=128), slot=192,
        )  # fmt: skip
    with pytest.raises(ValueError, match="one worker"):
        build_fused_core(
            FusedShape(96, 4, 24, 160, 1, 1), 1, workers=2, eps=1e-6,
            interpret=plgpu.InterpretGPUParams(),
        )  # fmt: skip
