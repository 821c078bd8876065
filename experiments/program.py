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
environment, so a reader sees every value the run used. Two helpers keep a long run usable:
`cpu_defaults` scales a GPU-sized default down on a CPU (the flags then hold what the run used),
and `keep_partial` writes the rows measured so far, marked "complete": false, when the run is
interrupted (Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from absl import app, flags

from experiments import cli
from experiments.cli import UserError
from experiments.measure import results as results_lib

__all__ = [
    "UserError",
    "check_outputs",
    "cpu_defaults",
    "keep_partial",
    "on_interrupt",
    "own_flag_values",
    "progress",
    "run",
    "write_results",
]

_own_flags: list[str] = []
_name = ["program"]  # the running program's name, for the lines it ends with


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


def run(
    name: str,
    define_flags: Callable[[], None],
    main: Callable[[list[str]], None],
    *,
    arguments: bool = False,
) -> None:
    """Defines the program's flags, parses argv (a bad value: `name: message`, exit 2) and runs
    `main(argv)`; a UserError from it ends in `name: message` on stderr and exit 2, and so do
    positional arguments unless `arguments` (main takes them, e.g. file paths). Standard
    output is line-buffered, so that note and result lines show as they happen through a pipe."""
    _name[0] = name
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    define(define_flags)
    app.run(cli.main_runner(name, main, arguments=arguments), flags_parser=cli.flags_parser(name))


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


def cpu_defaults(values: Mapping[str, Any]) -> str | None:
    """On a CPU backend, sets every flag of `values` the user did not give to its value there
    (smaller sizes, fewer repeats: defaults sized for a GPU run for many minutes on a CPU) and
    returns the one line that says so; None elsewhere, or when nothing changed. The flags then
    hold what the run uses, which is what its JSON records. Starts the JAX backend."""
    import jax

    if jax.devices()[0].platform != "cpu":
        return None
    changed = {}
    for name, value in values.items():
        flag = flags.FLAGS[name]
        if not flag.present and flag.value != value:
            flag.value = value
            changed[name] = ",".join(map(str, value)) if isinstance(value, list) else value
    if not changed:
        return None
    shown = " ".join(f"--{name}={value}" for name, value in changed.items())
    return f"CPU: a short run with {shown} (give a flag to override it)"


class Terminated(BaseException):
    """SIGTERM, raised in the main thread by `on_interrupt`'s handler (a BaseException, as
    KeyboardInterrupt, so that no `except Exception` of a measurement swallows it)."""


@contextlib.contextmanager
def on_interrupt(save: Callable[[], Path | str | None]) -> Iterator[None]:
    """Runs the block; on Ctrl-C or SIGTERM inside it calls `save()` (which writes what was
    measured so far and returns its path, or None when nothing is written), prints one line on
    stderr and exits with status 130 (Ctrl-C) or 143 (SIGTERM), without a traceback."""

    def terminate(signum: int, frame: Any) -> None:
        raise Terminated

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, terminate) if main_thread else None
    try:
        yield
    except (KeyboardInterrupt, Terminated) as e:
        if main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        path = save()
        kept = f'what was measured is in {path} ("complete": false)' if path else "nothing written"
        cli.fail(_name[0], f"interrupted; {kept}", 143 if isinstance(e, Terminated) else 130)
    finally:
        if main_thread and previous is not None:  # None: a handler not set from Python
            signal.signal(signal.SIGTERM, previous)


def keep_partial(
    path: str | None, payload: Callable[[], dict[str, Any]]
) -> contextlib.AbstractContextManager[None]:
    """`on_interrupt` that writes `write_results(path, payload())` marked "complete": false
    (nothing for an empty `path`); `payload` reads the rows measured so far when called."""

    def save() -> Path | None:
        return write_results(path, {**payload(), "complete": False}) if path else None

    return on_interrupt(save)
