"""The Huginn Core (adapter + sandwich layers) in PyTorch, for side-by-side comparisons with JAX.

Three implementations of the same math (`huginn_jax.layers`), one KV slot per (iteration, layer):
- `ReferenceCore`: reference-faithful and plain: a hand-written float32 RMSNorm, RoPE recomputed
  with `torch.stack` at every call, weights in JAX's [in, out] layout (shared with JAX through
  DLPack on a GPU). It also runs the prelude and coda of `torch_ref.huginn`, and holds the
  `teaching` cache path (history re-concatenated with `torch.cat`, an O(S) copy per layer and
  iteration).
- `FastCore`: the same Core the way a PyTorch performance engineer writes it (gpt-fast style):
  fused `F.rms_norm`, `F.linear` on [out, in] weights (nn.Linear's layout), q and k rotated
  together by a RoPE table built once per (start, T), views instead of copies, SDPA, the static
  cache written in place. Eager, or captured r iterations at a time in a CUDA graph. Its layer
  code is the module functions of `torch_ref.fast_layers` (`fast_layer_weights`, `fast_qkv`,
  `fast_out`, `fast_layer`) for any sandwich layer: `torch_ref.generation` runs the prelude and
  coda with them too.
- `CompiledCore`: FastCore's iteration (adapter + layers) through `torch.compile`, compiled once
  for all iterations: each call gets that iteration's K/V slots as tensor arguments.

Static cache: K and V [slots, B, S, H, K], written at [start, start + T) in place, so a CUDA graph
can capture whole calls. torch is imported lazily here, so importing this module needs no torch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from experiments.torch_ref.fast_layers import fast_layer, fast_layer_list, rope_table

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")


def compile_modes_for(flag_value: str) -> tuple[str, ...]:
    """torch.compile's modes to time for a Core case: the flag's, or with "fastest" every mode
    (experiments.core times each in the same process and keeps the fastest: which one that is
    changes with the case and, for the autotuning mode, from process to process; docs/peers.md)."""
    return COMPILE_MODES if flag_value == "fastest" else (flag_value,)


def compile_failure(error: BaseException) -> str | None:
    """The first line of `error` when it is torch.compile failing to build a graph (Inductor's
    or the backend's error, e.g. autotuning left with no kernel that ran), else None: a mode
    that fails so is left out of a "fastest" comparison, noted, while the others are timed."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    import torch._dynamo.exc
    import torch._inductor.exc

    kinds = (torch._inductor.exc.InductorError, torch._dynamo.exc.BackendCompilerFailed)
    if not isinstance(error, kinds):
        return None
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:200]


def run_each_mode(modes, run_mode, say, ended=None) -> tuple[dict[str, Any], dict[str, str]]:
    """`run_mode(mode)` for each of `modes` in turn, `say`ing "mode M (n of N)" as each starts
    where there are several: ({mode: what it returned}, {mode: why} for each mode that
    torch.compile failed to build (`compile_failure`), said and left out while another mode
    remains; with none, its error is raised). `ended(mode, what it returned)` as each ends:
    what an interrupted run keeps, an autotuning mode taking minutes."""
    done, failed = {}, {}
    for n, mode in enumerate(modes, 1):
        if len(modes) > 1:
            say(f"mode {mode} ({n} of {len(modes)})")
        try:
            done[mode] = run_mode(mode)
        except Exception as e:
            if (why := compile_failure(e)) is None or len(failed) + 1 == len(modes):
                raise
            failed[mode] = why
            say(f"mode {mode} left out, torch.compile failed: {why}")
            continue
        if ended is not None:
            ended(mode, done[mode])
    return done, failed


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


class ReferenceCore:
    """Adapter + Core layers with weights copied from a `huginn_jax.model.Core` state, written as
    plainly as the reference (hand-written float32 RMSNorm, RoPE recomputed at every call)."""

    def __init__(self, params: dict, config: Any, to_torch: Callable[[Any], Any]):
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
        """`iterations` Core iterations over the static caches [>= iterations · L, B, S, H, K];
        returns the new state [B, T, D]."""
        for i in range(iterations):
            state = self.step_static(state, embedded, i, start, k_cache, v_cache)
        return state

    def run_teaching(self, state, embedded, iterations: int, start: int, history: list):
        for i in range(iterations):
            state = self.step_teaching(state, embedded, i, start, history)
        return state


TorchCore = ReferenceCore  # the name this class had before FastCore existed


class FastCore:
    """Adapter + Core layers as a PyTorch performance engineer writes them (see the module
    docstring); the same math as `ReferenceCore` and `huginn_jax.layers`. Weights as
    `fast_layer_weights` lays them out (copies of JAX's [in, out] arrays), adapter included."""

    def __init__(self, params: dict, config: Any, to_torch: Callable[[Any], Any]):
        """As `ReferenceCore`: params = `nnx.to_pure_dict(nnx.state(core))` (or of the whole
        model: only `adapter` and `core_block` are read)."""
        import torch

        self.cfg = config
        self.adapter = torch.nn.Parameter(
            to_torch(params["adapter"]["kernel"]).t().contiguous(), requires_grad=False
        )
        self.layers = fast_layer_list(params["core_block"], config, to_torch)
        self._rope_tables: dict[tuple[int, int], tuple[Any, Any]] = {}

    def rope(self, start: int, tokens: int) -> tuple[Any, Any]:
        """(`rope_table` [T, K/2, 2] float32, the same memory as complex64 [T, K/2]) for positions
        [start, start + tokens), built at the first request and cached."""
        import torch

        key = (start, tokens)
        if key not in self._rope_tables:
            cfg = self.cfg
            device = self.adapter.device
            table = rope_table(start, tokens, cfg.head_dim, cfg.rope_base, device)
            self._rope_tables[key] = (table, torch.view_as_complex(table))
        return self._rope_tables[key]

    def layer(self, layer: dict, x, start: int, k_slot, v_slot, rope, *, compiled: bool = False):
        """One sandwich layer on x [B, T, D] at positions [start, start + T), writing its K/V into
        the slot's caches [B, S, H, K] in place. rope: `rope(start, T)[1]` (complex) eager, or
        `[0]` (real) with `compiled`. T > 1 needs start == 0 (a causal prefill)."""
        return fast_layer(self.cfg, layer, x, start, k_slot, v_slot, rope, compiled=compiled)

    def step(self, state, embedded, k_slots, v_slots, start: int, rope, *, compiled=False):
        """One Core iteration: adapter(concat[state, embedded]) then every layer j, writing the
        slots k_slots[j], v_slots[j] [B, S, H, K] (this iteration's: `slots`)."""
        import torch
        import torch.nn.functional as F

        x = F.linear(torch.cat([state, embedded], dim=-1), self.adapter)
        for j, layer in enumerate(self.layers):
            x = self.layer(layer, x, start, k_slots[j], v_slots[j], rope, compiled=compiled)
        return x

    def slots(self, k_cache, v_cache, iteration: int) -> tuple[list[Any], list[Any]]:
        """Iteration `iteration`'s K and V slots: per layer j, views [B, S, H, K] of the caches
        [slots, B, S, H, K]. One tensor per layer (not one [L, ...] view), so that torch.compile
        writes each slot in place (a stacked view made Inductor copy the whole slot back)."""
        first = iteration * len(self.layers)
        slots = range(first, first + len(self.layers))
        return [k_cache[s] for s in slots], [v_cache[s] for s in slots]

    def run_static(self, state, embedded, iterations: int, start: int, k_cache, v_cache):
        """As `ReferenceCore.run_static`: `iterations` iterations over the static caches."""
        rope = self.rope(start, state.shape[1])[1]
        for i in range(iterations):
            state = self.step(state, embedded, *self.slots(k_cache, v_cache, i), start, rope)
        return state


class CompiledCore(FastCore):
    """FastCore's iteration compiled by `torch.compile(fullgraph=True, dynamic=False, mode=...)`.

    The compiled unit is one iteration (adapter + layers), called r times per `run_static` with
    that iteration's K/V slot views and the cached RoPE table as tensor arguments: the same
    shapes and strides at every iteration, so it compiles once (`graphs_compiled` counts). The
    start position is a Python int, specialised into the graph (one compile per value). With
    mode "reduce-overhead", Inductor's CUDA-graph trees record each call; the slot views, the
    embedded input and the table are marked static addresses (no copy into the graph's inputs
    at replay; mutated inputs that are not static would make Inductor skip the CUDA graph), and
    every `run_static` begins a new step (`torch.compiler.cudagraph_mark_step_begin`).
    """

    def __init__(
        self, params: dict, config: Any, to_torch: Callable[[Any], Any], mode: str = "default"
    ):
        import torch

        if mode not in COMPILE_MODES:
            raise ValueError(f"compile mode {mode!r}: expected one of {', '.join(COMPILE_MODES)}")
        super().__init__(params, config, to_torch)
        self.mode = mode
        # A fresh Dynamo state: compiled entries of earlier instances live on the same code
        # object and would count toward its recompile limit (past it, Dynamo runs eager).
        torch._dynamo.reset()
        self._graphs_before = _unique_graphs()
        self.compiled_step = torch.compile(
            self._iteration, fullgraph=True, dynamic=False, mode=mode
        )

    def _iteration(self, state, embedded, k_slots, v_slots, table, start: int):
        return self.step(state, embedded, k_slots, v_slots, start, table, compiled=True)

    def graphs_compiled(self) -> int:
        """Graphs Dynamo compiled since this instance was made (1 once warm: no recompiles)."""
        return _unique_graphs() - self._graphs_before

    def run_static(self, state, embedded, iterations: int, start: int, k_cache, v_cache):
        import torch

        table = self.rope(start, state.shape[1])[0]
        static = self.mode == "reduce-overhead"
        if static:
            torch.compiler.cudagraph_mark_step_begin()
            for tensor in (embedded, table):
                torch._dynamo.mark_static_address(tensor)
        for i in range(iterations):
            k_slots, v_slots = self.slots(k_cache, v_cache, i)
            if static:
                for slot in (*k_slots, *v_slots):
                    torch._dynamo.mark_static_address(slot)
            state = self.compiled_step(state, embedded, k_slots, v_slots, table, start)
        return state


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


CORES = {"reference": ReferenceCore, "fast": FastCore, "compiled": CompiledCore}


def make_core(name: str, params: dict, config: Any, to_torch, **kwargs: Any):
    """CORES[name](params, config, to_torch, **kwargs) (kwargs: `mode` of "compiled")."""
    if name not in CORES:
        raise ValueError(f"unknown core {name!r}; known: {', '.join(CORES)}")
    return CORES[name](params, config, to_torch, **kwargs)


def to_torch_fn(device: str, dtype):
    """JAX array → torch tensor: zero-copy through DLPack on CUDA, through numpy on the CPU."""
    import torch

    def convert(array):
        if device == "cuda":
            return torch.from_dlpack(array).to(dtype)
        # A writable host copy: np.asarray of a JAX array is read-only, which torch warns about.
        return torch.from_numpy(np.array(array, dtype=np.float32)).to(dtype)

    return convert
