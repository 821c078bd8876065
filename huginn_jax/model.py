"""Huginn: prelude → Core loop (lax.scan over iterations) → ln_f → coda → ln_f → tied head.

Shape letters: B batch, T new positions, D model width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from huginn_jax import decode_row, parallel
from huginn_jax.config import HuginnConfig
from huginn_jax.kv_cache import KVCache
from huginn_jax.layers import Linear, RMSNorm, SandwichBlock, dot_precision, truncated_normal


class HuginnOutput(NamedTuple):
    logits: jax.Array  # [B, T, V] float32
    latents: jax.Array  # [B, T, D]: ln_f of the state after the recurrence (the coda's input)
    state: jax.Array  # [B, T, D]: the raw recurrent state (for continuous thought)
    cache: KVCache | None


class Huginn(nnx.Module):
    """The Huginn-0125 architecture. Attribute names mirror the checkpoint's keys."""

    def __init__(self, config: HuginnConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        cfg = self.config = config
        d = cfg.n_embd

        def blocks(n):
            return nnx.List([SandwichBlock(cfg, rngs=rngs, dtype=dtype) for _ in range(n)])

        self.wte = nnx.Param(
            truncated_normal(rngs.params(), (cfg.vocab_size, d), cfg.init_std, dtype)
        )
        self.prelude = blocks(cfg.n_layers_in_prelude)
        self.adapter = Linear(truncated_normal(rngs.params(), (2 * d, d), cfg.init_std, dtype))
        self.core_block = blocks(cfg.n_core)
        self.coda = blocks(cfg.n_layers_in_coda)
        self.ln_f = RMSNorm(d, eps=cfg.norm_eps, dtype=dtype)
        if not cfg.tie_embeddings:
            self.lm_head = nnx.Param(
                truncated_normal(rngs.params(), (d, cfg.vocab_size), cfg.init_std, dtype)
            )

    @property
    def dtype(self):
        return self.wte[...].dtype

    def __call__(
        self,
        input_ids: jax.Array,
        num_steps: int = 32,
        init_scale: float = 1.0,
        *,
        key: jax.Array | None = None,
        init_state: jax.Array | None = None,
        cache: KVCache | None = None,
        start: int | jax.Array = 0,
    ) -> HuginnOutput:
        """Runs the whole model, compiled (one executable per shape and `num_steps`).

        input_ids [B, T] int; `num_steps` Core iterations. The initial state is `init_state` if
        given, else zeros for `init_scale == 0`, else a draw from `key` (required then).
        With `cache`, the T tokens sit at positions [start, start + T) and attend to everything
        cached before them; the cache is donated and updated in place (do not reuse the argument,
        use `output.cache`).
        """
        input_ids = jnp.asarray(input_ids)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {input_ids.shape}")
        if num_steps < 1:
            raise ValueError(f"num_steps={num_steps} must be at least 1")
        batch, tokens = input_ids.shape
        if cache is not None:
            check_cache_fits(cache, num_steps=num_steps, start=start, tokens=tokens)
        if init_state is None:
            init_state = initial_state(
                self.config, (batch, tokens), init_scale=init_scale, key=key, dtype=self.dtype
            )
        graphdef, state = nnx.split(self)
        return _forward_jit(
            graphdef, state, input_ids, init_state, cache, jnp.int32(start), num_steps=num_steps
        )


def check_cache_fits(cache: KVCache, *, num_steps: int, start, tokens: int) -> None:
    if num_steps > cache.max_steps:
        raise ValueError(
            f"num_steps={num_steps} needs more Core slots than the cache has ({cache.max_steps})"
        )
    if not isinstance(start, jax.core.Tracer) and int(start) + tokens > cache.max_len:
        raise ValueError(
            f"positions up to {int(start) + tokens} exceed the cache's max_len={cache.max_len}"
        )


def initial_state(
    config: HuginnConfig, shape_BxT: tuple[int, int], *, init_scale: float, key, dtype
) -> jax.Array:
    """The reference's s0: truncated normal (±3 std), std init_std·init_scale, times embed_scale."""
    shape = (*shape_BxT, config.n_embd)
    if init_scale == 0.0:
        return jnp.zeros(shape, dtype)
    if key is None:
        raise ValueError("a random initial state (init_scale != 0) needs an explicit PRNG `key`")
    std = config.init_std * init_scale
    return (truncated_normal(key, shape, std, jnp.float32) * config.embed_scale).astype(dtype)


def embed(model: Huginn, input_ids_BxT: jax.Array) -> jax.Array:
    return jnp.take(model.wte[...], input_ids_BxT, axis=0) * jnp.asarray(
        model.config.embed_scale, model.dtype
    )


def run_prelude(model: Huginn, x, start, cache: KVCache | None):
    for j, block in enumerate(model.prelude):
        x, cache = block(x, start, cache, None if cache is None else cache.prelude_slot(j))
    return x, cache


def core_step(model: Huginn | Core, state, embedded, iteration, start, cache: KVCache | None):
    """One Core iteration: adapter(concat[state, embedded]) then the Core layers (at batch 1
    and one position through row GEMVs when the config asks for them: `decode_row`)."""
    if decode_row.uses_rows(model.core_block[0], state):
        return decode_row.core_step_rows(
            model.adapter, model.core_block, state, embedded, iteration, start, cache
        )
    x = model.adapter(jnp.concatenate([state, embedded], axis=-1))
    for j, block in enumerate(model.core_block):
        slot = None if cache is None else cache.core_slot(iteration, j)
        x, cache = block(x, start, cache, slot)
    return x, cache


def run_core(model: Huginn | Core, state, embedded, start, cache: KVCache | None, num_steps: int):
    """`num_steps` Core iterations as one `lax.scan`: the Core parameters are loop invariants
    (broadcast), the state and the cache are the carry, so r iterations compile to one loop."""
    graphdef, params = nnx.split((model.adapter, model.core_block))

    def body(carry, iteration):
        adapter, core_block = nnx.merge(graphdef, params)
        step_model = CoreWeights(adapter, core_block)
        state, cache = carry
        return core_step(step_model, state, embedded, iteration, start, cache), None

    (state, cache), _ = jax.lax.scan(body, (state, cache), jnp.arange(num_steps, dtype=jnp.int32))
    return state, cache


class CoreWeights(NamedTuple):
    """What `core_step` reads of a model: the adapter and the Core layers (inside the scan, the
    merged loop-invariant parameters, without the rest of the model)."""

    adapter: Linear
    core_block: nnx.List


class Core(nnx.Module):
    """The recurrent part alone (adapter + Core layers), initialised as in `Huginn`.

    What `experiments.core` measures: `run_core(core, state, embedded, start, cache, r)` runs
    exactly the code the full model runs, without allocating the embedding, prelude or coda.
    """

    def __init__(self, config: HuginnConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.config = config
        d = config.n_embd
        self.adapter = Linear(truncated_normal(rngs.params(), (2 * d, d), config.init_std, dtype))
        self.core_block = nnx.List(
            [SandwichBlock(config, rngs=rngs, dtype=dtype) for _ in range(config.n_core)]
        )


def run_coda(model: Huginn, state, start, cache: KVCache | None, *, last_only: bool = False):
    """ln_f → coda blocks → ln_f → head. Returns (logits float32, latents, cache).

    `last_only`: ln_f and the head on the last position only (logits [B, V]): for a next-token
    decision, so that a T-position prefill computes V logits, not T × V. The coda still runs on
    every position, writing their KV entries."""
    latents = model.ln_f(state)
    x = latents
    for j, block in enumerate(model.coda):
        x, cache = block(x, start, cache, None if cache is None else cache.coda_slot(j))
    x = model.ln_f(x[:, -1] if last_only else x)
    head = model.wte[...].T if model.config.tie_embeddings else model.lm_head[...]
    # In the weights' dtype, then float32 (as the reference's bf16 lm_head): asking XLA for a
    # float32 product of bf16 operands made its GPU build convert the whole [V, D] matrix to
    # float32 at every call (docs/core_layers.md).
    logits = jnp.matmul(x, head, precision=dot_precision(head.dtype)).astype(jnp.float32)
    return logits, latents, cache


def forward(model: Huginn, input_ids, init_state, cache, start, num_steps: int) -> HuginnOutput:
    """The whole forward pass, traceable (no jit of its own)."""
    embedded, cache = run_prelude(model, embed(model, input_ids), start, cache)
    state, cache = run_core(model, init_state, embedded, start, cache, num_steps)
    logits, latents, cache = run_coda(model, state, start, cache)
    return HuginnOutput(logits=logits, latents=latents, state=state, cache=cache)


@functools.partial(jax.jit, static_argnames=("graphdef", "num_steps"), donate_argnames=("cache",))
def _forward_jit(graphdef, state, input_ids, init_state, cache, start, *, num_steps):
    return forward(nnx.merge(graphdef, state), input_ids, init_state, cache, start, num_steps)


def random_init(
    config: HuginnConfig,
    key: jax.Array,
    dtype=jnp.float32,
    *,
    mesh: jax.sharding.Mesh | None = None,
) -> Huginn:
    """A model with the reference's initialisation (truncated normals; norms 1; qk_bias 0).

    With `mesh` (or config.mesh), the same weights split over its "model" axis
    (`parallel.shard_model`)."""
    mesh = mesh if mesh is not None else config.mesh
    config = dataclasses.replace(config, mesh=None)
    model = Huginn(config, rngs=nnx.Rngs(params=key), dtype=dtype)
    return model if mesh is None else parallel.shard_model(model, mesh)


KERNEL_CHOICES = ("attention_impl", "decode_attention_impl", "decode_gemv")


def with_config(model: Huginn, config: HuginnConfig) -> Huginn:
    """`model`'s parameters under `config`, which may differ from `model.config` only in its
    kernel choices (KERNEL_CHOICES): those are static, held by the modules, not the parameters,
    so a loaded checkpoint gets them this way. The mesh stays the model's: it shapes the
    parameters."""
    config = dataclasses.replace(config, mesh=model.config.mesh)
    same = dataclasses.replace(config, **{f: getattr(model.config, f) for f in KERNEL_CHOICES})
    if same != model.config:
        raise ValueError(
            f"with_config: the new config differs from the model's in more than {KERNEL_CHOICES}"
        )
    abstract = nnx.eval_shape(lambda: Huginn(config, rngs=nnx.Rngs(0), dtype=model.dtype))
    graphdef, _ = nnx.split(abstract)
    _, state = nnx.split(model)
    return nnx.merge(graphdef, state)
