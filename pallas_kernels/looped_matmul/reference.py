"""Plain-JAX reference of the looped matmul: the unfused chain the kernel must match."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def _step(x: jax.Array, w: jax.Array) -> jax.Array:
    """One step: [M, d] bf16 @ [d, d] bf16, float32 accumulation, rounded to bf16."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("steps",))
def looped_matmul_reference(x: jax.Array, w: jax.Array, steps: int) -> jax.Array:
    """x <- x @ w, `steps` times. x [M, d] bf16, w [d, d] bf16 -> [M, d] bf16."""
    return lax.fori_loop(0, steps, lambda _, x: _step(x, w), x)


@jax.jit
def looped_matmul_copies_reference(x: jax.Array, w_stacked: jax.Array) -> jax.Array:
    """x <- x @ w_stacked[s] for s = 0..steps-1. x [M, d], w_stacked [steps, d, d], bf16."""
    return lax.fori_loop(0, w_stacked.shape[0], lambda s, x: _step(x, w_stacked[s]), x)
