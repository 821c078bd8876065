"""What the one-layer attention programs (`decode_attention`, `prefill_attention`) share: which
implementations can run here, PyTorch's SDPA replayed from a CUDA graph, and building, checking
and timing one implementation into a record."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from experiments.measure import timing
from experiments.torch_ref import chain as torch_chain  # imports no torch


def runnable(impls: Sequence[str], gpu_only: Sequence[str], on_gpu: bool) -> list[str]:
    """`impls` less those that cannot run here (a note printed for each group left out)."""
    impls = list(impls)
    if not on_gpu and any(i in gpu_only for i in impls):
        print(f"note: {', '.join(i for i in impls if i in gpu_only)} need(s) CUDA; skipped")
        impls = [i for i in impls if i not in gpu_only]
    if "torch" in impls and not torch_chain.available():
        print("note: PyTorch is not installed; torch skipped")
        impls = [i for i in impls if i != "torch"]
    return impls


class SdpaRunner:
    """torch's scaled_dot_product_attention once per set on [B, H, S, K] views (no copy) of
    [sets, B, S, H, K] JAX arrays, all sets in one CUDA graph; output [sets, B, H, T, K]."""

    def __init__(self, q, k, v, *, causal: bool):
        import torch
        import torch.nn.functional as F

        self.sync = torch.cuda.synchronize
        q, k, v = (torch.from_dlpack(x).transpose(2, 3) for x in (q, k, v))  # [sets,B,H,S,K]
        out = torch.empty_like(q)

        def run():
            for i in range(q.shape[0]):
                out[i] = F.scaled_dot_product_attention(q[i], k[i], v[i], is_causal=causal)
            return out

        self.graph, self.out = torch_chain.capture_graph(run, warmup=1)

    def __call__(self):
        self.graph.replay()
        return self.out


def time_one(
    case: dict[str, Any],
    make_runner: Callable[[], Any],
    checked: Callable[[Any], np.ndarray],
    ref: np.ndarray,
    *,
    per_call: int,
    warmup: int,
    repeats: int,
) -> dict[str, Any]:
    """Builds one implementation's runner, checks `checked(output)` against `ref` and times it
    (`per_call` attentions per call): `case` plus the median µs per attention, its p10-p90, the
    relative error and the samples; or `case` plus "error" when it failed (a result too, e.g.
    a kernel refusing a shape)."""
    label = " ".join(f"{k}={v}" for k, v in case.items())
    try:
        runner = make_runner()
        out = checked(runner())
        samples = timing.time_fn(
            runner, warmup=warmup, repeats=repeats, sync=runner.sync, per_call=per_call
        )
    except Exception as e:
        message = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        print(f"note: {label} failed: {message}")
        return {**case, "error": message}
    err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    print(f"{label}: {samples.median * 1e6:.1f} us, rel err {err:.1e}")
    return {
        **case,
        "us": samples.median * 1e6,
        "us_p10": samples.quantile(0.1) * 1e6,
        "us_p90": samples.quantile(0.9) * 1e6,
        "rel_err_vs_f64": err,
        "samples_s": samples.seconds,
    }
