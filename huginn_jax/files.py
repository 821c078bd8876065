"""The project's file handling: the error a damaged model file raises, and outputs written
atomically with the usual permissions.

Imports nothing heavy, so that the configuration reader and the command lines can use it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


class CheckpointError(ValueError):
    """A model or training checkpoint that cannot be loaded (missing, truncated or damaged file,
    wrong-typed config value, missing or misshapen tensor). The message is one line that names
    the file (and the key) and what is wrong with it."""


def default_mode() -> int:
    """The mode a plain `open(path, "w")` gives a new file: 0o666 less the process umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_atomic(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Calls `write(tmp)` on a temporary path beside `path`, gives it the usual mode
    (`default_mode`, not mkstemp's 0600) and renames it to `path`: a reader never sees half a
    file. Creates the parent folders; removes the temporary file if `write` fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, default_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """`text` (UTF-8) at `path`, atomically (`write_atomic`)."""
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def check_writable(path: str | os.PathLike) -> None:
    """ValueError unless a file can be created at `path`: its folder is made if missing and a
    temporary file is created there and removed (a real try, not a permission guess)."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{path}: is a directory, not a file path")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}."):
            pass
    except OSError as e:
        raise ValueError(f"{path}: cannot write there ({e.strerror or e})") from None
