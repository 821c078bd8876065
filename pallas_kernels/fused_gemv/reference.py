"""Plain-JAX reference of one row GEMV with its three outputs: what the kernel must match."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def fused_gemv_reference(w, x, *, silu=False, as_partials=False) -> jax.Array:
    """x [K] @ w [K, N], the product in w's dtype (float32 weights: full float32 products, no
    TF32): [1, N] float32 partial sums (`as_partials`), the [N / 2] row silu(gate) * up (`silu`,
    w = [gate | up]) or the [N] row, in w's dtype.

    The kernel's `as_partials` output [split_k, N] sums over axis 0 to this one's."""
    precision = jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else None
    y = jnp.matmul(x, w, precision=precision)
    if as_partials:
        return y.astype(jnp.float32)[None]
    if silu:
        gate, up = jnp.split(y, 2)
        y = jax.nn.silu(gate) * up
    return y
