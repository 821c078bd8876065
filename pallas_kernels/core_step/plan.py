"""The static schedule of the Core weight stream: phases, shapes, who owns which units.

A Core decode iteration is a sequence of matrix-vector products ("phases"): the adapter, then
per layer the fused qkv, the attention output projection, the gate/up product (fc) and the MLP
output projection. `core_phases` lists them with every k padded to a multiple of 64 (the k-chunk)
and every n to a multiple of the tile width `unit_cols` (64, 128 or 256), which adds the zero rows
and columns that the packed weights carry.

Units. A phase's weight [k, n] is cut in units [64 rows, unit_cols columns] (8, 16 or 32 KiB of
bf16), numbered tile major (u = tile * k_chunks + chunk): consecutive units walk down the K rows
of one tile of unit_cols columns. Worker w (one warpgroup, one per SM) owns the contiguous range
[u_total * w // workers, u_total * (w + 1) // workers) of every phase, so every worker streams the
same number of bytes per phase, within one unit. A range crosses at most a few tile boundaries:
each piece ("segment") is one accumulator whose partial sums are added into the phase's f32
output by a TMA reduce-add. Wider units pay the per-unit fixed costs (barrier waits, the input
conversion, one wgmma issue) once per 16 or 32 KiB instead of once per 8 KiB.
"""

from __future__ import annotations

import dataclasses

UNIT = 64  # rows of a weight unit (the k-chunk), and the default tile width
UNIT_COLS = (64, 128, 256)  # tile widths: multiples of the wgmma M (64), at most a TMA box (256)


def pad_to(n: int, multiple: int) -> int:
    """n rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple


def pad_unit(n: int) -> int:
    """n rounded up to a multiple of the unit (64)."""
    return pad_to(n, UNIT)


def check_unit_cols(unit_cols: int) -> None:
    if unit_cols not in UNIT_COLS:
        raise ValueError(f"unit_cols={unit_cols} must be one of {UNIT_COLS}")


@dataclasses.dataclass(frozen=True)
class Phase:
    """One product y [n] = x [k] @ w [k, n]: k padded to 64, n to the tile width. Its input x is
    the leading k rows of the previous phase's output, except the first phase's, whose leading
    rows (as many as the last phase's n) are the previous iteration's output and the rest the
    external input."""

    name: str
    k: int
    n: int

    @property
    def k_chunks(self) -> int:
        return self.k // UNIT

    def tiles(self, unit_cols: int = UNIT) -> int:
        return self.n // unit_cols

    def units(self, unit_cols: int = UNIT) -> int:
        return self.k_chunks * self.tiles(unit_cols)

    @property
    def weight_bytes(self) -> int:
        return self.k * self.n * 2


def core_phases(
    n_embd: int, intermediate: int, n_qkv: int, layers: int, unit_cols: int = UNIT
) -> tuple[Phase, ...]:
    """The phases of one Core iteration: adapter [2 d, d], then per layer qkv [d, n_qkv],
    proj [d, d], fc [d, 2 i] (gate and up), mlp proj [i, d]; d = n_embd, i = intermediate.
    Each k is padded to 64 and each n to `unit_cols`; the adapter's k is the state (the last
    phase's padded n) followed by the external input (d padded to 64)."""
    check_unit_cols(unit_cols)
    d, i = pad_unit(n_embd), pad_unit(intermediate)
    d_n, q_n, fc_n = (pad_to(v, unit_cols) for v in (n_embd, n_qkv, 2 * i))
    phases = [Phase("adapter", d_n + d, d_n)]
    for j in range(layers):
        phases += [
            Phase(f"qkv{j}", d, q_n),
            Phase(f"proj{j}", d, d_n),
            Phase(f"fc{j}", d, fc_n),
            Phase(f"mlp_proj{j}", i, d_n),
        ]
    return tuple(phases)


def check_chained(phases: tuple[Phase, ...], unit_cols: int = UNIT) -> None:
    """Each k must be a multiple of 64 and each n of `unit_cols`; each phase's input must fit in
    the previous output; the first phase's state part in the last phase's output."""
    if not phases:
        raise ValueError("no phases")
    check_unit_cols(unit_cols)
    for p in phases:
        if p.k < UNIT or p.k % UNIT or p.n < unit_cols or p.n % unit_cols:
            raise ValueError(
                f"phase {p.name} [{p.k}, {p.n}]: k must be a multiple of {UNIT} and n of "
                f"unit_cols={unit_cols}"
            )
    for prev, cur in zip(phases, phases[1:], strict=False):
        if cur.k > prev.n:
            raise ValueError(f"phase {cur.name} reads {cur.k} rows of {prev.name}'s {prev.n}")
    if phases[0].k - phases[-1].n < 0:
        raise ValueError(f"the first phase's k={phases[0].k} < the last phase's n")


def unit_range(phase: Phase, workers: int, worker: int, unit_cols: int = UNIT) -> tuple[int, int]:
    """[first, end) of the units `worker` owns in `phase` (plain ints; the kernel computes the
    same expression on its traced worker index)."""
    return even_share(phase.units(unit_cols), workers, worker)


def even_share(units, workers: int, worker) -> tuple:
    """[first, end) of worker `worker`'s even share of `units` units among `workers` (each
    within one unit of the others); `worker` may be traced."""
    return units * worker // workers, units * (worker + 1) // workers


def min_units(phases: tuple[Phase, ...], workers: int, unit_cols: int = UNIT) -> int:
    """The fewest units any worker owns in any phase."""
    return min(p.units(unit_cols) // workers for p in phases)


def stream_bytes(phases: tuple[Phase, ...]) -> int:
    """Weight bytes one iteration streams (the padded weights)."""
    return sum(p.weight_bytes for p in phases)
