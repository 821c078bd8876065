"""Whether a problem fits, checked before anything is allocated.

A program estimates the bytes its largest case needs on the device and on the host, and
`check_fits` compares them with what the device's allocator may use (`memory_stats()`'s
`bytes_limit`) and with the host memory available now (/proc/meminfo's MemAvailable, else
sysconf). On a CPU backend the device's arrays live in host memory, so both needs count against
it. A problem that cannot fit is one UserError naming the flag to change, the bytes needed and the
bytes there are; a device that reports no limit is not checked.
"""

from __future__ import annotations

from typing import Any

from experiments.cli import UserError
from experiments.measure import results as results_lib
from huginn_jax.memory import format_bytes, host_available_bytes

__all__ = ["check_fits", "format_bytes", "host_available_bytes"]


def check_fits(
    flag: str,
    what: str,
    device_bytes: int,
    host_bytes: int = 0,
    *,
    device: Any = None,
    hint: str = "",
) -> None:
    """UserError `flag: needs N of device memory for what; the device allows M` when `device_bytes`
    exceed the allocator's limit of `device` (the first JAX device when None), or the same for
    the host when `host_bytes` (plus `device_bytes` on a CPU backend) exceed the memory available.
    `flag` names the value to change (e.g. "--context=4096"); `hint` ends the line."""
    if device is None:
        import jax

        device = jax.devices()[0]
    tail = f": {hint}" if hint else ""
    if device.platform == "cpu":
        host_bytes += device_bytes
    else:
        limit = results_lib.device_memory_bytes(device)
        if limit is not None and device_bytes > limit:
            raise UserError(
                f"{flag}: needs {format_bytes(device_bytes)} of device memory for {what}; "
                f"{device.device_kind} allows {format_bytes(limit)}{tail}"
            )
    available = host_available_bytes()
    if available is not None and host_bytes > available:
        where = "host memory" + (" (the CPU device's arrays)" if device.platform == "cpu" else "")
        raise UserError(
            f"{flag}: needs {format_bytes(host_bytes)} of {where} for {what}; "
            f"{format_bytes(available)} available{tail}"
        )
