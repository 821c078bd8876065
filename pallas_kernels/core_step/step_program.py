"""One Core decode iteration as the steps a persistent kernel runs between grid barriers.

The plain-JAX specification of the fused Core step: batch B, one new position `pos`, each layer
attending over its own cache slot [B, S, H, K]. A step is a row-local prologue on complete
vectors (it may use per-row scalars that earlier steps reduced), then one product with the
step's weight, split over k by the workers and reduce-added, with the sums of squares of its
input reduced beside it. A grid barrier ends every step; what crosses it are vectors (products'
outputs, residuals) and per-row scalars (sums of squares), [B, n] and [B, 1].

Deferred norms: rms_norm(z, g) @ W = ((z g) @ W) rsqrt(mean(z²) + eps), so a product takes z g
and its output is scaled after the barrier, once mean(z²), reduced beside it, is complete. The
sandwich block norms its residual stream (x1 = norm_2(x + attn), x' = norm_4(x1 + mlp)) and then
norms it again (norm_3, the next layer's norm_1): norm_b(norm_a(z)) = z a b ra rb with
ra = rsqrt(Σz² / D + eps), rb = rsqrt(Σ(z a)² ra² / D + eps), two sums of squares of one z.

Steps of an iteration of L layers (`step_names`; each ends at a barrier):

    adapter        (z g4) @ Wa[:D], beside Σz²: the state norm_4(z), not yet normed. The first
                   iteration also streams Wa[D:] (e @ Wa[D:] is the same in every iteration)
    qkv_j          x = norm_4(z), z = x1 + m of layer j - 1 (layer 0: x = a + e @ Wa[D:]);
                   (z g4 g1) @ Wqkv, beside Σz², Σ(z g4)²
    attn_proj_j    q, k, v scaled, + qk_bias, RoPE; k, v written at pos; each head attends over
                   [0, pos]; o = Σ_h out_h @ Wproj[rows of head h]: split-K by head, no barrier
                   between the attention and the product
    fc_j           h1 = x + o; (h1 g2 g3) @ Wfc, beside Σh1², Σ(h1 g2)²
    mlp_proj_j     x1 = norm_2(h1); silu(gate) * up of the scaled fc output; @ Wmlp

1 + 4 L barriers (17 for huginn-0125): one per product, as the weight stream (`plan.py`). The
workers of a head compute its whole attention there. With `kv_splits` (split-KV: each head's
positions in blocks, one per worker) the attention is a step of its own, `attn_j`, whose partial
softmax (max, sum per row and head; the weighted values [K]) crosses one more barrier before
`proj_j` combines them: 1 + 5 L barriers (21).
"""

from __future__ import annotations

import dataclasses
import types
from typing import NamedTuple

import jax
import jax.numpy as jnp

MASKED_SCORE = -1e30  # the model's: finite, so a fully masked block cannot produce NaN


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerWeights:
    """One sandwich block in the model's layout (weights [in, out])."""

    norm_1: jax.Array  # [D]
    wqkv: jax.Array  # [D, 3 D]: [q | k | v], each H heads of K
    qk_bias: jax.Array | None  # [2, 1, H, K]: added to q and k before RoPE; None: no bias
    proj: jax.Array  # [D, D]
    norm_2: jax.Array
    norm_3: jax.Array
    fc: jax.Array  # [D, 2 F]: [gate | up]
    mlp_proj: jax.Array  # [F, D]
    norm_4: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepWeights:
    """The adapter [2 D, D] (rows: state, then embedded) and the Core layers."""

    adapter: jax.Array
    layers: tuple[LayerWeights, ...]
    head_dim: int = dataclasses.field(metadata=dict(static=True))
    eps: float = dataclasses.field(metadata=dict(static=True))


class Pending(NamedTuple):
    """A state not yet normed: norm_gain(z) = z gain rsqrt(mean(z²) + eps); gain None: z itself
    (the initial state). The iteration's input and output."""

    z: jax.Array  # [B, D]
    gain: jax.Array | None = None

    def value(self, eps: float) -> jax.Array:
        """The model's state: the reduction over z that the next step would make beside it."""
        if self.gain is None:
            return self.z
        return self.z * self.gain * _inv_rms(_sumsq(self.z), self.z.shape[-1], eps)


def barriers_per_iteration(layers: int, kv_splits: int | None = None) -> int:
    """Grid barriers of one iteration: one per step."""
    return len(step_names(layers, kv_splits))


def step_names(layers: int, kv_splits: int | None = None) -> tuple[str, ...]:
    attention = ("attn_proj",) if kv_splits is None else ("attn", "proj")
    per_layer = ("qkv", *attention, "fc", "mlp_proj")
    return ("adapter", *(f"{s}{j}" for j in range(layers) for s in per_layer))


def rope_row(pos, head_dim: int, base: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin [K / 2] of position `pos` (the model's angles: pos base^(-2i/K), float32)."""
    freqs = 1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = jnp.asarray(pos, jnp.float32) * freqs
    return jnp.cos(angles), jnp.sin(angles)


def embedded_part(w: StepWeights, embedded: jax.Array) -> jax.Array:
    """e @ Wa[D:]: the adapter's embedded half, the same in every iteration of a token."""
    return _dot(embedded, w.adapter[w.adapter.shape[1] :])


def core_iteration(
    w: StepWeights,
    state: Pending,
    embedded: jax.Array,
    k_slots: jax.Array,
    v_slots: jax.Array,
    pos,
    cos: jax.Array,
    sin: jax.Array,
    *,
    e_part: jax.Array | None = None,
    kv_splits: int | None = None,
    trace: list | None = None,
):
    """One Core iteration at position `pos`, run step by step: each step sees only what earlier
    steps wrote (the barrier). state [B, D] pending its norm; embedded [B, D]; k_slots, v_slots
    [L, B, S, H, K]: the layers' cache slots this iteration; cos, sin [K / 2] (`rope_row`);
    e_part: `embedded_part`, or None for the first iteration, whose adapter step computes it.
    `trace` gets (step, {value: shape}) per step. Returns (state, k_slots, v_slots, e_part)."""
    done = {} if e_part is None else {"e_part": e_part}
    layers = len(w.layers)
    steps = _steps(w, state, embedded, k_slots, v_slots, pos, cos, sin, e_part, kv_splits)
    assert tuple(name for name, _ in steps) == step_names(layers, kv_splits)
    for name, step in steps:
        out = step(types.MappingProxyType(dict(done)))
        if trace is not None:
            trace.append((name, {key: value.shape for key, value in out.items()}))
        done.update(out)  # the grid barrier: now complete for every worker
    last = w.layers[-1]
    z = _residual(done, layers - 1, last, w) + done[f"m{layers - 1}"]  # row-local, as qkv_j does
    k_new = jnp.stack([done[f"k_slot{j}"] for j in range(layers)])
    v_new = jnp.stack([done[f"v_slot{j}"] for j in range(layers)])
    return Pending(z, last.norm_4), k_new, v_new, done["e_part"]


def _steps(w, state, embedded, k_slots, v_slots, pos, cos, sin, e_part, kv_splits):
    """(name, fn(done) -> values) per step, in order."""
    d, eps, head_dim = w.adapter.shape[1], w.eps, w.head_dim

    def r(ss):  # rsqrt(mean + eps) of a sum of squares [B, 1]
        return _inv_rms(ss, d, eps)

    def adapter(v):
        z, gain = state
        out = {"a": _dot(z if gain is None else z * gain, w.adapter[:d]), "ss_state": _sumsq(z)}
        if e_part is None:  # the first iteration: the embedded rows too, into a second output
            out["e_part"] = embedded_part(w, embedded)
        return out

    def layer_input(v, j):
        """(z, gain): layer j's input is norm_gain(z); gain None: z."""
        if j == 0:
            a = v["a"] if state.gain is None else v["a"] * r(v["ss_state"])
            return a + v["e_part"], None
        return _residual(v, j - 1, w.layers[j - 1], w) + v[f"m{j - 1}"], w.layers[j - 1].norm_4

    def scales(v, j):
        """(rx, r1): layer j's input is x = z gain rx, and norm_1(x) = x g1 r1."""
        rx = 1.0 if j == 0 else r(v[f"ss_z{j}"])
        return rx, r(v[f"ss_zg{j}"] * rx**2)

    def qkv(v, j):
        z, gain = layer_input(v, j)
        zg = z if gain is None else z * gain
        product = _dot(zg * w.layers[j].norm_1, w.layers[j].wqkv)
        return {f"z{j}": z, f"ss_z{j}": _sumsq(z), f"ss_zg{j}": _sumsq(zg), f"qkv{j}": product}

    def attention(v, j, splits):
        """The head's q, k, v from the complete qkv product, the cache write, and the softmax
        partials per block of the slot's positions."""
        lw = w.layers[j]
        rx, r1 = scales(v, j)
        b = v[f"qkv{j}"].shape[0]
        q, k, val = jnp.split((v[f"qkv{j}"] * (rx * r1)).reshape(b, 3, -1, head_dim), 3, axis=1)
        q, k, val = q[:, 0], k[:, 0], val[:, 0]  # [B, H, K]
        if lw.qk_bias is not None:
            q, k = q + lw.qk_bias[0, 0], k + lw.qk_bias[1, 0]
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        ks, vs = _write(k_slots[j], k, pos), _write(v_slots[j], val, pos)
        m, s, acc = _softmax_partials(q, ks, vs, pos, splits)
        return {f"k_slot{j}": ks, f"v_slot{j}": vs, f"max{j}": m, f"sum{j}": s, f"acc{j}": acc}

    def attn_proj(v, j):
        out = attention(v, j, 1)
        heads = _combine(out.pop(f"max{j}"), out.pop(f"sum{j}"), out.pop(f"acc{j}"))
        proj = w.layers[j].proj.reshape(heads.shape[1], head_dim, d)  # rows of each head
        hp = jax.lax.Precision.HIGHEST
        return {**out, f"o{j}": jnp.einsum("bhk,hkn->bn", heads, proj, precision=hp)}

    def proj(v, j):
        heads = _combine(v[f"max{j}"], v[f"sum{j}"], v[f"acc{j}"])
        return {f"o{j}": _dot(heads.reshape(heads.shape[0], d), w.layers[j].proj)}

    def fc(v, j):
        lw, (rx, _) = w.layers[j], scales(v, j)
        gain = None if j == 0 else w.layers[j - 1].norm_4
        x = v[f"z{j}"] if gain is None else v[f"z{j}"] * gain * rx
        h1 = x + v[f"o{j}"]
        return {
            f"h1_{j}": h1,
            f"ss_h1_{j}": _sumsq(h1),
            f"ss_h1g_{j}": _sumsq(h1 * lw.norm_2),
            f"fc{j}": _dot(h1 * lw.norm_2 * lw.norm_3, lw.fc),
        }

    def mlp_proj(v, j):
        r2 = r(v[f"ss_h1_{j}"])
        r3 = r(v[f"ss_h1g_{j}"] * r2**2)
        gate, up = jnp.split(v[f"fc{j}"] * (r2 * r3), 2, axis=-1)
        return {f"m{j}": _dot(jax.nn.silu(gate) * up, w.layers[j].mlp_proj)}

    steps = [("adapter", adapter)]
    for j in range(len(w.layers)):
        steps.append((f"qkv{j}", lambda v, j=j: qkv(v, j)))
        if kv_splits is None:
            steps.append((f"attn_proj{j}", lambda v, j=j: attn_proj(v, j)))
        else:
            steps.append((f"attn{j}", lambda v, j=j: attention(v, j, kv_splits)))
            steps.append((f"proj{j}", lambda v, j=j: proj(v, j)))
        steps.append((f"fc{j}", lambda v, j=j: fc(v, j)))
        steps.append((f"mlp_proj{j}", lambda v, j=j: mlp_proj(v, j)))
    return steps


def _residual(v, j, lw: LayerWeights, w: StepWeights):
    """x1 = norm_2(h1) of layer j, the residual its MLP adds to."""
    return v[f"h1_{j}"] * lw.norm_2 * _inv_rms(v[f"ss_h1_{j}"], w.adapter.shape[1], w.eps)


def _write(slot, x, pos):
    """The slot [B, S, H, K] with x [B, H, K] at position pos."""
    return jax.lax.dynamic_update_slice_in_dim(slot, x[:, None].astype(slot.dtype), pos, axis=1)


def _dot(x, w):
    return jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)


def _sumsq(x):
    return jnp.sum(x * x, axis=-1, keepdims=True)


def _inv_rms(ss, d: int, eps: float):
    return jax.lax.rsqrt(ss / d + eps)


def _rope(x, cos, sin):
    """(x0 cos - x1 sin, x1 cos + x0 sin) of each adjacent pair (2i, 2i + 1), as the model."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return jnp.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=-1).reshape(x.shape)


def _softmax_partials(q, k_slot, v_slot, pos, splits: int):
    """Per block of S / splits positions: max [B, H, n], sum [B, H, n] and the weighted
    values [B, H, n, K] of the visible positions (<= pos), as a split-KV worker leaves them."""
    b, s, h, head_dim = k_slot.shape
    if s % splits:
        raise ValueError(f"kv_splits={splits} must divide the slot's {s} positions")
    blocks = (b, splits, s // splits, h, head_dim)
    hp = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("bhk,bnlhk->bhnl", q, k_slot.reshape(blocks), precision=hp)
    visible = (jnp.arange(s) <= pos).reshape(splits, s // splits)
    scale = 1.0 / jnp.sqrt(jnp.float32(head_dim))  # the model's
    scores = jnp.where(visible, scores * scale, MASKED_SCORE)
    m = scores.max(axis=-1)
    p = jnp.where(visible, jnp.exp(scores - m[..., None]), 0.0)
    acc = jnp.einsum("bhnl,bnlhk->bhnk", p, v_slot.reshape(blocks), precision=hp)
    return m, p.sum(axis=-1), acc


def _combine(m, s, acc):
    """Each head's attention output [B, H, K] from its blocks' partials: a block without a
    visible position has max MASKED_SCORE, weight 0."""
    weight = jnp.exp(m - m.max(axis=-1, keepdims=True))
    return (acc * weight[..., None]).sum(axis=2) / (s * weight).sum(axis=2)[..., None]
