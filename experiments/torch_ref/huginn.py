"""The whole Huginn model in PyTorch, for a decode loop side by side with the JAX one.

embedding × embed_scale → prelude → Core loop (`core.ReferenceCore`, or the Core given: adapter
on concat[state, embedded], state first) → ln_f → coda → ln_f → tied head, with the layers of
`core.py` (RMSNorm and interleaved-pair RoPE in float32, qk_bias added before RoPE, gated SiLU
MLP whose gate is the first half of fc). Generation as `huginn_jax.generate.greedy`: a fixed
number of Core iterations, a zero initial state (init_scale 0), greedy argmax. `run_loop` runs
any of the PyTorch generation loops that `experiments.generate_vs_torch` compares (LOOPS; the
compiled one lives in `torch_ref.generation` and `torch_ref.generation_loop`).

The KV cache is preallocated, K and V each [L, B, S, H, K] with the slots of
`huginn_jax.kv_cache` ("full"): prelude layer j at j, Core (iteration i, layer j) at P + C·i + j,
coda layer j after the Core slots; every step writes its position in place. A decode step's shapes
and addresses therefore depend only on its position, so `decode_graph` can capture a whole token
(prelude, every iteration, coda, head, argmax) in one CUDA graph for that position.

Weights: the nested dict of `nnx.to_pure_dict(nnx.state(model))` (kernels [in, out]), turned into
tensors by `core.to_torch_fn` (zero-copy DLPack on CUDA). This module imports nothing from JAX and
imports torch lazily, like the rest of `torch_ref`.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from experiments.torch_ref.chain import capture_graph
from experiments.torch_ref.core import ReferenceCore, layer_list, make_core, rms_norm

if TYPE_CHECKING:
    import torch

    from experiments.torch_ref.core import FastCore

_GRAPH_WARMUP = 2  # side-stream runs before a capture, as the CUDA-graph docs ask


class TorchHuginn:
    """Huginn with weights taken from a `huginn_jax.model.Huginn` state, and a static KV cache.

    Call `setup_cache` first; `prefill`, `decode_step`, `forward` and `decode_graph` use it.
    """

    def __init__(self, params: dict, config: Any, to_torch: Any, core: Any = "reference"):
        """params: `nnx.to_pure_dict(nnx.state(model))` (keys wte, prelude/{i}, adapter,
        core_block/{j}, coda/{i}, ln_f; int or str layer keys); config: its `HuginnConfig`;
        to_torch: one JAX (or numpy) array → torch tensor (`core.to_torch_fn`); core: which
        implementation runs the Core iterations, a name of `core.CORES` or a factory
        (params, config, to_torch) → core; the prelude and coda always run ReferenceCore's code."""
        import torch

        self.cfg = config
        self.core = ReferenceCore(params, config, to_torch)  # adapter + Core layers
        # What runs the Core iterations (`run_static`); the prelude and coda use self.core.
        if isinstance(core, str):
            self.core_loop = (
                self.core if core == "reference" else make_core(core, params, config, to_torch)
            )
        else:
            self.core_loop = core(params, config, to_torch)
        self.wte = to_torch(params["wte"])  # [V, D]
        self.prelude = layer_list(params["prelude"], config, to_torch)
        self.coda = layer_list(params["coda"], config, to_torch)
        self.ln_f = to_torch(params["ln_f"]["weight"])  # [D], applied before and after the coda
        # [D, V]: the tied head is wte's transposed view, no copy.
        self.head = self.wte.T if config.tie_embeddings else to_torch(params["lm_head"])
        self.device, self.dtype = self.wte.device, self.wte.dtype
        # JAX rounds embed_scale to the weight dtype before multiplying; so does this 0-d tensor.
        self.embed_scale = torch.tensor(config.embed_scale, dtype=self.dtype, device=self.device)
        self.k_cache: torch.Tensor | None = None  # [L, B, S, H, K]
        self.v_cache: torch.Tensor | None = None
        self.max_steps = 0

    # ---------------------------------------------------------------- cache

    def setup_cache(self, batch: int, max_len: int, num_steps: int) -> None:
        """Zeroed K and V [P + num_steps·C + Q, batch, max_len, H, K] in the weights' dtype."""
        import torch

        cfg = self.cfg
        slots = cfg.n_layers_in_prelude + num_steps * cfg.n_core + cfg.n_layers_in_coda
        shape = (slots, batch, max_len, cfg.n_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.max_steps = num_steps

    @property
    def cache_bytes(self) -> int:
        if self.k_cache is None or self.v_cache is None:
            return 0
        return sum(c.numel() * c.element_size() for c in (self.k_cache, self.v_cache))

    def _check(self, ids_BxT: torch.Tensor, num_steps: int, start: int) -> None:
        if self.k_cache is None:
            raise ValueError("no KV cache: call setup_cache(batch, max_len, num_steps) first")
        slots, batch, max_len = self.k_cache.shape[:3]
        b, t = ids_BxT.shape
        if not 1 <= num_steps <= self.max_steps:
            raise ValueError(f"num_steps={num_steps} must lie in [1, {self.max_steps}] (cache)")
        if b != batch or start + t > max_len:
            raise ValueError(
                f"ids {tuple(ids_BxT.shape)} at start={start} do not fit the cache "
                f"(batch {batch}, max_len {max_len})"
            )
        if t > 1 and start != 0:
            # core.ReferenceCore's attention is causal only for a fresh prefill from position 0.
            raise ValueError(f"several new positions ({t}) need start=0, got start={start}")

    # ---------------------------------------------------------------- forward

    def forward(
        self, ids_BxT: torch.Tensor, num_steps: int, start: int = 0, *, last_only: bool = False
    ) -> torch.Tensor:
        """Logits float32 [B, T, V] (or [B, V] of the last position with `last_only`) for ids
        [B, T] int at positions [start, start + T), writing every slot's K/V there in place.

        T > 1 only from start 0 (a prefill); T == 1 anywhere (a decode step over the cache).
        """
        import torch
        import torch.nn.functional as F

        self._check(ids_BxT, num_steps, start)
        k, v = self.k_cache, self.v_cache
        prelude, core = len(self.prelude), num_steps * self.cfg.n_core
        coda_first = prelude + self.max_steps * self.cfg.n_core
        eps = self.cfg.norm_eps

        x = F.embedding(ids_BxT, self.wte) * self.embed_scale  # [B, T, D]
        for j, layer in enumerate(self.prelude):
            x = self.core.block_static(layer, x, start, k[j], v[j])
        state = torch.zeros_like(x)  # init_scale 0
        # Slicing the slot axis gives views: the Core writes straight into this cache.
        core_k, core_v = k[prelude : prelude + core], v[prelude : prelude + core]
        state = self.core_loop.run_static(state, x, num_steps, start, core_k, core_v)
        y = rms_norm(state, self.ln_f, eps)
        for j, layer in enumerate(self.coda):
            slot = coda_first + j
            y = self.core.block_static(layer, y, start, k[slot], v[slot])
        if last_only:
            y = y[:, -1:]  # the coda ran on every position (their K/V); the head on the last
        y = rms_norm(y, self.ln_f, eps)
        logits = self._head(y.flatten(0, 1)).unflatten(0, y.shape[:2])
        return logits[:, -1] if last_only else logits

    def _head(self, x_NxD: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, V] of x [N, D] through the (tied) head [D, V]: the product in the
        weights' dtype, then float32, as `huginn_jax.model.run_coda` and the reference's bf16
        lm_head compute it (so that bf16 logits round, and argmax ties break, alike)."""
        return (x_NxD @ self.head).float()

    def prefill(self, ids_BxT: torch.Tensor, num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt ids [B, T] from position 0: (greedy next token [B] int64, logits [B, V]
        float32 of the last position)."""
        logits = self.forward(ids_BxT, num_steps, 0, last_only=True)
        return logits.argmax(-1), logits

    def decode_step(
        self, ids_Bx1: torch.Tensor, position: int, num_steps: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token ids [B, 1] at `position`, eager: (next token [B] int64, logits [B, V])."""
        logits = self.forward(ids_Bx1, num_steps, position, last_only=True)
        return logits.argmax(-1), logits

    def decode_graph(
        self, ids_Bx1: torch.Tensor, position: int, num_steps: int, warmup: int = _GRAPH_WARMUP
    ) -> DecodeGraph:
        """`decode_step` at `position` captured in a CUDA graph (CUDA only); see DecodeGraph."""
        return DecodeGraph(self, ids_Bx1, position, num_steps, warmup)


class DecodeGraph:
    """One whole decode token (prelude, `num_steps` iterations, coda, head, argmax) captured in a
    CUDA graph at a fixed position.

    Reads the static buffer ids_Bx1 (int64 [B, 1], filled by the caller before each replay);
    `replay` rewrites every slot's K/V at `position` and leaves the next token in `next_ids`
    ([B] int64) and its logits in `logits` ([B, V] float32), both static buffers. The warm-up runs
    before the capture execute the same step on the same input, so the K/V they write are the
    ones a replay writes.
    """

    def __init__(
        self, model: TorchHuginn, ids_Bx1: torch.Tensor, position: int, num_steps: int, warmup: int
    ):
        if model.device.type != "cuda":
            raise ValueError("a CUDA graph needs the model on a CUDA device")

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            logits = model.forward(ids_Bx1, num_steps, position, last_only=True)
            return logits, logits.argmax(-1)

        self.graph, (self.logits, self.next_ids) = capture_graph(step, warmup)

    def replay(self) -> torch.Tensor:
        """Runs the captured step (asynchronously); returns the static next_ids [B]."""
        self.graph.replay()
        return self.next_ids


# -------------------------------------------------------------------- timed greedy generation


@dataclasses.dataclass(frozen=True)
class TorchGeneration:
    """What `generate_greedy` (and `generation_loop.generate_compiled`) return. Token 0 comes from
    the prefill, as in huginn_jax."""

    tokens: np.ndarray  # [B, N] int64
    logits: np.ndarray  # [B, N, V] float32: what each token was drawn from
    prefill_s: float  # the timed prefill, after `warmup` untimed ones
    latencies_s: list[float]  # N - 1 decode tokens: each token's time (see the loop that made it)
    capture_s: list[float]  # per decode token: warm-up + capture (not in latencies_s); [] else
    graph: bool  # decode tokens replayed from CUDA graphs
    setup_s: float = 0.0  # untimed: prefill warm-ups, compilation, warm-ups and captures
    graphs_compiled: int | None = None  # Dynamo graphs (compiled loops only)

    @property
    def latency_median_s(self) -> float | None:
        return statistics.median(self.latencies_s) if self.latencies_s else None


def start_generation(model, prompt_ids_BxT: np.ndarray, max_new_tokens: int, num_steps: int):
    """The model's cache set up for the prompt [B, T] and `max_new_tokens` more positions: (the
    prompt as int64 on the model's device, sync), sync() waiting for the device's queued work (a
    no-op on the CPU)."""
    import torch

    cuda = model.device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    batch, prompt_len = prompt_ids_BxT.shape
    model.setup_cache(batch, prompt_len + max_new_tokens, num_steps)
    prompt = torch.as_tensor(np.asarray(prompt_ids_BxT), dtype=torch.int64, device=model.device)
    return prompt, sync


def timed_prefill(prefill: Callable[[], Any], warmup: int, sync: Callable[[], None]):
    """prefill() `warmup` times untimed, then once timed: (its result, the warm-up's seconds,
    the timed call's seconds), each until sync() returns."""
    sync()
    t0 = time.perf_counter()
    for _ in range(warmup):
        prefill()
    sync()
    setup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    result = prefill()
    sync()
    return result, setup_s, time.perf_counter() - t0


def generate_greedy(
    model: TorchHuginn,
    prompt_ids_BxT: np.ndarray,
    max_new_tokens: int,
    num_steps: int,
    *,
    graph: bool = True,
    warmup: int = _GRAPH_WARMUP,
) -> TorchGeneration:
    """Greedy generation of `max_new_tokens` tokens after prompt ids [B, T], timed per token.

    A cache of T + max_new_tokens positions (as huginn_jax's default); the eager prefill runs
    `warmup` times untimed (the cache is rewritten with the same values), then once timed; then
    one step per token at positions T, T + 1, ...: with `graph` (CUDA), that position's
    DecodeGraph is captured (untimed, `capture_s`) and then one replay is timed until
    `torch.cuda.synchronize` returns; without, the eager `decode_step` is timed. The next token
    stays on the device (copied into the graph's input buffer); logits go to the host untimed.
    """
    import torch

    if graph and model.device.type != "cuda":
        raise ValueError("graph=True needs the model on a CUDA device")
    prompt, sync = start_generation(model, prompt_ids_BxT, max_new_tokens, num_steps)
    prompt_len = prompt.shape[1]
    with torch.no_grad():  # no tensor here needs grad; this only skips autograd bookkeeping
        (token, logits), setup_s, prefill_s = timed_prefill(
            lambda: model.prefill(prompt, num_steps), warmup, sync
        )
        tokens, all_logits = [token.cpu()], [logits.cpu()]
        ids = token[:, None].clone()  # [B, 1]: the decode input, a buffer outside any graph pool
        latencies, captures = [], []
        for n in range(1, max_new_tokens):
            position = prompt_len + n - 1
            if graph:
                t0 = time.perf_counter()
                step = model.decode_graph(ids, position, num_steps, warmup)
                sync()
                captures.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                token = step.replay()
                sync()
                latencies.append(time.perf_counter() - t0)
                logits = step.logits
            else:
                t0 = time.perf_counter()
                token, logits = model.decode_step(ids, position, num_steps)
                sync()
                latencies.append(time.perf_counter() - t0)
            tokens.append(token.cpu())
            all_logits.append(logits.cpu())
            ids.copy_(token[:, None])
            step = None  # frees the graph (and its memory pool) before the next capture
    return TorchGeneration(
        tokens=torch.stack(tokens, dim=1).numpy(),
        logits=torch.stack(all_logits, dim=1).numpy(),
        prefill_s=prefill_s,
        latencies_s=latencies,
        capture_s=captures,
        graph=graph,
        setup_s=setup_s + sum(captures),
    )


# -------------------------------------------------------------------- the loops compared

LOOPS = ("torch_compile", "torch_graph", "torch_reference")


def run_loop(
    impl: str,
    params: dict,
    config: Any,
    to_torch: Callable[[Any], Any],
    prompt_ids_BxT: np.ndarray,
    max_new_tokens: int,
    num_steps: int,
    *,
    compile_mode: str = "default",
    warmup: int = 2,
    fast_core: FastCore | None = None,
    trace: Callable[[Callable[[], Any]], Any] | None = None,
) -> TorchGeneration:
    """One PyTorch generation loop of LOOPS over these weights, on fresh caches, whose caches
    and compiled code are freed before it returns:
    - torch_compile: `generation.CompiledHuginn` in `compile_mode` + `generate_compiled`;
    - torch_graph: `TorchHuginn` with FastCore's Core, a CUDA graph captured per position
      (`generate_greedy`; eager on the CPU);
    - torch_reference: the same loop with ReferenceCore's Core (reference-faithful).
    fast_core: a FastCore of the same weights, shared by torch_compile and torch_graph.
    trace: torch_compile's `generate_compiled` hook (its decode step, run again after the
    timed tokens); the loops that capture a graph per position take none."""
    import torch

    from experiments.torch_ref.generation import CompiledHuginn
    from experiments.torch_ref.generation_loop import generate_compiled

    if impl not in LOOPS:
        raise ValueError(f"unknown torch loop {impl!r}; known: {', '.join(LOOPS)}")
    args = (prompt_ids_BxT, max_new_tokens, num_steps)
    if trace is not None and impl != "torch_compile":
        raise ValueError(f"{impl} captures a graph per position: only torch_compile is traced")
    if impl == "torch_compile":
        model = CompiledHuginn(params, config, to_torch, mode=compile_mode, core=fast_core)
        try:
            return generate_compiled(model, *args, warmup=warmup, trace=trace)
        finally:
            model.k, model.v, model.units = [], [], {}  # the caches, and the cycle through self
            torch._dynamo.reset()  # compiled code and Inductor's CUDA-graph pools
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if impl == "torch_reference":
        core: Any = "reference"
    else:
        core = "fast" if fast_core is None else (lambda *_: fast_core)
    eager = TorchHuginn(params, config, to_torch, core=core)
    cuda = eager.device.type == "cuda"
    try:
        return generate_greedy(eager, *args, graph=cuda, warmup=warmup)
    finally:
        eager.k_cache = eager.v_cache = None
        if cuda:
            torch.cuda.empty_cache()
