"""Row GEMVs with split-K partial sums or the SiLU gate fused in (Pallas, Triton backend).

Public entry point: `fused_gemv(w, x, *, silu, as_partials)` with the signature and meaning of
its plain-JAX reference `fused_gemv_reference` (`reference.py`). The model calls it for
`HuginnConfig(decode_gemv="pallas")` (`huginn_jax.ops`); this package imports nothing of the
model. On a machine without a GPU the kernel runs in interpret mode.
Design and traffic: `kernel.py`; tuning: `tune.py`.
"""

from __future__ import annotations

import dataclasses

import jax

from pallas_kernels.fused_gemv.kernel import fused_gemv_kernel
from pallas_kernels.fused_gemv.reference import fused_gemv_reference

__all__ = ["GemvConfig", "fused_gemv", "fused_gemv_reference", "pick_config"]

H200_SMS = 132


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """`block_n` output columns per program, W walked in [block_k, block_n] tiles by
    `num_warps` warps, Triton pipelining loads over `num_stages` tiles; `split_k` programs
    share a column block (partial sums only); `use_dot`: each tile multiplied on the tensor
    cores (the row padded to 16) instead of elementwise products summed after the loop."""

    block_n: int = 64
    block_k: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1
    use_dot: bool = False


# Frozen defaults, the fastest configs per output kind on the H200 (pallas_kernels.fused_gemv.tune;
# times in docs/fused_gemv.md): partial sums 128 x 64 tiles, split-K for 4 programs per SM;
# whole rows 64 columns per program, 256-row tiles (Wqkv); 64-row tiles for the two tiles of the
# SiLU product.
PROGRAMS_PER_SM = 4
PARTIALS_TUNING = {"block_n": 128, "block_k": 64, "num_stages": 3, "use_dot": True}
ROW_TUNING = {"block_n": 64, "block_k": 256, "num_stages": 3, "use_dot": True}
SILU_TUNING = {"block_n": 64, "block_k": 64, "num_stages": 3, "use_dot": True}


def pick_config(
    rows: int,
    columns: int,
    *,
    as_partials: bool,
    silu: bool = False,
    programs_per_sm: int = PROGRAMS_PER_SM,
    sms: int = H200_SMS,
    **tuning,
) -> GemvConfig:
    """The frozen tuning for the output kind, `tuning` overriding fields; for partial sums,
    as many row ranges as fill `programs_per_sm` programs per SM (at most one per block_k
    rows)."""
    default = PARTIALS_TUNING if as_partials else SILU_TUNING if silu else ROW_TUNING
    config = GemvConfig(**{**default, **tuning})
    if not as_partials:
        return config
    blocks = -(-columns // config.block_n)
    wanted = -(-programs_per_sm * sms // blocks)
    return dataclasses.replace(config, split_k=max(1, min(wanted, rows // config.block_k)))


def fused_gemv(
    w: jax.Array,
    x: jax.Array,
    *,
    silu: bool = False,
    as_partials: bool = False,
    config: GemvConfig | None = None,
) -> jax.Array:
    """x [K] @ w [K, N] as `fused_gemv_reference` returns it; for `as_partials` [split_k, N]
    float32 (sum over axis 0 for the product)."""
    if w.ndim != 2 or x.shape != w.shape[:1]:
        raise ValueError(f"fused_gemv: need w [K, N] and x [K]; got w {w.shape}, x {x.shape}")
    rows, n_total = w.shape
    if silu and (as_partials or n_total % 2):
        raise ValueError(
            f"fused_gemv: silu needs w = [gate | up] (even N, got {n_total}) and a "
            "whole row out (not as_partials)"
        )
    columns = n_total // 2 if silu else n_total
    config = config or pick_config(rows, columns, as_partials=as_partials, silu=silu)
    if config.split_k > 1 and not as_partials:
        raise ValueError("fused_gemv: split_k > 1 gives partial sums: ask for as_partials")
    return fused_gemv_kernel(
        x,
        w,
        silu=silu,
        as_partials=as_partials,
        split_k=config.split_k,
        block_k=config.block_k,
        block_n=config.block_n,
        use_dot=config.use_dot,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        interpret=jax.default_backend() != "gpu",
    )
