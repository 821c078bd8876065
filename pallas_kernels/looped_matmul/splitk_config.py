"""Frozen config of the split-K looped matmul (`splitk_kernel.py`): its sizes and its checks.

The picker is `splitk_pick.py`; the checks shared with the resident kernel's config are
`config.py`'s.

Vocabulary (sizes in elements unless a name ends in `_bytes`):
- worker: one warpgroup (128 threads). A block holds `warpgroups` workers that share nothing
  but the SM. Worker w owns column group `w // k_split` (`tiles` 64-column tiles, block_cols =
  64 * tiles output columns) and K range j = `w % k_split` of the d / 64 chunks of 64 rows.
  When k_split divides the chunks every range has k_chunks = chunks / k_split of them; else
  ("ragged") the last `chunks % k_split` ranges have one chunk more, and every worker runs
  k_chunks = ceil(chunks / k_split) chunks, the shorter ones with their last chunk's state
  zeroed (it lies in the next range: same cost, no contribution).
- unit: a [64 rows, 64 cols] bf16 piece of the worker's weight slice (8 KiB). Units are ordered
  k-chunk major, tile minor: unit u = (k chunk u // tiles, tile u % tiles). The first
  `reg_units` live in registers (wgmma A fragments, 16 registers per thread each), the next
  `smem_units` in shared memory, the rest are streamed from L2 every step through a ring of
  `ring` slots.
- n_pad: the state's rows M padded to a multiple of 8 (the wgmma N, 8..64).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.looped_matmul.barrier import check_poll
from pallas_kernels.looped_matmul.config import (
    BF16_BYTES,
    MBARRIER_BYTES,
    DeviceInfo,
    KernelConfig,
    check_at_least,
    check_columns,
    check_grid_fits,
    check_min_n_pad,
    check_ring_depth,
    check_state_rows,
)
from pallas_kernels.smem import aligned

UNIT = 64  # rows and columns of a weight unit
UNIT_BYTES = UNIT * UNIT * BF16_BYTES
F32_BYTES = 4
MAX_REGS_PER_THREAD = 255
# Registers per thread the kernel needs besides weight fragments and accumulators (addresses,
# loop counters, barrier phases, the f32 -> bf16 state conversion). An estimate: ptxas decides;
# the smoke program (experiments.kernels.looped_matmul_smoke) reports spills as slowness, and
# `reg_units` can be lowered per config.
REG_RESERVE = 64
# validate() only rejects plans above 255 with this smaller reserve (from a ptxas proxy of the
# register-operand loop: docs/looped_matmul.md, "Register budget").
REG_RESERVE_MIN = 40
MAX_BARRIERS_PER_ARRAY = 32
SYNCS = ("grid", "flags")


def n_pad_splitk(m: int, min_n_pad: int = 8) -> int:
    """State rows as multiplied: M rounded up to a multiple of 8, at least `min_n_pad`."""
    check_state_rows(m)
    return max(-(-m // 8) * 8, min_n_pad)


@dataclasses.dataclass(frozen=True)
class SplitKConfig(KernelConfig):
    """Tiling of the split-K persistent looped matmul (see the module docstring)."""

    PLAN = "split-K plan"

    tiles: int = 1
    k_split: int = 1
    warpgroups: int = 2
    reg_units: int = 0
    smem_units: int = 0
    ring: int = 2
    x_stages: int = 64  # f32 state chunks [64, n_pad] in flight (capped at k_len / 64)
    wgmma_lag: int = 1
    min_n_pad: int = 8
    # Grid barrier: who polls the epoch counter and how (`barrier.POLLS`).
    poll: str = "wait"
    # Fully streamed k chunks in reverse order on odd steps (L2 reuse across steps).
    zigzag: bool = False
    # Between steps: "grid" (one grid barrier) or "flags" (per-column-group counters: a worker
    # waits only for the groups whose columns are its K range; 5 state buffers instead of 3).
    sync: str = "grid"

    def __post_init__(self) -> None:
        if not 1 <= self.tiles <= 16:
            raise ValueError(f"tiles={self.tiles} must be in 1..16 (64-column wgmma tiles)")
        check_at_least("k_split", self.k_split, 1)
        if self.warpgroups not in (1, 2):
            raise ValueError(f"warpgroups={self.warpgroups} must be 1 or 2")
        for name in ("reg_units", "smem_units", "ring"):
            check_at_least(name, getattr(self, name), 0)
        check_at_least("x_stages", self.x_stages, 1)
        check_at_least("wgmma_lag", self.wgmma_lag, 1)
        check_poll(self.poll)
        if self.sync not in SYNCS:
            raise ValueError(f"sync={self.sync!r} is not one of {SYNCS}")
        check_min_n_pad(self.min_n_pad, (8, 16, 32, 64))

    # ---------------------------------------------------------------- derived sizes
    @property
    def block_cols(self) -> int:
        """Output columns of one worker (the wgmma M of its accumulator)."""
        return UNIT * self.tiles

    @property
    def state_buffers(self) -> int:
        """f32 state buffers: step s adds into S[s % B]. With a grid barrier 3 (S[s+1] is zeroed
        during step s); with flags workers drift up to a step apart, so 5 (S[s+2] is zeroed
        during step s, once every reader of the buffer it replaces is done)."""
        return 3 if self.sync == "grid" else 5

    def n_pad(self, m: int) -> int:
        return n_pad_splitk(m, self.min_n_pad)

    def col_groups(self, d: int) -> int:
        return d // self.block_cols

    def k_len(self, d: int) -> int:
        """Rows of w a worker multiplies (its K range, the short ranges' extra chunk included)."""
        return self.k_chunks(d) * UNIT

    def k_chunks(self, d: int) -> int:
        return -(-(d // UNIT) // self.k_split)

    def ragged(self, d: int) -> bool:
        """K ranges of unequal length (k_split does not divide the d / 64 chunks)."""
        return (d // UNIT) % self.k_split != 0

    def short_ranges(self, d: int) -> int:
        """How many K ranges (the first ones) have k_chunks - 1 chunks; 0 unless ragged."""
        chunks = d // UNIT
        return (self.k_split - chunks % self.k_split) % self.k_split

    def chunk_start(self, d: int, j):
        """First chunk of K range j (an int, or a traced index in the kernel)."""
        short = self.short_ranges(d)
        if not short:
            return self.k_chunks(d) * j
        base = self.k_chunks(d) - 1  # the short ranges' chunks; the later ranges own base + 1
        if isinstance(j, int):
            return base * j + max(0, j - short)
        return base * j + jnp.maximum(0, j - short)

    def units(self, d: int) -> int:
        """Weight units per worker."""
        return self.k_chunks(d) * self.tiles

    def streamed_units(self, d: int) -> int:
        return self.units(d) - self.reg_units - self.smem_units

    def num_workers(self, d: int) -> int:
        return self.col_groups(d) * self.k_split

    def num_blocks(self, d: int) -> int:
        return self.num_workers(d) // self.warpgroups

    def x_slots(self, d: int) -> int:
        """f32 state slots per worker; also used for the f32 partial sums (one per tile)."""
        return max(min(self.x_stages, self.k_chunks(d)), self.tiles)

    def ring_slots(self, d: int) -> int:
        """Ring slots allocated: the ring, or at least one slot to stage register units."""
        if self.streamed_units(d) > 0 or (self.reg_units and not self.smem_units):
            return max(self.ring, 1)
        return self.ring

    def regs_per_thread(self, m: int) -> int:
        """Estimated registers per thread: weight fragments + accumulator + REG_RESERVE."""
        acc = self.tiles * self.n_pad(m) // 2  # [64*tiles, n_pad] f32 over 128 threads
        return 16 * self.reg_units + acc + REG_RESERVE

    def smem_bytes(self, m: int, d: int, *, interpret: bool = False) -> int:
        """Shared memory per block, each buffer rounded up as Pallas allocates it (`aligned`)."""
        n_pad = self.n_pad(m)
        per_worker = (
            aligned(self.x_slots(d) * UNIT * n_pad * F32_BYTES)  # f32 state / partial sums
            + aligned(self.k_chunks(d) * n_pad * UNIT * BF16_BYTES)  # bf16 state (wgmma B)
            + (aligned(UNIT * n_pad * F32_BYTES) if self.k_split > 1 else 0)  # zero tile
            + self.smem_units * UNIT_BYTES
            + self.ring_slots(d) * UNIT_BYTES
            + (UNIT_BYTES if interpret and self.reg_units else 0)
        )
        barriers = MBARRIER_BYTES * (self.x_slots(d) + self.smem_units + self.ring_slots(d))
        return self.warpgroups * per_worker + aligned(self.warpgroups * barriers)

    # ---------------------------------------------------------------- checks (see validate)
    def check_tiling(
        self, m: int, d: int, steps: int, *, stacked: bool, device: DeviceInfo
    ) -> None:
        """One weight; whole column groups, K ranges and blocks; every block resident when
        workers synchronise; units, ring, barriers and registers within their limits."""
        if stacked:
            raise ValueError(
                "the split-K kernel keeps one weight on chip; use the resident kernel "
                "(LoopedMatmulConfig) for stacked weights"
            )
        check_columns(d, self.block_cols, f" (tiles={self.tiles})")
        if self.k_split > d // UNIT:
            raise ValueError(f"k_split={self.k_split} > {d // UNIT} chunks of 64 rows in d={d}")
        workers = self.num_workers(d)
        if workers % self.warpgroups:
            raise ValueError(
                f"{workers} workers do not fill blocks of warpgroups={self.warpgroups}"
            )
        if steps > 1 or self.k_split > 1:
            check_grid_fits(self.num_blocks(d), device, "raise tiles or lower k_split")
        units = self.units(d)
        if self.reg_units + self.smem_units > units:
            raise ValueError(
                f"reg_units + smem_units = {self.reg_units + self.smem_units} > {units} "
                "units in a worker's slice"
            )
        streamed = self.streamed_units(d)
        if streamed > 0:
            when = f" when {streamed} units are streamed"
            check_ring_depth("ring", self.ring, self.wgmma_lag, "ring slot", when)
        for name, n in (
            ("x slots", self.x_slots(d)),
            ("smem_units", self.smem_units),
            ("ring slots", self.ring_slots(d)),
        ):
            if self.warpgroups * n > MAX_BARRIERS_PER_ARRAY:
                raise ValueError(
                    f"{name}: {self.warpgroups} x {n} barriers > {MAX_BARRIERS_PER_ARRAY} "
                    "(Mosaic GPU tracks the phases of a barrier array in one 32-bit word)"
                )
        if self.zigzag and self.x_stages < self.k_chunks(d):
            raise ValueError(
                f"zigzag needs the whole state staged: x_stages={self.x_stages} < "
                f"{self.k_chunks(d)} k chunks"
            )
        n_pad = self.n_pad(m)
        regs = self.regs_per_thread(m) - REG_RESERVE + REG_RESERVE_MIN
        if regs > MAX_REGS_PER_THREAD:
            raise ValueError(
                f"reg_units={self.reg_units} with tiles={self.tiles}, n_pad={n_pad} needs "
                f"at least ~{regs} registers per thread > {MAX_REGS_PER_THREAD} (16 per unit, "
                f"{self.tiles * n_pad // 2} accumulator, >= {REG_RESERVE_MIN} other)"
            )

    def smem_contents(self, d: int) -> tuple[str, str]:
        return (
            f"{self.warpgroups} worker(s): {self.smem_units} resident + {self.ring_slots(d)} "
            f"ring units of {UNIT_BYTES} B, state buffers",
            "smem_units, ring or x_stages",
        )


def describe_splitk(cfg: SplitKConfig, m: int, d: int) -> str:
    """One line: workers, slice, what is in registers / shared memory / streamed."""
    workers, units = cfg.num_workers(d), cfg.units(d)
    kib = UNIT_BYTES / 1024
    streamed = cfg.streamed_units(d)
    on_chip_mib = workers * (cfg.reg_units + cfg.smem_units) * UNIT_BYTES / 2**20
    return (
        f"splitk: {cfg.num_blocks(d)} blocks x {cfg.warpgroups} wg = {workers} workers "
        f"({cfg.col_groups(d)} col groups x k_split {cfg.k_split}"
        f"{', ragged' if cfg.ragged(d) else ''}), slice "
        f"[{cfg.k_len(d)}, {cfg.block_cols}] = {units} units of {kib:.0f} KiB: "
        f"{cfg.reg_units} regs + {cfg.smem_units} smem + {streamed} streamed "
        f"(ring {cfg.ring}); on chip {on_chip_mib:.1f} MiB, streamed "
        f"{workers * streamed * UNIT_BYTES / 2**20:.1f} MiB/step; ~{cfg.regs_per_thread(m)} "
        f"regs/thread, smem {cfg.smem_bytes(m, d)} B, n_pad={cfg.n_pad(m)}; barrier poll "
        f"{cfg.poll}{', zigzag' if cfg.zigzag else ''}{', flags' if cfg.sync == 'flags' else ''}"
    )


__all__ = [
    "SplitKConfig",
    "describe_splitk",
    "n_pad_splitk",
]
