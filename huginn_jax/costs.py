"""Cost model of one Huginn Core iteration: parameter storage, matmul FLOPs, HBM traffic, roofline.

Reproduces Chapter 2 and Appendix A of the profiling study (see the README). Units everywhere:
bytes (B), FLOPs (a multiply-add counts 2), seconds; "GB" means 1e9 B. Counting rules:
- Every op reads its weights from HBM once, reads its input activation once and writes its output
  once. Per-iteration weights are therefore re-read at every Core iteration (no cache reuse).
- Only matrix multiplications count as FLOPs. Elementwise work (RMSNorm, residual adds, qk_bias,
  RoPE, softmax, the SiLU gate) is taken as fused into its neighbours: no FLOPs and no activation
  traffic; the norm and qk_bias weights still count as parameters read once.
- Attention is fused (flash-style): scores never reach HBM. QK^T reads Q and K, PV reads V and
  writes the output. Only causally allowed query-key pairs count.
- KV cache: Wqkv's output write includes the new K and V. Prefill reads K and V of the `context`
  positions once; decode reads the `context` cached positions (the new one comes from Wqkv).

Shape letters: M = positions processed together (prefill batch*context, decode batch),
h = n_embd, I = intermediate_size, H = n_heads, D = head_dim.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from huginn_jax.config import HuginnConfig

MiB = 1024**2
Mode = Literal["prefill", "decode"]
Bound = Literal["memory", "compute"]


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """Peak limits of one accelerator, as used by the roofline."""

    name: str
    peak_bf16_flops: float  # FLOP/s, dense bf16 matmul
    hbm_bandwidth: float  # B/s
    l2_bytes: int  # B
    num_sms: int
    smem_per_block_bytes: int  # B, opt-in maximum per block
    memory_bytes: int  # B of device memory (HBM), from the datasheet
    source: str  # where the numbers come from


DEVICES: dict[str, DeviceSpec] = {
    "b200": DeviceSpec(
        name="b200",
        peak_bf16_flops=2250e12,
        hbm_bandwidth=8e12,
        l2_bytes=int(126.5 * MiB),
        num_sms=148,
        smem_per_block_bytes=232_448,
        memory_bytes=180 * 10**9,  # HGX B200: 1,440 GB over 8 GPUs
        source="the profiling study: NVIDIA B200 published specs (2,250 TFLOP/s, 8 TB/s), L2 as "
        "reported there",
    ),
    "h200": DeviceSpec(
        name="h200",
        peak_bf16_flops=989.5e12,
        hbm_bandwidth=4.8e12,
        l2_bytes=60 * MiB,
        num_sms=132,
        smem_per_block_bytes=232_448,
        memory_bytes=141 * 10**9,
        source="NVIDIA H200 SXM datasheet; L2, SMs and smem as measured on the H200",
    ),
    # The ceilings `experiments.ceilings` measured on the H200 (results/h200/ceilings.json; a
    # test keeps the two equal): read-only streaming rate and sustained bf16 GEMM rate.
    "h200_measured": DeviceSpec(
        name="h200_measured",
        peak_bf16_flops=699.3e12,
        hbm_bandwidth=4.477e12,
        l2_bytes=60 * MiB,
        num_sms=132,
        smem_per_block_bytes=232_448,
        memory_bytes=141 * 10**9,
        source="results/h200/ceilings.json: sustained bf16 GEMM rate, read-only streaming rate",
    ),
    "h100": DeviceSpec(
        name="h100",
        peak_bf16_flops=989.5e12,
        hbm_bandwidth=3.35e12,
        l2_bytes=50 * MiB,
        num_sms=132,
        smem_per_block_bytes=232_448,
        memory_bytes=80 * 10**9,
        source="NVIDIA H100 SXM datasheet",
    ),
}


def get_device(name: str) -> DeviceSpec:
    """Looks a device up in `DEVICES`; raises ValueError naming the known ones."""
    try:
        return DEVICES[name]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(DEVICES)}") from None


@dataclasses.dataclass(frozen=True)
class OpCost:
    """Storage, work and HBM traffic of one op (bytes, FLOPs)."""

    name: str
    param_bytes: int  # parameter storage of the op
    flops: int  # matmul FLOPs
    hbm_read_bytes: int  # weights + activations + KV read
    hbm_write_bytes: int  # activations + KV written
    weight_bytes: int  # part of hbm_read_bytes that is weights
    kv_read_bytes: int = 0  # part of hbm_read_bytes that is KV cache
    kv_write_bytes: int = 0  # part of hbm_write_bytes that is KV cache

    @property
    def hbm_bytes(self) -> int:
        """All HBM traffic, read + write (B)."""
        return self.hbm_read_bytes + self.hbm_write_bytes

    def times(self, device: DeviceSpec, *, weights_only: bool = False) -> tuple[float, float]:
        """(compute seconds, memory seconds); `weights_only` counts only weight bytes as traffic."""
        nbytes = self.weight_bytes if weights_only else self.hbm_bytes
        return self.flops / device.peak_bf16_flops, nbytes / device.hbm_bandwidth

    def roofline(self, device: DeviceSpec, *, weights_only: bool = False) -> tuple[float, Bound]:
        """Ideal time in seconds, max(FLOPs / peak, bytes / bandwidth), and what bounds it."""
        compute, memory = self.times(device, weights_only=weights_only)
        return max(compute, memory), "compute" if compute > memory else "memory"


def matmul_cost(m: int, k: int, n: int, dtype_bytes: int = 2, name: str = "matmul") -> OpCost:
    """[m, k] @ [k, n] -> [m, n]: reads the weight [k, n] and the input once, writes the output."""
    weight = k * n * dtype_bytes
    return OpCost(
        name=name,
        param_bytes=weight,
        flops=2 * m * k * n,
        hbm_read_bytes=weight + m * k * dtype_bytes,
        hbm_write_bytes=m * n * dtype_bytes,
        weight_bytes=weight,
    )


def _param_op(name: str, nbytes: int) -> OpCost:
    """A parameter with negligible FLOPs (norm weight, qk_bias): its weight is read once."""
    return OpCost(
        name,
        param_bytes=nbytes,
        flops=0,
        hbm_read_bytes=nbytes,
        hbm_write_bytes=0,
        weight_bytes=nbytes,
    )


def core_iteration_ops(
    config: HuginnConfig, *, batch: int, context: int, mode: Mode, dtype_bytes: int = 2
) -> list[OpCost]:
    """Ops of ONE Core iteration: the adapter, then per Core layer attention, MLP and norms.

    prefill: batch*context new positions, causal pairs context*(context+1)/2 per sequence and head.
    decode: batch new positions, each attending to `context` cached positions and itself.
    """
    if mode not in ("prefill", "decode"):
        raise ValueError(f"mode={mode!r} must be 'prefill' or 'decode'")
    if batch < 1:
        raise ValueError(f"batch={batch} must be >= 1")
    if context < (1 if mode == "prefill" else 0):
        raise ValueError(f"context={context} must be >= 1 for prefill, >= 0 for decode")
    h, i_size, n_heads, d = config.n_embd, config.intermediate_size, config.n_heads, config.head_dim
    b = dtype_bytes
    if mode == "prefill":
        m, pairs = batch * context, context * (context + 1) // 2
    else:
        m, pairs = batch, context + 1
    kv_one = batch * context * n_heads * d * b  # K (or V) of the positions read, one layer

    ops = [matmul_cost(m, 2 * h, h, b, name="adapter")]
    for j in range(config.n_core):
        p = f"core.{j}"
        wqkv = matmul_cost(m, h, 3 * h, b, name=f"{p}.attn.Wqkv")
        ops.append(dataclasses.replace(wqkv, kv_write_bytes=m * 2 * h * b))
        if config.qk_bias:
            ops.append(_param_op(f"{p}.attn.qk_bias", 2 * n_heads * d * b))
        attn_flops = 2 * batch * n_heads * pairs * d
        # QK^T reads q [M, h] and K; scores stay on chip.
        ops.append(
            OpCost(
                f"{p}.attn.QK^T",
                param_bytes=0,
                flops=attn_flops,
                hbm_read_bytes=m * h * b + kv_one,
                hbm_write_bytes=0,
                weight_bytes=0,
                kv_read_bytes=kv_one,
            )
        )
        # PV reads V and writes the attention output [M, h].
        ops.append(
            OpCost(
                f"{p}.attn.PV",
                param_bytes=0,
                flops=attn_flops,
                hbm_read_bytes=kv_one,
                hbm_write_bytes=m * h * b,
                weight_bytes=0,
                kv_read_bytes=kv_one,
            )
        )
        ops.append(matmul_cost(m, h, h, b, name=f"{p}.attn.proj"))
        ops.append(matmul_cost(m, h, 2 * i_size, b, name=f"{p}.mlp.fc"))
        ops.append(matmul_cost(m, i_size, h, b, name=f"{p}.mlp.proj"))
        ops.extend(_param_op(f"{p}.norm_{k}", h * b) for k in range(1, 5))
    return ops


def totals(ops: list[OpCost], name: str = "total") -> OpCost:
    """Field-wise sum of `ops` as one OpCost."""
    fields = [f.name for f in dataclasses.fields(OpCost) if f.name != "name"]
    return OpCost(name, **{f: sum(getattr(op, f) for op in ops) for f in fields})


def serial_time(ops: list[OpCost], device: DeviceSpec, *, weights_only: bool = False) -> float:
    """Seconds if the ops run one after another, each at its own roofline."""
    return sum(op.roofline(device, weights_only=weights_only)[0] for op in ops)


def block_param_count(config: HuginnConfig) -> int:
    """Parameters of one sandwich block: Wqkv, qk_bias, proj, fc, mlp.proj, 4 norms."""
    h, i_size = config.n_embd, config.intermediate_size
    qk_bias = 2 * config.n_heads * config.head_dim if config.qk_bias else 0
    return h * 3 * h + qk_bias + h * h + h * 2 * i_size + i_size * h + 4 * h


def adapter_param_count(config: HuginnConfig) -> int:
    """Parameters of the adapter, Linear 2h -> h without bias."""
    return 2 * config.n_embd * config.n_embd


def core_param_count(config: HuginnConfig) -> int:
    """Parameters read by one Core iteration: the n_core blocks plus the adapter."""
    return config.n_core * block_param_count(config) + adapter_param_count(config)


def model_param_count(config: HuginnConfig) -> int:
    """All parameters: embedding (lm_head counted once if tied), blocks, adapter, ln_f."""
    embed = config.vocab_size * config.n_embd * (1 if config.tie_embeddings else 2)
    outer = (config.n_layers_in_prelude + config.n_layers_in_coda) * block_param_count(config)
    return embed + outer + core_param_count(config) + config.n_embd


@dataclasses.dataclass(frozen=True)
class IterationsCost:
    """Cost of r Core iterations for one forward step (bytes, FLOPs, seconds)."""

    iterations: int
    param_bytes: int  # storage of Core + adapter, paid once
    weight_bytes_reread: int  # iterations * weights read per iteration
    flops: int
    hbm_bytes: int  # all traffic, read + write
    weight_read_seconds: float  # lower bound: weight_bytes_reread / bandwidth
    roofline_seconds: float  # iterations * per-op roofline times summed


def iterations_cost(
    config: HuginnConfig,
    *,
    batch: int,
    context: int,
    mode: Mode,
    iterations: int,
    device: DeviceSpec,
    dtype_bytes: int = 2,
) -> IterationsCost:
    """Scales one Core iteration by `iterations` (every iteration re-reads all its weights)."""
    if iterations < 1:
        raise ValueError(f"iterations={iterations} must be >= 1")
    ops = core_iteration_ops(
        config, batch=batch, context=context, mode=mode, dtype_bytes=dtype_bytes
    )
    one = totals(ops)
    reread = iterations * one.weight_bytes
    return IterationsCost(
        iterations=iterations,
        param_bytes=one.param_bytes,
        weight_bytes_reread=reread,
        flops=iterations * one.flops,
        hbm_bytes=iterations * one.hbm_bytes,
        weight_read_seconds=reread / device.hbm_bandwidth,
        roofline_seconds=iterations * serial_time(ops, device),
    )


def headline(
    config: HuginnConfig,
    device: DeviceSpec,
    *,
    batch: int = 1,
    context: int = 1024,
    iterations: int = 32,
    dtype_bytes: int = 2,
) -> dict[str, float | int | str]:
    """The profiling study's Chapter 2 / Appendix A numbers for `device` (GB = 1e9 B, ms, us).

    Adapter [M, 2h] @ [2h, h] alone (no concatenation): M = batch for decode,
    M = batch * context for prefill.
    """
    it = iterations_cost(
        config,
        batch=batch,
        context=context,
        mode="decode",
        iterations=iterations,
        device=device,
        dtype_bytes=dtype_bytes,
    )
    h = config.n_embd
    m_dec, m_pre = batch, batch * context
    t_dec, bound_dec = matmul_cost(m_dec, 2 * h, h, dtype_bytes).roofline(device)
    t_pre, bound_pre = matmul_cost(m_pre, 2 * h, h, dtype_bytes).roofline(device)
    return {
        "device": device.name,
        "core_adapter_params": core_param_count(config),
        "core_adapter_param_gb": it.param_bytes / 1e9,
        "iterations": iterations,
        "reread_gb": it.weight_bytes_reread / 1e9,
        "min_ms_per_token": it.weight_read_seconds * 1e3,
        "adapter_decode_m": m_dec,
        "adapter_decode_us": t_dec * 1e6,
        "adapter_decode_bound": bound_dec,
        "adapter_prefill_m": m_pre,
        "adapter_prefill_us": t_pre * 1e6,
        "adapter_prefill_bound": bound_pre,
    }
