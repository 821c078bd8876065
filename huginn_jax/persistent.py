"""The Core's decode step as one persistent kernel: `run_core` for one new position, through
`pallas_kernels.core_step.fused_step`.

`PersistentCore.prepare(model, batch)` pads and packs the Core's weights into the kernel's
layout once per (model, batch): the packing copies every Core weight, so it must never happen
per call. `run_core_persistent(prepared, state, embedded, start, cache, num_steps)` then does
what `huginn_jax.model.run_core` does for a decode step: `num_steps` Core iterations at
position `start`, each (iteration, layer) attending over its cache slot (`cache.core_slot`),
the new k and v rows written into the cache, the state returned in its own dtype.
`why_not_persistent` says why a case has to take the XLA path instead (None when the kernel can
run it), asking the kernel's own checks rather than repeating them.

The kernel runs on an sm_90 GPU with one worker per SM unless given a worker count, at most as
many as its schedule allows at the Core's shapes (`workers_for`: each worker must own more weight
units of every product than the schedule keeps in flight, so a small Core runs on fewer workers
than the SMs), and on a CPU in Pallas' GPU interpret mode with one worker (exact enough to test
against `run_core`, far too slow to use). Where no schedule is given, `default_schedule` chooses
one for the case. The kernel is imported inside the functions that call it, so that importing
this module (for `step_weights`) does not load it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from huginn_jax.config import HuginnConfig
from huginn_jax.kv_cache import KVCache
from huginn_jax.model import Core, Huginn
from pallas_kernels.core_step.fused_fit import check_fused, most_workers
from pallas_kernels.core_step.fused_plan import DEFAULT_UNIT_COLS, FusedShape, Schedule
from pallas_kernels.core_step.step_program import LayerWeights, Pending, StepWeights

HOPPER = "9.0"  # the compute capability the kernel is built for (wgmma, TMA)


def step_weights(model: Core | Huginn) -> StepWeights:
    """The adapter and Core layers of `model` as the step program's (and the kernel's) weights,
    in the model's dtype and layout ([in, out])."""
    layers = tuple(
        LayerWeights(
            norm_1=b.norm_1.weight[...],
            wqkv=b.attn.Wqkv.kernel[...],
            qk_bias=b.attn.qk_bias[...] if model.config.qk_bias else None,
            proj=b.attn.proj.kernel[...],
            norm_2=b.norm_2.weight[...],
            norm_3=b.norm_3.weight[...],
            fc=b.mlp.fc.kernel[...],
            mlp_proj=b.mlp.proj.kernel[...],
            norm_4=b.norm_4.weight[...],
        )
        for b in model.core_block
    )
    cfg = model.config
    return StepWeights(model.adapter.kernel[...], layers, head_dim=cfg.head_dim, eps=cfg.norm_eps)


# The schedule where none is given: at these batches the cached blocks in a second warpgroup
# (`Schedule.overlap`) and one grid barrier per iteration (`Schedule.dataflow`), the fastest
# there in the kernel and in the model's call (docs/core_step_record.md, "Cached blocks in a second
# warpgroup", "One grid barrier per iteration"), where the case's attention items fit one per
# worker; the kernel's default `Schedule()` elsewhere (at batch 8 both were slower).
DATAFLOW_OVERLAP = Schedule(ring=3, kv_stages=2, overlap=1, dataflow=1)
DATAFLOW_OVERLAP_BATCHES = (1,)


@dataclasses.dataclass(frozen=True)
class Target:
    """Where and how the kernel runs: `workers` blocks (one per SM on a GPU); `interpret` None
    compiles it for the GPU, else Pallas' GPU interpreter params (one worker); `schedule`, the
    kernel's (`core_target` chooses it where none is given)."""

    workers: int
    interpret: Any = None
    schedule: Schedule = Schedule()


def target_for(workers: int | None = None, device=None) -> tuple[Target | None, str | None]:
    """(Target, None) for `device` (default: JAX's first), or (None, why it cannot run there).
    workers None: the GPU's SM count (`core_target` caps it for a Core's shapes); one worker in
    interpret mode on a CPU."""
    device = jax.devices()[0] if device is None else device
    if device.platform == "cpu":
        from jax.experimental.pallas import mosaic_gpu as plgpu

        return Target(1 if workers is None else workers, plgpu.InterpretGPUParams()), None
    if device.platform != "gpu":
        return None, f"the persistent Core is a CUDA kernel; the device here is {device.platform}"
    capability = getattr(device, "compute_capability", None)
    if capability != HOPPER:
        return None, (
            f"the persistent Core needs an sm_90 GPU (Hopper); {device.device_kind} is "
            f"sm_{str(capability).replace('.', '')}"
        )
    workers = getattr(device, "core_count", None) if workers is None else workers
    if not workers:
        return None, f"{device.device_kind} does not report its SM count: give workers"
    return Target(int(workers)), None


def schedule_named(text: str) -> Schedule | None:
    """The kernel's schedule written as `Schedule.parse` reads it (RING:KV_STAGES[:...]); None
    for '' (each case's default, `default_schedule`). ValueError for a bad one."""
    return Schedule.parse(text) if text else None


def cache_positions(positions: int, schedule: Schedule | None = None) -> int:
    """`positions` rounded up to whole blocks of cached positions, which the kernel reads with
    `schedule` (None: a case's default, `default_schedule`; every default reads blocks of
    `Schedule().kv_block` positions)."""
    block = (schedule or Schedule()).kv_block
    return -(-positions // block) * block


def core_target(
    config: HuginnConfig,
    batch: int,
    *,
    workers: int | None = None,
    schedule: Schedule | None = None,
    unit_cols: int = DEFAULT_UNIT_COLS,
    device=None,
) -> tuple[Target | None, str | None]:
    """`target_for(workers, device)` for a Core of `config` run on `batch` sequences, with
    `schedule` (None: `default_schedule`'s): workers None on a GPU takes its SM count capped by
    `workers_for` ((None, why) where that finds shapes the kernel refuses); given workers are
    kept as they are (the kernel's checks refuse too many)."""
    target, reason = target_for(workers, device)
    if reason:
        return target, reason
    if schedule is None:
        schedule = default_schedule(config, batch, target.workers, unit_cols)
    target = dataclasses.replace(target, schedule=schedule)
    if workers is not None or target.interpret is not None:
        return target, None
    try:
        fitting = workers_for(config, batch, target.workers, schedule, unit_cols)
    except ValueError as e:
        return None, _first_line(e)
    return dataclasses.replace(target, workers=fitting), None


def default_schedule(
    config: HuginnConfig, batch: int, workers: int, unit_cols: int = DEFAULT_UNIT_COLS
) -> Schedule:
    """The schedule for a Core of `config` on `batch` sequences and at most `workers` workers
    where none is given: `DATAFLOW_OVERLAP` at `DATAFLOW_OVERLAP_BATCHES` where the kernel's
    checks take it (its attention items one per worker), else the kernel's default."""
    if batch in DATAFLOW_OVERLAP_BATCHES:
        try:
            shape = fused_shape(config, batch, unit_cols)
            check_fused(shape, _fitting(shape, workers, DATAFLOW_OVERLAP), DATAFLOW_OVERLAP)
        except ValueError:  # refused shapes or too few workers: the kernel's default
            return Schedule()
        return DATAFLOW_OVERLAP
    return Schedule()


def workers_for(
    config: HuginnConfig,
    batch: int,
    sm_count: int,
    schedule: Schedule | None = None,
    unit_cols: int = DEFAULT_UNIT_COLS,
) -> int:
    """Workers for a Core of `config` on a GPU of `sm_count` SMs: one per SM, but no more than
    `schedule` (None: `Schedule()`) allows at the Core's shapes (`fused_fit.most_workers`), and
    at least one, so that where not even one fits the kernel's own check says why.
    ValueError for shapes the kernel refuses."""
    return _fitting(fused_shape(config, batch, unit_cols), sm_count, schedule or Schedule())


def _fitting(shape: FusedShape, sm_count: int, schedule: Schedule) -> int:
    """`workers_for` at the kernel's `shape`: min(sm_count, `most_workers`), at least one."""
    return max(1, min(sm_count, most_workers(shape, schedule)))


def fused_shape(config: HuginnConfig, batch: int, unit_cols: int = DEFAULT_UNIT_COLS) -> FusedShape:
    """The kernel's shapes for a Core of `config` run on `batch` sequences: those `pack_weights`
    takes from the weights (`fused_step.core_shape`), here from their shapes (nothing
    allocated). ValueError for shapes the kernel refuses."""
    from pallas_kernels.core_step.fused_step import core_shape

    weights = _abstract_weights(config, jnp.bfloat16)
    return core_shape(weights, heads=config.n_heads, batch=batch, unit_cols=unit_cols)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PersistentCore:
    """A Core's weights packed for the kernel (`fused_step.FusedWeights`, for one batch size)
    and its schedule. Create it with `prepare`, once per (model, batch)."""

    weights: Any  # fused_step.FusedWeights
    workers: int = dataclasses.field(metadata=dict(static=True))
    schedule: Schedule = dataclasses.field(metadata=dict(static=True))
    interpret: Any = dataclasses.field(metadata=dict(static=True))

    @property
    def batch(self) -> int:
        return self.weights.shape.batch

    @classmethod
    def prepare(
        cls,
        model: Core | Huginn,
        batch: int,
        *,
        workers: int | None = None,
        schedule: Schedule | None = None,
        unit_cols: int = DEFAULT_UNIT_COLS,
        device=None,
    ) -> PersistentCore:
        """Packs `model`'s Core for `batch` sequences (one compiled pass over the weights).
        `workers` None: one per SM, capped for the Core's shapes (`core_target`); one in
        interpret mode on a CPU. `schedule`: the kernel's (None: the case's default,
        `default_schedule`). ValueError where the kernel cannot run (`core_target`, or
        shapes it refuses)."""
        cfg = model.config
        target, reason = core_target(
            cfg, batch, workers=workers, schedule=schedule, unit_cols=unit_cols, device=device
        )
        if reason:
            raise ValueError(reason)
        packed = _pack(
            step_weights(model),
            heads=cfg.n_heads,
            batch=batch,
            rope_base=cfg.rope_base,
            unit_cols=unit_cols,
        )
        return cls(packed, target.workers, target.schedule, target.interpret)


@functools.partial(jax.jit, static_argnames=("heads", "batch", "rope_base", "unit_cols"))
def _pack(weights: StepWeights, *, heads: int, batch: int, rope_base: float, unit_cols: int):
    from pallas_kernels.core_step.fused_step import pack_weights

    return pack_weights(weights, heads=heads, batch=batch, rope_base=rope_base, unit_cols=unit_cols)


def packed_bytes(
    config: HuginnConfig, batch: int, *, unit_cols: int = DEFAULT_UNIT_COLS, dtype=jnp.bfloat16
) -> int:
    """Device bytes `PersistentCore.prepare` allocates for a model of `config` in `dtype`
    (nothing allocated); 0 where the kernel refuses the shapes (it will not be prepared)."""
    if config.mesh is not None:  # refused by why_not_persistent: never prepared
        return 0
    try:
        packed = _abstract_packed(config, batch, dtype, unit_cols)
    except ValueError:
        return 0
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(packed))


def _abstract_packed(config: HuginnConfig, batch: int, dtype, unit_cols: int):
    """`pack_weights` of a Core of `config` in `dtype`, as shapes (nothing allocated); its
    checks raise ValueError for shapes the kernel refuses."""
    from pallas_kernels.core_step.fused_step import pack_weights

    weights = _abstract_weights(config, dtype)
    pack = functools.partial(pack_weights, heads=config.n_heads, batch=batch,
                             rope_base=config.rope_base, unit_cols=unit_cols)  # fmt: skip
    return jax.eval_shape(pack, weights)


def _abstract_weights(config: HuginnConfig, dtype) -> StepWeights:
    """`step_weights` of a Core of `config` in `dtype`, as shapes (nothing allocated)."""
    return jax.eval_shape(lambda: step_weights(Core(config, rngs=nnx.Rngs(0), dtype=dtype)))


def run_core_persistent(
    prepared: PersistentCore,
    state_Bx1xD: jax.Array,
    embedded_Bx1xD: jax.Array,
    start,
    cache: KVCache,
    num_steps: int,
) -> tuple[jax.Array, KVCache]:
    """`run_core(model, state, embedded, start, cache, num_steps)` for one new position `start`
    (traceable): returns (state [B, 1, D] in the state's dtype, cache). Each Core slot gets its
    new row at `start`; where slots are shared (compress-sN), the last (iteration, layer) that
    uses a slot writes it, as in `run_core`."""
    from pallas_kernels.core_step.fused_step import fused_core_decode, write_new_rows

    batch, tokens, _ = state_Bx1xD.shape
    if tokens != 1 or embedded_Bx1xD.shape[1] != 1:
        raise ValueError(f"the persistent Core runs one new position; the state has {tokens}")
    if batch != prepared.batch:
        raise ValueError(f"batch {batch} != the batch the weights were packed for")
    slots_IxL = np.asarray(cache.slot_table(num_steps), np.int32)
    pending, k_new, v_new = fused_core_decode(
        prepared.weights,
        Pending(state_Bx1xD[:, 0]),
        embedded_Bx1xD[:, 0],
        cache.k,
        cache.v,
        jnp.asarray(slots_IxL),
        start,
        iterations=num_steps,
        workers=prepared.workers,
        schedule=prepared.schedule,
        interpret=prepared.interpret,
    )
    writers = last_writers(slots_IxL)
    if writers.size < slots_IxL.size:  # shared slots: only each one's last row is written
        slots_IxL = slots_IxL.reshape(-1)[writers, None]
        k_new, v_new = (x.reshape(-1, 1, *x.shape[2:])[writers] for x in (k_new, v_new))
    k, v = write_new_rows(cache.k, cache.v, slots_IxL, start, k_new, v_new)
    state = pending.value(prepared.weights.eps).astype(state_Bx1xD.dtype)
    return state[:, None], dataclasses.replace(cache, k=k, v=v)


def last_writers(slots_IxL: np.ndarray) -> np.ndarray:
    """Indices into the flattened [iterations, L] slot table of the last (iteration, layer)
    that uses each slot, in order: the rows a cache keeps when slots are shared."""
    last = {int(slot): n for n, slot in enumerate(np.asarray(slots_IxL).reshape(-1))}
    return np.array(sorted(last.values()), np.int64)


def why_not_persistent(
    config: HuginnConfig,
    batch: int,
    cache: KVCache,
    *,
    num_steps: int,
    tokens: int = 1,
    workers: int | None = None,
    schedule: Schedule | None = None,
    unit_cols: int = DEFAULT_UNIT_COLS,
    device=None,
) -> str | None:
    """Why `run_core_persistent` cannot run this case (a sentence), or None when it can: not a
    single new position, a model on a mesh, not one sequence per cache row, a cache that is not
    bfloat16, a device that is not an sm_90 GPU (a CPU runs the interpreter), or what the
    kernel's own checks refuse (batch above 8, cache positions not a multiple of the schedule's
    kv_block, head_dim not a multiple of 16 on a GPU, too few weight units per worker for the
    ring, ...). `workers` None: as `PersistentCore.prepare` takes them (`core_target`). `cache`
    may be abstract (`jax.eval_shape`); nothing is allocated or run."""
    if tokens != 1:
        return f"{tokens} new positions: the persistent Core runs a decode step of one position"
    if config.mesh is not None:
        return "the model is split over a mesh; the persistent Core runs on one device"
    if cache.k.shape[1] != batch:
        return f"the cache holds {cache.k.shape[1]} sequences, not the batch of {batch}"
    if jnp.dtype(cache.k.dtype) != jnp.bfloat16:
        return f"the cache is {jnp.dtype(cache.k.dtype).name}; the kernel reads a bfloat16 cache"
    target, reason = core_target(
        config, batch, workers=workers, schedule=schedule, unit_cols=unit_cols, device=device
    )
    if reason:
        return reason
    try:
        _trace_kernel(config, batch, cache, num_steps, target, unit_cols)
    except ValueError as e:
        return _first_line(e)
    return None


def _first_line(error: ValueError) -> str:
    """A refusal's first line: the sentence that says why."""
    return str(error).strip().splitlines()[0]


def _trace_kernel(config, batch, cache, num_steps, target: Target, unit_cols) -> None:
    """Traces `pack_weights` and `fused_core_decode` on abstract arguments of this case's
    shapes: the kernel's checks raise ValueError for what it cannot run."""
    from pallas_kernels.core_step.fused_step import fused_core_decode

    dtype = cache.k.dtype
    packed = _abstract_packed(config, batch, dtype, unit_cols)
    decode = functools.partial(
        fused_core_decode,
        iterations=num_steps,
        workers=target.workers,
        schedule=target.schedule,
        interpret=target.interpret,
    )
    row = jax.ShapeDtypeStruct((batch, config.n_embd), dtype)
    slots = jax.ShapeDtypeStruct((num_steps, config.n_core), jnp.int32)
    pos = jax.ShapeDtypeStruct((), jnp.int32)
    jax.eval_shape(decode, packed, Pending(row), row, cache.k, cache.v, slots, pos)
