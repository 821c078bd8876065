"""What the fused Core kernel's steps add into (`fused.py`), zeroed before the adds: the
products' outputs, the attention outputs and the scalar tiles, each worker its share of the
tiles, ordered before the adds by a grid barrier (or, for the outputs of products that start on
tile counters, by the barriers around the attention before them). The tile of zeros the copies
read is a product scope's (`fused_fit.scratch_types`): written at each product's start, since
the attention's scopes take the same bytes in between, and so kept out of the widest scope."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.core_step.fused_inputs import KernelContext, output_of
from pallas_kernels.core_step.fused_plan import SCALAR_ROWS, SHIFT, Buffers, kind_of
from pallas_kernels.core_step.plan import UNIT, pad_to


class Zeros:
    """One worker's zeroing: `first` before the first barrier, `after_start(it, p, s)` once
    product p's first copies are issued (`s`: its scope). `hands_over(p)`: whether the product
    after p starts on p's tile counters (`fused_products.Products.hands_over`)."""

    def __init__(self, k: KernelContext, iterations: int, hands_over):
        self.k, self.iterations, self.hands_over = k, iterations, hands_over
        self.phases, self.cols = k.shape.phases, k.shape.unit_cols
        self.att_rows = pad_to(k.shape.k_d, self.cols)

    def rows(self, zero, act, buf, offset, n) -> None:
        """The worker's tiles of act[buf, offset : offset + n] set to 0, a 64-row chunk per
        copy from `zero` (the tile of zeros is one chunk, to leave the shared memory to the
        rest); `act`: a set of buffers (`KernelContext.acts`)."""
        k, cols = self.k, self.cols
        tiles = n // cols

        @pl.loop(0, -(-tiles // k.workers))
        def _(r):
            t = k.worker + r * k.workers

            @pl.when(t < tiles)
            def _():
                for c in range(cols // UNIT):
                    dst = act.at[buf, pl.ds(offset + t * cols + c * UNIT, UNIT), :]
                    plgpu.copy_smem_to_gmem(zero, dst)

    def output(self, zero, act, p) -> None:
        """Product p's output in the buffers `act`."""
        self.rows(zero, act, *output_of(self.k.shape, p), self.phases[p].n)

    @staticmethod
    def fill(zero) -> None:
        """The tile `zero` set to zeros, visible to the copies issued after."""
        zero[...] = jnp.zeros(zero.shape, zero.dtype)
        plgpu.commit_smem()

    def after_start(self, it, p, s) -> None:
        """During product p: the next product's output (several workers add into it), during
        a qkv the attention output, the outputs of the products that start on tile counters
        (`hands_over`: no barrier orders them after the zeroing in the step before) and during
        layer 0's qkv the next scalar tile. With `Schedule.dataflow`, product p's output and
        the qkv's attention output in the next iteration's buffers (`KernelContext.acts`): the
        one barrier per iteration orders them, and the last product's output there is the
        state that this iteration's adapter read, which every proj's input waited for
        (`fused_counters.py`)."""
        k, phases, n_phases = self.k, self.phases, len(self.phases)
        kind, j = kind_of(phases[p].name)
        act, zero = k.acts(it), s["zero"]
        self.fill(zero)
        if kind == "qkv" and j == 0:

            @pl.when(k.worker == 0)
            def _():
                scalars = zero.at[pl.ds(0, SCALAR_ROWS)]
                plgpu.copy_smem_to_gmem(scalars, k.scal.at[lax.rem(it + 1, 2)])

        if self.k.dataflow:

            def next_iteration():
                nxt = k.acts(it + 1)
                if k.reduce:
                    self.output(zero, nxt, p)
                if kind == "qkv":
                    self.rows(zero, nxt, Buffers.of("att", j), 0, self.att_rows)

            pl.when(it < self.iterations - 1)(next_iteration)
            return
        if kind == "qkv":
            self.rows(zero, act, Buffers.of("att", j), 0, self.att_rows)
            for q in (p + 1, p + 3):  # proj (then fc) and the mlp proj (then a qkv)
                if q < n_phases and self.hands_over(q):
                    self.output(zero, act, q + 1)
        if k.reduce and not self.hands_over(p):  # each output tile is written whole by adds
            if p + 1 < n_phases:
                self.output(zero, act, p + 1)
            else:
                pl.when(it < self.iterations - 1)(lambda: self.output(zero, act, 0))

    def first(self) -> None:
        """Before the first barrier, from a product scope's tile of zeros (its copies done
        before the scope ends): both scalar tiles, the qkv buffers' padding rows and the
        adapter's output (with `Schedule.dataflow`, every output of the first iteration's
        buffers)."""
        self.k.scope("product", lambda s: self._first(s["zero"]))

    def _first(self, zero) -> None:
        k = self.k
        self.fill(zero)

        @pl.when(k.worker == 0)
        def _pads():
            for parity in range(2):
                plgpu.copy_smem_to_gmem(zero.at[pl.ds(0, SCALAR_ROWS)], k.scal.at[parity])
            for j in range(k.shape.layers):  # the rows around the product that RoPE's windows read
                for r in (0, SHIFT + self.phases[1].n):
                    for parity in range(k.parities):
                        dst = k.act.at[parity, Buffers.of("qkv", j), pl.ds(r, SHIFT), :]
                        plgpu.copy_smem_to_gmem(zero.at[pl.ds(0, SHIFT)], dst)

        first = k.acts(0)
        if self.k.dataflow:
            for j in range(k.shape.layers):
                self.rows(zero, first, Buffers.of("att", j), 0, self.att_rows)
        if k.reduce:
            for p in range(len(self.phases) if self.k.dataflow else 1):
                self.output(zero, first, p)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
