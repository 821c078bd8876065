"""What every experiment program does with an error a user can cause: one line, exit code 2."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn

from absl import flags


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
