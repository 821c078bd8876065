"""What each step of the fused Core kernel (`fused.py`) reads: the worker's context inside the
kernel, each product's input sources, owners' work and output, and what the scalar tile
scales."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.core_step.fused_plan import (
    GAIN_G2,
    GAIN_G4_BEFORE,
    SHIFT,
    Buffers,
    FusedShape,
    ScalarRows,
    kind_of,
)
from pallas_kernels.core_step.plan import UNIT
from pallas_kernels.core_step.tiles import WGMMA, bcast_rows


class KernelContext:
    """One worker's view inside the kernel: refs, scratch (`s`), schedule, and the helpers its
    steps share."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def acts(self, it, back: int = 0):
        """The activation buffers of iteration `it`, or of the one `back` before it: with
        `Schedule.dataflow` two sets used in turn (`parities`), else one."""
        return self.act.at[lax.rem(it + self.parities - back, self.parities)]

    def inv_rms(self, ss):
        return lax.rsqrt(ss / self.shape.d + self.eps)

    def load_scalars(self, wait: bool = True) -> None:
        """The scalar tiles into shared memory; `wait` False leaves the wait (on scbar) to the
        caller, who issues its other copies first."""
        plgpu.copy_gmem_to_smem(self.scal, self.s["sc"], self.s["scbar"])
        if wait:
            plgpu.barrier_wait(self.s["scbar"])

    def scalar(self, it, row: int, previous: bool = False):
        """[8]: row `row` of the iteration's scalar tile (or the previous iteration's)."""
        parity = lax.rem(it + (1 if previous else 0), 2)
        tile = plgpu.load(self.s["sc"].at[parity], layout=WGMMA)
        idx = plgpu.broadcasted_iota(jnp.int32, tile.shape, 0, layout=WGMMA)
        return jnp.sum(jnp.where(idx == row, tile, 0.0), axis=0)

    def add_into(self, src, dst, rows: int) -> None:
        """dst += src: a TMA reduce-add; one worker (interpret mode, which has none) reads, adds
        and writes back through shared memory."""
        if self.reduce:
            plgpu.copy_smem_to_gmem(src, dst, reduction_op="add")
            return
        tmp = self.s["pin"].at[pl.ds(0, rows)]
        plgpu.wait_smem_to_gmem(0)
        plgpu.copy_gmem_to_smem(dst, tmp, self.s["pbar"])
        plgpu.barrier_wait(self.s["pbar"])
        tmp[...] = plgpu.load(tmp, layout=WGMMA) + plgpu.load(src, layout=WGMMA)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(tmp, dst)
        plgpu.wait_smem_to_gmem(0)


def sources(shape: FusedShape, p: int):
    """Product p's input sources (a, b), the owners' work (sums: (row of Σv², row of
    Σ(v g)² or None), the gain column, the stored buffer) and its residual's (source,
    gain column, layer) or None."""
    kind, j = kind_of(shape.phases[p].name)
    if kind == "adapter":
        last = Buffers.of("m", shape.layers - 1)
        return ("state_or", last), None, (ScalarRows.STATE, None), None, None, None
    if kind == "qkv" and j == 0:
        return Buffers.A, "e_part", (ScalarRows.zg(0), None), None, Buffers.Z0, None
    if kind == "qkv":
        sums = (ScalarRows.z(j), ScalarRows.zg(j))
        return Buffers.of("m", j - 1), None, sums, GAIN_G4_BEFORE, None, None
    if kind == "proj":
        z = Buffers.Z0 if j == 0 else Buffers.of("m", j - 1)
        return Buffers.of("att", j), None, None, None, None, (z, GAIN_G4_BEFORE, j)
    if kind == "fc":
        sums = (ScalarRows.h1(j), ScalarRows.h1g(j))
        return Buffers.of("o", j), None, sums, GAIN_G2, None, None
    gate_up = ("gate_up", Buffers.of("fc", j))  # both halves' chunks in one copy
    return gate_up, None, None, None, None, (Buffers.of("o", j), GAIN_G2, j)


def is_gate_up(src) -> bool:
    """Whether an input source (`sources`) is the fc output's gate and up halves, whose chunk
    is one copy of 128 rows (the MLP proj's)."""
    return isinstance(src, tuple) and src[0] == "gate_up"


def input_chunk_rows(shape: FusedShape, p: int) -> int:
    """Rows of the output before product p in one of p's input chunks: 128 where the chunk is
    the gate's and the up half's 64 each (`is_gate_up`: the MLP proj's), else 64."""
    return 2 * UNIT if is_gate_up(sources(shape, p)[0]) else UNIT


def output_of(shape: FusedShape, p: int) -> tuple[int, int]:
    """(buffer, row offset) of product p's output."""
    kind, j = kind_of(shape.phases[p].name)
    if kind == "adapter":
        return Buffers.A, 0
    kind = {"qkv": "qkv", "proj": "o", "fc": "fc", "mlp_proj": "m"}[kind]
    return Buffers.of(kind, j), SHIFT if kind == "qkv" else 0


def scaled(k: KernelContext, it, p: int):
    """(fn(a, b) -> (input, v), the residual's scale [8] or None) of product p, from
    the scalar tile (loaded where p needs it)."""
    kind, j = kind_of(k.shape.phases[p].name)
    if kind == "qkv" and j == 0:
        first_f = (it == 0).astype(jnp.float32)
        r_state = bcast_rows(k.inv_rms(k.scalar(it, ScalarRows.STATE)), UNIT)
        ra = first_f + (1.0 - first_f) * r_state  # the given state is not normed

        def start(a, b):
            v = a * ra + b
            return v, v

        return start, None
    if kind == "mlp_proj":
        r2 = k.inv_rms(k.scalar(it, ScalarRows.h1(j)))
        r3 = k.inv_rms(k.scalar(it, ScalarRows.h1g(j)) * r2 * r2)
        scale = bcast_rows(r2 * r3, UNIT)

        def gate(a, b):
            g, up = a * scale, b * scale
            out = g / (1.0 + jnp.exp(-g)) * up
            return out, out

        return gate, r2
    rx = k.inv_rms(k.scalar(it, ScalarRows.z(j))) if kind == "proj" and j else None
    return (lambda a, b: (a, a)), rx
