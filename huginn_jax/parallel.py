"""Tensor parallelism over a mesh's "model" axis: Huginn's layers split Megatron-style.

Every sandwich block (prelude, Core, coda) is split across the N devices of the "model" axis:

    Wqkv [D, 3·H·K]   columns: device i holds q, k and v of its own heads     P(None, "model")
    qk_bias [2,1,H,K] heads                                                   P(.., "model", ..)
    attn.proj [H·K, D] rows of those heads (a partial sum per device)         P("model", None)
    mlp.fc [D, 2·F]   columns: device i holds its slice of the gate and of up P(None, "model")
    mlp.proj [F, D]   rows of that slice (a partial sum per device)           P("model", None)
    KV cache [L, B, S, H, K]  heads                                           P(.., "model", ..)

so attention and the MLP run on local heads and columns, and the two output projections end in
one all-reduce each (2 per block; XLA inserts them where the partial sums meet the replicated
residual stream). The adapter, the norms and the tied embedding / head stay replicated: the
adapter is about 3 % of a huginn-0125 Core iteration's weights, and splitting it would add a
third all-reduce per iteration; the head is read once per token (not per iteration), and a
vocab-split head would add all-reduces to every softmax of sampling and of the exit criteria.

A plain column split of the checkpoint's fused weights would hand device 0 the q of every head
and no k or v: the columns are [q heads | k heads | v heads] and [gate | up]. Under a mesh the
layers therefore hold them device-major ([dev 0: q, k, v of its heads | dev 1: ...], likewise
[dev 0: gate, up | ...]): `group_qkv` and `group_gate_up` lay them out, the layers read them
back the same way, and without a mesh (N = 1) both are the checkpoint's own order.

Heads that do not divide by N (huginn-0125: 55) are padded with zero-weight heads up to a
multiple of N (likewise the MLP width). A zero head has q = k = v = 0 and its rows of attn.proj
are zero, so it adds exactly 0 to the output; `layout_cost` counts what the padding costs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from huginn_jax.config import HuginnConfig

MODEL_AXIS = "model"
DATA_AXIS = "data"
AXES = (DATA_AXIS, MODEL_AXIS)


def parse_mesh_spec(spec: str) -> dict[str, int]:
    """ "model:2" or "data:2,model:2" -> {axis: size}; ValueError for a bad string."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, size = part.partition(":")
        if name not in AXES or not size.isdigit() or int(size) < 1 or name in sizes:
            raise ValueError(
                f"mesh {spec!r}: expected AXIS:SIZE[,AXIS:SIZE] with AXIS in {AXES} (once "
                "each) and SIZE >= 1, e.g. 'model:2'"
            )
        sizes[name] = int(size)
    if not sizes:
        raise ValueError(f"mesh {spec!r}: no axis given, e.g. 'model:2'")
    return sizes


def make_mesh(spec: str | dict[str, int], devices=None) -> Mesh:
    """A mesh over the first prod(sizes) of `devices` (default jax.devices()), axes in the
    order given. ValueError when there are fewer devices than the mesh needs."""
    sizes = parse_mesh_spec(spec) if isinstance(spec, str) else dict(spec)
    devices = jax.devices() if devices is None else list(devices)
    needed = int(np.prod(list(sizes.values())))
    if needed > len(devices):
        raise ValueError(f"mesh {sizes} needs {needed} devices; {len(devices)} present")
    grid = np.array(devices[:needed]).reshape(tuple(sizes.values()))
    return Mesh(grid, tuple(sizes))


# --- The layout: checkpoint order <-> device-major groups, padded -------------------------------


def _pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    """x zero-padded along `axis` to `size`; a numpy array stays on the host (the layout
    functions below reshape and transpose either kind)."""
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return np.pad(x, pad) if isinstance(x, np.ndarray) else jnp.pad(x, pad)


def group_qkv(kernel_Dx3HK: jax.Array, cfg: HuginnConfig) -> jax.Array:
    """Wqkv from the checkpoint's [q heads | k heads | v heads] to the config's layout
    [D, 3·Hp·K]: heads padded to Hp = cfg.attention_heads, grouped per device."""
    if cfg.model_shards == 1:
        return kernel_Dx3HK
    d, g, h, hp, k = cfg.n_embd, cfg.model_shards, cfg.n_heads, cfg.attention_heads, cfg.head_dim
    x = _pad_axis(kernel_Dx3HK.reshape(d, 3, h, k), 2, hp)
    return x.reshape(d, 3, g, hp // g, k).transpose(0, 2, 1, 3, 4).reshape(d, 3 * hp * k)


def ungroup_qkv(kernel: jax.Array, cfg: HuginnConfig) -> jax.Array:
    """The inverse of `group_qkv`: [D, 3·H·K] in the checkpoint's order."""
    if cfg.model_shards == 1:
        return kernel
    d, g, h, hp, k = cfg.n_embd, cfg.model_shards, cfg.n_heads, cfg.attention_heads, cfg.head_dim
    x = kernel.reshape(d, g, 3, hp // g, k).transpose(0, 2, 1, 3, 4).reshape(d, 3, hp, k)
    return x[:, :, :h].reshape(d, 3 * h * k)


def group_gate_up(kernel_Dx2F: jax.Array, cfg: HuginnConfig) -> jax.Array:
    """mlp.fc from [gate | up] to the config's layout [D, 2·Fp]: columns padded to
    Fp = cfg.mlp_width, each device's gate and up slices side by side."""
    if cfg.model_shards == 1:
        return kernel_Dx2F
    d, g, f, fp = cfg.n_embd, cfg.model_shards, cfg.intermediate_size, cfg.mlp_width
    x = _pad_axis(kernel_Dx2F.reshape(d, 2, f), 2, fp)
    return x.reshape(d, 2, g, fp // g).transpose(0, 2, 1, 3).reshape(d, 2 * fp)


def ungroup_gate_up(kernel: jax.Array, cfg: HuginnConfig) -> jax.Array:
    """The inverse of `group_gate_up`: [D, 2·F] as [gate | up]."""
    if cfg.model_shards == 1:
        return kernel
    d, g, f, fp = cfg.n_embd, cfg.model_shards, cfg.intermediate_size, cfg.mlp_width
    x = kernel.reshape(d, g, 2, fp // g).transpose(0, 2, 1, 3).reshape(d, 2, fp)
    return x[:, :, :f].reshape(d, 2 * f)


def pad_head_rows(kernel_HKxD: jax.Array, cfg: HuginnConfig) -> jax.Array:
    """attn.proj [H·K, D] -> [Hp·K, D] with zero rows for the padded heads."""
    return _pad_axis(kernel_HKxD, 0, cfg.attention_heads * cfg.head_dim)


def pad_qk_bias(bias_2x1xHxK: jax.Array, cfg: HuginnConfig) -> jax.Array:
    return _pad_axis(bias_2x1xHxK, 2, cfg.attention_heads)


def pad_mlp_rows(kernel_FxD: jax.Array, cfg: HuginnConfig) -> jax.Array:
    """mlp.proj [F, D] -> [Fp, D] with zero rows for the padded columns."""
    return _pad_axis(kernel_FxD, 0, cfg.mlp_width)


# The split parameters, by the end of their path in the model state: (to the config's layout,
# back to the checkpoint's, partition spec). Every other parameter is replicated.
_SPLIT = {
    ("attn", "Wqkv", "kernel"): (group_qkv, ungroup_qkv, P(None, MODEL_AXIS)),
    ("attn", "qk_bias"): (
        pad_qk_bias,
        lambda x, cfg: x[:, :, : cfg.n_heads],
        P(None, None, MODEL_AXIS, None),
    ),
    ("attn", "proj", "kernel"): (
        pad_head_rows,
        lambda x, cfg: x[: cfg.n_heads * cfg.head_dim],
        P(MODEL_AXIS, None),
    ),
    ("mlp", "fc", "kernel"): (group_gate_up, ungroup_gate_up, P(None, MODEL_AXIS)),
    ("mlp", "proj", "kernel"): (
        pad_mlp_rows,
        lambda x, cfg: x[: cfg.intermediate_size],
        P(MODEL_AXIS, None),
    ),
}


def _rule(path: tuple) -> tuple | None:
    names = tuple(str(getattr(p, "key", p)) for p in path)
    for suffix, rule in _SPLIT.items():
        if names[-len(suffix) :] == suffix:
            return rule
    return None


def param_spec(path: tuple) -> P:
    """The partition spec of the parameter at `path` (a tuple of state keys)."""
    rule = _rule(path)
    return P() if rule is None else rule[2]


# --- Placing a model and its cache on a mesh -----------------------------------------------------


def place_param(path: tuple, x, config: HuginnConfig) -> jax.Array:
    """One parameter in the checkpoint's layout (at `path` in the model state) laid out for
    `config` and placed: split per `param_spec` over config.mesh, or on the default device
    without a mesh. A numpy `x` is laid out on the host and each device receives only its
    slice, so a checkpoint loads tensor by tensor without any device holding the whole model."""
    if config.mesh is None:
        return jax.device_put(x)
    rule = _rule(path)
    if rule is not None:
        x = rule[0](x, config)
    return jax.device_put(x, NamedSharding(config.mesh, param_spec(path)))


def _relayout(model, config: HuginnConfig, convert, sharding):
    """`model`'s parameters converted leaf by leaf (convert(rule, x) with the leaf's _SPLIT rule
    or None) in one compiled call where the parameters are, then placed by sharding(path) and
    merged under `config` (a Huginn or a Core)."""
    state = nnx.state(model)
    dtype = jax.tree.leaves(state)[0].dtype
    abstract = nnx.eval_shape(lambda: type(model)(config, rngs=nnx.Rngs(0), dtype=dtype))
    graphdef, target = nnx.split(abstract)
    values = jax.jit(
        lambda tree: jax.tree_util.tree_map_with_path(lambda path, x: convert(_rule(path), x), tree)
    )(nnx.to_pure_dict(state))
    shardings = jax.tree_util.tree_map_with_path(lambda path, _: sharding(path), values)
    nnx.replace_by_pure_dict(target, jax.device_put(values, shardings))
    return nnx.merge(graphdef, target)


def shard_model(model, mesh: Mesh):
    """`model` (a Huginn or a Core on one device, without a mesh) laid out and placed on `mesh`:
    split parameters per `param_spec`, the rest replicated. The model's config gets the mesh, so
    its calls, its caches (KVCache.create) and generation run on the mesh unchanged."""
    if model.config.mesh is not None:
        raise ValueError("the model is already on a mesh (gather_model brings it back)")
    config = dataclasses.replace(model.config, mesh=mesh)
    return _relayout(
        model,
        config,
        lambda rule, x: x if rule is None else rule[0](x, config),
        lambda path: NamedSharding(mesh, param_spec(path)),
    )


def gather_model(model, device=None):
    """The inverse of `shard_model`: one device's model in the checkpoint's layout."""
    cfg = model.config
    if cfg.mesh is None:
        return model
    device = device or jax.devices()[0]
    return _relayout(
        model,
        dataclasses.replace(cfg, mesh=None),
        lambda rule, x: x if rule is None else rule[1](x, cfg),
        lambda path: jax.sharding.SingleDeviceSharding(device),
    )


def kv_cache_sharding(config: HuginnConfig) -> NamedSharding | None:
    """The KV cache [L, B, S, Hp, K] split by heads over "model" (None without a mesh)."""
    if config.mesh is None:
        return None
    return NamedSharding(config.mesh, P(None, None, None, MODEL_AXIS, None))


def constrain(x: jax.Array, config: HuginnConfig, *trailing) -> jax.Array:
    """x with its last len(trailing) axes sharded as `trailing` on the config's mesh (the
    leading ones, batch and positions, left to XLA); x itself without a mesh.

    The layers pin the two points of the Megatron layout: heads on "model" after the qkv split,
    and the residual stream whole (not split over "model") after each output projection, so the
    partial sums end in an all-reduce, never in a split of the residual stream."""
    if config.mesh is None:
        return x
    spec = P(*(P.UNCONSTRAINED,) * (x.ndim - len(trailing)), *trailing)
    return jax.lax.with_sharding_constraint(x, NamedSharding(config.mesh, spec))


# --- What the layout costs -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayoutCost:
    """The split of one model over `shards` devices, per device (bytes in the weights' dtype,
    FLOPs of the matmuls per position; a multiply-add counts 2)."""

    shards: int
    heads: int
    padded_heads: int
    mlp_width: int
    padded_mlp_width: int
    block_bytes: int  # one sandwich block: its slices (padding included) + its replicated norms
    block_padding_bytes: int  # of those, the zero-padded heads and MLP columns
    block_flops: int  # one block's matmuls, one position, padding included
    block_padding_flops: int  # of those, on padded heads and columns
    adapter_bytes: int  # replicated: read whole by every device at every Core iteration
    core_bytes: int  # what one Core iteration reads: the adapter + the Core blocks
    core_bytes_one_device: int  # the same on one device, without padding
    embedding_bytes: int  # wte (and an untied head), replicated

    @property
    def core_ratio(self) -> float:
        """Per-device Core bytes against one device's (ideal: 1 / shards)."""
        return self.core_bytes / self.core_bytes_one_device

    @property
    def attention_padding(self) -> float:
        """Extra fraction of KV cache bytes and attention FLOPs from the padded heads."""
        return self.padded_heads / self.heads - 1


def layout_cost(config: HuginnConfig, shards: int, dtype_bytes: int = 2) -> LayoutCost:
    """What `shard_model` costs on each of `shards` devices for `config`'s shape: the padding
    (whole zero heads up to a multiple of `shards`, likewise MLP columns) and the replicated
    adapter, norms and embedding. Pure arithmetic; no device needed."""
    if shards < 1:
        raise ValueError(f"shards={shards} must be >= 1")
    d, k, h, f = config.n_embd, config.head_dim, config.n_heads, config.intermediate_size
    hp, fp = -(-h // shards) * shards, -(-f // shards) * shards

    def split_params(heads: int, width: int) -> int:
        """Parameters of a block's split matrices with `heads` heads and `width` MLP columns."""
        qk_bias = 2 * heads * k if config.qk_bias else 0
        return 4 * d * heads * k + qk_bias + 3 * d * width

    def matmul_flops(heads: int, width: int) -> int:
        return 2 * (4 * d * heads * k + 3 * d * width)

    norms = 4 * d * dtype_bytes
    block = split_params(hp, fp) * dtype_bytes // shards + norms
    padding = (split_params(hp, fp) - split_params(h, f)) * dtype_bytes // shards
    adapter = 2 * d * d * dtype_bytes
    one_block = split_params(h, f) * dtype_bytes + norms
    vocab = config.vocab_size * d * dtype_bytes * (1 if config.tie_embeddings else 2)
    return LayoutCost(
        shards=shards,
        heads=h,
        padded_heads=hp,
        mlp_width=f,
        padded_mlp_width=fp,
        block_bytes=block,
        block_padding_bytes=padding,
        block_flops=matmul_flops(hp, fp) // shards,
        block_padding_flops=(matmul_flops(hp, fp) - matmul_flops(h, f)) // shards,
        adapter_bytes=adapter,
        core_bytes=adapter + config.n_core * block,
        core_bytes_one_device=adapter + config.n_core * one_block,
        embedding_bytes=vocab,
    )


# --- Data parallelism (training) ------------------------------------------------------------------


def data_shards(mesh: Mesh | None) -> int:
    """Devices along the mesh's "data" axis (1 without a mesh or without that axis)."""
    return 1 if mesh is None else int(dict(mesh.shape).get(DATA_AXIS, 1))


def replicate(tree, mesh: Mesh):
    """Every array of `tree` whole on every device of `mesh` (parameters, optimizer state)."""
    return jax.device_put(tree, NamedSharding(mesh, P()))


def split_batch(tree, mesh: Mesh | None):
    """Inside a jitted step: every array of `tree` split along its leading (batch) axis over the
    mesh's "data" axis, so each device computes its slice and XLA all-reduces the gradients of
    the replicated parameters. `tree` itself without a "data" axis."""
    if data_shards(mesh) == 1:
        return tree
    return jax.lax.with_sharding_constraint(tree, NamedSharding(mesh, P(DATA_AXIS)))
