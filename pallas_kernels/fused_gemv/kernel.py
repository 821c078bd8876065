"""One decode row times a weight, with split-K partial sums or the gated MLP's SiLU fused in
(Pallas, Triton backend).

y = x @ W for one row x [K] and W [K, N] (read once, in place). Two outputs that cuBLAS and XLA
give only with a second kernel:
- partial sums (`as_partials`): program (j, s) sums rows [s * chunk, (s + 1) * chunk) of W's
  columns [j * block_n, (j + 1) * block_n) into float32 partials [split_k, N]; whoever builds
  the next row adds them up (in the decode path, the fusion that adds the residual and norms),
  where cuBLAS's split-K GEMV launches its own reduction kernel;
- `silu` (W = [gate | up], N = 2F): program j reads the gate's and the up's column block j and
  writes the F values bf16(silu(gate) * up), instead of a [2F] row and an XLA kernel.
Otherwise the row of N values in W's dtype.

Each step multiplies a [block_k, block_n] tile of W (two with `silu`): elementwise, the float32
products summed over the rows once after the loop, or (`use_dot`) on the tensor cores with x as
row 0 of a [16, block_k] operand, which lets Triton pipeline the tile loads over `num_stages`.
Traffic: W once (K * N * itemsize); x and the outputs are KBs. On chip: the tiles and float32
accumulators ([block_k, block_n] each, or [16, block_n] with `use_dot`), in registers.
`use_dot` is the faster form on the H200; streaming rates against cuBLAS: docs/fused_gemv.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _kernel(x_ref, w_ref, out_ref, *, silu, chunk, block_k, block_n, use_dot):
    dtype = w_ref.dtype
    size, n_total = w_ref.shape
    columns = n_total // 2 if silu else n_total
    j, s = pl.program_id(0), pl.program_id(1)
    col = j * block_n + jnp.arange(block_n)
    col_inside = col < columns
    begin = s * chunk
    stop = jnp.minimum(begin + chunk, size)
    steps = pl.cdiv(jnp.maximum(stop - begin, 0), block_k)

    def tile(k0, rows_inside, offset):
        return plgpu.load(
            w_ref.at[pl.ds(k0, block_k), pl.ds(offset + j * block_n, block_n)],
            mask=rows_inside[:, None] & col_inside[None, :],
            other=0.0,
        )

    if use_dot:
        lhs_rows = jnp.arange(16)[:, None] == 0
        # float32 weights: full float32 products (Triton's default for them is TF32)
        precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None

        def product(x, w):
            lhs = jnp.where(lhs_rows, x[None, :], 0.0).astype(dtype)
            return jnp.dot(lhs, w, precision=precision, preferred_element_type=jnp.float32)

        acc_shape = (16, block_n)
    else:

        def product(x, w):
            return x[:, None] * w.astype(jnp.float32)

        acc_shape = (block_k, block_n)

    def body(i, accs):
        k0 = begin + i * block_k
        rows_inside = (k0 + jnp.arange(block_k)) < stop
        x = plgpu.load(x_ref.at[pl.ds(k0, block_k)], mask=rows_inside, other=0.0)
        x = x.astype(jnp.float32)
        offsets = (0, columns) if silu else (0,)
        return tuple(
            acc + product(x, tile(k0, rows_inside, offset))
            for acc, offset in zip(accs, offsets, strict=True)
        )

    zeros = jnp.zeros(acc_shape, jnp.float32)
    accs = lax.fori_loop(0, steps, body, (zeros, zeros) if silu else (zeros,))
    sums = [jnp.sum(acc, axis=0) for acc in accs]
    if out_ref.ndim == 2:  # partial sums
        plgpu.store(out_ref.at[s, pl.ds(j * block_n, block_n)], sums[0], mask=col_inside)
        return
    if silu:
        gate, up = (v.astype(dtype).astype(jnp.float32) for v in sums)
        value = (gate * jax.nn.sigmoid(gate)).astype(dtype).astype(jnp.float32) * up
    else:
        value = sums[0]
    plgpu.store(out_ref.at[pl.ds(j * block_n, block_n)], value.astype(dtype), mask=col_inside)


@functools.partial(
    jax.jit,
    static_argnames=(
        "silu",
        "as_partials",
        "split_k",
        "block_k",
        "block_n",
        "use_dot",
        "num_warps",
        "num_stages",
        "interpret",
    ),
)
def fused_gemv_kernel(
    x: jax.Array,
    w: jax.Array,
    *,
    silu: bool,
    as_partials: bool,
    split_k: int,
    block_k: int,
    block_n: int,
    use_dot: bool,
    num_warps: int,
    num_stages: int,
    interpret: bool = False,
) -> jax.Array:
    """x [K] times w [K, N]: [split_k, N] float32 partials, [N / 2] silu(gate) * up or [N]."""
    size, n_total = w.shape
    columns = n_total // 2 if silu else n_total
    chunk = pl.cdiv(pl.cdiv(size, split_k), block_k) * block_k
    if as_partials:
        out_shape = jax.ShapeDtypeStruct((split_k, columns), jnp.float32)
    else:
        out_shape = jax.ShapeDtypeStruct((columns,), w.dtype)
    return pl.pallas_call(
        functools.partial(
            _kernel, silu=silu, chunk=chunk, block_k=block_k, block_n=block_n, use_dot=use_dot
        ),
        grid=(pl.cdiv(columns, block_n), split_k),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="fused_gemv_silu" if silu else "fused_gemv",
    )(x, w)
