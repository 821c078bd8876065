"""The chain `x <- x @ W_i` in PyTorch: eager, CUDA-graph replay, and torch.compile.

Weights come from the same numpy values as the JAX side. torch is imported lazily so that
everything else runs without it; the runners need a CUDA GPU (`compile_chain` also runs on CPU).
Shapes: x [batch, d], each W [d, d], in the chain's dtype; outputs as float32 numpy arrays.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from collections.abc import Callable
from typing import Any

import numpy as np

IMPLS = ("torch_eager", "torch_graph", "torch_compile")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
_GRAPH_WARMUP = 3  # side-stream runs before capture, as the CUDA-graph docs ask
INSTALL = 'pip install -e ".[torch]"'  # what a note about missing PyTorch tells the user to run


def available() -> bool:
    """True when torch is installed (without importing it)."""
    return importlib.util.find_spec("torch") is not None


def cuda_available() -> bool:
    """True when torch is installed and sees a CUDA device."""
    if not available():
        return False
    import torch

    return bool(torch.cuda.is_available())


def torch_dtype(name: str) -> Any:
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def to_device(array: np.ndarray, dtype_name: str) -> Any:
    """numpy (any float dtype, e.g. ml_dtypes bfloat16) -> CUDA tensor of `dtype_name`."""
    import torch

    # bf16 -> f32 is exact, so the tensor holds exactly the numpy values.
    host = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
    return host.to(torch_dtype(dtype_name)).cuda()


def make_weights(w_host: np.ndarray, steps: int, layout: str, dtype_name: str) -> list[Any]:
    """`steps` CUDA tensors [d, d]: one tensor repeated ("shared") or distinct clones ("copies")."""
    w = to_device(w_host, dtype_name)
    if layout == "shared":
        return [w] * steps
    if layout == "copies":
        return [w] + [w.clone() for _ in range(steps - 1)]
    raise ValueError(f"unknown layout {layout!r}")


def chain(x: Any, ws: list[Any]) -> Any:
    """x [batch, d] through every W in order; bf16 matmul accumulates in fp32 inside cuBLAS."""
    for w in ws:
        x = x @ w
    return x


def _chain_of_args(x: Any, *ws: Any) -> Any:
    return chain(x, list(ws))


def compile_chain(mode: str = "default", backend: str = "inductor") -> Callable[..., Any]:
    """`chain` as one graph (fullgraph=True, static shapes) for `f(x, *ws)`, compiled at its
    first call. Dynamo's caches are reset first: each runner compiles afresh, so that the
    recompile limit (sizes x layouts) never sends a call back to eager."""
    import torch

    if mode not in COMPILE_MODES:
        raise ValueError(f"torch.compile mode {mode!r} must be one of {COMPILE_MODES}")
    torch._dynamo.reset()
    if backend == "inductor":
        return torch.compile(_chain_of_args, fullgraph=True, dynamic=False, mode=mode)
    return torch.compile(_chain_of_args, fullgraph=True, dynamic=False, backend=backend)


@dataclasses.dataclass
class Runner:
    """What the timing helper needs: a call, its chains, a sync, and the comparable outputs;
    `compile_seconds`: the first call of the compiled chain (torch_compile only)."""

    fn: Callable[[], Any]
    per_call: int
    sync: Callable[[], None]
    output: Callable[[], np.ndarray]  # float32 [batch, d] after `chains_in_output` chains
    chains_in_output: int
    one_chain: Callable[[], np.ndarray]  # float32 [batch, d] after one chain
    compile_seconds: float | None = None
    # The tensors a captured graph reads: held here, or the allocator would reuse their memory
    # once `runner` returns and later replays would read whatever was written there since.
    inputs: tuple[Any, ...] = ()


def runner(
    impl: str,
    x_host: np.ndarray,
    ws: list[Any],
    *,
    dtype_name: str,
    n: int,
    compile_mode: str = "default",
) -> Runner:
    """torch_eager: one chain per call. torch_graph: one captured chain replayed `n` times.
    torch_compile: the chain compiled in `compile_mode`, then replayed as torch_graph; with
    "reduce-overhead" the compiled chain is called `n` times (Inductor replays its own graphs)."""
    import torch

    x = to_device(x_host, dtype_name)
    sync = torch.cuda.synchronize
    if impl == "torch_eager":

        def eager_output() -> np.ndarray:
            return chain(x, ws).float().cpu().numpy()

        return Runner(
            fn=lambda: chain(x, ws),
            per_call=1,
            sync=sync,
            output=eager_output,
            chains_in_output=1,
            one_chain=eager_output,
        )
    if impl not in ("torch_graph", "torch_compile"):
        raise ValueError(f"unknown torch impl {impl!r}")
    compile_seconds = None
    if impl == "torch_compile":
        compiled = compile_chain(compile_mode)
        t0 = time.perf_counter()
        compiled(x, *ws)
        sync()
        compile_seconds = time.perf_counter() - t0

        def one_call() -> Any:
            return compiled(x, *ws)

        if compile_mode == "reduce-overhead":
            return _direct_runner(one_call, n, sync, compile_seconds)
    else:

        def one_call() -> Any:
            return chain(x, ws)

    graph, y = capture_graph(one_call)  # y: rewritten by every replay

    def replay() -> None:
        for _ in range(n):
            graph.replay()

    def output() -> np.ndarray:
        graph.replay()
        sync()
        return y.float().cpu().numpy()

    return Runner(
        fn=replay,
        per_call=n,
        sync=sync,
        output=output,
        chains_in_output=1,
        one_chain=output,
        compile_seconds=compile_seconds,
        inputs=(x, tuple(ws)),
    )


def _direct_runner(
    fn: Callable[[], Any], n: int, sync: Callable[[], None], compile_seconds: float
) -> Runner:
    """`fn` called `n` times per call; for a chain compiled with "reduce-overhead", whose first
    calls record CUDA graphs that later calls replay."""
    for _ in range(_GRAPH_WARMUP):
        fn()
    sync()

    def call() -> None:
        for _ in range(n):
            fn()

    def output() -> np.ndarray:
        return fn().float().cpu().numpy()  # read before the next call reuses the graph's output

    return Runner(
        fn=call,
        per_call=n,
        sync=sync,
        output=output,
        chains_in_output=1,
        one_chain=output,
        compile_seconds=compile_seconds,
    )


def capture_graph(fn: Callable[[], Any], warmup: int = _GRAPH_WARMUP) -> tuple[Any, Any]:
    """Runs `fn` `warmup` times on a side stream (as the CUDA-graph docs ask), then captures one
    call. Returns (graph, that call's output: static buffers that every replay rewrites).

    Capture mode "thread_local": JAX shares the process, and its threads may call CUDA (freeing
    buffers, polling events) while torch captures; in the default "global" mode such a call
    invalidates the capture (cudaErrorStreamCaptureInvalidated, seen on the H200 in
    experiments.generate_vs_torch right after the JAX loop).
    """
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


def release() -> None:
    """Returns cached blocks to the driver so that a child process can allocate them."""
    import torch

    torch.cuda.empty_cache()
