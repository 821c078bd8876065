"""How much memory new arrays may take, read before a large allocation so that a size that cannot
fit is refused in one line instead of failing in the allocator minutes later.

An accelerator's arrays count against its allocator's limit (`memory_stats()['bytes_limit']`); a
CPU backend's arrays live in host memory, which counts what is available now (/proc/meminfo's
MemAvailable: free plus reclaimable caches, else the free pages sysconf reports).
"""

from __future__ import annotations

import os
from typing import Any

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(n: float) -> str:
    """3 significant digits in the largest binary unit below `n`: 1.5 * 2**30 -> '1.5 GiB'."""
    for unit, scale in _UNITS:
        if n >= scale:
            value = n / scale
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:,.0f} {unit}"
    return f"{n:.0f} B"


def host_available_bytes() -> int | None:
    """Host memory available to a new allocation now, or None where the host does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def device_limit_bytes(device: Any) -> int | None:
    """Bytes the JAX allocator may use on `device` (`memory_stats()['bytes_limit']`), or None."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory stats raise various errors
        return None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return None


def available_bytes(device: Any = None) -> tuple[int | None, str]:
    """(bytes new arrays on `device` may take, what holds them): the allocator's limit of an
    accelerator, the host memory available now for a CPU device; None where neither is known.
    `device` defaults to the first JAX device (which starts the backend)."""
    if device is None:
        import jax

        device = jax.devices()[0]
    if device.platform == "cpu":
        return host_available_bytes(), "host memory (the CPU device's arrays)"
    return device_limit_bytes(device), f"{device.device_kind} memory"
