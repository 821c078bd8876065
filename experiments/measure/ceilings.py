"""The device ceilings every "% of floor" figure is stated against, as the project measured them.

`python -m experiments.ceilings` measures two rates on the device it runs on and writes them to
`results/<device>/ceilings.json` (e.g. `results/h200/ceilings.json`):
  read_bytes_per_s   the read-only streaming rate over weights far larger than L2: the fastest
                     of a large bf16 GEMV [1, K] @ [K, N], XLA's reduction of the weight, and
                     on a Hopper GPU its bytes copied by TMA into every SM's shared memory
                     with nothing done with them (the best a batch-1 decode GEMV or a
                     persistent kernel's weight stream can do);
  bf16_flops_per_s   the sustained dense bf16 GEMM rate: 8192^3 matmuls back to back for about
                     a second (the rate a long prefill sees, not a short burst's).
Programs load that file for the device they run on (`for_device`); with no file for the device
(e.g. on a CPU) they report no floor rather than borrow another device's numbers.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parents[2] / "results"
FILE_NAME = "ceilings.json"


class CeilingsError(ValueError):
    """A ceilings file that cannot be used: unreadable, malformed, or of another device."""


@dataclasses.dataclass(frozen=True)
class Ceilings:
    read_bytes_per_s: float  # read-only HBM streaming rate, B/s
    bf16_flops_per_s: float  # sustained dense bf16 GEMM rate, FLOP/s
    device_kind: str  # as jax reports it, e.g. "NVIDIA H200"
    source: str  # the results file these numbers come from

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def device_slug(device_kind: str) -> str:
    """ "NVIDIA H200" -> "h200": the results folder of a device."""
    name = re.sub(r"^nvidia\s+", "", device_kind.strip(), flags=re.IGNORECASE)
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "device"


def default_path(device_kind: str) -> Path:
    return RESULTS_DIR / device_slug(device_kind) / FILE_NAME


def load(path: str | Path) -> Ceilings:
    """The ceilings stored in `path` (a JSON written by `experiments.ceilings`)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        values = data["ceilings"]
        return Ceilings(
            read_bytes_per_s=float(values["read_bytes_per_s"]),
            bf16_flops_per_s=float(values["bf16_flops_per_s"]),
            device_kind=str(data["environment"]["device_kind"]),
            source=str(path),
        )
    except OSError as e:
        raise CeilingsError(f"{path}: cannot read ({e.strerror})") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CeilingsError(f"{path}: not a ceilings file ({type(e).__name__}: {e})") from None


def for_device(device_kind: str, path: str | Path | None = None) -> Ceilings | None:
    """The ceilings for `device_kind`: from `path` when given (it must be of that device), else
    from `default_path(device_kind)` when that file exists; None when the project has none."""
    if path is None:
        path = default_path(device_kind)
        if not path.exists():
            return None
    ceilings = load(path)
    if ceilings.device_kind != device_kind:
        raise CeilingsError(
            f"{path}: measured on {ceilings.device_kind!r}, this run is on {device_kind!r}"
        )
    return ceilings
