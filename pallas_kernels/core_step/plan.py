"""The static schedule of the Core weight stream: phases, shapes, who owns which units.

A Core decode iteration is a sequence of matrix-vector products ("phases"): the adapter, then
per layer the fused qkv, the attention output projection, the gate/up product (fc) and the MLP
output projection. `core_phases` lists them with every dimension padded to a multiple of 64 (the
unit), which adds the zero rows and columns that the packed weights carry.

Units. A phase's weight [k, n] is cut in units [64 rows, 64 columns] (8 KiB of bf16), numbered
tile major (u = tile * k_chunks + chunk): consecutive units walk down the K rows of one 64-column
tile. Worker w (one warpgroup, one per SM) owns the contiguous range
[u_total * w // workers, u_total * (w + 1) // workers) of every phase, so every worker streams the
same number of bytes per phase, within one unit. A range crosses at most a few tile boundaries:
each piece ("segment") is one accumulator whose partial sums are added into the phase's f32
output by a TMA reduce-add.
"""

from __future__ import annotations

import dataclasses

UNIT = 64  # rows and columns of a weight unit
UNIT_BYTES = UNIT * UNIT * 2


def pad_unit(n: int) -> int:
    """n rounded up to a multiple of the unit."""
    return -(-n // UNIT) * UNIT


@dataclasses.dataclass(frozen=True)
class Phase:
    """One product y [n] = x [k] @ w [k, n]: k, n padded to the unit. Its input x is the
    leading k rows of the previous phase's output, except the first phase's, whose leading
    `state_rows` rows are the previous iteration's output and the rest the external input."""

    name: str
    k: int
    n: int

    @property
    def k_chunks(self) -> int:
        return self.k // UNIT

    @property
    def tiles(self) -> int:
        return self.n // UNIT

    @property
    def units(self) -> int:
        return self.k_chunks * self.tiles

    @property
    def weight_bytes(self) -> int:
        return self.k * self.n * 2


def core_phases(n_embd: int, intermediate: int, n_qkv: int, layers: int) -> tuple[Phase, ...]:
    """The phases of one Core iteration: adapter [2 d, d], then per layer qkv [d, n_qkv],
    proj [d, d], fc [d, 2 i] (gate and up), mlp proj [i, d]; d = n_embd, i = intermediate."""
    d, i, q = pad_unit(n_embd), pad_unit(intermediate), pad_unit(n_qkv)
    phases = [Phase("adapter", 2 * d, d)]
    for j in range(layers):
        phases += [
            Phase(f"qkv{j}", d, q),
            Phase(f"proj{j}", d, d),
            Phase(f"fc{j}", d, 2 * i),
            Phase(f"mlp_proj{j}", i, d),
        ]
    return tuple(phases)


def check_chained(phases: tuple[Phase, ...]) -> None:
    """Each phase's input must fit in the previous output; the first phase's state part in the
    last phase's output."""
    if not phases:
        raise ValueError("no phases")
    for prev, cur in zip(phases, phases[1:], strict=False):
        if cur.k > prev.n:
            raise ValueError(f"phase {cur.name} reads {cur.k} rows of {prev.name}'s {prev.n}")
    if phases[0].k - phases[-1].n < 0:
        raise ValueError(f"the first phase's k={phases[0].k} < the last phase's n")


def unit_range(phase: Phase, workers: int, worker: int) -> tuple[int, int]:
    """[first, end) of the units `worker` owns in `phase` (plain ints; the kernel computes the
    same expression on its traced worker index)."""
    return phase.units * worker // workers, phase.units * (worker + 1) // workers


def min_units(phases: tuple[Phase, ...], workers: int) -> int:
    """The fewest units any worker owns in any phase."""
    return min(p.units // workers for p in phases)


def stream_bytes(phases: tuple[Phase, ...]) -> int:
    """Weight bytes one iteration streams (the padded weights)."""
    return sum(p.weight_bytes for p in phases)
