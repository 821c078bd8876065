"""Communication cost of one Huginn Core iteration split over devices (tensor parallelism).

Under huginn_jax.parallel's Megatron layout each sandwich block ends its attention and its MLP
in one all-reduce of the residual stream's partial sums: the positions processed x n_embd in
the activation dtype (decode: B positions, prefill: B·T). Units as in `costs`: bytes, seconds.
The time of one all-reduce is `AllReduceModel`'s latency + bytes / bandwidth, fitted to a
measurement of `experiments.allreduce`.
"""

from __future__ import annotations

import dataclasses

from huginn_jax.config import HuginnConfig
from huginn_jax.costs import Mode

ALL_REDUCES_PER_LAYER = 2  # after attn.proj and after mlp.proj


@dataclasses.dataclass(frozen=True)
class AllReduceModel:
    """Seconds of one all-reduce of `nbytes` over `devices` devices: latency + nbytes / bandwidth.

    `bytes_per_s` is the buffer's size over the time above latency (nccl-tests' "algbw"); both
    parameters are fitted to a measurement of `experiments.allreduce` (`fit`, `from_results`)."""

    devices: int
    latency_s: float
    bytes_per_s: float
    source: str = ""

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s

    @classmethod
    def fit(cls, devices: int, sizes: list[int], seconds: list[float], source: str = ""):
        """Least squares of seconds = latency + size / bandwidth over >= 2 distinct sizes, each
        point weighted by 1 / seconds² (relative errors count alike, so the small sizes set the
        latency and the large ones the bandwidth); the latency kept >= 0. ValueError for fewer
        sizes or times that do not grow with size."""
        if len(set(sizes)) < 2:
            raise ValueError("an all-reduce fit needs at least two distinct sizes")
        points = list(zip(sizes, seconds, strict=True))
        weights = [1.0 / y**2 for _, y in points]
        total = sum(weights)
        mean_x = sum(w * x for w, (x, _) in zip(weights, points, strict=True)) / total
        mean_y = sum(w * y for w, (_, y) in zip(weights, points, strict=True)) / total
        sxx = sum(w * (x - mean_x) ** 2 for w, (x, _) in zip(weights, points, strict=True))
        sxy = sum(
            w * (x - mean_x) * (y - mean_y) for w, (x, y) in zip(weights, points, strict=True)
        )
        slope = sxy / sxx
        if slope <= 0:
            raise ValueError("all-reduce times do not grow with size: no bandwidth to fit")
        latency = max(0.0, mean_y - slope * mean_x)
        return cls(devices, latency, 1.0 / slope, source)

    @classmethod
    def from_results(cls, data: dict, devices: int) -> AllReduceModel:
        """The fit for `devices` from experiments.allreduce's JSON (its "fits" list)."""
        for fit in data.get("fits", []):
            if fit["devices"] == devices:
                return cls(devices, fit["latency_s"], fit["bytes_per_s"], fit.get("source", ""))
        raise ValueError(f"the all-reduce results hold no fit for {devices} devices")


def allreduce_bytes(
    config: HuginnConfig, *, batch: int, context: int, mode: Mode, dtype_bytes: int = 2
) -> int:
    """Bytes of one all-reduce: B·n_embd (decode) or B·T·n_embd (prefill, T = context) values."""
    positions = batch if mode == "decode" else batch * context
    return positions * config.n_embd * dtype_bytes


@dataclasses.dataclass(frozen=True)
class CommCost:
    """The all-reduces of one Core iteration split over `devices` (bytes, seconds)."""

    devices: int
    all_reduces: int  # per iteration: ALL_REDUCES_PER_LAYER x Core layers (0 on one device)
    bytes_per_all_reduce: int
    bytes: int  # all_reduces x bytes_per_all_reduce
    seconds: float | None  # under an AllReduceModel, else None


def core_iteration_comm(
    config: HuginnConfig,
    *,
    batch: int,
    context: int,
    mode: Mode,
    devices: int,
    dtype_bytes: int = 2,
    model: AllReduceModel | None = None,
) -> CommCost:
    """All-reduces of ONE Core iteration on `devices` devices of the "model" axis (the adapter is
    replicated: none for it), timed by `model` when given."""
    if model is not None and model.devices != devices:
        raise ValueError(f"the all-reduce model is for {model.devices} devices, not {devices}")
    count = 0 if devices == 1 else ALL_REDUCES_PER_LAYER * config.n_core
    size = allreduce_bytes(config, batch=batch, context=context, mode=mode, dtype_bytes=dtype_bytes)
    seconds = None
    if model is not None:
        seconds = count * model.seconds(size)
    return CommCost(devices, count, size, count * size, seconds)
