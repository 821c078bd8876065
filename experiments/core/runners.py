"""The Core's weights and a case's inputs, the jitted Core and its XLA runner, and the runner of
every impl of `experiments.core` (the PyTorch runners: experiments.torch_ref.core_runner)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.cli import UserError
from experiments.core.cases import PERSISTENT, XLA_VARIANTS, Case, jax_dtype
from experiments.torch_ref.core_runner import TorchRunner  # imports no torch
from huginn_jax import persistent
from huginn_jax.checkpoint import CheckpointError, from_pretrained
from huginn_jax.kv_cache import KVCache
from huginn_jax.model import Core, run_core


def core_graphdef(cfg, dtype):
    """The Core's structure (static: it carries the config) without allocating weights."""
    return nnx.graphdef(nnx.eval_shape(lambda: Core(cfg, rngs=nnx.Rngs(0), dtype=dtype)))


def build_core(cfg, dtype, seed: int):
    """Random Core weights with the reference init, created on the device (jitted init)."""

    @jax.jit
    def init(key):
        return nnx.split(Core(cfg, rngs=nnx.Rngs(params=key), dtype=dtype))[1]

    return core_graphdef(cfg, dtype), init(jax.random.key(seed))


def load_core(cfg, dtype, path: str):
    """The adapter and Core layers of the from_pretrained directory `path`, as `build_core`'s
    (graphdef, params)."""
    try:
        model = from_pretrained(path, dtype)
    except CheckpointError as e:
        raise UserError(str(e)) from None
    state = nnx.state(model)
    params = nnx.State({"adapter": state["adapter"], "core_block": state["core_block"]})
    graphdef = core_graphdef(cfg, dtype)
    nnx.merge(graphdef, params)  # the structures agree
    return graphdef, params


def core_weights(cfg, dtype, *, weights: str, path: str, seed: int):
    """(graphdef, params): `weights` "trained" loads the directory `path` (`load_core`),
    "random" draws them from `seed` (`build_core`)."""
    if weights == "trained":
        return load_core(cfg, dtype, path)
    return build_core(cfg, dtype, seed)


def case_inputs(cfg, case: Case, dtype, seed: int):
    """(state, embedded) [B, T, D] and a cache whose history positions [0, start) are random."""
    keys = jax.random.split(jax.random.key(seed + 1), 4)
    shape = (case.batch, case.new_tokens, cfg.n_embd)
    state = jax.random.normal(keys[0], shape, dtype)
    embedded = jax.random.normal(keys[1], shape, dtype)
    cache = KVCache.create(
        cfg, batch=case.batch, max_len=case.max_len, num_steps=case.iterations, dtype=dtype
    )
    if case.mode == "decode":

        @functools.partial(jax.jit, donate_argnums=0)
        def fill(cache):
            """One slot at a time, in place: drawing the whole cache at once needs float32
            temporaries of its size (the largest decode cases ran out of device memory)."""

            def fill_slot(slot, kv):
                shape = kv[0].shape[1:]
                return tuple(
                    x.at[slot].set(jax.random.normal(jax.random.fold_in(key, slot), shape, dtype))
                    for x, key in zip(kv, keys[2:], strict=True)
                )

            k, v = jax.lax.fori_loop(0, cache.k.shape[0], fill_slot, (cache.k, cache.v))
            return dataclasses.replace(cache, k=k, v=v)

        cache = fill(cache)
    return state, embedded, cache


def jit_core(graphdef, params, *, iterations: int, from_zero=False):
    """The Core's r iterations, jitted: returns (fn, weights); `fn(weights, state, embedded,
    cache, start)` returns (state, cache). `weights` are the leaves of the nnx.State `params`: a
    tuple of arrays is flattened in C++ at each call, where flattening the State itself costs
    far more Python per call than a decode iteration takes on the GPU.

    `from_zero`: a prefill into an empty cache; start is then the constant 0, so attention reads
    the new positions alone with a plain causal mask (as generation's prefill does). The cache is
    donated, so XLA updates it in place.
    """
    leaves, treedef = jax.tree.flatten(params)

    def core(weights, state, embedded, cache, start):
        model = nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))
        return run_core(model, state, embedded, 0 if from_zero else start, cache, iterations)

    return jax.jit(core, donate_argnames="cache"), tuple(leaves)


class CompiledRunner:
    """A JAX executable `compiled(*args, cache, start)` -> (state, cache): each call feeds the
    cache back (donated, so XLA updates it in place) and returns the output state."""

    sync = None
    compiled: jax.stages.Compiled
    args: tuple
    cache: KVCache
    start: jax.Array

    def compile_report(self):
        """Optimized HLO text and `memory_analysis()` of the executable that is timed."""
        return self.compiled.as_text(), self.compiled.memory_analysis()

    def __call__(self):
        out, self.cache = self.compiled(*self.args, self.cache, self.start)
        return out


class XlaRunner(CompiledRunner):
    """The Core compiled once ahead of time (`jit_core`)."""

    def __init__(self, graphdef, params, state, embedded, cache, case: Case):
        fn, weights = jit_core(
            graphdef, params, iterations=case.iterations, from_zero=case.mode == "prefill"
        )
        self.args = (weights, state, embedded)
        self.start = jnp.int32(case.start)
        self.cache = cache
        self.compiled = fn.lower(*self.args, self.cache, self.start).compile()

    def release(self):
        self.cache = self.compiled = None


def why_not_persistent(cfg, case: Case, dtype_name: str, schedule=None) -> str | None:
    """Why the persistent impl cannot run `case` with `schedule` (None: the case's default)
    here (None: it can)."""
    if case.mode != "decode":
        return "it runs decode steps (one new position)"
    cache = jax.eval_shape(
        lambda: KVCache.create(
            cfg, batch=case.batch, max_len=persistent.cache_positions(case.max_len, schedule),
            num_steps=case.iterations, dtype=jax_dtype(dtype_name),
        )
    )  # fmt: skip
    return persistent.why_not_persistent(
        cfg, case.batch, cache, num_steps=case.iterations, schedule=schedule
    )


class PersistentRunner(CompiledRunner):
    """The Core's decode step in the persistent kernel (`huginn_jax.persistent`, its
    `schedule`): the weights packed and the step compiled once, before any timed call. The
    cache is `case_inputs`' with zero positions appended up to whole blocks, after the new
    position, so never visible."""

    def __init__(self, graphdef, params, state, embedded, cache, case: Case, schedule):
        self.prepared = persistent.PersistentCore.prepare(
            nnx.merge(graphdef, params), case.batch, schedule=schedule
        )
        pad = [(0, 0)] * cache.k.ndim
        pad[2] = (0, persistent.cache_positions(cache.max_len, schedule) - cache.max_len)
        self.cache = dataclasses.replace(cache, k=jnp.pad(cache.k, pad), v=jnp.pad(cache.v, pad))

        def core(prepared, state, embedded, cache, start):
            return persistent.run_core_persistent(
                prepared, state, embedded, start, cache, case.iterations
            )

        self.args = (self.prepared, state, embedded)
        self.start = jnp.int32(case.start)
        fn = jax.jit(core, donate_argnames="cache")
        self.compiled = fn.lower(*self.args, self.cache, self.start).compile()

    def release(self):
        self.cache = self.compiled = self.prepared = self.args = None


def make_runner(
    impl, cfg, graphdef, params, case, dtype_name, *, seed: int, compile_mode: str, schedule
):
    """The runner of `impl` for `case`, over fresh inputs drawn from `seed`: XlaRunner for the
    XLA impls (a variant's model config from XLA_VARIANTS), TorchRunner for the torch ones
    (`compile_mode`: torch.compile's), PersistentRunner for `persistent` (the kernel's
    `schedule`)."""
    state, embedded, cache = case_inputs(cfg, case, jax_dtype(dtype_name), seed)
    if impl == "xla":
        return XlaRunner(graphdef, params, state, embedded, cache, case)
    if impl == PERSISTENT:
        return PersistentRunner(graphdef, params, state, embedded, cache, case, schedule)
    if impl in XLA_VARIANTS:
        variant = dataclasses.replace(cfg, **XLA_VARIANTS[impl])
        return XlaRunner(
            core_graphdef(variant, jax_dtype(dtype_name)), params, state, embedded, cache, case
        )
    return TorchRunner(
        impl,
        nnx.to_pure_dict(params),
        cfg,
        state,
        embedded,
        cache,
        case,
        dtype_name,
        compile_mode=compile_mode,
    )


def to_numpy(out) -> np.ndarray:
    """A runner's output state (a JAX array or a torch tensor) as float32 numpy."""
    if hasattr(out, "detach"):
        return out.detach().float().cpu().numpy()
    return np.asarray(out, dtype=np.float32)
