"""The training program's flags and their check: every value is validated before the backend
starts, into one `Options` that the run reads (the run never reads a flag itself).

Each function takes the `FlagValues` to define or read (default: absl's global one), so a test
can parse a command line of its own without touching the program's flags.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from absl import flags

from experiments.program import UserError
from huginn_jax.config import PRESETS
from huginn_jax.tasks import TASKS

if TYPE_CHECKING:
    from huginn_jax.config import HuginnConfig
    from huginn_jax.tasks import Task
    from huginn_jax.train import TrainConfig

FLAGS = flags.FLAGS


def define_flags(fv: flags.FlagValues = FLAGS) -> None:
    """Defines the program's flags in `fv`; called only when the program runs (or by a test)."""
    on = {"flag_values": fv}
    flags.DEFINE_enum("config", "micro", list(PRESETS), "Model preset.", **on)
    flags.DEFINE_enum("task", "root", list(TASKS), "Synthetic task (huginn_jax.tasks).", **on)
    flags.DEFINE_integer("nodes", 16, "root, khop: node symbols.", **on)
    flags.DEFINE_integer("max_chain", 8, "root: longest chain (nodes); depth < this.", **on)
    flags.DEFINE_bool(
        "uniform_lengths",
        True,
        "root: chain lengths uniform in 1..max_chain (else all max_chain).",
        **on,
    )
    flags.DEFINE_bool(
        "edge_tokens", True, "root: one token per edge (else two, 'a parent(a)').", **on
    )
    flags.DEFINE_integer(
        "vocab_size",
        None,
        "Override the preset's vocabulary; unset: the preset's, raised to the task's token "
        "count when the task needs more.",
        **on,
    )
    flags.DEFINE_list(
        "layers",
        None,
        "Override the preset's depth: prelude,core,coda layers (e.g. 1,1,1: a single pass is 3 "
        "layers, so deep queries must be solved by Core iterations).",
        **on,
    )
    flags.DEFINE_integer("max_hops", 8, "khop: hops per query, uniform in 1..max_hops.", **on)
    flags.DEFINE_integer("queries", 4, "root, khop: queries per sequence.", **on)
    flags.DEFINE_integer("digits", 8, "add: digits per operand.", **on)
    flags.DEFINE_integer("steps", 1000, "Total optimizer steps (a resumed run continues).", **on)
    flags.DEFINE_integer("batch", 64, "Sequences per step.", **on)
    flags.DEFINE_string(
        "mesh",
        "",
        "Data parallelism: data:N splits each batch over N devices (--batch a multiple of N); "
        "'' = one device.",
        **on,
    )
    flags.DEFINE_float("lr", 1e-3, "Peak learning rate.", **on)
    flags.DEFINE_enum(
        "schedule",
        "constant",
        ["constant", "cosine"],
        "After warm-up: flat, or cosine to lr/10.",
        **on,
    )
    flags.DEFINE_integer("warmup_steps", 100, "Linear warm-up steps.", **on)
    flags.DEFINE_float("clip", 1.0, "Max global gradient norm.", **on)
    flags.DEFINE_float("weight_decay", 0.1, "Decoupled weight decay (matrices only).", **on)
    flags.DEFINE_float("mean_recurrence", 32.0, "Mean of τ (E[p] = mean + 1).", **on)
    flags.DEFINE_integer("backprop_depth", 8, "k: iterations with gradient.", **on)
    flags.DEFINE_float("init_scale", 1.0, "Random initial state scale when training.", **on)
    flags.DEFINE_enum(
        "dtype",
        "float32",
        ["float32", "bfloat16"],
        "Compute dtype (params stay float32).",
        **on,
    )
    flags.DEFINE_integer("seed", 0, "Seed of init, data, recurrence and evaluation.", **on)
    flags.DEFINE_string("out_dir", None, "Default home of json, plot, ckpt and export.", **on)
    flags.DEFINE_string("ckpt_dir", None, "Orbax checkpoints (default OUT_DIR/ckpt).", **on)
    flags.DEFINE_integer("save_every", 500, "Save a checkpoint every N steps.", **on)
    flags.DEFINE_integer("keep", 3, "Checkpoints kept.", **on)
    flags.DEFINE_bool("resume", False, "Continue from the newest good checkpoint.", **on)
    flags.DEFINE_integer(
        "log_every",
        50,
        "Steps per history entry (window means) and per host sync / time check.",
        **on,
    )
    flags.DEFINE_float(
        "max_train_seconds",
        0.0,
        "Stop training (save, evaluate) after this wall time; 0: no limit.",
        **on,
    )
    flags.DEFINE_list(
        "eval_iterations",
        ["1", "2", "4", "8", "16", "32", "64"],
        "Test-time iterations to score.",
        **on,
    )
    flags.DEFINE_integer("eval_examples", 1024, "Evaluation sequences.", **on)
    flags.DEFINE_float(
        "eval_init_scale", 1.0, "Initial state at test time: 1 as in training, 0 zeros.", **on
    )
    flags.DEFINE_float("kl_threshold", 5e-4, "Adaptive exit: KL(prev || current) threshold.", **on)
    flags.DEFINE_string("json_out", None, "Results JSON (default OUT_DIR/train.json).", **on)
    flags.DEFINE_string("plot_out", None, "Plot from the JSON (default OUT_DIR/train.png).", **on)
    flags.DEFINE_string("export_dir", None, "safetensors export (default OUT_DIR/export).", **on)
    flags.DEFINE_bool("compare_random", False, "Trained vs random weights (timing, exits).", **on)
    flags.DEFINE_integer("compare_steps", 32, "Core iterations per decoded token.", **on)
    flags.DEFINE_integer("compare_repeats", 50, "Timed decode steps per model.", **on)


@dataclasses.dataclass(frozen=True)
class Paths:
    """Where the outputs go; None: not written."""

    json_out: Path | None
    plot_out: Path | None
    ckpt_dir: Path | None
    export_dir: Path | None

    def check_writable(self) -> None:
        """UserError unless every output can be created: the JSON and plot files, and the
        checkpoint and export folders (checked before training, so that a bad path costs no run)."""
        from experiments import program

        program.check_outputs(*(str(p) for p in (self.json_out, self.plot_out) if p))
        for folder in (self.ckpt_dir, self.export_dir):
            if folder is None:
                continue
            if folder.is_dir():
                if not os.access(folder, os.W_OK | os.X_OK):
                    raise UserError(f"{folder}: cannot write there (not a writable directory)")
            elif folder.exists():
                raise UserError(f"{folder}: is a file, not a directory")
            else:
                program.check_outputs(str(folder))  # its parent can hold a new folder

    def unsaved(self) -> str | None:
        """One line naming what this run will not save (None when everything is saved), said
        before training, so that a long run without --out_dir is no surprise at its end."""
        names = {
            "json_out": "results JSON",
            "plot_out": "plot",
            "ckpt_dir": "checkpoints",
            "export_dir": "trained weights",
        }
        missing = [words for field, words in names.items() if getattr(self, field) is None]
        if not missing:
            return None
        if len(missing) == len(names):
            return "no --out_dir: nothing will be saved (results JSON, plot, checkpoints, weights)"
        return f"this run will not save: {', '.join(missing)}"


def paths_from_flags(fv: flags.FlagValues = FLAGS) -> Paths:
    """Each output at its own flag's path, else under --out_dir; '' turns an output off."""
    out = Path(fv.out_dir) if fv.out_dir else None

    def pick(value: str | None, default: str) -> Path | None:
        if value is not None:
            return Path(value) if value else None
        return out / default if out else None

    return Paths(
        json_out=pick(fv.json_out, "train.json"),
        plot_out=pick(fv.plot_out, "train.png"),
        ckpt_dir=pick(fv.ckpt_dir, "ckpt"),
        export_dir=pick(fv.export_dir, "export"),
    )


def eval_iterations_from_flags(fv: flags.FlagValues = FLAGS) -> list[int]:
    """--eval_iterations as sorted distinct integers >= 1."""
    try:
        values = sorted({int(v) for v in fv.eval_iterations})
    except ValueError:
        raise UserError(f"--eval_iterations must be integers, got {fv.eval_iterations}") from None
    if not values or values[0] < 1:
        raise UserError(f"--eval_iterations must be >= 1, got {fv.eval_iterations}")
    return values


def setup_from_flags(fv: flags.FlagValues = FLAGS):
    """(model config, task, TrainConfig) from the flags; UserError on the first bad value."""
    from huginn_jax import tasks, train
    from huginn_jax.config import HuginnConfig

    counts = ("steps", "batch", "save_every", "keep", "log_every", "eval_examples")
    for flag in (*counts, "compare_steps", "compare_repeats"):
        if fv[flag].value < 1:
            raise UserError(f"--{flag} must be >= 1, got {fv[flag].value}")
    if fv.seed < 0:
        raise UserError(f"--seed must be >= 0, got {fv.seed}")
    floats = {
        "max_train_seconds": (lambda v: v >= 0, ">= 0 (0: no limit)"),
        "eval_init_scale": (lambda v: v >= 0, ">= 0 (0: zeros)"),
        "kl_threshold": (lambda v: v > 0, "> 0"),
    }
    for flag, (ok, words) in floats.items():
        value = fv[flag].value
        if not (math.isfinite(value) and ok(value)):
            raise UserError(f"--{flag} must be a number {words}, got {value}")
    if fv.resume and paths_from_flags(fv).ckpt_dir is None:
        raise UserError("--resume needs --ckpt_dir (or --out_dir)")
    try:
        cfg = train.TrainConfig(
            batch=fv.batch,
            lr=fv.lr,
            warmup_steps=fv.warmup_steps,
            total_steps=fv.steps,
            schedule=fv.schedule,
            clip=fv.clip,
            weight_decay=fv.weight_decay,
            mean_recurrence=fv.mean_recurrence,
            backprop_depth=fv.backprop_depth,
            init_scale=fv.init_scale,
            compute_dtype=fv.dtype,
        )
        task = tasks.make_task(
            fv.task,
            nodes=fv.nodes,
            max_chain=fv.max_chain,
            uniform_lengths=fv.uniform_lengths,
            edge_tokens=fv.edge_tokens,
            max_hops=fv.max_hops,
            queries=fv.queries,
            digits=fv.digits,
        )
    except ValueError as e:
        raise UserError(str(e)) from None
    config = HuginnConfig.from_name(fv.config)
    if fv.vocab_size is not None:
        if fv.vocab_size < 1:
            raise UserError(f"--vocab_size must be >= 1, got {fv.vocab_size}")
        config = dataclasses.replace(config, vocab_size=fv.vocab_size)
    if fv.layers is not None:
        layers = ",".join(fv.layers)
        try:
            prelude, core, coda = (int(n) for n in fv.layers)
        except ValueError:
            raise UserError(
                f"--layers takes three integers prelude,core,coda; got {layers}"
            ) from None
        if min(prelude, core, coda) < 1:
            raise UserError(f"--layers needs at least one layer in each part; got {layers}")
        config = dataclasses.replace(
            config,
            n_layers_in_prelude=prelude,
            n_layers_in_recurrent_block=core,
            n_layers_in_coda=coda,
        )
    config = train.run_config(config, cfg)
    if task.vocab_size > config.vocab_size:
        if fv.vocab_size is not None:
            raise UserError(
                f"--vocab_size={fv.vocab_size}: task {task.name} needs {task.vocab_size} tokens"
            )
        config = dataclasses.replace(config, vocab_size=task.vocab_size)
    if task.seq_len - 1 > config.block_size:
        raise UserError(
            f"task {task.name} sequences have {task.seq_len - 1} positions; --config="
            f"{fv.config} has block_size={config.block_size}"
        )
    eval_iterations_from_flags(fv)
    return config, task, cfg


@dataclasses.dataclass(frozen=True)
class Options:
    """A checked run: what the training, evaluation and comparison read."""

    preset: str  # --config
    config: HuginnConfig  # the preset with --vocab_size, --layers and the recurrence applied
    task: Task
    train: TrainConfig
    paths: Paths
    eval_iterations: list[int]
    seed: int
    steps: int
    resume: bool
    save_every: int
    keep: int
    log_every: int
    max_train_seconds: float
    eval_examples: int
    eval_init_scale: float
    kl_threshold: float
    compare_random: bool
    compare_steps: int
    compare_repeats: int
    data_devices: int = 1  # --mesh=data:N

    def eval_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `huginn_jax.evaluation.evaluate` for this run."""
        return dict(
            iterations=self.eval_iterations,
            num_examples=self.eval_examples,
            init_scale=self.eval_init_scale,
            kl_threshold=self.kl_threshold,
        )


def options_from_flags(fv: flags.FlagValues = FLAGS) -> Options:
    """The checked `Options` of the parsed flags; UserError on the first bad value."""
    config, task, cfg = setup_from_flags(fv)
    return Options(
        preset=fv.config,
        config=config,
        task=task,
        train=cfg,
        paths=paths_from_flags(fv),
        eval_iterations=eval_iterations_from_flags(fv),
        seed=fv.seed,
        steps=fv.steps,
        resume=fv.resume,
        save_every=fv.save_every,
        keep=fv.keep,
        log_every=fv.log_every,
        max_train_seconds=fv.max_train_seconds,
        eval_examples=fv.eval_examples,
        eval_init_scale=fv.eval_init_scale,
        kl_threshold=fv.kl_threshold,
        compare_random=fv.compare_random,
        compare_steps=fv.compare_steps,
        compare_repeats=fv.compare_repeats,
        data_devices=data_devices_from_flags(fv),
    )


def data_devices_from_flags(fv: flags.FlagValues = FLAGS) -> int:
    """N of --mesh=data:N (1 without --mesh); UserError for another axis, a bad string or a
    --batch that N does not divide."""
    if not fv.mesh:
        return 1
    from huginn_jax import parallel

    try:
        sizes = parallel.parse_mesh_spec(fv.mesh)
    except ValueError as e:
        raise UserError(f"--mesh: {e}") from None
    if set(sizes) != {parallel.DATA_AXIS}:
        raise UserError(f"--mesh={fv.mesh}: training splits over a 'data' axis only")
    n = sizes[parallel.DATA_AXIS]
    if fv.batch % n:
        raise UserError(f"--batch={fv.batch} must be a multiple of the {n} devices of --mesh")
    return n
