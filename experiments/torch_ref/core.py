"""The Huginn Core (adapter + sandwich layers) in PyTorch, for side-by-side comparisons.

Two cache schemes, both with one KV entry per (iteration, layer):
- `static`: preallocated [L, B, S, H, K] tensors written in place at `start` (gpt-fast style), so
  a CUDA graph can capture r iterations;
- `teaching`: the seeds' teaching implementation, history re-concatenated with `torch.cat` at
  every step (an O(S) copy per layer and iteration).

Weights come from the JAX model in JAX's [in, out] layout (shared through DLPack on a GPU, so both
sides compute with the same values and no copy); `x @ W` with W [in, out] is what F.linear does
with the transposed [out, in] weight. torch is imported lazily here.
"""

from __future__ import annotations

import numpy as np


def _rope(x_BxTxHxK, positions_T, base: float):
    import torch

    head_dim = x_BxTxHxK.shape[-1]
    freqs = 1.0 / (
        base ** (torch.arange(0, head_dim, 2, device=x_BxTxHxK.device).float() / head_dim)
    )
    angles = positions_T.float()[:, None] * freqs[None, :]
    cos, sin = torch.cos(angles)[None, :, None, :], torch.sin(angles)[None, :, None, :]
    pairs = x_BxTxHxK.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    return (
        torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1)
        .flatten(-2)
        .type_as(x_BxTxHxK)
    )


def rms_norm(x, weight, eps: float):
    """x * rsqrt(mean(x²) + eps) in float32, cast back to x's dtype, times the weight (as
    `huginn_jax.layers.RMSNorm`). x [..., D], weight [D]."""
    import torch

    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def layer_weights(layer: dict, config, to_torch) -> dict:
    """One sandwich layer's weights (a `SandwichBlock` state dict) as torch tensors, [in, out]."""
    return {
        "norm": [to_torch(layer[f"norm_{n}"]["weight"]) for n in (1, 2, 3, 4)],
        "Wqkv": to_torch(layer["attn"]["Wqkv"]["kernel"]),
        "qk_bias": to_torch(layer["attn"]["qk_bias"]) if config.qk_bias else None,
        "proj": to_torch(layer["attn"]["proj"]["kernel"]),
        "fc": to_torch(layer["mlp"]["fc"]["kernel"]),
        "mlp_proj": to_torch(layer["mlp"]["proj"]["kernel"]),
    }


def layer_list(layers: dict, config, to_torch) -> list[dict]:
    """`layer_weights` of a `nnx.List` state ({0: ..., 1: ...}), in layer order. Keys may be ints
    (`nnx.to_pure_dict`) or strings (a dict rebuilt from flat file keys), so sort numerically."""
    return [layer_weights(layers[k], config, to_torch) for k in sorted(layers, key=int)]


class TorchCore:
    """Adapter + Core layers with weights copied from a `huginn_jax.model.Core` state."""

    def __init__(self, params: dict, config, to_torch):
        """params: the nested dict of `nnx.to_pure_dict(nnx.state(core))`; `to_torch` turns
        one JAX array into a torch tensor on the target device (see `to_torch_fn`)."""
        self.cfg = config
        self.adapter = to_torch(params["adapter"]["kernel"])
        self.layers = layer_list(params["core_block"], config, to_torch)

    def _qkv(self, layer, x, start: int):
        import torch

        b, t, _ = x.shape
        h, k = self.cfg.n_heads, self.cfg.head_dim
        q, key, v = (x @ layer["Wqkv"]).view(b, t, 3, h, k).unbind(dim=2)
        if layer["qk_bias"] is not None:
            q, key = q + layer["qk_bias"][0], key + layer["qk_bias"][1]
        positions = torch.arange(start, start + t, device=x.device)
        base = self.cfg.rope_base
        return _rope(q, positions, base), _rope(key, positions, base), v

    def _attend(self, q, k_all, v_all, fresh: bool):
        """q [B, T, H, K]; k_all, v_all [B, S, H, K] holding every visible position."""
        import torch.nn.functional as F

        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k_all.transpose(1, 2),
            v_all.transpose(1, 2),
            is_causal=fresh and q.shape[1] > 1,
        )
        return out.transpose(1, 2).flatten(2)

    def _block(self, layer, x, attn_out):
        import torch.nn.functional as F

        eps = self.cfg.norm_eps
        _, n2, n3, n4 = layer["norm"]
        x = rms_norm(x + attn_out @ layer["proj"], n2, eps)
        gate, up = (rms_norm(x, n3, eps) @ layer["fc"]).chunk(2, dim=-1)
        return rms_norm(x + (F.silu(gate) * up) @ layer["mlp_proj"], n4, eps)

    def step_static(self, state, embedded, iteration: int, start: int, k_cache, v_cache):
        """One iteration writing into preallocated caches [L, B, S, H, K] at `start`.

        Attention sees positions [0, start + T): with T > 1 and start == 0 it is a causal
        prefill; with T == 1 a decode over the cached history.
        """
        import torch

        x = torch.cat([state, embedded], dim=-1) @ self.adapter
        for j, layer in enumerate(self.layers):
            slot = iteration * len(self.layers) + j
            x = self.block_static(layer, x, start, k_cache[slot], v_cache[slot])
        return x

    def block_static(self, layer: dict, x, start: int, k_slot, v_slot):
        """One sandwich layer (any of `layer_weights`: prelude, Core or coda) on x [B, T, D],
        writing its K/V into the slot's caches [B, S, H, K] at [start, start + T) in place."""
        t = x.shape[1]
        q, key, v = self._qkv(layer, rms_norm(x, layer["norm"][0], self.cfg.norm_eps), start)
        k_slot[:, start : start + t] = key
        v_slot[:, start : start + t] = v
        k_all, v_all = k_slot[:, : start + t], v_slot[:, : start + t]
        return self._block(layer, x, self._attend(q, k_all, v_all, fresh=start == 0))

    def step_teaching(self, state, embedded, iteration: int, start: int, history: list):
        """One iteration with the teaching cache: `history[slot]` = (k, v) [B, start, H, K],
        re-concatenated with the new entries (a fresh copy of the whole history each time)."""
        import torch

        x = torch.cat([state, embedded], dim=-1) @ self.adapter
        for j, layer in enumerate(self.layers):
            slot = iteration * len(self.layers) + j
            q, key, v = self._qkv(layer, rms_norm(x, layer["norm"][0], self.cfg.norm_eps), start)
            old_k, old_v = history[slot]
            k_all, v_all = torch.cat([old_k, key], dim=1), torch.cat([old_v, v], dim=1)
            x = self._block(layer, x, self._attend(q, k_all, v_all, fresh=start == 0))
        return x

    def run_static(self, state, embedded, iterations: int, start: int, k_cache, v_cache):
        for i in range(iterations):
            state = self.step_static(state, embedded, i, start, k_cache, v_cache)
        return state

    def run_teaching(self, state, embedded, iterations: int, start: int, history: list):
        for i in range(iterations):
            state = self.step_teaching(state, embedded, i, start, history)
        return state


def to_torch_fn(device: str, dtype):
    """JAX array → torch tensor: zero-copy through DLPack on CUDA, through numpy on the CPU."""
    import torch

    def convert(array):
        if device == "cuda":
            return torch.from_dlpack(array).to(dtype)
        # A writable host copy: np.asarray of a JAX array is read-only, which torch warns about.
        return torch.from_numpy(np.array(array, dtype=np.float32)).to(dtype)

    return convert
