"""Processes that compile at the same time and take turns on the GPU: `held(path)` holds an
exclusive lock on a file for a block (fcntl.flock; none for an empty path)."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator


@contextlib.contextmanager
def held(path: str) -> Iterator[None]:
    """The block runs while this process holds the lock on the file `path` (created if
    missing); with an empty path it runs at once."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
