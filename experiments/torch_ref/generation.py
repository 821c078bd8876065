"""Greedy Huginn generation through torch.compile, gpt-fast style: one compilation and one CUDA
graph serve every decode position.

The decode step reads its position from a tensor (`CompiledHuginn.pos`, int64 [1]), never a
Python int: every layer writes its K/V there with `index_copy_` into a static cache (K and V: one
[B, S, H, K] tensor per slot, the [slots, B, S, H, K] cache of `torch_ref.huginn` split by slot
so that no two inputs of a compiled call share a storage), attends over all S cached positions
with an additive mask (-inf after the position), and rotates q and k by the rows of a RoPE
table of all S positions built once, gathered by the position tensor.

Compiled units (`torch.compile(fullgraph=True, dynamic=False, mode=...)`), each compiled once:
the prelude (embedding, prelude layers; it also makes the token's mask, RoPE rows and zero
state), ONE Core iteration (adapter + Core layers, called r times with that iteration's slots:
a whole unrolled token would be a graph r times larger), and the coda (ln_f, coda layers, ln_f,
head, argmax). The prefill (positions [0, T), a Python constant) has its own three units:
causal attention over the new positions only (`fast_layers.fast_layer`), as FastCore's prefill.

A decode token = prelude, r iterations, coda, then the next token copied into the input buffer
`ids` and `pos` advanced, all on the device. On CUDA, with modes "default" and
"max-autotune-no-cudagraphs", that whole token is captured once in one CUDA graph and replayed
for every position; with "reduce-overhead", Inductor's CUDA-graph trees record the r + 2
compiled calls of a token (their inputs marked static addresses) and replay them at every later
token. On the CPU (tests) the compiled units run without graphs. The timed loop over these
tokens is `torch_ref.generation_loop`. torch is imported lazily.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from experiments.torch_ref.core import COMPILE_MODES, FastCore, _unique_graphs
from experiments.torch_ref.fast_layers import (
    fast_layer,
    fast_layer_list,
    fast_out,
    fast_qkv,
    rope_table,
)

CACHE_ALIGN = 16  # cache positions rounded up to this: aligned attention-mask rows
# The compiled methods (`_<name>`): prefill's and decode's prelude, Core iteration and coda.
UNITS = tuple(f"{p}_{u}" for p in ("prefill", "decode") for u in ("prelude", "iteration", "coda"))


def layer_at(cfg: Any, layer: dict, x, pos_T, k_slot, v_slot, rope_T, mask_TxS):
    """One FastCore-layout sandwich layer on x [B, T, D] at the positions held by the tensor
    pos_T (int64 [T]): writes K and V there (`index_copy_` into the slot's [B, S, H, K] caches),
    then attends over all S positions with the additive mask_TxS (0 where visible, -inf after
    the query's position). rope_T: the RoPE table's rows of pos_T, float32 [T, K/2, 2]."""
    import torch.nn.functional as F

    b, t, d = x.shape
    q, key, v = fast_qkv(cfg, layer, x, rope_T, compiled=True)
    k_slot.index_copy_(1, pos_T, key)
    v_slot.index_copy_(1, pos_T, v)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k_slot.transpose(1, 2), v_slot.transpose(1, 2), attn_mask=mask_TxS
    )
    return fast_out(cfg, layer, x, out.transpose(1, 2).reshape(b, t, d))


class CompiledHuginn:
    """Huginn in FastCore's layout (prelude, Core, coda), with compiled prefill and decode units.

    Call `setup_cache` first. `prefill(ids)` runs the prompt from position 0; `decode_token()`
    one token from the buffers `ids` [B, 1] and `pos` [1] (the caller fills them); both return
    (next token [B] int64, its logits [B, V] float32). `graphs_compiled()` counts the Dynamo
    graphs since construction: 6 once prefill and decode ran, whatever the positions.
    """

    def __init__(
        self,
        params: dict,
        config: Any,
        to_torch: Callable[[Any], Any],
        *,
        mode: str = "default",
        core: FastCore | None = None,
    ):
        """params: `nnx.to_pure_dict(nnx.state(model))`; to_torch: `core.to_torch_fn`; mode:
        torch.compile's mode (COMPILE_MODES); core: a FastCore of the same weights to share
        (its adapter and Core layers), else one is made."""
        import torch

        if mode not in COMPILE_MODES:
            raise ValueError(f"compile mode {mode!r}: expected one of {', '.join(COMPILE_MODES)}")

        def param(tensor):
            return torch.nn.Parameter(tensor, requires_grad=False)

        self.cfg, self.mode = config, mode
        self.core = core if core is not None else FastCore(params, config, to_torch)
        self.prelude = fast_layer_list(params["prelude"], config, to_torch)
        self.coda = fast_layer_list(params["coda"], config, to_torch)
        self.wte = param(to_torch(params["wte"]))  # [V, D]; zero-copy on CUDA
        self.ln_f = param(to_torch(params["ln_f"]["weight"]))
        self.lm_head = (
            None if config.tie_embeddings else param(to_torch(params["lm_head"]).t().contiguous())
        )
        self.device, self.dtype = self.wte.device, self.wte.dtype
        # JAX rounds embed_scale to the weight dtype before multiplying; so does this tensor.
        self.embed_scale = param(
            torch.tensor(config.embed_scale, dtype=self.dtype, device=self.device)
        )
        self.k: list[Any] = []
        self.v: list[Any] = []
        self.num_steps = 0
        # A fresh Dynamo state: entries of earlier instances live on the same code objects and
        # would count as recompiles.
        torch._dynamo.reset()
        self._graphs_before = _unique_graphs()
        self.units = {
            name: torch.compile(getattr(self, f"_{name}"), fullgraph=True, dynamic=False, mode=mode)
            for name in UNITS
        }

    def graphs_compiled(self) -> int:
        """Dynamo graphs compiled since construction (6 once prefill and decode ran)."""
        return _unique_graphs() - self._graphs_before

    def setup_cache(self, batch: int, max_len: int, num_steps: int) -> None:
        """Zeroed K and V slots (prelude, num_steps · Core, coda) [B, S, H, K], S = max_len
        rounded up to CACHE_ALIGN; the RoPE table and position index of S positions; the
        decode's input buffers `ids` [B, 1] and `pos` [1] (int64)."""
        import torch

        cfg, dev = self.cfg, self.device
        seq = -(-max_len // CACHE_ALIGN) * CACHE_ALIGN
        slots = len(self.prelude) + num_steps * cfg.n_core + len(self.coda)
        shape = (batch, seq, cfg.n_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(slots)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(slots)]
        self.num_steps = num_steps
        self.table = rope_table(0, seq, cfg.head_dim, cfg.rope_base, dev)  # [S, K/2, 2]
        self.positions = torch.arange(seq, device=dev)
        self.ids = torch.zeros((batch, 1), dtype=torch.int64, device=dev)
        self.pos = torch.zeros((1,), dtype=torch.int64, device=dev)
        if self.mode == "reduce-overhead":
            # Read and written in place at their addresses by Inductor's CUDA graphs; a mutated
            # input that is not static would make Inductor skip its graphs.
            for tensor in (*self.k, *self.v, self.table, self.positions, self.ids, self.pos):
                torch._dynamo.mark_static_address(tensor)

    # ---------------------------------------------------------------- compiled units

    def _embed(self, ids_BxT):
        import torch.nn.functional as F

        return F.embedding(ids_BxT, self.wte) * self.embed_scale

    def _ln_f(self, x):
        import torch.nn.functional as F

        return F.rms_norm(x, (x.shape[-1],), self.ln_f, self.cfg.norm_eps)

    def _logits(self, y_BxTxD):
        """ln_f and the head on the last position: float32 logits [B, V] (the product in the
        weights' dtype, as JAX's and the reference's head) and their argmax [B]."""
        import torch.nn.functional as F

        head = self.wte if self.lm_head is None else self.lm_head  # [V, D]
        logits = F.linear(self._ln_f(y_BxTxD[:, -1]), head).float()
        return logits, logits.argmax(-1)

    def _prefill_prelude(self, ids_BxT, k_slots, v_slots):
        import torch

        rope = self.table[: ids_BxT.shape[1]]
        x = self._embed(ids_BxT)
        for j, layer in enumerate(self.prelude):
            x = fast_layer(self.cfg, layer, x, 0, k_slots[j], v_slots[j], rope, compiled=True)
        return x, torch.zeros_like(x), rope

    def _prefill_iteration(self, state, embedded, k_slots, v_slots, rope):
        return self.core.step(state, embedded, k_slots, v_slots, 0, rope, compiled=True)

    def _prefill_coda(self, state, k_slots, v_slots, rope):
        y = self._ln_f(state)
        for j, layer in enumerate(self.coda):
            y = fast_layer(self.cfg, layer, y, 0, k_slots[j], v_slots[j], rope, compiled=True)
        return self._logits(y)

    def _decode_prelude(self, ids_BxT, pos_T, k_slots, v_slots):
        import torch

        rope = self.table[pos_T]  # [T, K/2, 2]
        visible = self.positions[None, :] <= pos_T[:, None]  # [T, S]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=visible.device)
        mask = mask.masked_fill(~visible, float("-inf"))
        x = self._embed(ids_BxT)
        for j, layer in enumerate(self.prelude):
            x = layer_at(self.cfg, layer, x, pos_T, k_slots[j], v_slots[j], rope, mask)
        return x, torch.zeros_like(x), rope, mask

    def _decode_iteration(self, state, embedded, k_slots, v_slots, pos_T, rope, mask):
        import torch
        import torch.nn.functional as F

        x = F.linear(torch.cat([state, embedded], dim=-1), self.core.adapter)
        for j, layer in enumerate(self.core.layers):
            x = layer_at(self.cfg, layer, x, pos_T, k_slots[j], v_slots[j], rope, mask)
        return x

    def _decode_coda(self, state, pos_T, k_slots, v_slots, rope, mask):
        y = self._ln_f(state)
        for j, layer in enumerate(self.coda):
            y = layer_at(self.cfg, layer, y, pos_T, k_slots[j], v_slots[j], rope, mask)
        return self._logits(y)

    # ---------------------------------------------------------------- one call

    def _slots(self, part: str, iteration: int = 0) -> tuple[list[Any], list[Any]]:
        """The K and V slot lists of the prelude, Core iteration `iteration`, or the coda."""
        p, c = len(self.prelude), self.cfg.n_core
        first, n = {
            "prelude": (0, p),
            "core": (p + c * iteration, c),
            "coda": (p + c * self.num_steps, len(self.coda)),
        }[part]
        return self.k[first : first + n], self.v[first : first + n]

    def prefill(self, ids_BxT) -> tuple[Any, Any]:
        """The prompt ids [B, T] (int64, on the model's device) at positions [0, T): (next token
        [B] int64, logits [B, V] float32 of the last position)."""
        import torch

        if not self.k:
            raise ValueError("no KV cache: call setup_cache(batch, max_len, num_steps) first")
        if ids_BxT.shape[0] != self.ids.shape[0] or ids_BxT.shape[1] > self.k[0].shape[1]:
            raise ValueError(f"ids {tuple(ids_BxT.shape)} do not fit the cache")
        if self.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        u = self.units
        x, state, rope = u["prefill_prelude"](ids_BxT, *self._slots("prelude"))
        for i in range(self.num_steps):
            state = u["prefill_iteration"](state, x, *self._slots("core", i), rope)
        logits, token = u["prefill_coda"](state, *self._slots("coda"), rope)
        return token, logits

    def decode_token(self) -> tuple[Any, Any]:
        """One token: ids [B, 1] at position `pos`, r iterations (`setup_cache`'s num_steps):
        (next token [B] int64, logits [B, V] float32). Writes every slot at `pos`."""
        u = self.units
        x, state, rope, mask = u["decode_prelude"](self.ids, self.pos, *self._slots("prelude"))
        for i in range(self.num_steps):
            state = u["decode_iteration"](state, x, *self._slots("core", i), self.pos, rope, mask)
        logits, token = u["decode_coda"](state, self.pos, *self._slots("coda"), rope, mask)
        return token, logits
