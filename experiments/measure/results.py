"""Results JSON: the environment a measurement ran in, and an atomic writer.

Every experiment writes one JSON file holding its config (all flag values), the environment
(device kind, L2 size, memory, versions, host, UTC time), raw samples and summaries; tables and
plots are drawn from that file.
"""

from __future__ import annotations

import ctypes
import datetime
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import socket
import sys
from pathlib import Path
from typing import Any

from huginn_jax.files import write_text_atomic

_PACKAGES = ("jax", "jaxlib", "flax", "numpy", "absl-py", "matplotlib", "torch")
_CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38  # from cuda.h


def versions() -> dict[str, str | None]:
    """Python and package versions; None for a package that is not installed."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _l2_from_driver(ordinal: int) -> int | None:
    """L2 size in bytes via libcuda's cuDeviceGetAttribute; None when there is no driver."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        if lib.cuInit(0) != 0:
            return None
        dev, value = ctypes.c_int(), ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
            return None
        if lib.cuDeviceGetAttribute(ctypes.byref(value), _CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, dev):
            return None
        return int(value.value)
    except (OSError, AttributeError):
        return None


def l2_cache_bytes(device: Any) -> int | None:
    """L2 size of a JAX GPU device in bytes: a device attribute, the driver, or torch; else None."""
    if getattr(device, "platform", "") != "gpu":
        return None
    for attr in ("l2_cache_size", "l2_cache_size_bytes"):
        value = getattr(device, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    ordinal = int(getattr(device, "local_hardware_id", None) or 0)
    value = _l2_from_driver(ordinal)
    if value:
        return value
    if "torch" in sys.modules or importlib.util.find_spec("torch") is not None:
        try:
            import torch

            return int(torch.cuda.get_device_properties(ordinal).L2_cache_size)
        except (RuntimeError, AssertionError, AttributeError):
            return None
    return None


def device_memory_bytes(device: Any) -> int | None:
    """Bytes the JAX allocator may use on `device` (`memory_stats()['bytes_limit']`), or None."""
    from huginn_jax.memory import device_limit_bytes

    return device_limit_bytes(device)


def host_memory_bytes() -> int | None:
    """Physical memory of this host in bytes, or None where sysconf does not know it."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def environment(flag_values: dict[str, Any]) -> dict[str, Any]:
    """Device, versions, host, UTC time, argv and the given flag values, for a results JSON."""
    import jax

    device = jax.devices()[0]
    return {
        "device_kind": device.device_kind,
        "platform": device.platform,
        "device_count": jax.device_count(),
        "l2_bytes": l2_cache_bytes(device),
        "device_memory_limit_bytes": device_memory_bytes(device),
        "versions": versions(),
        "hostname": socket.gethostname(),
        "timestamp_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "argv": list(sys.argv),
        "flags": flag_values,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def _clean(obj: Any) -> Any:
    """NaN and inf become None, so that the file is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """Writes `obj` as strict JSON to `path` atomically (`write_text_atomic`)."""
    return write_text_atomic(path, json.dumps(_clean(obj), indent=1, allow_nan=False) + "\n")


def write_results(path: str | os.PathLike, flag_values: dict[str, Any], payload: dict) -> Path:
    """A program's results JSON: {"environment": environment(flag_values), **payload}."""
    return write_json_atomic(path, {"environment": environment(flag_values), **payload})


def read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)
