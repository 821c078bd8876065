"""The PyTorch side of `experiments.core`: one runner per (impl, case), r Core iterations a call.

  torch_compile    CompiledCore (FastCore's iteration through torch.compile, compiled once for
                   all iterations); on CUDA, modes "default" and "max-autotune-no-cudagraphs":
                   the r compiled calls captured in one CUDA graph; "reduce-overhead": called
                   directly, Inductor's CUDA-graph trees record and replay them
  torch_graph      FastCore, r iterations captured in one CUDA graph
  torch_eager      FastCore, eager
  torch_reference  ReferenceCore (reference-faithful), r iterations captured in one CUDA graph
  torch_teaching   ReferenceCore with the teaching cache (history re-concatenated), eager

Weights, state, embedded input and cache history are the JAX arrays' values (zero-copy through
DLPack on CUDA, where the caches are then written in place in JAX's buffers). On a machine without
CUDA every impl runs without a CUDA graph (for tests); `experiments.core` skips CUDA_ONLY_IMPLS
there. torch is imported lazily.
"""

from __future__ import annotations

import time
from typing import Any

from experiments.torch_ref.chain import capture_graph
from experiments.torch_ref.core import (
    COMPILE_MODES,
    CompiledCore,
    FastCore,
    ReferenceCore,
    to_torch_fn,
)

__all__ = ["COMPILE_MODES", "CUDA_ONLY_IMPLS", "TORCH_IMPLS", "TorchRunner", "torch_device"]

TORCH_IMPLS = ("torch_compile", "torch_graph", "torch_eager", "torch_reference", "torch_teaching")
# Timed through CUDA graphs: r iterations captured in one (torch_compile with "reduce-overhead":
# Inductor's CUDA-graph trees instead).
CUDA_ONLY_IMPLS = ("torch_compile", "torch_graph", "torch_reference")
# Calls that compile, autotune at first launch and, with "reduce-overhead", warm up and record
# Inductor's CUDA graphs (its trees record at the second call); all inside compile_seconds.
COMPILE_CALLS = 3
_GRAPH_WARMUP = 2  # side-stream runs before a capture


def _cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def torch_device() -> str:
    """Where the runners compute: "cuda" when torch sees a CUDA device, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class TorchRunner:
    """The Core of `case` in PyTorch over the same weights, state and history as the JAX runner.

    `runner()` runs r iterations from the same state and history (the static cache is rewritten
    at the same positions) and returns the output state tensor [B, T, D]; `sync` waits for the
    device; `release()` frees everything. `compile_seconds`: torch_compile's wall time of its
    first COMPILE_CALLS calls (compilation included), None for the other impls;
    `graphs_compiled`: Dynamo graphs compiled for it (1: no recompile across iterations).
    """

    def __init__(
        self,
        impl: str,
        params: dict,
        cfg: Any,
        state: Any,
        embedded: Any,
        cache: Any,
        case: Any,
        dtype_name: str,
        compile_mode: str = "default",
    ):
        """params: `nnx.to_pure_dict` of the Core's state; state, embedded: JAX arrays [B, T, D];
        cache: a `huginn_jax.KVCache` (k, v [slots, B, S, H, K]); case: has iterations, start,
        mode, batch; dtype_name: "bf16" or "fp32"; compile_mode: torch.compile's mode for
        torch_compile (one of COMPILE_MODES)."""
        import torch

        if impl not in TORCH_IMPLS:
            raise ValueError(f"unknown torch impl {impl!r}; known: {', '.join(TORCH_IMPLS)}")
        if compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile mode {compile_mode!r}: expected one of {COMPILE_MODES}")
        self.impl, self.case = impl, case
        self.device = torch_device()
        cuda = self.device == "cuda"
        dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
        convert = to_torch_fn(self.device, dtype)
        self.state, self.embedded = convert(state), convert(embedded)
        self.k, self.v = convert(cache.k), convert(cache.v)
        self.sync = torch.cuda.synchronize if cuda else (lambda: None)
        self.compile_seconds: float | None = None
        self.graphs_compiled: int | None = None
        r, start = case.iterations, case.start
        if impl == "torch_compile":
            self.core = CompiledCore(params, cfg, convert, mode=compile_mode)
        elif impl in ("torch_graph", "torch_eager"):
            self.core = FastCore(params, cfg, convert)
        else:
            self.core = ReferenceCore(params, cfg, convert)

        if impl == "torch_teaching":
            n = r * cfg.n_core
            history = [(self.k[s, :, :start], self.v[s, :, :start]) for s in range(n)]

            def fn():
                return self.core.run_teaching(self.state, self.embedded, r, start, history)

        else:

            def fn():
                return self.core.run_static(self.state, self.embedded, r, start, self.k, self.v)

        if impl == "torch_compile":
            skips = _cudagraph_skips()
            self.sync()
            t0 = time.perf_counter()
            for _ in range(COMPILE_CALLS):
                fn()
            self.sync()
            self.compile_seconds = time.perf_counter() - t0
            self.graphs_compiled = self.core.graphs_compiled()
            if self.graphs_compiled != 1:
                raise RuntimeError(
                    f"torch_compile compiled {self.graphs_compiled} graphs for one Core "
                    "iteration (expected 1: the same graph for every iteration)"
                )
            if cuda and compile_mode == "reduce-overhead" and _cudagraph_skips() > skips:
                raise RuntimeError(
                    "torch_compile: Inductor skipped its CUDA graphs (the log's 'skipping "
                    "cudagraphs' line says why); the timing would be of launches, not graphs"
                )
        if (
            cuda
            and impl in CUDA_ONLY_IMPLS
            and not (impl == "torch_compile" and compile_mode == "reduce-overhead")
        ):
            fn = self._capture(fn)
        self.fn = fn

    @staticmethod
    def _capture(fn):
        graph, out = capture_graph(fn, warmup=_GRAPH_WARMUP)

        def replay():
            graph.replay()
            return out

        return replay

    def __call__(self) -> Any:
        return self.fn()

    def release(self) -> None:
        """Drops the graph, the core and the caches; returns torch's cached blocks to the driver
        (and, for torch_compile, Dynamo's compiled code and Inductor's CUDA-graph pools)."""
        import torch

        compiled = isinstance(self.core, CompiledCore)
        self.fn = self.core = self.k = self.v = self.state = self.embedded = None
        if compiled:
            torch._dynamo.reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
