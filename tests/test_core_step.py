"""The Core weight stream kernel (pallas_kernels/core_step): its schedule on CPU, the kernel in
GPU interpret mode with one worker, lowered for sm_90 with every SM, and on a GPU against the
plain-JAX reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.core_step import core_phases, stream_bytes, weight_stream
from pallas_kernels.core_step import weight_stream_reference as reference
from pallas_kernels.core_step.plan import Phase, check_chained, unit_range
from pallas_kernels.core_step.stream import check_schedule
from tests.tolerance import assert_close

ON_GPU = jax.devices()[0].platform == "gpu"
gpu = pytest.mark.gpu
requires_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (Mosaic GPU, sm_90)")
HUGINN = (5280, 17920, 3 * 5280, 4)  # n_embd, intermediate, qkv columns, Core layers
TINY = (128, 192, 192, 1)
SMALL = (512, 768, 3 * 512, 2)  # 8 workers own >= 8 units of every phase


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


@pytest.mark.parametrize("workers", [1, 7, 132])
def test_unit_ranges_cover_each_unit_once(workers):
    for phase in core_phases(*TINY) + core_phases(*HUGINN)[:2]:
        ranges = [unit_range(phase, workers, w) for w in range(workers)]
        assert ranges[0][0] == 0 and ranges[-1][1] == phase.units
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
        sizes = [end - start for start, end in ranges]
        assert max(sizes) - min(sizes) <= 1


def test_schedule_errors():
    with pytest.raises(ValueError, match="reads 256 rows"):
        check_chained((Phase("a", 128, 128), Phase("b", 256, 128)))
    with pytest.raises(ValueError, match="ring"):
        check_schedule(core_phases(*TINY), workers=1, ring=4, x_stages=2)  # proj owns 4 units
    with pytest.raises(ValueError, match="x_stages"):
        check_schedule(core_phases(*TINY), workers=1, ring=3, x_stages=4)


@pytest.mark.parametrize("m,iterations", [(1, 1), (3, 2)])
def test_interpret_one_worker_matches_reference(m, iterations):
    phases = core_phases(*TINY)
    x0, weights = make_inputs(phases, m)
    got = weight_stream(
        x0,
        weights,
        phases=phases,
        iterations=iterations,
        workers=1,
        ring=3,
        x_stages=2,
        interpret=plgpu.InterpretGPUParams(),
    )
    want = reference(x0, weights, phases=phases, iterations=iterations)
    assert got.shape == (m, phases[-1].n)
    # Same roundings (each input to bf16), f32 sums in another order: a sum that lands across
    # a rounding boundary flips it and feeds the next product.
    assert_close(got, want, steps=len(phases) * iterations)


def test_interpret_refuses_several_workers():
    phases = core_phases(*TINY)
    x0, weights = make_inputs(phases, 1)
    with pytest.raises(ValueError, match="one worker"):
        weight_stream(
            x0, weights, phases=phases, iterations=1, workers=2, ring=1, x_stages=1,
            interpret=plgpu.InterpretGPUParams(),
        )  # fmt: skip


def test_lowers_for_cuda_with_every_sm():
    """Traces and lowers the kernel (grid barrier, reduce-adds) for sm_90 at huginn-0125's
    shapes (one Core layer, to keep the test short); catches API misuse and smem overflow."""
    phases = core_phases(*HUGINN[:3], 1)
    x0 = jax.ShapeDtypeStruct((1, phases[0].k), jnp.float32)
    weights = tuple(jax.ShapeDtypeStruct((p.k, p.n), jnp.bfloat16) for p in phases)

    def f(x, w):
        return weight_stream(x, w, phases=phases, iterations=8, workers=132, ring=24)

    text = jax.jit(f).trace(x0, weights).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@gpu
@requires_gpu
@pytest.mark.parametrize(
    "shape,workers,m,iterations",
    [
        (SMALL, 8, 1, 1),
        (SMALL, 8, 8, 3),
        (HUGINN, 132, 1, 1),
        (HUGINN, 132, 1, 8),
        (HUGINN, 132, 8, 2),
    ],
)
def test_matches_reference_gpu(shape, workers, m, iterations):
    phases = core_phases(*shape)
    x0, weights = make_inputs(phases, m, seed=m + iterations)
    ring = min(16, min(p.units // workers for p in phases) - 1)
    got = weight_stream(
        x0, weights, phases=phases, iterations=iterations, workers=workers, ring=ring, x_stages=2
    )
    want = reference(x0, weights, phases=phases, iterations=iterations)
    assert bool(jnp.isfinite(got).all())
    # Every product rounds its input to bf16: sums in another order can flip a rounding.
    assert_close(got, want, steps=len(phases) * iterations)
    np.testing.assert_array_equal(got.shape, (m, phases[-1].n))
