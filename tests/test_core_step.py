"""The Core weight stream kernel (pallas_kernels/core_step): its schedule on CPU, the kernel in
GPU interpret mode with one worker, lowered for sm_90 with every SM, and on a GPU against the
plain-JAX reference; each with weight tiles 64, 128 and 256 columns wide (unit_cols)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.core_step import core_phases, pad_inputs, stream_bytes, weight_stream
from pallas_kernels.core_step import weight_stream_reference as reference
from pallas_kernels.core_step.plan import UNIT_COLS, Phase, check_chained, min_units, unit_range
from pallas_kernels.core_step.stream import check_schedule, default_ring
from tests.tolerance import assert_close

ON_GPU = jax.devices()[0].platform == "gpu"
gpu = pytest.mark.gpu
requires_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (Mosaic GPU, sm_90)")
HUGINN = (5280, 17920, 3 * 5280, 4)  # n_embd, intermediate, qkv columns, Core layers
TINY = (128, 192, 192, 1)
TINY_WIDE = (192, 256, 192, 1)  # d padded to 192 for k, to 256 for n: the state rows grow
SMALL = (512, 768, 3 * 512, 2)  # 8 workers own >= 8 units of every phase (4 at unit_cols 256)


# shape, workers, batch, iterations of the GPU tests, per tile width (fewer for the wider tiles)
GPU_CASES = {
    64: [
        (SMALL, 8, 1, 1),
        (SMALL, 8, 8, 3),
        (HUGINN, 132, 1, 1),
        (HUGINN, 132, 1, 8),
        (HUGINN, 132, 8, 2),
    ],
    128: [(SMALL, 8, 8, 3), (HUGINN, 132, 1, 8), (HUGINN, 132, 8, 2)],
    256: [(SMALL, 4, 8, 3), (HUGINN, 132, 1, 8), (HUGINN, 132, 8, 2)],
}


def gpu_ring(phases, workers, unit_cols):
    """The GPU tests' ring: the default's bytes, shorter than any worker's units of a phase."""
    return min(default_ring(unit_cols), min_units(phases, workers, unit_cols) - 1)


def make_inputs(phases, m, seed=0):
    key = jax.random.key(seed)
    weights = tuple(
        (jax.random.normal(jax.random.fold_in(key, i), (p.k, p.n)) / p.k**0.5).astype(jnp.bfloat16)
        for i, p in enumerate(phases)
    )
    return jax.random.normal(jax.random.fold_in(key, 99), (m, phases[0].k)), weights


def test_core_phases_pad_huginn_to_units():
    phases = core_phases(*HUGINN)
    assert [p.name for p in phases[:5]] == ["adapter", "qkv0", "proj0", "fc0", "mlp_proj0"]
    assert len(phases) == 17
    assert (phases[0].k, phases[0].n) == (10624, 5312)  # [2 d, d], d = 5280 padded to 5312
    assert (phases[1].k, phases[1].n) == (5312, 15872)
    assert (phases[4].k, phases[4].n) == (17920, 5312)
    unpadded = 2 * (
        2 * 5280 * 5280 + 4 * (5280 * 15840 + 5280**2 + 2 * 5280 * 17920 + 17920 * 5280)
    )
    assert unpadded < stream_bytes(phases) < 1.01 * unpadded


def test_core_phases_pad_n_to_wide_tiles():
    for cols in (128, 256):
        phases = core_phases(*HUGINN, unit_cols=cols)
        # n to 5376 (d), 15872 (qkv), 35840 (fc); k stays padded to 64; the adapter's k is the
        # state (the last n) followed by the external input
        assert (phases[0].k, phases[0].n) == (5376 + 5312, 5376)
        assert [(p.k, p.n) for p in phases[1:5]] == [
            (5312, 15872),
            (5312, 5376),
            (5312, 35840),
            (17920, 5376),
        ]
        assert all(p.n % cols == 0 and p.k % 64 == 0 for p in phases)
        assert stream_bytes(phases) < 1.01 * stream_bytes(core_phases(*HUGINN))
    with pytest.raises(ValueError, match="unit_cols"):
        core_phases(*TINY, unit_cols=96)


@pytest.mark.parametrize("unit_cols", UNIT_COLS)
@pytest.mark.parametrize("workers", [1, 7, 132])
def test_unit_ranges_cover_each_unit_once(workers, unit_cols):
    phases = core_phases(*TINY_WIDE, unit_cols=unit_cols)
    for phase in phases + core_phases(*HUGINN, unit_cols=unit_cols)[:2]:
        ranges = [unit_range(phase, workers, w, unit_cols) for w in range(workers)]
        assert ranges[0][0] == 0 and ranges[-1][1] == phase.units(unit_cols)
        assert phase.units(unit_cols) == phase.k // 64 * phase.n // unit_cols
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
        sizes = [end - start for start, end in ranges]
        assert max(sizes) - min(sizes) <= 1


def test_schedule_errors():
    with pytest.raises(ValueError, match="reads 256 rows"):
        check_chained((Phase("a", 128, 128), Phase("b", 256, 128)))
    with pytest.raises(ValueError, match="n of unit_cols=128"):
        check_chained((Phase("a", 128, 192), Phase("b", 128, 128)), unit_cols=128)
    with pytest.raises(ValueError, match="ring"):
        check_schedule(core_phases(*TINY), workers=1, ring=4, x_stages=2)  # proj owns 4 units
    with pytest.raises(ValueError, match="ring"):  # proj owns 3 units of [64, 256]
        check_schedule(core_phases(*TINY_WIDE, unit_cols=256), 1, 3, 2, unit_cols=256)
    with pytest.raises(ValueError, match="x_stages"):
        check_schedule(core_phases(*TINY), workers=1, ring=3, x_stages=4)
    with pytest.raises(ValueError, match="lag"):  # unit i's copy would wait for unit i
        check_schedule(core_phases(*TINY), workers=1, ring=1, x_stages=1)
    huginn = {c: core_phases(*HUGINN, unit_cols=c) for c in UNIT_COLS}
    with pytest.raises(ValueError, match="shared memory"):  # 8 x 32 KiB
        check_schedule(huginn[256], 132, ring=8, x_stages=4, unit_cols=256)
    with pytest.raises(ValueError, match="shared memory"):  # 14 x 16 KiB
        check_schedule(huginn[128], 132, ring=14, x_stages=4, unit_cols=128)
    with pytest.raises(ValueError, match="shared memory"):  # out and zero: 2 x 64 KiB
        check_schedule(huginn[256], 132, ring=4, x_stages=4, unit_cols=256, m=64)
    for cols, ring in [(64, 24), (128, 12), (256, 6)]:  # 192 KiB of ring fits
        check_schedule(huginn[cols], 132, ring=ring, x_stages=4, unit_cols=cols, m=8)


@pytest.mark.parametrize(
    "unit_cols,m,iterations,lag",
    [(64, 1, 1, 1), (64, 3, 2, 1), (128, 3, 1, 1), (256, 3, 2, 1), (64, 3, 2, 0)],
)
def test_interpret_one_worker_matches_reference(unit_cols, m, iterations, lag):
    phases = core_phases(*(TINY if unit_cols == 64 else TINY_WIDE), unit_cols=unit_cols)
    x0, weights = make_inputs(phases, m)
    got = weight_stream(
        x0,
        weights,
        phases=phases,
        iterations=iterations,
        workers=1,
        unit_cols=unit_cols,
        ring=min(3, min_units(phases, 1, unit_cols) - 1),
        x_stages=2,
        lag=lag,
        interpret=plgpu.InterpretGPUParams(),
    )
    want = reference(x0, weights, phases=phases, iterations=iterations)
    assert got.shape == (m, phases[-1].n)
    # Same roundings (each input to bf16), f32 sums in another order: a sum that lands across
    # a rounding boundary flips it and feeds the next product.
    assert_close(got, want, steps=len(phases) * iterations)


@pytest.mark.parametrize("unit_cols", [128, 256])
def test_zero_padding_to_wide_tiles_keeps_the_products(unit_cols):
    shape = (320, 200, 330, 1)  # d: k 320, n 384 or 512; every n grows
    narrow = core_phases(*shape)
    wide = core_phases(*shape, unit_cols=unit_cols)
    assert wide[-1].n > narrow[-1].n  # the state rows grow
    x0, weights = make_inputs(narrow, 2)
    x0_w, weights_w = pad_inputs(x0, weights, narrow, wide)
    assert [w.shape for w in weights_w] == [(p.k, p.n) for p in wide]
    want = reference(x0, weights, phases=narrow, iterations=2)
    got = reference(x0_w, weights_w, phases=wide, iterations=2)
    np.testing.assert_array_equal(got[:, narrow[-1].n :], 0)
    assert_close(got[:, : narrow[-1].n], want, steps=len(narrow) * 2)


def test_interpret_refuses_several_workers():
    phases = core_phases(*TINY)
    x0, weights = make_inputs(phases, 1)
    with pytest.raises(ValueError, match="one worker"):
        weight_stream(
            x0, weights, phases=phases, iterations=1, workers=2, ring=1, x_stages=1,
            interpret=plgpu.InterpretGPUParams(),
        )  # fmt: skip


@pytest.mark.parametrize(
    "unit_cols,ring,lag", [(64, 24, 1), (128, 12, 1), (256, 6, 1), (256, 4, 0)]
)
def test_lowers_for_cuda_with_every_sm(unit_cols, ring, lag):
    """Traces and lowers the kernel (grid barrier, reduce-adds, the [unit_cols, 64] transposed
    A operand) for sm_90 at huginn-0125's shapes (one Core layer, to keep the test short) with
    the longest ring that fits, and with a wgmma lag of 0; catches API misuse and smem
    overflow."""
    phases = core_phases(*HUGINN[:3], 1, unit_cols=unit_cols)
    x0 = jax.ShapeDtypeStruct((1, phases[0].k), jnp.float32)
    weights = tuple(jax.ShapeDtypeStruct((p.k, p.n), jnp.bfloat16) for p in phases)

    def f(x, w):
        return weight_stream(
            x, w, phases=phases, iterations=8, workers=132, unit_cols=unit_cols, ring=ring,
            lag=lag,
        )  # fmt: skip

    text = jax.jit(f).trace(x0, weights).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("unit_cols", UNIT_COLS)
def test_gpu_configurations_fit(unit_cols):
    """The GPU tests' schedules pass the checks (ring > lag, shared memory) on CPU."""
    for shape, workers, m, _ in GPU_CASES[unit_cols]:
        phases = core_phases(*shape, unit_cols=unit_cols)
        ring = gpu_ring(phases, workers, unit_cols)
        check_schedule(phases, workers, ring, x_stages=2, unit_cols=unit_cols, m=m)
        if shape == HUGINN:  # the default ring: 128 KiB of weights in flight
            assert ring == default_ring(unit_cols)


@gpu
@requires_gpu
@pytest.mark.parametrize(
    "unit_cols,shape,workers,m,iterations",
    [(cols, *case) for cols, cases in GPU_CASES.items() for case in cases],
    ids=lambda v: (
        {SMALL: "small", HUGINN: "huginn"}.get(v, str(v)) if isinstance(v, tuple) else None
    ),
)
def test_matches_reference_gpu(unit_cols, shape, workers, m, iterations):
    phases = core_phases(*shape, unit_cols=unit_cols)
    x0, weights = make_inputs(phases, m, seed=m + iterations)
    got = weight_stream(
        x0,
        weights,
        phases=phases,
        iterations=iterations,
        workers=workers,
        unit_cols=unit_cols,
        ring=gpu_ring(phases, workers, unit_cols),
        x_stages=2,
    )
    want = reference(x0, weights, phases=phases, iterations=iterations)
    assert bool(jnp.isfinite(got).all())
    # Every product rounds its input to bf16: sums in another order can flip a rounding.
    assert_close(got, want, steps=len(phases) * iterations)
    np.testing.assert_array_equal(got.shape, (m, phases[-1].n))
