"""The split-K looped matmul's picker: the frozen tuning for (M, d) on a device.

`pick_splitk_config` searches 2-D splits (column groups x K ranges) and fills each with as much
of the weight on chip as fits (`fill_on_chip`): registers, then shared memory, the rest streamed
through a ring. The measurements behind each rule: docs/looped_matmul.md.
"""

from __future__ import annotations

import dataclasses
import functools

from pallas_kernels.looped_matmul.config import SMEM_RESERVE_BYTES, DeviceInfo
from pallas_kernels.looped_matmul.splitk_config import (
    REG_RESERVE,
    UNIT,
    SplitKConfig,
    n_pad_splitk,
)

# The picker keeps its estimate below this (margin under the 255 limit against spills).
PICK_MAX_REGS = 240
# Ring slots per worker when most of the slice is streamed (tuned on the H200:
# docs/looped_matmul.md).
DEEP_RING = 9


def fill_on_chip(
    base: SplitKConfig, m: int, d: int, device: DeviceInfo | None = None
) -> SplitKConfig | None:
    """Fills base's split: registers first (up to PICK_MAX_REGS), then shared memory.

    When the slice does not fit on chip, no register units: the streamed bytes set the step's
    time, and register-operand units were slower there. The ring keeps `base.ring` slots, or
    DEEP_RING when more than 3/4 of the slice is streamed anyway (HBM-bound shapes want bytes in
    flight more than a few resident units). Streamed slices read their chunks in zigzag order
    where the whole state is staged anyway (it needs that; staging it only for zigzag did not
    pay). The measurements behind each rule: docs/looped_matmul.md. Returns None when not even
    the state buffers fit.
    """
    device = device or DeviceInfo()
    cfg = _fill(base, m, d, device)
    if cfg is None or cfg.streamed_units(d) == 0:
        return cfg
    cfg = _fill(base, m, d, device, registers=False) or cfg
    if base.ring < DEEP_RING and 4 * cfg.streamed_units(d) > 3 * cfg.units(d):
        deep = dataclasses.replace(base, ring=DEEP_RING)
        cfg = _fill(deep, m, d, device, registers=False) or cfg
    # Zigzag where the whole state is staged anyway (it needs that).
    return dataclasses.replace(cfg, zigzag=cfg.x_stages >= cfg.k_chunks(d))


def _fill(
    base: SplitKConfig, m: int, d: int, device: DeviceInfo, *, registers: bool = True
) -> SplitKConfig | None:
    """The f32 state is staged whole (one TMA round trip per step) when that leaves room for
    the ring, else in fewer slots."""
    units = base.units(d)
    acc = base.tiles * base.n_pad(m) // 2
    reg_units = min(units, max(0, (PICK_MAX_REGS - REG_RESERVE - acc) // 16)) if registers else 0
    free = device.smem_bytes - SMEM_RESERVE_BYTES
    chunks = base.k_chunks(d)
    for x_stages in sorted({chunks, min(chunks, 8), min(chunks, 4), min(chunks, 2)}, reverse=True):
        cfg = dataclasses.replace(base, reg_units=reg_units, smem_units=0, x_stages=x_stages)
        all_in = dataclasses.replace(cfg, smem_units=units - reg_units, ring=0)
        if all_in.smem_bytes(m, d) <= free:
            return all_in  # everything on chip, no ring
        for smem_units in range(units - reg_units - 1, -1, -1):
            cand = dataclasses.replace(cfg, smem_units=smem_units)
            if cand.smem_bytes(m, d) <= free:
                return cand
    return None


def pick_splitk_config(m: int, d: int, *, device: DeviceInfo | None = None) -> SplitKConfig:
    """The frozen split-K tuning for (M, d): most SMs busy, then most of the weight on chip
    (unless it is mostly streamed anyway), then least state traffic.

    Candidates: warpgroups in (2, 1), tiles in 1..12, k_split dividing d/64, with every block
    resident (<= SM count) and the state buffers fitting next to a 3-unit ring. Raises
    ValueError when none fits. Neither ragged K ranges nor per-group flags (sync="flags") are
    picked: neither was clearly faster on the H200 (docs/looped_matmul.md, "Variants not
    picked").
    """
    return _pick_splitk(m, d, device or DeviceInfo())


@functools.cache
def _pick_splitk(m: int, d: int, device: DeviceInfo) -> SplitKConfig:
    """pick_splitk_config's search (seconds of Python at huginn sizes), once per (M, d, device):
    every jit trace of the public wrapper and every test or smoke-program case asks again."""
    n_pad = n_pad_splitk(m)
    if d <= 0 or d % UNIT:
        raise ValueError(f"d={d} must be a positive multiple of 64")
    chunks = d // UNIT
    best: tuple | None = None
    for warpgroups in (2, 1):
        for tiles in range(1, 13):
            if chunks % tiles or tiles * n_pad // 2 > 96:
                continue
            for k_split in range(1, chunks + 1):
                if chunks % k_split:
                    continue
                base = SplitKConfig(tiles=tiles, k_split=k_split, warpgroups=warpgroups, ring=3)
                workers = base.num_workers(d)
                if workers % warpgroups or base.num_blocks(d) > device.num_sms:
                    continue
                cfg = fill_on_chip(base, m, d, device)
                if cfg is None:
                    continue
                try:
                    cfg.validate(m, d, 2, device=device)
                except ValueError:
                    continue
                blocks = cfg.num_blocks(d)
                # Mostly streamed (the deep-ring regime): a few on-chip units do not matter,
                # the state traffic does.
                mostly_streamed = 4 * cfg.streamed_units(d) > 3 * cfg.units(d)
                on_chip = 0 if mostly_streamed else (cfg.reg_units + cfg.smem_units) * workers
                # state bytes per step: f32 reads (column groups x d) + reduce-adds (k_split x d)
                state = (cfg.col_groups(d) + (k_split if k_split > 1 else 0)) * d * n_pad
                key = (min(blocks, device.num_sms) * warpgroups, on_chip, -state, -k_split)
                if best is None or key > best[0]:
                    best = (key, cfg)
    if best is None:
        raise ValueError(
            f"no split-K tiling fits d={d}, M={m} on {device.num_sms} SMs with "
            f"{device.smem_bytes} B of shared memory"
        )
    return best[1]


__all__ = ["DEEP_RING", "fill_on_chip", "pick_splitk_config"]
