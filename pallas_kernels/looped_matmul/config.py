"""The looped matmul configs' shared limits and checks; the resident kernel's config and picker.

Shared by both kernels (`KernelConfig`, `check_*`): the device (`DeviceInfo`), the state's row
range, and `validate`'s frame: state rows and steps first, the kernel's own tiling checks, then
shared memory against the device. Both configs word a limit they share the same way.

Vocabulary of the resident kernel (all sizes in elements unless a name ends in `_bytes`):
- `d`: width of the state and of the square weight `w` [d, d].
- `n_pad`: the state's row count M padded to 16, 32 or 64; it is the N of the wgmma and also the
  swizzle width (n_pad * 2 bytes), because the state chunk [block_k, n_pad] is the wgmma's B
  operand and A and B must share one swizzle.
- `block_cols`: output columns owned by one block (the wgmma's M, a multiple of 64).
  num_blocks = d // block_cols.
- `block_k`: rows of a weight chunk [block_k, block_cols]; the unit of residency and streaming.
- `resident_chunks`: chunks of each block's slice loaded into shared memory once, before the loop.
  The other `d // block_k - resident_chunks` chunks are streamed through a ring every step.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from pallas_kernels.smem import SMEM_LIMIT

# H200 (sm_90): SM count; with `SMEM_LIMIT`, DeviceInfo's defaults off-GPU.
H200_NUM_SMS = 132

BF16_BYTES = 2
MBARRIER_BYTES = 8  # one mbarrier in shared memory
MAX_M = 64
# Bytes of shared memory we leave to Pallas/Mosaic (mbarriers, reduction scratch, alignment).
SMEM_RESERVE_BYTES = 2048


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """What the picker needs to know about the GPU: SM count and opt-in smem per block (bytes)."""

    num_sms: int = H200_NUM_SMS
    smem_bytes: int = SMEM_LIMIT

    @staticmethod
    def current() -> DeviceInfo:
        """Reads the default device; falls back to the H200's numbers on CPU."""
        dev = jax.devices()[0]
        if dev.platform != "gpu":
            return DeviceInfo()
        num_sms = int(getattr(dev, "core_count", H200_NUM_SMS) or H200_NUM_SMS)
        smem = int(getattr(dev, "shared_memory_per_block_optin", SMEM_LIMIT) or 0)
        return DeviceInfo(num_sms=num_sms, smem_bytes=smem or SMEM_LIMIT)


# ---------------------------------------------------------------- shared checks
def check_state_rows(m: int) -> None:
    """Raises unless 1 <= M <= MAX_M: the state is the N of one wgmma in both kernels."""
    if not 1 <= m <= MAX_M:
        raise ValueError(
            f"M={m} is out of range: 1 <= M <= {MAX_M} (the state is the N of one wgmma)"
        )


def check_at_least(name: str, value: int, low: int) -> None:
    """Raises unless a config field `name` = `value` is >= `low`."""
    if value < low:
        raise ValueError(f"{name}={value} must be >= {low}")


def check_min_n_pad(min_n_pad: int, allowed: tuple[int, ...]) -> None:
    """Raises unless `min_n_pad` is one of the kernel's padded state widths `allowed`."""
    if min_n_pad not in allowed:
        listed = ", ".join(str(n) for n in allowed[:-1]) + f" or {allowed[-1]}"
        raise ValueError(f"min_n_pad={min_n_pad} must be {listed}")


def check_ring_depth(name: str, slots: int, lag: int, slot: str, when: str = "") -> None:
    """Raises unless a ring of `slots` outlives `lag` wgmma groups in flight: a slot is refilled
    only once the group `lag` behind it is done, so a ring of <= lag slots waits on itself."""
    if slots < lag + 1:
        raise ValueError(
            f"{name}={slots} must be >= wgmma_lag + 1 = {lag + 1}{when}: a {slot} is refilled "
            f"{lag} wgmma group(s) late (wgmma_wait({lag})); fewer slots deadlock"
        )


def check_columns(d: int, block_cols: int, why: str) -> None:
    """Raises unless d splits into whole blocks of `block_cols` output columns."""
    if d % block_cols:
        raise ValueError(f"d={d} must be a multiple of block_cols={block_cols}{why}")


def check_grid_fits(blocks: int, device: DeviceInfo, remedy: str) -> None:
    """Raises when the grid has more blocks than SMs: the grid barrier needs them all resident."""
    if blocks > device.num_sms:
        raise ValueError(
            f"{blocks} blocks > {device.num_sms} SMs: the grid barrier deadlocks unless every "
            f"block is resident at once (one block per SM); {remedy}"
        )


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Base of both kernels' configs (no fields): `validate` checks the state rows and steps,
    then the kernel's own tiling (`check_tiling`), then its shared memory against the device."""

    # Named in the shared-memory error: "the <PLAN> needs N B of shared memory ...".
    PLAN = "plan"

    def n_pad(self, m: int) -> int:
        """State rows as multiplied; raises when M is out of range."""
        raise NotImplementedError

    def smem_bytes(self, m: int, d: int) -> int:
        """Shared memory the kernel allocates per block, in bytes (without SMEM_RESERVE_BYTES)."""
        raise NotImplementedError

    def check_tiling(
        self, m: int, d: int, steps: int, *, stacked: bool, device: DeviceInfo
    ) -> None:
        """The kernel's own limits on (m, d, steps) and this tiling; raises ValueError."""
        raise NotImplementedError

    def smem_contents(self, d: int) -> tuple[str, str]:
        """(What the shared memory holds, the fields that lower it), for the error message."""
        raise NotImplementedError

    def validate(
        self,
        m: int,
        d: int,
        steps: int,
        *,
        stacked: bool = False,
        device: DeviceInfo | None = None,
    ) -> None:
        """Raises ValueError naming the limit that (m, d, steps) and this config break."""
        device = device or DeviceInfo()
        self.n_pad(m)
        if steps < 1:
            raise ValueError(f"steps={steps} must be >= 1")
        self.check_tiling(m, d, steps, stacked=stacked, device=device)
        need = self.smem_bytes(m, d) + SMEM_RESERVE_BYTES
        if need > device.smem_bytes:
            holds, lower = self.smem_contents(d)
            raise ValueError(
                f"the {self.PLAN} needs {need} B of shared memory per block > "
                f"{device.smem_bytes} B ({holds}); lower {lower}"
            )


# ---------------------------------------------------------------- resident kernel
def n_pad_for(m: int) -> int:
    """Rows of the padded state: 16, 32 or 64 (the wgmma N and the swizzle width)."""
    check_state_rows(m)
    return 16 if m <= 16 else 32 if m <= 32 else 64


@dataclasses.dataclass(frozen=True)
class LoopedMatmulConfig(KernelConfig):
    """Tiling of the persistent looped matmul (see module docstring for the names)."""

    PLAN = "on-chip plan"

    block_cols: int = 64
    block_k: int = 64
    resident_chunks: int = 0
    stream_stages: int = 4
    x_stages: int = 4
    wgmma_lag: int = 1  # wgmma groups left in flight before a chunk's slots are refilled
    # Lower bound on n_pad (16, 32 or 64). A wider state means a wider swizzle for the weight
    # chunks too (TMA rows of n_pad*2 bytes), which ran faster on the H200, so padding small M
    # further may pay (docs/looped_matmul.md).
    min_n_pad: int = 16

    def __post_init__(self) -> None:
        block_cols, block_k = self.block_cols, self.block_k
        if block_cols <= 0 or block_cols % 64:
            raise ValueError(
                f"{block_cols=} must be a positive multiple of 64: it is the M of a wgmma "
                "(64 rows per instruction)"
            )
        if block_cols > 256:
            raise ValueError(
                f"{block_cols=} must be <= 256: the accumulator [block_cols, n_pad] float32 "
                "lives in the registers of one warpgroup"
            )
        if block_k <= 0 or block_k % 64:
            raise ValueError(
                f"{block_k=} must be a positive multiple of 64: a chunk is a whole number of "
                "wgmma K-groups for every swizzle (16, 32 or 64 elements)"
            )
        if block_k > 256:
            raise ValueError(f"{block_k=} must be <= 256 (one TMA box per chunk)")
        check_at_least("resident_chunks", self.resident_chunks, 0)
        check_min_n_pad(self.min_n_pad, (16, 32, 64))
        check_at_least("wgmma_lag", self.wgmma_lag, 1)
        lag = self.wgmma_lag
        check_ring_depth("stream_stages", self.stream_stages, lag, "ring slot")
        check_ring_depth("x_stages", self.x_stages, lag, "state slot")

    # ---------------------------------------------------------------- derived sizes
    def n_pad(self, m: int) -> int:
        """State rows as stored and multiplied: max(n_pad_for(m), min_n_pad)."""
        return max(n_pad_for(m), self.min_n_pad)

    def num_blocks(self, d: int) -> int:
        return d // self.block_cols

    def num_chunks(self, d: int) -> int:
        """Weight chunks per block slice (= K chunks per step)."""
        return d // self.block_k

    def streamed_chunks(self, d: int) -> int:
        return self.num_chunks(d) - self.resident_chunks

    def chunk_bytes(self) -> int:
        return self.block_k * self.block_cols * BF16_BYTES

    def smem_bytes(self, m: int, d: int) -> int:
        """Shared memory the kernel allocates, in bytes (without Pallas's own reserve)."""
        n_pad = self.n_pad(m)
        ring = self.stream_stages if self.streamed_chunks(d) > 0 else 0
        w_bytes = (self.resident_chunks + ring) * self.chunk_bytes()
        x_bytes = self.x_stages * self.block_k * n_pad * BF16_BYTES
        out_bytes = self.block_cols * n_pad * BF16_BYTES
        barrier_bytes = MBARRIER_BYTES * (self.resident_chunks + ring + self.x_stages)
        return w_bytes + x_bytes + out_bytes + barrier_bytes

    # ---------------------------------------------------------------- checks (see validate)
    def check_tiling(
        self, m: int, d: int, steps: int, *, stacked: bool, device: DeviceInfo
    ) -> None:
        """Whole blocks and chunks, every block resident between steps, resident chunks that
        exist and are reused."""
        check_columns(d, self.block_cols, ": each block owns block_cols whole output columns")
        if d % self.block_k:
            raise ValueError(f"d={d} must be a multiple of block_k={self.block_k}")
        if steps > 1:
            check_grid_fits(self.num_blocks(d), device, "raise block_cols")
        chunks = self.num_chunks(d)
        if self.resident_chunks > chunks:
            raise ValueError(
                f"resident_chunks={self.resident_chunks} > {chunks} chunks in a block's slice"
            )
        if stacked and self.resident_chunks:
            raise ValueError(
                "resident_chunks must be 0 for stacked weights: each step reads a different "
                "weight, so nothing is reused"
            )

    def smem_contents(self, d: int) -> tuple[str, str]:
        return (
            f"{self.resident_chunks} resident + {self.stream_stages} streamed chunks of "
            f"{self.chunk_bytes()} B, plus state buffers",
            "resident_chunks or stream_stages",
        )


def pick_config(
    m: int,
    d: int,
    *,
    stacked: bool = False,
    device: DeviceInfo | None = None,
) -> LoopedMatmulConfig:
    """The frozen tuning for (M, d): as many blocks as fit, then as much weight resident as fits.

    Raises ValueError when no tiling fits (d not a multiple of 64, or too few SMs for d).
    """
    device = device or DeviceInfo()
    n_pad_for(m)
    if d <= 0 or d % 64:
        raise ValueError(
            f"d={d} must be a positive multiple of 64: output columns are split into "
            "64-column wgmma tiles"
        )
    tiles = d // 64
    # Fewest 64-column tiles per block such that every block gets a whole number of tiles and
    # all blocks are resident at once (grid barrier); accumulator <= 256 rows.
    tiles_per_block = next(
        (t for t in range(1, 5) if tiles % t == 0 and tiles // t <= device.num_sms), None
    )
    if tiles_per_block is None:
        raise ValueError(
            f"d={d} is too large for {device.num_sms} SMs: needs more than 4 tiles of 64 "
            "columns per block (accumulator limit) or a tile count with no divisor <= 4 "
            "that fits the SM count"
        )
    block_cols = 64 * tiles_per_block
    # Chunks of 16 KiB: big enough to amortise a barrier wait and a wgmma group per chunk, small
    # enough that a 4-deep ring leaves most of shared memory for resident weight.
    block_k = 128 if (d % 128 == 0 and block_cols == 64) else 64
    base = LoopedMatmulConfig(block_cols, block_k, 0, stream_stages=4, x_stages=4)
    if stacked:
        return base
    chunks = d // block_k
    free = device.smem_bytes - SMEM_RESERVE_BYTES
    # Everything resident if it fits (no ring then), else fill what the rings leave.
    all_resident = dataclasses.replace(base, resident_chunks=chunks)
    if all_resident.smem_bytes(m, d) <= free:
        return all_resident
    resident = chunks - 1
    cfg = dataclasses.replace(base, resident_chunks=resident)
    while resident > 0 and cfg.smem_bytes(m, d) > free:
        resident -= 1
        cfg = dataclasses.replace(base, resident_chunks=resident)
    return cfg


def describe(cfg: LoopedMatmulConfig, m: int, d: int) -> str:
    """One line: blocks, slice size, resident and streamed bytes per block."""
    slice_bytes = d * cfg.block_cols * BF16_BYTES
    resident_bytes = cfg.resident_chunks * cfg.chunk_bytes()
    return (
        f"{cfg.num_blocks(d)} blocks x {cfg.block_cols} cols, slice {slice_bytes / 1024:.0f} KiB, "
        f"resident {resident_bytes / 1024:.0f} KiB "
        f"({math.floor(100 * resident_bytes / slice_bytes)}%), streamed "
        f"{(slice_bytes - resident_bytes) / 1024:.0f} KiB/step/block, block_k={cfg.block_k}, "
        f"stages={cfg.stream_stages}/{cfg.x_stages}, smem={cfg.smem_bytes(m, d)} B"
    )
