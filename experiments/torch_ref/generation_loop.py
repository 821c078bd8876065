"""The timed greedy generation loop of `generation.CompiledHuginn` (whose module docstring says
how a token is compiled and replayed): `decode_step` readies the decode of one token to be called
once per token (a replay of one CUDA graph, of Inductor's CUDA-graph trees, or plain compiled
calls on the CPU), and `generate_compiled` runs the prefill, then the decode tokens, timing the
prefill and each token's latency from the token before it being ready, and returns a
`huginn.TorchGeneration` as the eager loops do. torch is imported lazily.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from experiments.torch_ref.generation import CompiledHuginn
from experiments.torch_ref.huginn import TorchGeneration, start_generation, timed_prefill


def decode_step(model: CompiledHuginn, warmup: int) -> tuple[Callable[[], Any], bool]:
    """The decode of one token from `model.ids` at `model.pos`, ready to be called once per
    token: (step, graph). step() returns (token [B], logits [B, V]) and leaves the token in
    `ids` and pos + 1 in `pos`. Before returning, the step runs `warmup` times untimed (at least
    2 in "reduce-overhead": Inductor's trees warm up, then record), each followed by restoring
    `ids` and `pos` (the K/V it wrote at pos are rewritten alike by the next call); on CUDA in
    the other modes, the step is then captured in one CUDA graph, and step() replays it.
    graph: whether step() replays CUDA graphs."""
    import torch

    cuda = model.device.type == "cuda"
    inductor_graphs = model.mode == "reduce-overhead" and cuda

    def step() -> tuple[Any, Any]:
        if model.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        token, logits = model.decode_token()
        model.ids.copy_(token[:, None])
        model.pos.add_(1)
        return token, logits

    ids0, pos0 = model.ids.clone(), model.pos.clone()

    def warm_up() -> None:
        for _ in range(max(warmup, 2) if inductor_graphs else warmup):
            step()
            model.ids.copy_(ids0)
            model.pos.copy_(pos0)

    if not cuda or inductor_graphs:
        warm_up()
        return step, inductor_graphs
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as the CUDA-graph docs ask
        warm_up()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # "thread_local": JAX's threads share the process (see `chain.capture_graph`).
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = step()

    def replay() -> tuple[Any, Any]:
        graph.replay()
        return out

    return replay, True


def _wait(event: Any, ready: float, latencies: list[float]) -> float:
    """Waits for `event` (None: nothing to wait for, on the CPU); appends the time since
    `ready` to `latencies` and returns the time now."""
    if event is not None:
        event.synchronize()
    now = time.perf_counter()
    latencies.append(now - ready)
    return now


def _cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def generate_compiled(
    model: CompiledHuginn,
    prompt_ids_BxT: np.ndarray,
    max_new_tokens: int,
    num_steps: int,
    *,
    warmup: int = 2,
    trace: Callable[[Callable[[], Any]], Any] | None = None,
) -> TorchGeneration:
    """Greedy generation of `max_new_tokens` tokens after prompt ids [B, T], timed per token:
    the compiled prefill runs `warmup` times untimed (compilation; Inductor's graphs) and once
    timed; the decode step is compiled and captured once (`decode_step`, untimed, in
    `setup_s`), then each token is one call (one graph replay on CUDA), made before the token
    before it is read, as huginn_jax's loop dispatches its steps; a token's latency is the time
    from the token before it being ready (a CUDA event) to it being ready. Tokens and logits
    are copied on the device and go to the host after the loop. The cache holds T +
    max_new_tokens positions (rounded up to CACHE_ALIGN).

    `trace`: called after the timed tokens with the decode step, set back to the first decode
    position, to run it again (under a profiler, say): it may call the step up to
    max_new_tokens - 1 times, which decode the same tokens again within the cache."""
    import torch

    cuda = model.device.type == "cuda"
    prompt, sync = start_generation(model, prompt_ids_BxT, max_new_tokens, num_steps)
    prompt_len = prompt.shape[1]
    inductor_graphs = model.mode == "reduce-overhead" and cuda
    prefill_warmup = max(warmup, 2) if inductor_graphs else warmup
    skips = _cudagraph_skips()
    with torch.no_grad():
        (token, logits), setup_s, prefill_s = timed_prefill(
            lambda: model.prefill(prompt), prefill_warmup, sync
        )
        tokens, all_logits = [token.cpu()], [logits.cpu()]
        latencies: list[float] = []
        graph = False
        if max_new_tokens > 1:
            model.ids.copy_(token[:, None])
            model.pos.fill_(prompt_len)
            # No prefill output stays alive while Inductor's trees record the decode.
            token = logits = None
            t0 = time.perf_counter()
            step, graph = decode_step(model, warmup)
            sync()
            setup_s += time.perf_counter() - t0
            if inductor_graphs and _cudagraph_skips() > skips:
                raise RuntimeError(
                    "torch_compile: Inductor skipped its CUDA graphs (the log's 'skipping "
                    "cudagraphs' line says why); the timing would be of launches, not graphs"
                )
            # Each token's call is made before the token before it is read (as huginn_jax's
            # loop dispatches its steps); the latency of a token is the time from the token
            # before it being ready to it being ready. Copies on the device keep each token.
            ready, before = time.perf_counter(), None
            for n in range(1, max_new_tokens):
                token, logits = step()
                tokens.append(token.clone())
                all_logits.append(logits.clone())
                event = torch.cuda.Event() if cuda else None  # None: the CPU's call is done
                if cuda:
                    event.record()
                if n > 1:
                    ready = _wait(before, ready, latencies)
                before = event
            _wait(before, ready, latencies)
            if trace is not None:
                model.ids.copy_(tokens[0][:, None])
                model.pos.fill_(prompt_len)
                trace(step)
    return TorchGeneration(
        tokens=torch.stack([t.cpu() for t in tokens], dim=1).numpy(),
        logits=torch.stack([x.cpu() for x in all_logits], dim=1).numpy(),
        prefill_s=prefill_s,
        latencies_s=latencies,
        capture_s=[],
        graph=graph,
        setup_s=setup_s,
        graphs_compiled=model.graphs_compiled(),
    )
