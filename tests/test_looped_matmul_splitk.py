"""Tests of pallas_kernels.looped_matmul's split-K kernel and its grid barrier.

CPU: config validation and picks; the kernel in GPU interpret mode where no grid barrier is
needed (one step, or one worker); lowered for sm_90 (the module checked for its register-operand
wgmmas, ldmatrix.trans loads and TMA reduce-adds), with each way of polling the barrier. GPU
(marked `gpu`, skipped elsewhere): the kernel against the reference, within tests/tolerance.py's
bound for the number of chained bf16 steps, and the barrier probe.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from looped_matmul_common import GPU_D, INTERPRET, gpu, make_inputs, requires_gpu
from tolerance import assert_close, rel_fro

from pallas_kernels.looped_matmul import (
    DeviceInfo,
    LoopedMatmulConfig,
    SplitKConfig,
    looped_matmul,
    looped_matmul_reference,
    pick_any_config,
    pick_splitk_config,
)
from pallas_kernels.looped_matmul.barrier import POLLS, build_barrier_probe
from pallas_kernels.looped_matmul.splitk_kernel import build_splitk, looped_matmul_splitk
from pallas_kernels.looped_matmul.splitk_pick import DEEP_RING

SPLITK_H200_PICKS = [(1, 2048), (8, 3520), (1, 6144), (8, 6144), (17, 6144), (1, 12288)]


def splitk_module_text(capfd, m, d, steps, cfg) -> str:
    """The Mosaic GPU module of the split-K kernel, as printed by `debug=True` when lowering."""
    f = build_splitk(m, d, steps, cfg, debug=True)
    x0 = jax.ShapeDtypeStruct((d, cfg.n_pad(m)), jnp.float32)
    w = jax.ShapeDtypeStruct((d, d), jnp.bfloat16)
    capfd.readouterr()
    jax.jit(f).trace(x0, w).lower(lowering_platforms=("cuda",))
    return capfd.readouterr().out


# ------------------------------------------------------------------ config (CPU)
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(tiles=0), "tiles=0 must be in 1..16"),
        (dict(k_split=0), "k_split=0 must be >= 1"),
        (dict(warpgroups=3), "warpgroups=3 must be 1 or 2"),
        (dict(reg_units=-1), "reg_units=-1 must be >= 0"),
        (dict(x_stages=0), "x_stages=0 must be >= 1"),
        (dict(wgmma_lag=0), "wgmma_lag=0 must be >= 1"),
        (dict(min_n_pad=24), "min_n_pad=24 must be 8, 16, 32 or 64"),
        (dict(sync="epoch"), "sync='epoch' is not one of"),
    ],
)
def test_splitk_config_post_init_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SplitKConfig(**kwargs)


def test_splitk_config_validate_errors():
    h200 = DeviceInfo()
    cfg = SplitKConfig(tiles=2, k_split=4, warpgroups=2, ring=2)
    cfg.validate(1, 512, 8, device=h200)
    with pytest.raises(ValueError, match="multiple of block_cols=128"):
        cfg.validate(1, 576, 2, device=h200)
    with pytest.raises(ValueError, match="k_split=8 > 6 chunks of 64 rows"):
        dataclasses.replace(cfg, tiles=1, k_split=8).validate(1, 384, 2, device=h200)
    with pytest.raises(ValueError, match="do not fill blocks of warpgroups=2"):
        SplitKConfig(tiles=1, k_split=1, warpgroups=2).validate(1, 192, 1, device=h200)
    with pytest.raises(ValueError, match="blocks > 132 SMs"):
        SplitKConfig(tiles=1, k_split=2, warpgroups=1).validate(1, 64 * 134, 2, device=h200)
    with pytest.raises(ValueError, match="units in a worker's slice"):
        dataclasses.replace(cfg, reg_units=3, smem_units=2).validate(1, 512, 2, device=h200)
    with pytest.raises(ValueError, match="ring=1 must be >= wgmma_lag"):
        dataclasses.replace(cfg, ring=1).validate(1, 512, 2, device=h200)
    with pytest.raises(ValueError, match="registers per thread > 255"):
        SplitKConfig(tiles=4, k_split=1, reg_units=14, ring=2).validate(1, 1024, 2, device=h200)
    with pytest.raises(ValueError, match="B of shared memory per block"):
        SplitKConfig(tiles=4, k_split=1, smem_units=15, ring=2).validate(1, 1024, 2, device=h200)
    with pytest.raises(ValueError, match="barriers > 32"):
        SplitKConfig(tiles=4, k_split=1, warpgroups=2, smem_units=17).validate(
            1, 512, 2, device=DeviceInfo(smem_bytes=10**7)
        )
    with pytest.raises(ValueError, match="stacked weights"):
        cfg.validate(1, 512, 2, stacked=True, device=h200)


@pytest.mark.parametrize("m", [1, 8, 17])
@pytest.mark.parametrize("d", [2048, 3520, 4096, 6144, 8192, 12288])
def test_pick_splitk_config_is_valid(m, d):
    h200 = DeviceInfo()
    cfg = pick_splitk_config(m, d, device=h200)
    cfg.validate(m, d, 8, device=h200)
    assert cfg.num_blocks(d) <= h200.num_sms
    assert cfg.num_blocks(d) * cfg.warpgroups >= 120  # >= 120 SMs' worth of workers
    assert cfg.regs_per_thread(m) <= 240


def test_pick_splitk_config_puts_weight_on_chip():
    cfg = pick_splitk_config(1, 6144)
    # 72 MiB: every SM busy; streamed, so no register units
    assert cfg.num_blocks(6144) == 128 and cfg.warpgroups == 2
    assert cfg.reg_units == 0 and cfg.streamed_units(6144) > 0 and cfg.zigzag
    small = pick_splitk_config(1, 3520)  # 24 MiB: all of it on chip, registers included
    assert small.streamed_units(3520) == 0 and small.reg_units >= 8
    # d = 55 x 64 has no even split over 2 warpgroups per SM; ragged ones are not picked
    assert small.warpgroups == 1 and not small.ragged(3520)
    big = pick_splitk_config(1, 12288)  # 288 MiB: HBM-bound, a deep ring instead
    assert big.ring == DEEP_RING and big.reg_units == 0
    assert 4 * big.streamed_units(12288) > 3 * big.units(12288)


def test_pick_any_config_variants():
    assert isinstance(pick_any_config(1, 2048), SplitKConfig)  # the default
    assert isinstance(pick_any_config(64, 6144), LoopedMatmulConfig)  # no split-K tiling fits
    assert isinstance(pick_any_config(1, 2048, stacked=True), LoopedMatmulConfig)
    assert isinstance(pick_any_config(1, 2048, variant="splitk"), SplitKConfig)
    assert isinstance(pick_any_config(1, 2048, variant="resident"), LoopedMatmulConfig)
    assert isinstance(pick_any_config(1, 2048, stacked=True, variant="splitk"), LoopedMatmulConfig)
    with pytest.raises(ValueError, match="variant='fast' must be one of"):
        pick_any_config(1, 2048, variant="fast")
    with pytest.raises(ValueError, match="no split-K tiling fits"):
        pick_splitk_config(64, 6144)


# ------------------------------------------------------------------ interpret mode (CPU)
# Interpret mode runs blocks one after another, has no global semaphores and no TMA reduction
# (emulated by a read-modify-write), and cannot take a wgmma A operand from registers (the
# register fragments are stored back to a shared-memory tile first). So: one step with any
# number of workers (one warpgroup per block when k_split > 1), or one worker and many steps.
SPLITK_INTERPRET_CASES = [
    # (m, d, steps, config)
    (1, 128, 3, SplitKConfig(tiles=2, k_split=1, warpgroups=1, reg_units=1, smem_units=1)),
    (3, 256, 1, SplitKConfig(tiles=1, k_split=1, warpgroups=2, reg_units=2, smem_units=1)),
    (5, 256, 1, SplitKConfig(tiles=2, k_split=2, warpgroups=1, reg_units=1, smem_units=1)),
    # ragged first chunk (4 on-chip units, 3 tiles), state refilled one chunk at a time, lag 2
    (2, 192, 4, SplitKConfig(3, 1, 1, reg_units=3, smem_units=1, ring=3, x_stages=1, wgmma_lag=2)),
    # reduction over 4 K ranges, n_pad 24, 2 state slots for 3 chunks (static + dynamic refills)
    (17, 768, 1, SplitKConfig(3, 4, 1, reg_units=2, smem_units=2, ring=2, x_stages=2)),
    (64, 256, 1, SplitKConfig(tiles=1, k_split=1, warpgroups=2, ring=2, x_stages=2)),  # streamed
    (8, 128, 3, SplitKConfig(tiles=2, k_split=1, warpgroups=1, reg_units=4, ring=0)),  # all regs
    (4, 256, 2, SplitKConfig(tiles=4, k_split=1, warpgroups=1, reg_units=2, smem_units=5)),
    # zigzag: 3 fully streamed chunks reversed on odd steps, then a mixed chunk; all streamed
    (3, 256, 3, SplitKConfig(4, 1, 1, reg_units=1, smem_units=2, ring=3, zigzag=True)),
    (1, 192, 4, SplitKConfig(tiles=3, k_split=1, warpgroups=1, ring=4, zigzag=True)),
    # ragged K ranges: 5 chunks over 2 ranges (2 + 3), 7 over 3 (2 + 2 + 3), all streamed
    (3, 320, 1, SplitKConfig(tiles=5, k_split=2, warpgroups=1, reg_units=2, smem_units=3)),
    (1, 448, 1, SplitKConfig(tiles=7, k_split=3, warpgroups=1, ring=2)),
    # sync="flags": 5 state buffers (7 steps wrap around them), and the reduce-add into them
    (1, 128, 7, SplitKConfig(2, 1, 1, reg_units=1, smem_units=1, sync="flags")),
    (5, 256, 1, SplitKConfig(2, 2, 1, reg_units=1, smem_units=1, sync="flags")),
]


@pytest.mark.parametrize("m,d,steps,cfg", SPLITK_INTERPRET_CASES)
def test_splitk_interpret_matches_reference(m, d, steps, cfg):
    x, w = make_inputs(2000 + m * d + steps, m, d)
    got = looped_matmul(x, w, steps, config=cfg, interpret=INTERPRET)
    want = looped_matmul_reference(x, w, steps)
    assert got.shape == (m, d) and got.dtype == jnp.bfloat16
    assert float(jnp.abs(want.astype(jnp.float32)).max()) > 0
    assert rel_fro(got, want) <= 2e-3


@pytest.mark.parametrize("d,k_split", [(3520, 20), (3520, 22), (448, 3), (2048, 16), (320, 2)])
def test_splitk_ragged_ranges_cover_k_once(d, k_split):
    cfg = SplitKConfig(tiles=1, k_split=k_split)
    chunks, per = d // 64, cfg.k_chunks(d)
    starts = [cfg.chunk_start(d, j) for j in range(k_split)]
    ends = starts[1:] + [chunks]
    owned = [e - s for s, e in zip(starts, ends, strict=True)]
    assert starts[0] == 0 and sorted(owned) == owned  # short ranges first
    assert owned.count(per - 1) == cfg.short_ranges(d) and set(owned) <= {per - 1, per}
    assert cfg.ragged(d) == (cfg.short_ranges(d) > 0)
    # every worker runs `per` chunks: a short range's extra chunk stays inside w
    assert all(s + per <= chunks for s in starts)


def test_splitk_zigzag_needs_the_whole_state_staged():
    cfg = SplitKConfig(tiles=3, k_split=1, warpgroups=1, ring=4, zigzag=True, x_stages=2)
    with pytest.raises(ValueError, match="zigzag needs the whole state staged"):
        cfg.validate(1, 192, 4)


def test_splitk_interpret_refuses_barrier_and_racy_emulation():
    x, w = make_inputs(3, 2, 256)
    two_workers = SplitKConfig(tiles=2, k_split=1, warpgroups=1, ring=2)
    with pytest.raises(ValueError, match="cannot run the grid barrier"):
        looped_matmul(x, w, 2, config=two_workers, interpret=INTERPRET)
    two_wg_reduce = SplitKConfig(tiles=2, k_split=2, warpgroups=2, ring=2)
    with pytest.raises(ValueError, match="use warpgroups=1 with k_split > 1"):
        looped_matmul(x, w, 1, config=two_wg_reduce, interpret=INTERPRET)


# ------------------------------------------------------------------ lowering for CUDA (CPU)
@pytest.mark.parametrize("m,d", SPLITK_H200_PICKS)
def test_splitk_lowers_for_cuda(capfd, m, d):
    """The picked configs lower (sm_90); the module has the planned instructions."""
    cfg = pick_splitk_config(m, d)
    text = splitk_module_text(capfd, m, d, 8, cfg)
    reg_wgmma = re.findall(r"wgmma\.mma_async[^\"]*\}, \{\$", text)
    assert len(reg_wgmma) == 4 * cfg.reg_units  # 4 k16 instructions per register unit
    ldmatrix_trans = re.findall(r"nvvm\.ldmatrix[^\n]*layout = <col>", text)
    assert len(ldmatrix_trans) == 4 * cfg.reg_units
    assert f"m64n{cfg.n_pad(m)}k16.f32.bf16.bf16" in text
    if cfg.k_split > 1:
        assert len(re.findall(r"cp\.reduce\.async\.bulk\.tensor[^\"]*\.add", text)) == cfg.tiles
    assert "red.release.gpu.global.add.u32" in text and "ld.relaxed.gpu.global.b32" in text


@pytest.mark.parametrize(
    "m,d,steps,overrides",
    [
        (1, 6144, 8, dict(reg_units=6, wgmma_lag=2)),
        (1, 6144, 2, dict(x_stages=2, ring=4, smem_units=6, zigzag=False)),
        (64, 2048, 2, {}),
        (1, 6144, 1, {}),
        (1, 2048, 8, dict(poll="leader")),
        (8, 6144, 1, dict(poll="leader")),
        (1, 3520, 8, dict(k_split=22, warpgroups=2, reg_units=0, smem_units=4, ring=3, x_stages=3)),
        (1, 6144, 8, dict(sync="flags")),
        (1, 4992, 3, dict(sync="flags")),  # K ranges of 832 rows over 128-column groups
    ],
)
def test_splitk_variants_lower_for_cuda(m, d, steps, overrides):
    cfg = dataclasses.replace(pick_splitk_config(m, d), **overrides)
    cfg.validate(m, d, steps)
    x = jax.ShapeDtypeStruct((m, d), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((d, d), jnp.bfloat16)
    f = jax.jit(lambda x, w: looped_matmul_splitk(x, w, steps=steps, cfg=cfg))
    assert "mosaic_gpu" in f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("d", [2048, 3520])
def test_splitk_without_barrier_lowers_for_cuda(d):
    """The smoke run's barrier ablation (a timing probe, not a correct kernel) lowers."""
    cfg = pick_splitk_config(1, d)
    x = jax.ShapeDtypeStruct((1, d), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((d, d), jnp.bfloat16)
    f = jax.jit(lambda x, w: looped_matmul_splitk(x, w, steps=8, cfg=cfg, grid_barrier=False))
    assert "mosaic_gpu" in f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("poll", POLLS)
def test_splitk_polls_lower_for_cuda(capfd, poll):
    """Each way of polling the grid barrier lowers, with the load it promises."""
    cfg = dataclasses.replace(pick_splitk_config(1, 2048), poll=poll)
    text = splitk_module_text(capfd, 1, 2048, 8, cfg)
    assert "red.release.gpu.global.add.u32" in text
    load = {
        "all_threads": "ld.acquire.sys.u32",
        "leader": "ld.acquire.sys.u32",
        "wait": "ld.relaxed.gpu.global.b32",
        "one_thread": "ld.acquire.gpu.global.b32",
    }[poll]
    assert load in text


@pytest.mark.parametrize("poll", POLLS)
@pytest.mark.parametrize("warpgroups", [1, 2])
def test_barrier_probe_lowers_for_cuda(poll, warpgroups):
    f = build_barrier_probe(132, warpgroups, 8, poll)
    assert "mosaic_gpu" in f.trace().lower(lowering_platforms=("cuda",)).as_text()


def test_poll_errors():
    with pytest.raises(ValueError, match="poll='spin' is not one of"):
        SplitKConfig(poll="spin")
    with pytest.raises(ValueError, match="is not one of"):
        build_barrier_probe(2, 1, 1, "spin")


# ------------------------------------------------------------------ GPU
@gpu
@requires_gpu
@pytest.mark.parametrize("d", GPU_D)
@pytest.mark.parametrize("m", [1, 8, 17])
@pytest.mark.parametrize("steps", [1, 2, 8, 32])
def test_splitk_matches_reference_gpu(d, m, steps):
    x, w = make_inputs(d + 11 * m + steps, m, d)
    got = looped_matmul(x, w, steps, config=pick_splitk_config(m, d))
    want = looped_matmul_reference(x, w, steps)
    assert got.shape == (m, d) and bool(jnp.isfinite(got.astype(jnp.float32)).all())
    assert_close(got, want, steps=steps)


@gpu
@requires_gpu
@pytest.mark.parametrize(
    "overrides",
    [
        dict(reg_units=0),  # no register residency
        dict(reg_units=4, wgmma_lag=2),
        dict(x_stages=2, zigzag=False),  # state refilled while converting
        dict(k_split=8, tiles=3),  # other 2-D split (re-filled below)
    ],
)
def test_splitk_configs_gpu(overrides):
    m, d, steps = 4, 6144, 8
    x, w = make_inputs(23, m, d)
    cfg = dataclasses.replace(pick_splitk_config(m, d), **overrides)
    if "k_split" in overrides:
        cfg = dataclasses.replace(cfg, reg_units=8, smem_units=2, x_stages=4, zigzag=False)
    got = looped_matmul(x, w, steps, config=cfg)
    assert_close(got, looped_matmul_reference(x, w, steps), steps=steps)


# d = 3520 = 55 x 64 in ragged K ranges over 2 warpgroups per SM: all on chip (the config
# the smoke run times against the pick) and with streamed units and zigzag.
SPLITS_3520 = [
    SplitKConfig(tiles=5, k_split=20, warpgroups=2, reg_units=9, smem_units=6, ring=0),
    SplitKConfig(5, 22, 2, reg_units=0, smem_units=4, ring=3, x_stages=3, zigzag=True),
]


@pytest.mark.parametrize("cfg", SPLITS_3520)
def test_splitk_3520_splits_are_valid(cfg):
    cfg.validate(1, 3520, 8)


@gpu
@requires_gpu
@pytest.mark.parametrize("cfg", SPLITS_3520)
@pytest.mark.parametrize("steps", [1, 8])
def test_splitk_3520_splits_gpu(cfg, steps):
    x, w = make_inputs(61 + steps, 1, 3520)
    got = looped_matmul(x, w, steps, config=cfg)
    assert_close(got, looped_matmul_reference(x, w, steps), steps=steps)


@gpu
@requires_gpu
@pytest.mark.parametrize("d", [2048, 3520, 4992, 6144, 12288])
@pytest.mark.parametrize("m", [1, 8, 17])
@pytest.mark.parametrize("steps", [2, 3, 8, 32])
def test_splitk_flags_gpu(d, m, steps):
    """Per-group flags instead of the grid barrier: workers drift a step apart, so the
    zeroing two steps ahead over 5 buffers is what keeps the sums right."""
    x, w = make_inputs(71 + d + m + steps, m, d)
    cfg = dataclasses.replace(pick_splitk_config(m, d), sync="flags")
    got = looped_matmul(x, w, steps, config=cfg)
    assert_close(got, looped_matmul_reference(x, w, steps), steps=steps)


@gpu
@requires_gpu
@pytest.mark.parametrize("poll", POLLS)
def test_splitk_polls_gpu(poll):
    x, w = make_inputs(47, 1, 2048)
    cfg = dataclasses.replace(pick_splitk_config(1, 2048), poll=poll)
    assert_close(looped_matmul(x, w, 32, config=cfg), looped_matmul_reference(x, w, 32), steps=32)


@gpu
@requires_gpu
@pytest.mark.parametrize("poll", POLLS)
def test_barrier_probe_gpu(poll):
    seen = np.asarray(build_barrier_probe(132, 2, 65, poll)())
    assert seen.shape == (264,) and (seen == 264 * 65).all()


@gpu
@requires_gpu
@pytest.mark.parametrize("zigzag", [False, True])
@pytest.mark.parametrize("steps", [1, 2, 3, 8])
def test_splitk_zigzag_gpu(zigzag, steps):
    x, w = make_inputs(53 + steps, 8, 6144)
    cfg = dataclasses.replace(pick_splitk_config(8, 6144), zigzag=zigzag)
    got = looped_matmul(x, w, steps, config=cfg)
    assert_close(got, looped_matmul_reference(x, w, steps), steps=steps)


@gpu
@requires_gpu
def test_splitk_repeated_calls_gpu():
    # S[0] is zeroed by the kernel itself and the semaphore per call: a stale one would show.
    x, w = make_inputs(43, 8, 6144)
    cfg = pick_splitk_config(8, 6144)
    want = looped_matmul_reference(x, w, 8)
    for _ in range(3):
        assert_close(looped_matmul(x, w, 8, config=cfg), want, steps=8)
