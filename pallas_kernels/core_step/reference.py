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


def pad_inputs(
    x0: jax.Array,
    weights: tuple[jax.Array, ...],
    phases: tuple[Phase, ...],
    wide: tuple[Phase, ...],
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """x0 and the weights of `phases` zero-padded to `wide` (the same products padded to wider
    tiles, `core_phases(..., unit_cols)`): every n grows with zero columns, and the state rows
    (x0's and the first weight's leading phases[-1].n rows) with zero rows up to wide[-1].n.
    The chain then computes the same result, followed by wide[-1].n - phases[-1].n zeros."""
    state, state_w = phases[-1].n, wide[-1].n
    grow = state_w - state
    if len(wide) != len(phases) or grow < 0:
        raise ValueError("wide must pad the same phases")
    for p, (a, b) in enumerate(zip(phases, wide, strict=True)):
        if b.k != a.k + (grow if p == 0 else 0) or b.n < a.n:
            raise ValueError(f"phase {b.name} [{b.k}, {b.n}] does not pad [{a.k}, {a.n}]")

    def insert_state_rows(a, axis):
        zeros = jnp.zeros(a.shape[:axis] + (grow,) + a.shape[axis + 1 :], a.dtype)
        head, tail = jnp.split(a, [state], axis=axis)
        return jnp.concatenate([head, zeros, tail], axis=axis)

    padded = []
    for p, (a, b, w) in enumerate(zip(phases, wide, weights, strict=True)):
        if p == 0:
            w = insert_state_rows(w, 0)
        padded.append(jnp.pad(w, ((0, 0), (0, b.n - a.n))))
    return insert_state_rows(x0, 1), tuple(padded)
