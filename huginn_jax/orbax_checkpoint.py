"""Training checkpoints with orbax: periodic saves, keep-N, resume from the newest good one.

Layout (orbax `CheckpointManager`): `<dir>/<step>/state` holds the train-state pytree,
`<dir>/<step>/meta` a JSON with the run's description, the [path, shape, dtype] of every leaf and a
SHA-256 over all of them. A restore checks that both items exist, compares the leaf list with the
expected tree (orbax alone would cast dtypes and ignore shapes), reads the arrays and checks the
digest, so a missing, truncated, partial or bit-flipped step is caught. Such a step is reported
in one line, moved aside to `<dir>/corrupt-<step>` (kept for inspection, out of orbax's step list
so that keep-N and later saves ignore it) and the next older step is tried: the last good
checkpoint is what a run resumes from; when every step is damaged that is a CheckpointError, not
a fresh start. An intact checkpoint of another run is refused (CheckpointMismatch), never moved.
Every error names the step directory.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from huginn_jax.files import CheckpointError

_REQUIRED = ("state", "meta")  # the items every finished step directory holds


def tree_digest(tree: Any) -> str:
    """SHA-256 over every leaf's path, dtype, shape and bytes, in tree order (host arrays)."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{jax.tree_util.keystr(path)}|{a.dtype}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def tree_signature(tree: Any) -> list[list]:
    """[path, shape, dtype] of every leaf (arrays or ShapeDtypeStructs), in tree order."""
    return [
        [jax.tree_util.keystr(path), list(np.shape(leaf)), str(np.dtype(leaf.dtype))]
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


class CheckpointMismatch(CheckpointError):
    """An intact checkpoint of another run (other model, task or tree): never set aside."""


def _quiet_closed_loop_callbacks() -> None:
    """After a failed read, tensorstore still completes the pending reads of that restore and
    calls back into orbax's event loop, already closed: each callback would print a traceback
    ("Event loop is closed") through `sys.unraisablehook`. Drop exactly those; pass on the rest."""
    previous = sys.unraisablehook
    if getattr(previous, "_drops_closed_loop", False):
        return

    def hook(unraisable):
        exc = unraisable.exc_value
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        previous(unraisable)

    hook._drops_closed_loop = True
    sys.unraisablehook = hook


def _report_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class TrainCheckpoints:
    """A directory of training checkpoints (an orbax `CheckpointManager` with integrity checks).

    `save(step, tree, meta)` writes every `save_interval_steps` steps (or when forced) and keeps the
    newest `max_to_keep`; `restore_latest(abstract)` returns the newest step that reads back intact.
    Trees are copied to host before orbax writes them, so a caller may donate its device buffers
    right after `save` returns.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        max_to_keep: int = 3,
        save_interval_steps: int = 1,
        report: Callable[[str], None] = _report_stderr,
    ):
        if max_to_keep < 1 or save_interval_steps < 1:
            raise ValueError(f"{max_to_keep=} and {save_interval_steps=} must be positive")
        self.directory = Path(directory).absolute()
        self.report = report
        self.save_interval_steps = save_interval_steps
        # The interval is applied here (step % interval == 0), not by orbax, which also saves the
        # first step it sees.
        self._options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        self._manager = self._open()

    def _open(self) -> ocp.CheckpointManager:
        return ocp.CheckpointManager(self.directory, item_names=_REQUIRED, options=self._options)

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        """True every `save_interval_steps` steps (multiples of it)."""
        return step % self.save_interval_steps == 0

    def save(self, step: int, tree: Any, meta: dict, *, force: bool = False) -> bool:
        """Saves `tree` (any pytree of arrays) and `meta` (JSON) as `step`; True if it wrote."""
        if not force and not self.should_save(step):
            return False
        host = jax.device_get(tree)
        meta = {
            **meta,
            "step": int(step),
            "sha256": tree_digest(host),
            "leaves": tree_signature(host),
        }
        return self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(host), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )

    def wait(self) -> None:
        """Blocks until asynchronous writes have finished."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    def restore(
        self, step: int, abstract: Any, *, validate: Callable[[dict], None] | None = None
    ) -> tuple[Any, dict]:
        """(tree, meta) of `step`; raises CheckpointError naming the step directory and what is
        wrong with its files, or CheckpointMismatch when they are intact but hold another run's
        tree (or `validate(meta)` raises it).

        `abstract`: the expected tree of `jax.ShapeDtypeStruct`s. Orbax itself would cast dtypes
        and ignore shapes silently, hence the leaf-by-leaf comparison against the saved list.
        """
        step_dir = self.directory / str(step)
        missing = [name for name in _REQUIRED if not (step_dir / name).is_dir()]
        if missing:
            raise CheckpointError(f"{step_dir}: incomplete, no {' or '.join(missing)} item")
        meta = self._read(step, ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        if not isinstance(meta, dict) or "sha256" not in meta or "leaves" not in meta:
            raise CheckpointError(f"{step_dir}: incomplete, meta lacks the digest or the leaf list")
        if validate is not None:
            validate(meta)
        expected = tree_signature(abstract)
        for saved, want in zip(meta["leaves"], expected, strict=False):
            if saved != want:
                raise CheckpointMismatch(
                    f"{step_dir} holds {saved[0]} {saved[2]}{saved[1]}, this run expects "
                    f"{want[0]} {want[2]}{want[1]}"
                )
        if len(meta["leaves"]) != len(expected):
            raise CheckpointMismatch(
                f"{step_dir} holds {len(meta['leaves'])} arrays, this run expects {len(expected)}"
            )
        state = self._read(step, ocp.args.Composite(state=ocp.args.StandardRestore(abstract))).state
        if tree_digest(jax.device_get(state)) != meta["sha256"]:
            raise CheckpointError(
                f"{step_dir}: contents differ from what was saved (sha256 mismatch)"
            )
        return state, meta

    def _read(self, step: int, args: ocp.args.Composite):
        try:
            return self._manager.restore(step, args=args)
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many kinds; all mean "bad"
            _quiet_closed_loop_callbacks()
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(
                f"{self.directory / str(step)}: unreadable: {type(e).__name__}: {first[:200]}"
            ) from e

    def restore_latest(
        self, abstract: Any, *, validate: Callable[[dict], None] | None = None
    ) -> tuple[int, Any, dict] | None:
        """(step, tree, meta) of the newest intact step, or None (reported) if the directory
        holds no checkpoint at all.

        Each damaged step met on the way is reported in one line and moved to `corrupt-<step>`;
        when no intact step is left (all damaged now, or only damaged ones set aside earlier) a
        CheckpointError says so: there is nothing to resume from, and starting afresh is the
        caller's choice. A CheckpointMismatch (another run's checkpoint) is raised, nothing is
        moved.
        """
        self.wait()
        steps = self.all_steps()
        if not steps:
            aside = sorted(p.name for p in self.directory.glob("corrupt-*"))
            if aside:
                raise CheckpointError(
                    f"{self.directory}: no intact checkpoint, only damaged ones set aside "
                    f"({', '.join(aside)}); nothing to resume from"
                )
            self.report(f"checkpoint: no checkpoint in {self.directory}")
            return None
        for step in reversed(steps):
            try:
                tree, meta = self.restore(step, abstract, validate=validate)
            except CheckpointMismatch:
                raise
            except CheckpointError as e:
                aside = self._set_aside(step)
                older = [s for s in steps if s < step]
                then = f"trying step {older[-1]}" if older else "no older checkpoint left"
                self.report(
                    f"checkpoint: step {step} is damaged ({e}); moved to {aside.name}; {then}"
                )
                continue
            return step, tree, meta
        raise CheckpointError(
            f"{self.directory}: every checkpoint is damaged (steps {', '.join(map(str, steps))}, "
            "each moved aside to corrupt-<step>); nothing to resume from"
        )

    def _set_aside(self, step: int) -> Path:
        """Renames a bad step directory out of orbax's view."""
        source = self.directory / str(step)
        target = self.directory / f"corrupt-{step}"
        n = 1
        while target.exists():
            n += 1
            target = self.directory / f"corrupt-{step}.{n}"
        source.rename(target)
        self._manager.reload()  # re-read the step list from disk
        return target
