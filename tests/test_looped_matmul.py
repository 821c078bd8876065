"""Tests of pallas_kernels.looped_matmul's reference and resident kernel.

CPU: the reference against a float64 NumPy chain with per-step bf16 rounding; config and input
validation; the resident kernel in GPU interpret mode where no grid barrier is needed (one step,
or one block), and lowered for sm_90. GPU (marked `gpu`, skipped elsewhere): the kernel against
the reference, within tests/tolerance.py's bound for the number of chained bf16 steps.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from looped_matmul_common import GPU_D, INTERPRET, ON_GPU, gpu, make_inputs, requires_gpu
from tolerance import assert_close, rel_fro, rtol

from pallas_kernels.looped_matmul import (
    DeviceInfo,
    LoopedMatmulConfig,
    device_supported,
    looped_matmul,
    looped_matmul_copies,
    looped_matmul_copies_reference,
    looped_matmul_reference,
    pick_config,
)
from pallas_kernels.looped_matmul.kernel import looped_matmul_kernel


def numpy_chain(x, ws) -> np.ndarray:
    """float64 products, each rounded to bf16 (round-to-nearest-even) before the next step."""
    bf16 = ml_dtypes.bfloat16
    cur = np.asarray(x).astype(np.float64)
    for w in ws:
        cur = (cur @ np.asarray(w).astype(np.float64)).astype(bf16).astype(np.float64)
    return cur


# ------------------------------------------------------------------ reference (CPU)
@pytest.mark.parametrize(
    "m,d,steps", [(1, 64, 1), (8, 128, 2), (64, 256, 8), (3, 192, 32), (17, 128, 5)]
)
def test_reference_matches_numpy_chain(m, d, steps):
    x, w = make_inputs(100 + m + d + steps, m, d)
    assert float(jnp.abs(x.astype(jnp.float32)).max()) > 0
    got = looped_matmul_reference(x, w, steps)
    assert got.shape == (m, d) and got.dtype == jnp.bfloat16
    want = numpy_chain(x, [w] * steps)
    # f32 vs f64 accumulation only flips an occasional bf16 rounding, then the chain drifts
    # (tests/tolerance.py); at d <= 256 the flips are rare enough for 2e-3 over 8 steps.
    assert rel_fro(got, want) <= (2e-3 if steps <= 8 else rtol(steps))


def test_reference_one_step_is_rounded_product():
    x, w = make_inputs(7, 4, 128)
    got = np.asarray(looped_matmul_reference(x, w, 1), np.float32)
    want = np.asarray(
        (x.astype(jnp.float32) @ w.astype(jnp.float32)).astype(jnp.bfloat16), np.float32
    )
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)


def test_copies_reference_matches_numpy_chain():
    x, ws = make_inputs(11, 5, 128, steps=4)
    got = looped_matmul_copies_reference(x, ws)
    assert rel_fro(got, numpy_chain(x, list(ws))) <= 2e-3


# ------------------------------------------------------------------ config (CPU)
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(block_cols=48), "block_cols=48 must be a positive multiple of 64"),
        (dict(block_cols=320), "block_cols=320 must be <= 256"),
        (dict(block_k=96), "block_k=96 must be a positive multiple of 64"),
        (dict(block_k=512), "block_k=512 must be <= 256"),
        (dict(resident_chunks=-1), "resident_chunks=-1 must be >= 0"),
        (dict(stream_stages=1), "stream_stages=1 must be >= wgmma_lag"),
        (dict(x_stages=1), "x_stages=1 must be >= wgmma_lag"),
        (dict(wgmma_lag=0), "wgmma_lag=0 must be >= 1"),
        (dict(min_n_pad=8), "min_n_pad=8 must be 16, 32 or 64"),
        (dict(wgmma_lag=2, stream_stages=2), "stream_stages=2 must be >= wgmma_lag"),
    ],
)
def test_config_post_init_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoopedMatmulConfig(**kwargs)


def test_config_validate_errors():
    h200 = DeviceInfo()
    cfg = LoopedMatmulConfig(block_cols=64, block_k=64, resident_chunks=4)
    with pytest.raises(ValueError, match="multiple of block_cols"):
        cfg.validate(1, 96, 2, device=h200)
    with pytest.raises(ValueError, match="blocks > 132 SMs"):
        cfg.validate(1, 64 * 133, 2, device=h200)
    cfg.validate(1, 64 * 133, 1, device=h200)  # one step: no grid barrier, any grid
    with pytest.raises(ValueError, match="resident_chunks=4 > 2 chunks"):
        cfg.validate(1, 128, 2, device=h200)
    with pytest.raises(ValueError, match="resident_chunks must be 0 for stacked"):
        cfg.validate(1, 512, 2, stacked=True, device=h200)
    big = LoopedMatmulConfig(block_cols=64, block_k=128, resident_chunks=40)
    with pytest.raises(ValueError, match="needs .* B of shared memory per block"):
        big.validate(1, 6144, 2, device=h200)
    with pytest.raises(ValueError, match="M=65 is out of range"):
        cfg.validate(65, 512, 2, device=h200)
    with pytest.raises(ValueError, match="steps=0 must be >= 1"):
        cfg.validate(1, 512, 0, device=h200)


@pytest.mark.parametrize("m", [1, 8, 16, 17, 33, 64])
@pytest.mark.parametrize("d", [2048, 3520, 4096, 6144, 8192, 12288])
def test_pick_config_is_valid(m, d):
    h200 = DeviceInfo()
    cfg = pick_config(m, d, device=h200)
    cfg.validate(m, d, 8, device=h200)
    assert cfg.num_blocks(d) <= h200.num_sms
    assert 0 < cfg.resident_chunks <= cfg.num_chunks(d)
    stacked = pick_config(m, d, stacked=True, device=h200)
    stacked.validate(m, d, 8, stacked=True, device=h200)


def test_pick_config_small_slice_is_all_resident():
    cfg = pick_config(1, 1024)  # 16 blocks x [1024, 64] = 128 KiB each: fits
    assert cfg.resident_chunks == cfg.num_chunks(1024)


def test_pick_config_errors():
    with pytest.raises(ValueError, match="d=100 must be a positive multiple of 64"):
        pick_config(1, 100)
    with pytest.raises(ValueError, match="too large for 132 SMs"):
        pick_config(1, 64 * 4 * 133)


# ------------------------------------------------------------------ wrapper validation (CPU)
def test_wrapper_input_errors():
    x, w = make_inputs(3, 4, 128)
    with pytest.raises(ValueError, match="must be bfloat16"):
        looped_matmul(x.astype(jnp.float32), w, 2, interpret=INTERPRET)
    with pytest.raises(ValueError, match="must have shape"):
        looped_matmul(x, w[:64], 2, interpret=INTERPRET)
    with pytest.raises(ValueError, match="M=65 is out of range"):
        looped_matmul(jnp.zeros((65, 128), jnp.bfloat16), w, 2, interpret=INTERPRET)
    with pytest.raises(ValueError, match="steps=0 must be an int >= 1"):
        looped_matmul(x, w, 0, interpret=INTERPRET)
    xo, wo = make_inputs(3, 4, 96)
    with pytest.raises(ValueError, match="d=96 must be a multiple of 64"):
        looped_matmul(xo, wo, 2, interpret=INTERPRET)
    with pytest.raises(ValueError, match="w_stacked must be"):
        looped_matmul_copies(x, w, interpret=INTERPRET)
    cfg = LoopedMatmulConfig(block_cols=64, block_k=64, resident_chunks=2)
    with pytest.raises(ValueError, match="interpret mode cannot run the grid barrier"):
        looped_matmul(x, w, 2, config=cfg, interpret=INTERPRET)


@pytest.mark.skipif(ON_GPU, reason="checks the CPU-only error")
def test_wrapper_needs_gpu_without_interpret():
    assert not device_supported()
    x, w = make_inputs(3, 4, 128)
    with pytest.raises(ValueError, match=r"needs a GPU with Mosaic GPU \(sm_90"):
        looped_matmul(x, w, 2)


# ------------------------------------------------------------------ interpret mode (CPU)
# Interpret mode runs blocks one after another and has no global semaphores, so these configs
# avoid the grid barrier: one step (any number of blocks) or one block (any number of steps).
INTERPRET_CASES = [
    # (m, d, steps, config)
    (1, 128, 1, LoopedMatmulConfig(64, 64, resident_chunks=1, stream_stages=2, x_stages=2)),
    (16, 512, 1, LoopedMatmulConfig(64, 128, resident_chunks=2, stream_stages=2, x_stages=2)),
    (3, 128, 3, LoopedMatmulConfig(128, 64, resident_chunks=1, stream_stages=2, x_stages=2)),
    (1, 192, 5, LoopedMatmulConfig(192, 64, resident_chunks=3, stream_stages=2, x_stages=4)),
    (20, 256, 4, LoopedMatmulConfig(256, 64, resident_chunks=0, stream_stages=3, x_stages=2)),
    (64, 256, 2, LoopedMatmulConfig(256, 64, resident_chunks=2, stream_stages=2, x_stages=3)),
    # deeper wgmma pipelining: slots are refilled `wgmma_lag` chunks late
    (2, 256, 3, LoopedMatmulConfig(256, 64, 1, stream_stages=3, x_stages=3, wgmma_lag=2)),
    (9, 256, 2, LoopedMatmulConfig(256, 64, 0, stream_stages=4, x_stages=4, wgmma_lag=3)),
    # state padded beyond what M needs (wider swizzle)
    (1, 128, 2, LoopedMatmulConfig(128, 64, 1, stream_stages=2, x_stages=2, min_n_pad=64)),
    (5, 256, 1, LoopedMatmulConfig(64, 128, 1, stream_stages=2, x_stages=2, min_n_pad=32)),
]


@pytest.mark.parametrize("m,d,steps,cfg", INTERPRET_CASES)
def test_kernel_interpret_matches_reference(m, d, steps, cfg):
    x, w = make_inputs(1000 + m * d + steps, m, d)
    got = looped_matmul(x, w, steps, config=cfg, interpret=INTERPRET)
    want = looped_matmul_reference(x, w, steps)
    assert got.shape == (m, d) and got.dtype == jnp.bfloat16
    assert rel_fro(got, want) <= 2e-3


def test_kernel_interpret_copies_matches_reference():
    x, ws = make_inputs(5, 5, 128, steps=3)
    cfg = LoopedMatmulConfig(128, 64, resident_chunks=0, stream_stages=2, x_stages=2)
    got = looped_matmul_copies(x, ws, config=cfg, interpret=INTERPRET)
    assert rel_fro(got, looped_matmul_copies_reference(x, ws)) <= 2e-3


def test_kernel_interpret_without_barrier_flag_one_step_many_blocks():
    # grid_barrier=False on one step is the "minimal kernel" of the smoke test.
    x, w = make_inputs(9, 2, 256)
    cfg = LoopedMatmulConfig(64, 64, resident_chunks=2, stream_stages=2, x_stages=2)
    got = looped_matmul_kernel(x, w, steps=1, cfg=cfg, interpret=INTERPRET, grid_barrier=False)
    assert rel_fro(got, looped_matmul_reference(x, w, 1)) <= 2e-3


# ------------------------------------------------------------------ lowering for CUDA (CPU)
@pytest.mark.parametrize(
    "m,d,steps,stacked",
    [
        (1, 2048, 8, False),
        (8, 6144, 8, False),
        (64, 6144, 2, False),
        (1, 12288, 2, False),
        (32, 3520, 4, False),
        (1, 2048, 4, True),
    ],
)
def test_kernel_lowers_for_cuda(m, d, steps, stacked):
    """Traces and lowers the real kernel (grid barrier included) to a Mosaic GPU custom call.

    Runs on CPU (the target defaults to sm_90 without a GPU); catches API misuse, layout and
    swizzle errors, and shared-memory overflow (Mosaic checks 227 KiB) before a GPU run.
    """
    cfg = pick_config(m, d, stacked=stacked)
    x = jax.ShapeDtypeStruct((m, d), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((steps, d, d) if stacked else (d, d), jnp.bfloat16)
    f = jax.jit(lambda x, w: looped_matmul_kernel(x, w, steps=steps, cfg=cfg, stacked=stacked))
    text = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


# ------------------------------------------------------------------ GPU
@gpu
@requires_gpu
@pytest.mark.parametrize("d", GPU_D)
@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize("steps", [1, 2, 8, 32])
def test_kernel_matches_reference_gpu(d, m, steps):
    x, w = make_inputs(d + 7 * m + steps, m, d)
    got = looped_matmul(x, w, steps, config=pick_config(m, d))  # the resident kernel
    want = looped_matmul_reference(x, w, steps)
    assert got.shape == (m, d) and got.dtype == jnp.bfloat16
    assert bool(jnp.isfinite(got.astype(jnp.float32)).all())
    assert_close(got, want, steps=steps)


@gpu
@requires_gpu
@pytest.mark.parametrize(
    "overrides",
    [
        dict(resident_chunks=0),  # everything streamed
        dict(block_k=64, resident_chunks=8, stream_stages=8),
        dict(stream_stages=2, x_stages=2),
    ],
)
def test_kernel_configs_gpu(overrides):
    m, d, steps = 4, 6144, 8
    x, w = make_inputs(21, m, d)
    cfg = dataclasses.replace(pick_config(m, d), **overrides)
    got = looped_matmul(x, w, steps, config=cfg)
    assert_close(got, looped_matmul_reference(x, w, steps), steps=steps)


@gpu
@requires_gpu
@pytest.mark.parametrize("m,d,steps", [(1, 2048, 8), (8, 3520, 4), (64, 6144, 2)])
def test_kernel_copies_gpu(m, d, steps):
    x, ws = make_inputs(31 + d, m, d, steps=steps)
    got = looped_matmul_copies(x, ws)
    assert_close(got, looped_matmul_copies_reference(x, ws), steps=steps)


@gpu
@requires_gpu
def test_kernel_repeated_calls_gpu():
    # The global semaphore is zeroed per call; a stale epoch would hang or race here.
    x, w = make_inputs(41, 8, 2048)
    want = looped_matmul_reference(x, w, 8)
    for _ in range(3):
        assert_close(looped_matmul(x, w, 8, config=pick_config(8, 2048)), want, steps=8)
