"""`experiments.core --mesh=model:N`: the Core split over N devices (huginn_jax.parallel).

The XLA impls whose kernels XLA can partition (xla, xla_split, xla_cudnn) run on the mesh with
the Core's weights and KV cache split by heads and MLP columns; the Pallas impls and the
PyTorch rows run on one device and are left out of a --mesh run with a note. Each record then
carries `model_shards` and the cost model's all-reduces of one iteration
(huginn_jax.comm_costs: count and bytes; timing them needs experiments.allreduce's fit).
"""

from __future__ import annotations

import dataclasses

from absl import flags
from flax import nnx

from experiments.cli import UserError
from experiments.torch_ref.core_runner import TORCH_IMPLS  # imports no torch
from huginn_jax import comm_costs, parallel

FLAGS = flags.FLAGS
SINGLE_DEVICE_IMPLS = ("xla_pallas", "xla_row_gemv", "xla_mgpu", "persistent", *TORCH_IMPLS)


def define_flag() -> None:
    flags.DEFINE_string(
        "mesh",
        "",
        "Tensor parallelism: model:N splits the Core's heads and MLP columns over N devices "
        "(xla, xla_split, xla_cudnn only; the other impls are skipped); '' = one device.",
    )


def shards_from_flag() -> int:
    """N of --mesh=model:N (1 without --mesh); UserError for another axis or a bad string."""
    return shards_of(FLAGS.mesh)


def shards_of(spec: str) -> int:
    """N of the mesh string "model:N" (1 for ''); UserError for another axis or a bad string."""
    if not spec:
        return 1
    try:
        sizes = parallel.parse_mesh_spec(spec)
    except ValueError as e:
        raise UserError(f"--mesh: {e}") from None
    if set(sizes) != {parallel.MODEL_AXIS}:
        raise UserError(f"--mesh={spec}: the Core splits over a 'model' axis only")
    return sizes[parallel.MODEL_AXIS]


def runnable_on_mesh(impls: list[str]) -> list[str]:
    """`impls` less the single-device ones when --mesh is given, with a note line for them."""
    if not FLAGS.mesh:
        return impls
    skipped = [i for i in impls if i in SINGLE_DEVICE_IMPLS]
    if skipped:
        print(f"note: {', '.join(skipped)} run(s) on one device; skipped with --mesh={FLAGS.mesh}")
    return [i for i in impls if i not in skipped]


def shard_core(cfg, graphdef, params):
    """(cfg, graphdef, params) of the Core split over --mesh (unchanged without it); UserError
    when fewer devices are present than the mesh needs."""
    if not FLAGS.mesh:
        return cfg, graphdef, params
    try:
        mesh = parallel.make_mesh({parallel.MODEL_AXIS: shards_from_flag()})
    except ValueError as e:
        raise UserError(f"--mesh: {e}") from None
    core = parallel.shard_model(nnx.merge(graphdef, params), mesh)
    graphdef, params = nnx.split(core)
    return core.config, graphdef, params


def comm_record(cfg, case, dtype_bytes: int) -> dict:
    """`model_shards` and the all-reduces of one Core iteration of `case` (empty on one device)."""
    if cfg.mesh is None:
        return {}
    comm = comm_costs.core_iteration_comm(
        cfg,
        batch=case.batch,
        context=case.context,
        mode=case.mode,
        devices=cfg.model_shards,
        dtype_bytes=dtype_bytes,
    )
    return {"model_shards": cfg.model_shards, "comm": dataclasses.asdict(comm)}
