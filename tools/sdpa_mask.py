"""Does gpt-fast's additive mask slow PyTorch's decode attention? One query over a static cache
of S positions, as `experiments.torch_ref.generation` attends, with and without the mask, per
SDPA backend: µs per attention (a CUDA graph of 20 calls, median of 10 replays) and, masked, the
max error against attending over the visible prefix only (float32).

    python3 tools/sdpa_mask.py     # on a CUDA GPU; huginn-0125's 55 heads of 96, S = 1056
"""

import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

B, H, K, S, POS = 1, 55, 96, 1056, 1040  # POS: the new token's position; later ones masked
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def graph_us(fn, calls: int = 20, replays: int = 10) -> float:
    """Median µs per call of `fn` captured `calls` times in one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def main() -> None:
    q = torch.randn(B, H, 1, K, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, H, S, K, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    mask = torch.zeros(1, S, device="cuda", dtype=torch.bfloat16)
    mask[:, POS + 1 :] = float("-inf")
    prefix = F.scaled_dot_product_attention(
        q.float(), k.float()[:, :, : POS + 1], v.float()[:, :, : POS + 1]
    )
    print(f"B={B} H={H} K={K} S={S}, positions after {POS} masked")
    for name, backend in BACKENDS.items():
        for masked in (False, True):
            kwargs = {"attn_mask": mask} if masked else {}

            def attend(kwargs=kwargs):
                return F.scaled_dot_product_attention(q, k, v, **kwargs)

            label = f"{name:10s} {'masked' if masked else 'no mask':8s}"
            try:
                with sdpa_kernel([backend]):
                    err = (attend().float() - prefix).abs().max().item() if masked else None
                    us = graph_us(attend)
            except RuntimeError as e:
                print(f"{label} unsupported: {str(e).splitlines()[0][:80]}")
                continue
            print(f"{label} {us:7.1f} µs" + (f"  max err vs prefix {err:.1e}" if masked else ""))
    chosen = graph_us(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    print(f"SDPA's own choice, masked: {chosen:.1f} µs")


if __name__ == "__main__":
    main()
