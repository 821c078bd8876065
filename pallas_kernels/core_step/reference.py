"""Plain-JAX reference of the weight stream: the same chain of products, one XLA dot each."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.core_step.plan import Phase


@functools.partial(jax.jit, static_argnames=("phases", "iterations"))
def weight_stream_reference(
    x0: jax.Array, weights: tuple[jax.Array, ...], *, phases: tuple[Phase, ...], iterations: int
) -> jax.Array:
    """x0 [M, k0] -> [M, n_last] f32. Each product takes its input rounded to bf16 and
    accumulates in f32; its input is the leading rows of the previous output, the first
    product's the last output (x0's state rows at the start) followed by x0's other rows."""
    state_rows = phases[-1].n
    state, external = x0[:, :state_rows].astype(jnp.float32), x0[:, state_rows:]
    y = state
    for _ in range(iterations):
        for p, (phase, w) in enumerate(zip(phases, weights, strict=True)):
            if p == 0:
                x = jnp.concatenate([state, external.astype(jnp.float32)], axis=1)
            else:
                x = y
            x = x[:, : phase.k].astype(jnp.bfloat16)
            y = jnp.dot(x, w, preferred_element_type=jnp.float32)
        state = y
    return y
