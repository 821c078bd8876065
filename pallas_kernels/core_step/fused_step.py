"""The fused Core decode kernel's inputs and outputs in the model's terms.

`pack_weights` pads and packs a Core's weights once (bf16 products in the kernel's padded
shapes, the norm gains as per-product gain tiles, the qk bias); `fused_core_decode` runs
`iterations` Core iterations at one position from a state and the embedded token, over each
(iteration, layer)'s cache slot, and returns the state (pending its last norm, as
`step_program.Pending`) and the new k and v rows per (iteration, layer), which
`write_new_rows` puts into the cache. The adapter's embedded half e @ Wa[D:] is the same in every
iteration of a token: it is one product here, before the kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.core_step.fused import build_fused_core
from pallas_kernels.core_step.fused_plan import (
    DEFAULT_SCHEDULE,
    DEFAULT_UNIT_COLS,
    N_PAD,
    Buffers,
    FusedShape,
    Schedule,
)
from pallas_kernels.core_step.plan import UNIT
from pallas_kernels.core_step.step_program import LayerWeights, Pending, StepWeights, rope_row


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FusedWeights:
    """A Core's weights as the kernel reads them (`pack_weights`)."""

    products: tuple[jax.Array, ...]  # per kind of product (`fused_plan.PRODUCT_KINDS`), the
    # layers' [n / cols, k, cols] bf16 (`tile_columns`) stacked, zero-padded, gains folded in;
    # the adapter's Wa[:D] twice: norm_4 folded in, then as it is (the first iteration's)
    embedded_half: jax.Array  # Wa[D:] [D, D], the adapter's embedded rows
    gains: jax.Array  # [L, k_d, 8] f32: per layer, norm_4 of the layer before (1), norm_2
    qk_bias: jax.Array  # [L, 2, D] f32 (zeros without a bias)
    last_norm: jax.Array  # [D]: norm_4 of the last layer, pending on the returned state
    shape: FusedShape = dataclasses.field(metadata=dict(static=True))
    eps: float = dataclasses.field(metadata=dict(static=True))
    rope_base: float = dataclasses.field(metadata=dict(static=True))


def _pad2(x, rows: int, cols: int, dtype=jnp.bfloat16):
    return jnp.pad(x, ((0, rows - x.shape[0]), (0, cols - x.shape[1]))).astype(dtype)


def core_shape(
    w: StepWeights, *, heads: int, batch: int, unit_cols: int = DEFAULT_UNIT_COLS
) -> FusedShape:
    """The kernel's shapes for the Core of `w` (arrays, or their shapes from `jax.eval_shape`)
    run on `batch` sequences: D from the adapter, the MLP width from the mlp proj. ValueError
    for shapes the kernel refuses (`FusedShape`)."""
    d, intermediate = w.adapter.shape[1], w.layers[0].mlp_proj.shape[0]
    return FusedShape(d, heads, w.head_dim, intermediate, len(w.layers), batch, unit_cols)


def interleave_halves(x: jax.Array) -> jax.Array:
    """[..., 2 k] of two halves [a | b] -> [a_0 b_0 a_1 b_1 ...] by chunks of 64 columns: the fc
    output's rows [128 c, 128 c + 128) are then the MLP proj's input chunk c (the gate's, then
    the up half's), one copy."""
    *lead, n = x.shape
    chunks = x.reshape(*lead, 2, n // (2 * UNIT), UNIT)
    return jnp.swapaxes(chunks, -3, -2).reshape(*lead, n)


def pack_weights(
    w: StepWeights, *, heads: int, batch: int, rope_base: float, unit_cols: int = DEFAULT_UNIT_COLS
) -> FusedWeights:
    """Pads every product to the kernel's shapes with the norms' gains folded into its rows
    (rms_norm(z, g) @ W = (z @ (g W)) rsqrt(mean(z²) + eps)): the adapter's state rows by the
    last layer's norm_4 (and once as they are, for the first iteration), qkv by norm_4 of the
    layer before and norm_1, fc by norm_2 and norm_3. Per layer, the gain tile holds what the
    kernel still multiplies by: norm_4 of the layer before (ones for layer 0) and norm_2, for the
    sums of squares and the residuals."""
    shape = core_shape(w, heads=heads, batch=batch, unit_cols=unit_cols)
    d = shape.d
    phases = iter(shape.phases)
    ones = jnp.ones((d,), jnp.float32)
    adapter = w.adapter[:d].astype(jnp.float32)
    kn = _kn(next(phases))
    cols = shape.unit_cols
    adapters = [_pad2(w.layers[-1].norm_4[:, None] * adapter, *kn), _pad2(adapter, *kn)]
    per_layer, tiles = [], []
    for j, lw in enumerate(w.layers):
        g4_prev = ones if j == 0 else w.layers[j - 1].norm_4
        fc = interleave_halves(
            jnp.concatenate(
                [_pad2(half, d, shape.k_i, jnp.float32) for half in jnp.split(lw.fc, 2, axis=1)],
                axis=1,
            )
        )
        folded = (
            (g4_prev * lw.norm_1)[:, None] * lw.wqkv,
            lw.proj,
            (lw.norm_2 * lw.norm_3)[:, None] * fc,
            lw.mlp_proj,
        )
        per_layer.append([tile_columns(_pad2(x, *_kn(next(phases))), cols) for x in folded])
        tiles.append(jnp.stack([g4_prev, lw.norm_2], axis=-1))
    gains = jnp.stack(tiles).astype(jnp.float32)
    gains = jnp.pad(gains, ((0, 0), (0, shape.k_d - d), (0, N_PAD - 2)))
    bias = [
        jnp.zeros((2, d)) if lw.qk_bias is None else lw.qk_bias.reshape(2, d) for lw in w.layers
    ]
    products = [jnp.stack([tile_columns(x, cols) for x in adapters])]
    products += [jnp.stack(kind) for kind in zip(*per_layer, strict=True)]
    return FusedWeights(
        products=tuple(products),
        embedded_half=w.adapter[d:],
        gains=gains,
        qk_bias=jnp.stack(bias).astype(jnp.float32),
        last_norm=w.layers[-1].norm_4,
        shape=shape,
        eps=w.eps,
        rope_base=rope_base,
    )


def _kn(phase):
    return phase.k, phase.n


def tile_columns(w: jax.Array, cols: int) -> jax.Array:
    """[k, n] -> [n / cols, k, cols]: each tile of `cols` columns contiguous, so that every
    [64, cols] weight unit, and a worker's run of units down a tile, is one contiguous read."""
    k, n = w.shape
    return w.reshape(k, n // cols, cols).transpose(1, 0, 2)


def rope_tables(pos, head_dim: int, d: int, base: float) -> jax.Array:
    """[3, d] per column c of a head section: cos, -sin on even c (paired with c + 1) and sin on
    odd c (paired with c - 1), the angle of pair (c mod head_dim) // 2 at `pos`."""
    cos, sin = rope_row(pos, head_dim, base)
    pair = (jnp.arange(d) % head_dim) // 2
    even = jnp.arange(d) % 2 == 0
    c, s = cos[pair], sin[pair]
    return jnp.stack([c, jnp.where(even, -s, 0.0), jnp.where(even, 0.0, s)])


def _rope_columns(x, tables):
    """RoPE of x [..., d] by the tables (the model's pairs)."""
    up = jnp.concatenate([x[..., 1:], jnp.zeros_like(x[..., :1])], axis=-1)
    down = jnp.concatenate([jnp.zeros_like(x[..., :1]), x[..., :-1]], axis=-1)
    return x * tables[0] + up * tables[1] + down * tables[2]


def kernel_arguments(
    fw: FusedWeights,
    state: Pending,
    embedded: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    slots: jax.Array,
    pos,
) -> tuple[jax.Array, ...]:
    """The arguments of `fused.build_fused_core`'s kernel for `fused_core_decode`'s inputs: the
    position and slots, the state and e @ Wa[D:] as [k_d, 8] f32 columns, the gain tiles, RoPE's
    tables and its rotated qk bias per column, the caches with their heads flattened, the
    packed products. ValueError for a state with a gain, or another batch than the packed one."""
    if state.gain is not None:
        raise ValueError("the kernel starts from a state value (Pending with gain None)")
    shape = fw.shape
    d, kd, b = shape.d, shape.k_d, state.z.shape[0]
    if b != shape.batch:
        raise ValueError(f"batch {b} != the packed batch {shape.batch}")
    f32 = jnp.float32

    def columns(x, rows):  # [B, n] -> [rows, 8] f32
        return jnp.pad(x.astype(f32).T, ((0, rows - x.shape[1]), (0, N_PAD - b)))

    # bf16 out, as the model's adapter: XLA's GEMV for bf16 in and f32 out converts the whole
    # weight to f32 first (twice its bytes written, then read)
    e_part = jnp.dot(embedded.astype(jnp.bfloat16), fw.embedded_half.astype(jnp.bfloat16))
    tables = rope_tables(pos, shape.head_dim, d, fw.rope_base)
    rope_bias = _rope_columns(fw.qk_bias, tables)  # linear: rope(q s + b) = s rope(q) + rope(b)

    def per_column(x):  # [..., d] -> [..., table_rows, 8]: the last key window's rows past d
        x = jnp.pad(x.astype(f32), [(0, 0)] * (x.ndim - 1) + [(0, shape.table_rows - d)])
        return jnp.broadcast_to(x[..., None], (*x.shape, N_PAD))

    meta = jnp.concatenate([jnp.asarray(pos, jnp.int32)[None], slots.reshape(-1).astype(jnp.int32)])
    flat = (k_cache.shape[0], b, k_cache.shape[2], d)
    return (
        meta,
        columns(state.z, kd),
        columns(e_part, kd),
        fw.gains,
        per_column(tables),
        per_column(rope_bias),
        k_cache.reshape(flat),
        v_cache.reshape(flat),
        *fw.products,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "iterations",
        "workers",
        "schedule",
        "interpret",
        "profile_dir",
        "skip_barriers",
    ),
)
def fused_core_decode(
    fw: FusedWeights,
    state: Pending,
    embedded: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    slots: jax.Array,
    pos,
    *,
    iterations: int,
    workers: int,
    schedule: Schedule = DEFAULT_SCHEDULE,
    interpret: Any = None,
    profile_dir: str = "",
    skip_barriers: tuple[str, ...] = (),
) -> tuple[Pending, jax.Array, jax.Array]:
    """`iterations` Core iterations at position `pos`. state: Pending with gain None (the value
    [B, D]); embedded [B, D]; k_cache, v_cache [slots, B, S, H, K] (S a multiple of the
    schedule's kv_block); slots [iterations, L] int32: each (iteration, layer)'s cache slot.
    Returns (Pending state, k_new, v_new [iterations, L, B, H, K] in the cache's dtype).
    `skip_barriers`: a timing bound whose results are wrong (`fused.build_fused_core`)."""
    shape = fw.shape
    s_len = k_cache.shape[2]
    if s_len % schedule.kv_block:
        raise ValueError(
            f"cache slots hold {s_len} positions: must be a multiple of the schedule's blocks "
            f"({schedule.kv_block})"
        )
    kernel = build_fused_core(
        shape, iterations, workers=workers, eps=fw.eps, schedule=schedule, interpret=interpret,
        profile_dir=profile_dir, skip_barriers=skip_barriers,
    )  # fmt: skip
    arguments = kernel_arguments(fw, state, embedded, k_cache, v_cache, slots, pos)
    act, _, _, kv_new = kernel(*arguments)
    d, b = shape.d, shape.batch
    last = (iterations - 1) % act.shape[0]  # the last iteration's buffers
    z = act[last, Buffers.of("m", shape.layers - 1), :d, :b].T  # the last mlp output + residual
    # kv_new [it, L, 2, H, 8, kp] bf16 -> the head's columns (k of its key window, v of its
    # value window) of the batch's rows -> [2, it, L, B, H, K]
    pairs = bool(schedule.head_pairs)
    cols = np.stack([
        [np.arange(shape.head_dim) + window(h)[1] for h in range(shape.heads)]
        for window in (shape.key_window, lambda h: shape.value_window(h, pairs))
    ])  # fmt: skip
    picked = jnp.take_along_axis(kv_new[..., :b, :], cols[None, None, :, :, None, :], axis=5)
    new = picked.transpose(2, 0, 1, 4, 3, 5)
    return Pending(z, fw.last_norm), new[0].astype(k_cache.dtype), new[1].astype(v_cache.dtype)


def lowered_for_hopper(shape: FusedShape, iterations: int, positions: int, **kernel_options):
    """`build_fused_core(shape, iterations, ...)` lowered for sm_90 on abstract inputs of its
    shapes (no GPU needed), each (iteration, layer) a cache slot of `positions`: a
    `jax.stages.Lowered` whose text holds the kernel's Mosaic GPU module."""
    f = build_fused_core(shape, iterations, eps=1e-6, **kernel_options)
    sd, f32, slots = jax.ShapeDtypeStruct, jnp.float32, iterations * shape.layers
    cache = sd((slots, shape.batch, positions, shape.d), jnp.bfloat16)
    args = [
        sd((1 + slots,), jnp.int32), sd((shape.k_d, N_PAD), f32), sd((shape.k_d, N_PAD), f32),
        sd((shape.layers, shape.k_d, N_PAD), f32), sd((3, shape.table_rows, N_PAD), f32),
        sd((shape.layers, 2, shape.table_rows, N_PAD), f32), cache, cache,
        *(sd(w, jnp.bfloat16) for w in shape.weight_shapes()),
    ]  # fmt: skip
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


def write_new_rows(k_cache, v_cache, slots, pos, k_new, v_new):
    """The caches with each (iteration, layer)'s new row written at `pos` of its slot."""
    flat = slots.reshape(-1)
    k_cache = k_cache.at[flat, :, pos].set(k_new.reshape(-1, *k_new.shape[2:]))
    v_cache = v_cache.at[flat, :, pos].set(v_new.reshape(-1, *v_new.shape[2:]))
    return k_cache, v_cache


@functools.partial(jax.jit, static_argnums=1)
def _bf16_normal(key, shape: tuple[int, int]) -> jax.Array:
    """normal / sqrt(k) of `shape` [k, n] in bf16, compiled once per shape: no float32 copy of
    the matrix outlives the call."""
    return (jax.random.normal(key, shape) / shape[0] ** 0.5).astype(jnp.bfloat16)


def random_step_weights(d: int, heads: int, f: int, layers: int, seed: int = 5) -> StepWeights:
    """A Core of random weights for tests and measurements: bf16 products (normal / sqrt(k),
    as the model stores them: a float32 reference multiplies them exactly), float32 norm gains
    1 + 0.3 N (not 1, so that a misplaced gain shows), qk bias 0.5 N."""
    keys = iter(jax.random.split(jax.random.key(seed), 16 * layers + 1))

    def matrix(k, n):
        return _bf16_normal(next(keys), (k, n))

    def gain():
        return 1 + 0.3 * jax.random.normal(next(keys), (d,))

    layer = []
    for _ in range(layers):
        layer.append(
            LayerWeights(
                norm_1=gain(),
                wqkv=matrix(d, 3 * d),
                qk_bias=0.5 * jax.random.normal(next(keys), (2, 1, heads, d // heads)),
                proj=matrix(d, d),
                norm_2=gain(),
                norm_3=gain(),
                fc=matrix(d, 2 * f),
                mlp_proj=matrix(f, d),
                norm_4=gain(),
            )  # fmt: skip
        )
    return StepWeights(matrix(2 * d, d), tuple(layer), head_dim=d // heads, eps=1e-6)
