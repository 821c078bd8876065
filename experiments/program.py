"""The one skeleton every experiment program follows.

    define flags -> validate (a UserError: one line on stderr, exit 2) -> run with progress on
    stderr -> write the results JSON atomically -> print the table last

A program module keeps its flags in `define_flags()` (called only when it runs as the program,
so that tests and other programs can import it) and hands both to `run`:

    def main(argv: list[str]) -> None:
        options = options_from_flags()           # UserError for a bad value, before any work
        program.check_outputs(FLAGS.json_out)     # an unwritable path fails now, not at the end
        records = measure(options)                # program.progress(...) over long loops
        program.write_results(FLAGS.json_out, {"records": records})
        print(format_table(records))

    if __name__ == "__main__":
        program.run("core", define_flags, main)

A program's own flags are the ones its `define_flags()` added: they go into the JSON's
environment, so a reader sees every value the run used.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from absl import app, flags

from experiments import cli
from experiments.cli import UserError
from experiments.measure import results as results_lib

__all__ = [
    "UserError",
    "check_outputs",
    "own_flag_values",
    "progress",
    "run",
    "write_results",
]

_own_flags: list[str] = []


def define(define_flags: Callable[[], None]) -> list[str]:
    """Calls `define_flags()`, records the names of the flags it added (the program's own) and
    makes them key flags of the main module, so that `--help` lists them wherever they were
    defined (absl lists only the main module's flags)."""
    before = set(flags.FLAGS)
    define_flags()
    _own_flags[:] = sorted(set(flags.FLAGS) - before)
    for name in _own_flags:
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[name])
    return list(_own_flags)


def run(name: str, define_flags: Callable[[], None], main: Callable[[list[str]], None]) -> None:
    """Defines the program's flags, parses argv (a bad value: `name: message`, exit 2) and runs
    `main(argv)`; a UserError from it ends in `name: message` on stderr and exit 2."""
    define(define_flags)
    app.run(cli.main_runner(name, main), flags_parser=cli.flags_parser(name))


def own_flag_values() -> dict[str, Any]:
    """{name: value} of the running program's own flags (see `define`), less the internal ones
    (help text marked "Internal:", e.g. the flags a program passes to its own child process)."""
    return {
        name: value
        for name, value in cli.flag_values(_own_flags).items()
        if "Internal:" not in (flags.FLAGS[name].help or "")
    }


def check_outputs(*paths: str | None) -> None:
    """UserError unless each given output path (empty or None: not written) can be created."""
    for path in paths:
        if path:
            cli.check_writable(path)


def progress[T](items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
    """`items`, with a progress bar on stderr (silent for fewer than two items)."""
    from tqdm import tqdm

    items = list(items) if total is None else items
    count = total if total is not None else len(items)  # type: ignore[arg-type]
    yield from tqdm(items, desc=desc, total=count, disable=count < 2, file=sys.stderr)


def write_results(path: str, payload: dict[str, Any]) -> Path:
    """The results JSON at `path`, atomically: the environment (device, versions, this program's
    own flag values) and `payload`."""
    return results_lib.write_results(path, own_flag_values(), payload)
