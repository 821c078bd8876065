"""One Huginn sandwich layer in PyTorch the way a performance engineer writes it (gpt-fast style),
as module functions: weights laid out for `F.linear` ([out, in], nn.Linear's layout) by
`fast_layer_weights`, fused `F.rms_norm`, q and k rotated together by a table of their positions
(`rope_table`: its complex view eager, the real table under torch.compile), views instead of
copies, SDPA, and the slot's static K/V cache [B, S, H, K] written in place. The same math as
`huginn_jax.layers`. These are the layers of `core.FastCore` and `core.CompiledCore`, and
`torch_ref.generation` runs the prelude, Core and coda with them too. torch is imported lazily,
so importing this module needs no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def rope_table(start: int, tokens: int, head_dim: int, base: float, device) -> Any:
    """cos and sin of positions [start, start + tokens) as float32 [T, K/2, 2] (cos at 0, sin at
    1), the angles as `huginn_jax.layers.apply_rope` computes them: pos · base^(-2i/K)."""
    import torch

    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    positions = torch.arange(start, start + tokens, device=device).float()
    angles = positions[:, None] * freqs[None, :]
    return torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1).contiguous()


def _rope_complex(x, freqs_cis):
    """Interleaved-pair RoPE as one complex multiply in float32 (eager: one kernel, plus the
    casts for a bf16 x). x [B, T, ..., K]; freqs_cis complex64 [T, K/2]."""
    import torch

    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    shape = (1, x.shape[1]) + (1,) * (x.dim() - 3) + (x.shape[-1] // 2,)
    return torch.view_as_real(pairs * freqs_cis.view(shape)).flatten(-2).type_as(x)


def _rope_real(x, table):
    """`_rope_complex` in real arithmetic, for torch.compile (Inductor generates no complex
    kernels; it fuses this into one pointwise kernel). table: `rope_table` [T, K/2, 2]."""
    import torch

    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    shape = (1, x.shape[1]) + (1,) * (x.dim() - 3) + (x.shape[-1] // 2,)
    cos, sin = table[..., 0].view(shape), table[..., 1].view(shape)
    return torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1).flatten(-2).type_as(x)


def fast_layer_weights(layer: dict, config: Any, to_torch: Callable[[Any], Any]) -> dict:
    """One sandwich layer (a `SandwichBlock` state dict) in FastCore's layout: norm_1..norm_4 [D],
    Wqkv [3D, D] (rows [q; k; v]), qk_bias [2, H, K] or None, proj, fc (rows [gate; up]) and
    mlp_proj as [out, in] contiguous copies for `F.linear`; all `torch.nn.Parameter`s without
    grad (static inputs to torch.compile and its CUDA graphs)."""
    import torch

    def param(tensor):
        return torch.nn.Parameter(tensor, requires_grad=False)

    def matrix(array):  # [in, out] -> [out, in], as nn.Linear stores it
        return param(to_torch(array).t().contiguous())

    h, k = config.n_heads, config.head_dim
    bias = layer["attn"]["qk_bias"] if config.qk_bias else None
    return {
        **{f"norm_{n}": param(to_torch(layer[f"norm_{n}"]["weight"])) for n in (1, 2, 3, 4)},
        "Wqkv": matrix(layer["attn"]["Wqkv"]["kernel"]),
        # [2, 1, H, K] -> [2, H, K]: q's and k's bias, against qkv[:, :, :2]
        "qk_bias": None if bias is None else param(to_torch(bias).reshape(2, h, k)),
        "proj": matrix(layer["attn"]["proj"]["kernel"]),
        "fc": matrix(layer["mlp"]["fc"]["kernel"]),
        "mlp_proj": matrix(layer["mlp"]["proj"]["kernel"]),
    }


def fast_layer_list(layers: dict, config: Any, to_torch: Callable[[Any], Any]) -> list[dict]:
    """`fast_layer_weights` of a `nnx.List` state, in layer order (as `core.layer_list`)."""
    return [fast_layer_weights(layers[k], config, to_torch) for k in sorted(layers, key=int)]


def fast_qkv(cfg: Any, layer: dict, x, rope, *, compiled: bool):
    """The attention inputs of a FastCore-layout layer on x [B, T, D]: (q, k, v) [B, T, H, K],
    q and k with qk_bias added, then rotated by `rope` (complex [T, K/2] eager, the real table
    [T, K/2, 2] with `compiled`), v a view of the projection."""
    import torch.nn.functional as F

    b, t, d = x.shape
    qkv = F.linear(F.rms_norm(x, (d,), layer["norm_1"], cfg.norm_eps), layer["Wqkv"])
    qkv = qkv.view(b, t, 3, cfg.n_heads, cfg.head_dim)
    qk, v = qkv[:, :, :2], qkv[:, :, 2]  # views
    if layer["qk_bias"] is not None:
        qk = qk + layer["qk_bias"]  # before RoPE; one add for q and k
    qk = _rope_real(qk, rope) if compiled else _rope_complex(qk, rope)
    return qk[:, :, 0], qk[:, :, 1], v


def fast_out(cfg: Any, layer: dict, x, attn_BxTxD):
    """The rest of the layer after attention: proj, norm_2 on the residual, the gated MLP
    (gate = first half of fc) and norm_4 on the residual; x, attention output [B, T, D]."""
    import torch.nn.functional as F

    d, eps = x.shape[-1], cfg.norm_eps
    x = F.rms_norm(x + F.linear(attn_BxTxD, layer["proj"]), (d,), layer["norm_2"], eps)
    gate, up = F.linear(F.rms_norm(x, (d,), layer["norm_3"], eps), layer["fc"]).chunk(2, -1)
    out = F.linear(F.silu(gate) * up, layer["mlp_proj"])
    return F.rms_norm(x + out, (d,), layer["norm_4"], eps)


def fast_layer(cfg: Any, layer: dict, x, start: int, k_slot, v_slot, rope, *, compiled: bool):
    """`core.FastCore.layer` for any FastCore-layout layer (prelude, Core or coda); see there."""
    import torch.nn.functional as F

    b, t, d = x.shape
    if t > 1 and start != 0:
        raise ValueError(f"several new positions ({t}) need start=0, got start={start}")
    q, key, v = fast_qkv(cfg, layer, x, rope, compiled=compiled)
    k_slot[:, start : start + t].copy_(key)
    v_slot[:, start : start + t].copy_(v)
    if start == 0:  # a prefill: the new positions alone, causal
        keys, values = key, v
    else:  # a decode: every cached position [0, start + 1)
        keys, values = k_slot[:, : start + t], v_slot[:, : start + t]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), is_causal=t > 1
    )
    return fast_out(cfg, layer, x, out.transpose(1, 2).reshape(b, t, d))
