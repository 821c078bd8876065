"""Training the reference's way: a random recurrence per step, truncated backprop, AdamW.

Shape letters: B batch, T positions, D model width, V vocabulary, A answer positions, R iterations.

One optimizer step (`make_train_step`, one jitted function of the `TrainState` alone):
  1. key = fold_in(rng, step): the batch (drawn in-graph by the task), the recurrence and the
     initial state all come from it, so a step is a pure function of (state, step) and a resumed
     run replays an uninterrupted one exactly.
  2. Recurrence as in the reference: τ ~ LogNormal(ln(mean) − σ²/2, σ), p = Poisson(τ) + 1;
     n_nograd = max(p − k, 0) iterations run without gradient, then n_grad = min(p, k) with it.
  3. How a dynamic p compiles to ONE executable (no recompiles):
     - the no-grad iterations are a `lax.fori_loop` with a traced trip count (a while loop). Its
       inputs (Core parameters, embedded prompt, state) pass through `stop_gradient`, so autodiff
       sees only symbolic-zero tangents, never differentiates the loop and keeps no residuals;
     - the grad iterations are a `lax.scan` over a fixed k whose body is
       `lax.cond(i < n_grad, core_step, identity)`: an iteration past n_grad neither computes nor
       changes the state (exact, not a masked blend), and reverse mode runs through scan and cond.
  4. Loss: mean cross-entropy over the task's answer tokens only; optax chain(clip_by_global_norm,
     adamw(b1=0.9, b2=0.95, decoupled weight decay on matrices only)) with linear warm-up.

Parameters are kept in float32 (the master copy the optimizer updates); the forward casts them to
`compute_dtype` (bfloat16 on GPU), so gradients come back in float32. Evaluating the trained
model (accuracy against test-time iterations, the `kl` exit) is `huginn_jax.evaluation`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from huginn_jax import parallel
from huginn_jax.config import HuginnConfig
from huginn_jax.model import (
    Huginn,
    core_step,
    embed,
    initial_state,
    random_init,
    run_coda,
    run_prelude,
)
from huginn_jax.tasks import Batch, Task

Params = dict  # the model's nnx.Param tree as a pure nested dict (nnx.to_pure_dict)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimizer, schedule and recurrence settings of a run (everything but model and task)."""

    batch: int = 64
    lr: float = 1e-3
    warmup_steps: int = 100
    total_steps: int = 1000  # the cosine schedule decays over these
    schedule: str = "constant"  # "constant" (the reference: warm-up then flat) or "cosine"
    clip: float = 1.0  # max global gradient norm
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    mean_recurrence: float = 32.0  # E[τ]; E[p] = mean + 1
    backprop_depth: int = 8  # k
    sigma: float = 0.5  # of log τ
    init_scale: float = 1.0  # std multiplier of the random initial state, as the reference
    compute_dtype: str = "float32"

    def __post_init__(self):
        positive = ("batch", "lr", "total_steps", "clip", "mean_recurrence", "backprop_depth")
        for name in positive:  # NaN and inf fail too
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        for name in ("warmup_steps", "weight_decay", "sigma", "init_scale"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"{name}={getattr(self, name)} must be a number >= 0")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
            raise ValueError(f"betas must lie in [0, 1); got b1={self.b1} b2={self.b2}")
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"schedule={self.schedule!r} must be 'constant' or 'cosine'")
        if self.compute_dtype not in _DTYPES:
            raise ValueError(f"compute_dtype={self.compute_dtype!r} must be one of {list(_DTYPES)}")

    @property
    def dtype(self):
        return _DTYPES[self.compute_dtype]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class TrainState(NamedTuple):
    """Everything a step reads and writes; a pytree, checkpointed whole."""

    params: Params  # float32 master weights
    opt_state: optax.OptState
    step: jax.Array  # int32 scalar: optimizer steps taken
    rng: jax.Array  # uint32 key data of the run's base key; step keys are fold_in(rng, step)


# ----------------------------------------------------------------------------- recurrence sampler


def sample_recurrence(
    key: jax.Array, mean: float, backprop_depth: int, sigma: float = 0.5
) -> tuple[jax.Array, jax.Array]:
    """The reference's p = Poisson(τ) + 1, τ ~ LogNormal(ln(mean) − σ²/2, σ), split as
    (n_nograd, n_grad) = (max(p − k, 0), min(p, k)); both int32 scalars, traceable."""
    k_tau, k_p = jax.random.split(key)
    mu = jnp.log(jnp.float32(mean)) - sigma**2 / 2
    tau = jnp.exp(mu + sigma * jax.random.normal(k_tau, (), jnp.float32))
    p = jax.random.poisson(k_p, tau, dtype=jnp.int32) + 1
    n_grad = jnp.minimum(p, backprop_depth)
    return p - n_grad, n_grad


# ----------------------------------------------------------------------------- the Core loops


class _Core(NamedTuple):
    """What `core_step` reads: the adapter and the Core blocks."""

    adapter: Any
    core_block: Any


def split_core(model: Huginn) -> tuple[nnx.GraphDef, Any]:
    """(graphdef, params) of the recurrent part (adapter + Core blocks)."""
    return nnx.split((model.adapter, model.core_block))


def iterate(core_graphdef: nnx.GraphDef, core_params, state_BxTxD, embedded_BxTxD) -> jax.Array:
    """One Core iteration without a cache (positions 0..T-1)."""
    adapter, core_block = nnx.merge(core_graphdef, core_params)
    state, _ = core_step(_Core(adapter, core_block), state_BxTxD, embedded_BxTxD, 0, 0, None)
    return state


def run_nograd(
    core_graphdef: nnx.GraphDef, core_params, state_BxTxD, embedded_BxTxD, num_steps: jax.Array
) -> jax.Array:
    """`num_steps` (traced) iterations that no gradient flows through, in both directions."""
    core_params, state, embedded = jax.lax.stop_gradient((core_params, state_BxTxD, embedded_BxTxD))
    state = jax.lax.fori_loop(
        0, num_steps, lambda _, s: iterate(core_graphdef, core_params, s, embedded), state
    )
    return jax.lax.stop_gradient(state)


def run_grad(
    core_graphdef: nnx.GraphDef,
    core_params,
    state_BxTxD,
    embedded_BxTxD,
    num_steps: jax.Array,
    max_steps: int,
) -> jax.Array:
    """`num_steps` (traced, <= `max_steps`) differentiable iterations: a scan over `max_steps` whose
    iteration i is `cond(i < num_steps, core, identity)`, so the trailing ones are exact no-ops."""

    def body(state, i):
        state = jax.lax.cond(
            i < num_steps,
            lambda s: iterate(core_graphdef, core_params, s, embedded_BxTxD),
            lambda s: s,
            state,
        )
        return state, None

    state, _ = jax.lax.scan(body, state_BxTxD, jnp.arange(max_steps, dtype=jnp.int32))
    return state


# ----------------------------------------------------------------------------- loss and step


def cast_params(params: Params, dtype) -> Params:
    return jax.tree.map(lambda p: p.astype(dtype), params)


def answer_loss(
    logits_BxTxV: jax.Array, targets_BxT: jax.Array, mask_BxT: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(mean cross-entropy, accuracy) over the positions where mask holds; float32 scalars."""
    logp = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets_BxT[..., None], axis=-1)[..., 0]
    count = jnp.maximum(mask_BxT.sum(), 1)
    loss = jnp.where(mask_BxT, nll, 0.0).sum() / count
    correct = (jnp.argmax(logits_BxTxV, axis=-1) == targets_BxT) & mask_BxT
    return loss, correct.sum() / count


def loss_fn(
    params: Params,
    graphdef: nnx.GraphDef,
    batch: Batch,
    state_key: jax.Array,
    n_nograd: jax.Array,
    n_grad: jax.Array,
    *,
    max_grad_steps: int,
    init_scale: float = 1.0,
    compute_dtype=jnp.float32,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Answer-token cross-entropy after n_nograd + n_grad Core iterations (truncated backprop).

    The prelude, the last n_grad iterations and the coda carry gradient; the embedded prompt
    reaches the no-grad iterations through `stop_gradient`, as under the reference's `no_grad`.
    """
    model = nnx.merge(graphdef, cast_params(params, compute_dtype))
    ids, targets, mask = batch.tokens[:, :-1], batch.tokens[:, 1:], batch.loss_mask[:, 1:]
    start = jnp.int32(0)
    embedded, _ = run_prelude(model, embed(model, ids), start, None)
    state = initial_state(
        model.config, ids.shape, init_scale=init_scale, key=state_key, dtype=model.dtype
    )
    core_graphdef, core_params = split_core(model)
    state = run_nograd(core_graphdef, core_params, state, embedded, n_nograd)
    state = run_grad(core_graphdef, core_params, state, embedded, n_grad, max_grad_steps)
    logits, _, _ = run_coda(model, state, start, None)
    loss, accuracy = answer_loss(logits, targets, mask)
    return loss, {"accuracy": accuracy}


def decay_mask(params: Params) -> Params:
    """Weight decay on weight matrices and the embedding; not on norm weights or qk_bias."""

    def keep(path, p):
        names = {getattr(k, "key", None) for k in path}
        return p.ndim >= 2 and "qk_bias" not in names

    return jax.tree_util.tree_map_with_path(keep, params)


def make_schedule(cfg: TrainConfig) -> optax.Schedule:
    if cfg.schedule == "cosine":
        decay_steps = max(cfg.total_steps, cfg.warmup_steps + 1)
        return optax.warmup_cosine_decay_schedule(
            0.0, cfg.lr, cfg.warmup_steps, decay_steps, end_value=cfg.lr * 0.1
        )
    return optax.warmup_constant_schedule(0.0, cfg.lr, cfg.warmup_steps)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """clip_by_global_norm → AdamW(b1, b2, decoupled weight decay) on the warm-up schedule."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip),
        optax.adamw(
            make_schedule(cfg),
            b1=cfg.b1,
            b2=cfg.b2,
            weight_decay=cfg.weight_decay,
            mask=decay_mask,
        ),
    )


def run_config(config: HuginnConfig, cfg: TrainConfig) -> HuginnConfig:
    """The model config with the run's recurrence recorded, its depth-dependent init recomputed."""
    return dataclasses.replace(
        config,
        mean_recurrence=max(1, round(cfg.mean_recurrence)),
        mean_backprop_depth=cfg.backprop_depth,
        effective_expected_depth=0,
        out_proj_std=0.0,
    )


def init_params(config: HuginnConfig, key: jax.Array) -> tuple[nnx.GraphDef, Params]:
    """(graphdef, float32 params) of `random_init(config, key)`, drawn in one compiled call
    (eager initialisation dispatches every op on its own, seconds even for tiny models)."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: random_init(config, key, jnp.float32)))
    params = jax.jit(lambda k: nnx.to_pure_dict(nnx.state(random_init(config, k, jnp.float32))))(
        key
    )
    return graphdef, params


def init_train_state(
    config: HuginnConfig, tx: optax.GradientTransformation, seed: int
) -> tuple[nnx.GraphDef, TrainState]:
    """A freshly initialised float32 model and optimizer; the graphdef is static (hashable)."""
    base = jax.random.key(seed)
    graphdef, params = init_params(config, jax.random.fold_in(base, 0))
    rng = jax.random.key_data(jax.random.fold_in(base, 1))
    return graphdef, TrainState(params, jax.jit(tx.init)(params), jnp.int32(0), rng)


def step_keys(state: TrainState) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(data, recurrence, initial-state) keys of the step `state.step`."""
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    k_data, k_depth, k_state = jax.random.split(key, 3)
    return k_data, k_depth, k_state


def make_train_step(
    graphdef: nnx.GraphDef,
    task: Task,
    tx: optax.GradientTransformation,
    cfg: TrainConfig,
    mesh: jax.sharding.Mesh | None = None,
) -> Callable[[TrainState], tuple[TrainState, dict[str, jax.Array]]]:
    """The jitted step: `new_state, metrics = step(state)`; `state` is donated.

    metrics (scalars): loss, accuracy (answer tokens), grad_norm (before clipping), lr,
    n_nograd, n_grad. With a `mesh` over a "data" axis the batch is split over it (data
    parallel; the state must be replicated on the mesh: `parallel.replicate`); the batch, the
    recurrence and the loss are those of one device.
    """
    if cfg.batch % parallel.data_shards(mesh):
        raise ValueError(
            f"batch={cfg.batch} must be a multiple of the mesh's data axis "
            f"({parallel.data_shards(mesh)})"
        )
    schedule = make_schedule(cfg)

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state: TrainState):
        k_data, k_depth, k_state = step_keys(state)
        batch = parallel.split_batch(task.sample(k_data, cfg.batch), mesh)
        n_nograd, n_grad = sample_recurrence(
            k_depth, cfg.mean_recurrence, cfg.backprop_depth, cfg.sigma
        )
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params,
            graphdef,
            batch,
            k_state,
            n_nograd,
            n_grad,
            max_grad_steps=cfg.backprop_depth,
            init_scale=cfg.init_scale,
            compute_dtype=cfg.dtype,
        )
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss,
            "accuracy": aux["accuracy"],
            "grad_norm": optax.tree.norm(grads),
            "lr": schedule(state.step),
            "n_nograd": n_nograd,
            "n_grad": n_grad,
        }
        return TrainState(params, opt_state, state.step + 1, state.rng), metrics

    return train_step


def merge_model(graphdef: nnx.GraphDef, params: Params, dtype=jnp.float32) -> Huginn:
    """A `Huginn` module holding `params` (cast to `dtype`)."""
    return nnx.merge(graphdef, cast_params(params, dtype))
