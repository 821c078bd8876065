"""What every experiment program does with an error a user can cause: one line, exit code 2."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn

from absl import flags


class UserError(Exception):
    """An error the user can fix (a bad flag value, a size that cannot fit, a missing directory):
    reported as one line on stderr, exit code 2, no traceback."""


def positive_ints(name: str, values: list[str]) -> list[int]:
    """The list flag `--name` as integers >= 1; UserError naming the flag otherwise."""
    try:
        ints = [int(v) for v in values]
    except ValueError:
        raise UserError(f"--{name}={','.join(values)}: expected integers") from None
    if not ints or min(ints) < 1:
        raise UserError(f"--{name}={','.join(values)}: values must be >= 1")
    return ints


def check_writable(path: str) -> None:
    """UserError unless a file can be created at `path`: its folder is made if missing and a
    temporary file is created there and removed (a real try, not a permission guess). Checked
    before a measurement, not after it."""
    import tempfile
    from pathlib import Path

    target = Path(path)
    if target.is_dir():
        raise UserError(f"{path}: is a directory, not a file path")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}."):
            pass
    except OSError as e:
        raise UserError(f"{path}: cannot write there ({e.strerror or e})") from None


def flag_values(names) -> dict:
    """{name: value} of the parsed absl flags `names` (for a results JSON's environment)."""
    return {name: flags.FLAGS[name].value for name in names}


def main_runner(program: str, main: Callable[[list[str]], None]) -> Callable[[list[str]], None]:
    """`main` for `app.run`, with a UserError ending in `program: message` and exit code 2."""

    def run(argv: list[str]) -> None:
        try:
            main(argv)
        except UserError as e:
            fail(program, str(e))

    return run


def fail(program: str, message: str, code: int = 2) -> NoReturn:
    """Prints `program: message` on stderr and exits (no traceback, no usage text)."""
    print(f"{program}: {message}", file=sys.stderr)
    sys.exit(code)


def flags_parser(program: str) -> Callable[[list[str]], list[str]]:
    """For `app.run(main, flags_parser=...)`: absl's parser, but a bad flag value ends in one
    stderr line and exit code 2 instead of absl's usage text."""

    def parse(argv: list[str]) -> list[str]:
        try:
            return flags.FLAGS(argv)
        except flags.Error as e:
            fail(program, str(e).splitlines()[0])

    return parse
