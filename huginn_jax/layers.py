"""Huginn's building blocks: RMSNorm, interleaved-pair RoPE, attention, gated MLP, sandwich block.

Shape letters: B batch, T new positions, S cache positions, D model width (n_embd),
H heads, K head_dim, F MLP intermediate width.
Weights are stored [in, out] (the transpose of the PyTorch checkpoint's [out, in]).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from huginn_jax import ops, parallel
from huginn_jax.config import HuginnConfig
from huginn_jax.kv_cache import KVCache

MASKED_SCORE = -1e30  # finite, so a fully masked row cannot produce NaN


def truncated_normal(key: jax.Array, shape: tuple[int, ...], std: float, dtype) -> jax.Array:
    """Normal(0, std) cut at ±3 std, as the reference's `trunc_normal_(std, -3std, 3std)`."""
    return (jax.random.truncated_normal(key, -3.0, 3.0, shape, jnp.float32) * std).astype(dtype)


def dot_precision(dtype) -> jax.lax.Precision | None:
    """float32 weights get full float32 products (no TF32); lower precisions the default."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


class Linear(nnx.Module):
    """y = x @ kernel, no bias. kernel [in, out]."""

    def __init__(self, kernel: jax.Array):
        self.kernel = nnx.Param(kernel)

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel[...]
        return jnp.matmul(x, kernel, precision=dot_precision(kernel.dtype)).astype(x.dtype)


class RMSNorm(nnx.Module):
    """x * rsqrt(mean(x²) + eps) in float32, cast back to x's dtype, then times the weight."""

    def __init__(self, dim: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x * rsqrt(mean(x²) + eps) in float32, cast back to x's dtype, then times the weight."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * weight


def apply_rope(x_BxTxHxK: jax.Array, positions_T: jax.Array, base: float) -> jax.Array:
    """Rotates adjacent pairs (2i, 2i+1) by pos · base^(-2i/K), computed in float32."""
    head_dim = x_BxTxHxK.shape[-1]
    freqs = 1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles_TxK2 = positions_T.astype(jnp.float32)[:, None] * freqs[None, :]
    cos = jnp.cos(angles_TxK2)[None, :, None, :]
    sin = jnp.sin(angles_TxK2)[None, :, None, :]
    pairs = x_BxTxHxK.astype(jnp.float32).reshape(*x_BxTxHxK.shape[:-1], head_dim // 2, 2)
    # (x0 cos - x1 sin, x1 cos + x0 sin) as pairs * cos + swapped pairs * (-sin, sin), elementwise:
    # XLA makes one loop fusion of q's, k's and v's slices, where jnp.stack made a concatenate
    # fusion per operand (docs/core_layers.md).
    signed_sin = sin[..., None] * jnp.array([-1.0, 1.0], jnp.float32)
    rotated = pairs * cos[..., None] + pairs[..., ::-1] * signed_sin
    return rotated.reshape(x_BxTxHxK.shape).astype(x_BxTxHxK.dtype)


def attend(
    q_BxTxHxK: jax.Array,
    k_BxSxHxK: jax.Array,
    v_BxSxHxK: jax.Array,
    q_pos_T: jax.Array,
    k_pos_S: jax.Array,
) -> jax.Array:
    """Causal softmax attention: key s is visible to query t iff k_pos[s] <= q_pos[t].

    Scores and softmax in float32; probabilities cast to the value dtype for the second product.
    """
    precision = dot_precision(q_BxTxHxK.dtype)
    scale = 1.0 / jnp.sqrt(jnp.float32(q_BxTxHxK.shape[-1]))
    scores_BxHxTxS = jnp.einsum(
        "bthk,bshk->bhts",
        q_BxTxHxK,
        k_BxSxHxK,
        precision=precision,
        preferred_element_type=jnp.float32,
    )
    visible_TxS = k_pos_S[None, :] <= q_pos_T[:, None]
    scores_BxHxTxS = jnp.where(visible_TxS, scores_BxHxTxS * scale, MASKED_SCORE)
    probs = jax.nn.softmax(scores_BxHxTxS, axis=-1).astype(v_BxSxHxK.dtype)
    return jnp.einsum("bhts,bshk->bthk", probs, v_BxSxHxK, precision=precision)


def attend_cudnn(
    q_BxTxHxK, k_BxSxHxK, v_BxSxHxK, q_pos_T, k_pos_S, *, causal: bool = False
) -> jax.Array:
    """`attend` through cuDNN's fused attention: the [T, S] visibility mask goes in as a mask,
    so scores never reach HBM. NVIDIA GPUs, bf16/fp16 only.

    `causal`: the keys are the queries' own positions (q_pos == k_pos), so the mask is the lower
    triangle: cuDNN's causal kernel, which skips the masked half, instead of a mask operand."""
    if causal:
        return jax.nn.dot_product_attention(
            q_BxTxHxK, k_BxSxHxK, v_BxSxHxK, is_causal=True, implementation="cudnn"
        )
    visible = (k_pos_S[None, :] <= q_pos_T[:, None])[None, None]
    return jax.nn.dot_product_attention(
        q_BxTxHxK, k_BxSxHxK, v_BxSxHxK, mask=visible, implementation="cudnn"
    )


MGPU_BLOCK = 128  # block_q and block_kv of jax's Mosaic GPU attention (multiples of 64)
MGPU_TOKENS = 2 * MGPU_BLOCK  # its T must be a multiple: two compute warpgroups of block_q rows


def attend_mgpu_causal(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK) -> jax.Array:
    """Causal self-attention of T positions (q, k, v of the same positions) by jax's Mosaic GPU
    flash-attention kernel (`jax.experimental.pallas.ops.gpu.attention_mgpu`, sm_90).

    What the kernel needs is done around it: q scaled by 1/sqrt(K) (it does not scale), K
    zero-padded to a multiple of 64 (huginn-0125's 96 -> 128), T zero-padded at the end to a
    multiple of MGPU_TOKENS (a causal query never sees later keys, so padding changes no real
    row), and float16 operands: in jax 0.11.2 the kernel allocates its shared-memory tiles as
    float16 whatever the input dtype (bf16 fails), so bf16 values go in as float16 (exact
    within float16's range, |x| < 65504) and the output comes back in q's dtype."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    _, tokens, _, head_dim = q_BxTxHxK.shape
    q_BxTxHxK = q_BxTxHxK * jnp.asarray(head_dim**-0.5, q_BxTxHxK.dtype)
    pad = [(0, 0), (0, -tokens % MGPU_TOKENS), (0, 0), (0, -head_dim % 64)]
    q, k, v = (jnp.pad(x.astype(jnp.float16), pad) for x in (q_BxTxHxK, k_BxTxHxK, v_BxTxHxK))
    config = attention_mgpu.TuningConfig(
        block_q=MGPU_BLOCK, block_kv=MGPU_BLOCK, max_concurrent_steps=2, causal=True
    )
    out = attention_mgpu.attention(q, k, v, config)
    return out[:, :tokens, :, :head_dim].astype(q_BxTxHxK.dtype)


# Cache positions per block of attend_decode_split: 128 is faster than 256 inside the Core's
# scan, though not for one layer alone, as XLA fuses the two differently (docs/core_layers.md).
DECODE_BLOCK = 128


def attend_decode_split(
    q_Bx1xHxK, k_BxSxHxK, v_BxSxHxK, q_pos_T, k_pos_S, *, block: int = DECODE_BLOCK
) -> jax.Array:
    """`attend` for one query position, split over the cache (flash-decoding written in XLA): the
    S positions in blocks of `block` (a shorter one last), a float32 softmax per block, the
    blocks combined through their maxima and sums. Many short reductions instead of one over all
    S, which XLA runs as a column reduction with H * K outputs (too few to fill the GPU)."""
    batch, s, heads, head_dim = k_BxSxHxK.shape
    precision = dot_precision(q_Bx1xHxK.dtype)
    scale = 1.0 / jnp.sqrt(jnp.float32(head_dim))
    q_BxHxK = q_Bx1xHxK[:, 0]

    def partial(k_BxCxLxHxK, v_BxCxLxHxK, pos_CxL):
        scores = jnp.einsum(
            "bhk,bclhk->bchl",
            q_BxHxK,
            k_BxCxLxHxK,
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        visible = (pos_CxL <= q_pos_T[0])[None, :, None, :]
        scores = jnp.where(visible, scores * scale, MASKED_SCORE)
        max_BxCxH = scores.max(axis=-1)
        p = jnp.exp(scores - max_BxCxH[..., None])
        acc = jnp.einsum(
            "bchl,bclhk->bchk",
            p.astype(v_BxCxLxHxK.dtype),
            v_BxCxLxHxK,
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        return max_BxCxH, p.sum(axis=-1), acc

    full = s // block * block
    parts = []
    if full:
        blocks = (batch, full // block, block, heads, head_dim)
        parts.append(
            partial(
                k_BxSxHxK[:, :full].reshape(blocks),
                v_BxSxHxK[:, :full].reshape(blocks),
                k_pos_S[:full].reshape(-1, block),
            )
        )
    if full < s:
        parts.append(
            partial(k_BxSxHxK[:, None, full:], v_BxSxHxK[:, None, full:], k_pos_S[None, full:])
        )
    maxima, sums, acc = (jnp.concatenate(x, axis=1) for x in zip(*parts, strict=True))
    # A fully masked block has max MASKED_SCORE and weight exp(MASKED_SCORE - max) = 0.
    weight_BxCxH = jnp.exp(maxima - maxima.max(axis=1, keepdims=True))
    out = (acc * weight_BxCxH[..., None]).sum(1) / (sums * weight_BxCxH).sum(1)[..., None]
    return out[:, None].astype(v_BxSxHxK.dtype)


def attend_decode_cudnn(q_Bx1xHxK, k_BxSxHxK, v_BxSxHxK, q_pos_T, k_pos_S) -> jax.Array:
    """`attend` for one query position through cuDNN's fused attention, the visible keys given
    as a count (key_value_seq_lengths) instead of a mask operand. The visible keys must be a
    prefix of the cache, as in the model's cache (k_pos_S = 0 .. S-1). NVIDIA GPUs, bf16/fp16."""
    visible = jnp.sum(k_pos_S <= q_pos_T[0], dtype=jnp.int32)
    lengths_B = jnp.full((q_Bx1xHxK.shape[0],), visible, jnp.int32)
    return jax.nn.dot_product_attention(
        q_Bx1xHxK, k_BxSxHxK, v_BxSxHxK, key_value_seq_lengths=lengths_B, implementation="cudnn"
    )


class Attention(nnx.Module):
    """Multi-head attention with fused Wqkv, a learned qk_bias added before RoPE, and a KV slot.

    Under a mesh (cfg.mesh) the weights are in `parallel`'s layout: cfg.attention_heads heads
    (zero-padded), Wqkv's columns grouped per device."""

    def __init__(self, cfg: HuginnConfig, *, rngs: nnx.Rngs, dtype):
        d, h, k = cfg.n_embd, cfg.attention_heads, cfg.head_dim
        self.cfg = cfg
        wqkv = truncated_normal(rngs.params(), (d, 3 * d), cfg.init_std, dtype)
        self.Wqkv = Linear(parallel.group_qkv(wqkv, cfg))
        if cfg.qk_bias:
            self.qk_bias = nnx.Param(jnp.zeros((2, 1, h, k), dtype))
        proj = truncated_normal(rngs.params(), (d, d), cfg.out_proj_std, dtype)
        self.proj = Linear(parallel.pad_head_rows(proj, cfg))

    def __call__(
        self, x_BxTxD: jax.Array, start: jax.Array, cache: KVCache | None, slot
    ) -> tuple[jax.Array, KVCache | None]:
        """Attends the T new positions [start, start + T) to themselves and, with a cache, to
        every earlier position stored in `slot`; writes their K/V into that slot in place."""
        out_BxTxD, cache = self.attend_qkv(self.Wqkv(x_BxTxD), start, cache, slot)
        return parallel.constrain(self.proj(out_BxTxD), self.cfg, None), cache

    def attend_qkv(
        self, qkv_BxTx3D: jax.Array, start: jax.Array, cache: KVCache | None, slot
    ) -> tuple[jax.Array, KVCache | None]:
        """`__call__` from the Wqkv product on, without the output projection: [B, T, H * K]."""
        b, t, _ = qkv_BxTx3D.shape
        h, k, g = self.cfg.attention_heads, self.cfg.head_dim, self.cfg.model_shards
        # G groups (one per device of the mesh's "model" axis, 1 without) of [q | k | v] heads.
        q, key, v = jnp.split(qkv_BxTx3D.reshape(b, t, g, 3, h // g, k), 3, axis=3)
        q, key, v = (x.reshape(b, t, h, k) for x in (q, key, v))
        q, key, v = (
            parallel.constrain(x, self.cfg, parallel.MODEL_AXIS, None) for x in (q, key, v)
        )
        if self.cfg.qk_bias:
            bias = self.qk_bias[...]
            q, key = q + bias[0], key + bias[1]
        positions_T = start + jnp.arange(t, dtype=jnp.int32)
        q = apply_rope(q, positions_T, self.cfg.rope_base)
        key = apply_rope(key, positions_T, self.cfg.rope_base)
        fused = self.cfg.attention_impl == "cudnn" and t > 1
        mgpu = self.cfg.attention_impl == "mgpu" and t > 1
        if cache is not None:
            cache = cache.write(slot, start, key, v)
        if cache is None or (isinstance(start, int) and start == 0):
            # Nothing before the new positions (start known to be 0 at trace time): attending
            # to them alone skips reading, scoring and masking the cache's other positions,
            # and the mask is plain causal.
            if fused:
                out = attend_cudnn(q, key, v, positions_T, positions_T, causal=True)
            elif mgpu:
                out = attend_mgpu_causal(q, key, v)
            else:
                out = attend(q, key, v, positions_T, positions_T)
        elif t == 1:
            attention = ops.decode_attention(self.cfg.decode_attention_impl)
            out = attention(q, cache, slot, positions_T)
        else:
            k_all, v_all = cache.read(slot)
            k_pos_S = jnp.arange(k_all.shape[1], dtype=jnp.int32)
            out = (attend_cudnn if fused else attend)(q, k_all, v_all, positions_T, k_pos_S)
        return out.reshape(b, t, h * k), cache


class GatedMLP(nnx.Module):
    """proj(silu(gate) * up) with [gate; up] = fc(x): the first half of fc's output is the gate.

    Under a mesh (cfg.mesh) fc holds cfg.mlp_width zero-padded columns of each, as G groups
    [gate | up] (one per device of the "model" axis): `parallel.group_gate_up`."""

    def __init__(self, cfg: HuginnConfig, *, rngs: nnx.Rngs, dtype):
        d, f = cfg.n_embd, cfg.intermediate_size
        self.cfg = cfg
        # The reference draws the gate half with init_std and the up half with out_proj_std.
        gate = truncated_normal(rngs.params(), (d, f), cfg.init_std, dtype)
        up = truncated_normal(rngs.params(), (d, f), cfg.out_proj_std, dtype)
        self.fc = Linear(parallel.group_gate_up(jnp.concatenate([gate, up], axis=1), cfg))
        proj = truncated_normal(rngs.params(), (f, d), cfg.out_proj_std, dtype)
        self.proj = Linear(parallel.pad_mlp_rows(proj, cfg))

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        gate_up = self.fc(x_BxTxD)
        g, f = self.cfg.model_shards, self.cfg.mlp_width
        if g == 1:
            gate, up = gate_up[..., :f], gate_up[..., f:]
        else:
            grouped = gate_up.reshape(*gate_up.shape[:-1], g, 2, f // g)
            gate, up = (grouped[..., i, :].reshape(*gate_up.shape[:-1], f) for i in (0, 1))
        return parallel.constrain(self.proj(jax.nn.silu(gate) * up), self.cfg, None)


class SandwichBlock(nnx.Module):
    """x = norm_2(x + attn(norm_1(x))); x = norm_4(x + mlp(norm_3(x)))."""

    def __init__(self, cfg: HuginnConfig, *, rngs: nnx.Rngs, dtype):
        eps, d = cfg.norm_eps, cfg.n_embd
        self.norm_1 = RMSNorm(d, eps=eps, dtype=dtype)
        self.attn = Attention(cfg, rngs=rngs, dtype=dtype)
        self.norm_2 = RMSNorm(d, eps=eps, dtype=dtype)
        self.norm_3 = RMSNorm(d, eps=eps, dtype=dtype)
        self.mlp = GatedMLP(cfg, rngs=rngs, dtype=dtype)
        self.norm_4 = RMSNorm(d, eps=eps, dtype=dtype)

    def __call__(
        self, x_BxTxD: jax.Array, start: jax.Array, cache: KVCache | None, slot
    ) -> tuple[jax.Array, KVCache | None]:
        attn_out, cache = self.attn(self.norm_1(x_BxTxD), start, cache, slot)
        x = self.norm_2(x_BxTxD + attn_out)
        x = self.norm_4(x + self.mlp(self.norm_3(x)))
        return x, cache
