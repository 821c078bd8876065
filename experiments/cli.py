"""What every experiment program does with an error a user can cause: one line, exit code 2."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from absl import flags, logging


class UserError(Exception):
    """An error the user can fix (a bad flag value, a size that cannot fit, a missing directory):
    reported as one line on stderr, exit code 2, no traceback."""


def positive_ints(name: str, values: list[str], least: int = 1) -> list[int]:
    """The list flag `--name` as integers >= `least` (1: positive); UserError naming the flag
    otherwise."""
    if not values:
        raise UserError(f"--{name} is empty: give at least one value")
    try:
        ints = [int(v) for v in values]
    except ValueError:
        raise UserError(f"--{name}={','.join(values)}: expected integers") from None
    if min(ints) < least:
        raise UserError(f"--{name}={','.join(values)}: values must be >= {least}")
    return ints


def check_writable(path: str) -> None:
    """UserError unless a file can be created at `path` (`huginn_jax.files.check_writable`: a
    real try). Checked before a measurement, not after it."""
    from huginn_jax.files import check_writable as try_create

    try:
        try_create(path)
    except ValueError as e:
        raise UserError(str(e)) from None


def flag_values(names) -> dict:
    """{name: value} of the parsed absl flags `names` (for a results JSON's environment)."""
    return {name: flags.FLAGS[name].value for name in names}


def main_runner(
    program: str, main: Callable[[list[str]], None], *, arguments: bool = False
) -> Callable[[list[str]], None]:
    """`main` for `app.run`, with a UserError, or a damaged model file (huginn_jax's
    CheckpointError, whose message names the file), ending in `program: message` and exit code
    2; so do positional arguments unless `arguments` (main takes them). Without --verbosity,
    absl logs warnings and errors only: the backends' INFO lines (e.g. a TPU probe on a CPU
    host) stay off stderr, where an error is one line."""

    def run(argv: list[str]) -> None:
        if not flags.FLAGS["verbosity"].present:
            logging.set_verbosity(logging.WARNING)
        try:
            if len(argv) > 1 and not arguments:
                raise UserError(f"unexpected arguments: {' '.join(argv[1:])}")
            main(argv)
        except UserError as e:
            fail(program, str(e))
        except ValueError as e:
            checkpoint_error = _checkpoint_error()
            if checkpoint_error is None or not isinstance(e, checkpoint_error):
                raise
            fail(program, str(e))

    return run


def _checkpoint_error() -> type | None:
    """huginn_jax's CheckpointError if a loader was imported (only then can one be raised)."""
    files = sys.modules.get("huginn_jax.files")
    return None if files is None else files.CheckpointError


def fail(program: str, message: str, code: int = 2) -> NoReturn:
    """Prints `program: message` on stderr and exits (no traceback, no usage text)."""
    print(f"{program}: {message}", file=sys.stderr)
    sys.exit(code)


def flags_parser(program: str) -> Callable[[list[str]], list[str]]:
    """For `app.run(main, flags_parser=...)`: absl's parser, but a bad flag value ends in one
    stderr line and exit code 2 instead of absl's usage text, and `--help` (which absl ends with
    status 1) exits with status 0: the help was asked for and printed."""

    def parse(argv: list[str]) -> list[str]:
        try:
            return flags.FLAGS(argv)
        except flags.Error as e:
            fail(program, str(e).splitlines()[0])
        except SystemExit as e:  # only absl's help flags exit while parsing
            raise SystemExit(0 if e.code == 1 else e.code) from None

    return parse


def names_in(name: str, values: list[str], known: Sequence[str], noun: str = "") -> list[str]:
    """The list flag `--name` without repeats; UserError when it is empty or holds a value not in
    `known` (the message lists them; `noun` names what a value is, e.g. "impl")."""
    if not values:
        raise UserError(f"--{name} is empty: give one or more of {', '.join(known)}")
    unknown = [v for v in values if v not in known]
    if unknown:
        what = f"{noun} " if noun else ""
        raise UserError(f"--{name}: unknown {what}{unknown[0]!r}; known: {', '.join(known)}")
    return list(dict.fromkeys(values))
