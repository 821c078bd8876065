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


def _rms_norm(x, weight, eps: float):
    import torch

    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


class TorchCore:
    """Adapter + Core layers with weights copied from a `huginn_jax.model.Core` state."""

    def __init__(self, params: dict, config, to_torch):
        """params: the nested dict of `nnx.to_pure_dict(nnx.state(core))`; `to_torch` turns
        one JAX array into a torch tensor on the target device (see `to_torch_fn`)."""
        self.cfg = config
        self.adapter = to_torch(params["adapter"]["kernel"])
        self.layers = []
        for layer in params["core_block"].values():
            self.layers.append(
                {
                    "norm": [to_torch(layer[f"norm_{n}"]["weight"]) for n in (1, 2, 3, 4)],
                    "Wqkv": to_torch(layer["attn"]["Wqkv"]["kernel"]),
                    "qk_bias": to_torch(layer["attn"]["qk_bias"]) if config.qk_bias else None,
                    "proj": to_torch(layer["attn"]["proj"]["kernel"]),
                    "fc": to_torch(layer["mlp"]["fc"]["kernel"]),
                    "mlp_proj": to_torch(layer["mlp"]["proj"]["kernel"]),
                }
            )

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
        x = _rms_norm(x + attn_out @ layer["proj"], n2, eps)
        gate, up = (_rms_norm(x, n3, eps) @ layer["fc"]).chunk(2, dim=-1)
        return _rms_norm(x + (F.silu(gate) * up) @ layer["mlp_proj"], n4, eps)

    def step_static(self, state, embedded, iteration: int, start: int, k_cache, v_cache):
        """One iteration writing into preallocated caches [L, B, S, H, K] at `start`.

        Attention sees positions [0, start + T): with T > 1 and start == 0 it is a causal
        prefill; with T == 1 a decode over the cached history.
        """
        import torch

        x = torch.cat([state, embedded], dim=-1) @ self.adapter
        t = x.shape[1]
        for j, layer in enumerate(self.layers):
            slot = iteration * len(self.layers) + j
            q, key, v = self._qkv(layer, _rms_norm(x, layer["norm"][0], self.cfg.norm_eps), start)
            k_cache[slot, :, start : start + t] = key
            v_cache[slot, :, start : start + t] = v
            k_all, v_all = k_cache[slot, :, : start + t], v_cache[slot, :, : start + t]
            x = self._block(layer, x, self._attend(q, k_all, v_all, fresh=start == 0))
        return x

    def step_teaching(self, state, embedded, iteration: int, start: int, history: list):
        """One iteration with the teaching cache: `history[slot]` = (k, v) [B, start, H, K],
        re-concatenated with the new entries (a fresh copy of the whole history each time)."""
        import torch

        x = torch.cat([state, embedded], dim=-1) @ self.adapter
        for j, layer in enumerate(self.layers):
            slot = iteration * len(self.layers) + j
            q, key, v = self._qkv(layer, _rms_norm(x, layer["norm"][0], self.cfg.norm_eps), start)
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
        return torch.from_numpy(np.asarray(array, dtype=np.float32)).to(dtype)

    return convert
