r"""Trains a small Huginn on a synthetic task with the reference recipe; scores test-time compute.

    python -m experiments.train --config=micro --vocab_size=128 --nodes=10 --max_chain=6 \
        --queries=6 --steps=3000 --mean_recurrence=8 --backprop_depth=4 --lr=2e-3 --out_dir=DIR
    python -m experiments.train --flagfile=experiments/train_h200.flags --out_dir=DIR

Recipe (huginn_jax.train): recurrence p = Poisson(τ) + 1 with τ ~ LogNormal(ln(mean) − σ²/2, 0.5),
the first max(p − k, 0) iterations without gradient and the last min(p, k) with it; AdamW
(0.9, 0.95), linear warm-up, global-norm clipping; loss on the task's answer tokens only. Data are
drawn in-graph from fold_in(seed, step), so `--resume` continues bit for bit. Tasks
(huginn_jax.tasks): `root` (follow parent pointers to a chain's head; the default), `khop`
(h hops through a permutation), `add` (addition, sum most-significant digit first).
`--max_train_seconds` caps the training wall time (compilation included) for fixed budgets.

Outputs (all optional; `--out_dir` sets the defaults; every path is checked before training):
  DIR/train.json   flags, environment, training history (loss, accuracy, tokens/s), the
                   accuracy-against-iterations curve, adaptive-exit statistics, trained vs random
  DIR/train.png    drawn from the JSON only (`report.plot_results`)
  DIR/ckpt/        orbax checkpoints (every --save_every steps, newest --keep kept)
  DIR/export/      the trained weights in the safetensors layout `huginn_jax.from_pretrained` reads

Trained vs random (`--compare_random`): times one decode step (a token through prelude, r Core
iterations with a full KV cache, coda) for the trained weights and for random weights of the same
shape, with `experiments.measure.timing` (warm-up calls, then the median of timed calls, caches
not flushed), and reports the KL-exit statistics of both on the task, and of
`huginn_jax.generate.generate(..., criterion="kl")`.

The program checks every flag and output path first, then trains, evaluates, exports and
compares, writes the JSON and the plot, and prints the table last.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Any

from absl import flags, logging

from experiments import program
from experiments.train import compare, loop, options, report
from experiments.train.options import Options, options_from_flags

NAME = "train"


def define_flags() -> None:
    """The program's flags (`options.define_flags`), listed by --help as this program's own."""
    options.define_flags()
    flags.adopt_module_key_flags(options)


def run(opts: Options, notes: list[str]) -> dict[str, Any]:
    """Trains, evaluates (accuracy against test-time iterations, the KL exit), exports and
    compares as `opts` says; returns the results JSON's content. Notes go to `notes` and stderr."""
    import jax
    import jax.numpy as jnp

    import huginn_jax
    from experiments.measure import results as results_lib
    from huginn_jax import train
    from huginn_jax.evaluation import evaluate

    def note(message: str) -> None:
        notes.append(message)
        print(f"{NAME}: {message}", file=sys.stderr, flush=True)

    run_t0 = time.perf_counter()
    trained = loop.run_training(opts, note)
    config, task, cfg, seed = opts.config, opts.task, opts.train, opts.seed
    params = trained.state.params
    params_f32 = train.merge_model(trained.graphdef, params, jnp.float32)
    model = train.merge_model(trained.graphdef, params, cfg.dtype)
    eval_kwargs = opts.eval_kwargs()
    t0 = time.perf_counter()
    key = jax.random.fold_in(jax.random.key(seed), 2)
    evaluation = evaluate(model, task, key, **eval_kwargs)
    eval_s = time.perf_counter() - t0
    export_dir = opts.paths.export_dir
    if export_dir is not None:
        huginn_jax.save_pretrained(params_f32, export_dir)
        note(f"exported float32 weights to {export_dir}")

    history = trained.history
    data: dict[str, Any] = {
        "experiment": NAME,
        "env": results_lib.environment(program.own_flag_values()),
        "config": {
            "preset": opts.preset,
            "model": dataclasses.asdict(config),
            "task": task.to_dict(),
            "difficulty_labels": {str(d): task.label(d) for d in task.difficulties},
            "train": cfg.to_dict(),
            "seed": seed,
            "tokens_per_step": trained.tokens_per_step,
        },
        "train": {
            "history": history,
            "resumed_from": trained.resumed_from,
            "final_step": int(jax.device_get(trained.state.step)),
            **trained.timing,
        },
        "eval": {**evaluation, "seconds": eval_s},
        "notes": notes,
    }
    if opts.compare_random:
        small_eval = {**eval_kwargs, "num_examples": min(256, opts.eval_examples)}
        data["compare_random"] = compare.compare_random(
            model,
            task,
            eval_kwargs=small_eval,
            num_steps=opts.compare_steps,
            repeats=opts.compare_repeats,
            seed=seed,
        )
    if not math.isfinite(history[-1]["loss"] if history else 0.0):
        note("the training loss is not finite")
    data["wall_s"] = time.perf_counter() - run_t0  # backend start-up to here; not plot/JSON
    return data


def main(argv: list[str]) -> None:
    """Flags and output paths checked, `run`, then the JSON, the plot and the table (last). A
    run that saves nothing says so first; a checkpoint directory with no intact step to resume
    from (huginn_jax's CheckpointError) ends in one line and exit status 2, as a bad flag."""
    from experiments.measure import results as results_lib

    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # keep orbax/backend INFO lines off stderr
    opts = options_from_flags()  # every flag checked before the backend starts
    paths = opts.paths
    paths.check_writable()  # and every output path, before any training
    loop.check_fits(opts)  # and a size that cannot fit, before anything is allocated
    unsaved = paths.unsaved()
    if unsaved:
        print(f"{NAME}: warning: {unsaved}", file=sys.stderr, flush=True)
    notes: list[str] = []
    data = run(opts, notes)
    json_path = results_lib.write_json_atomic(paths.json_out, data) if paths.json_out else None
    plot_path = None
    if json_path and paths.plot_out:
        plot_path = report.plot_results(json_path, paths.plot_out)
    print()
    print(report.format_table(data))
    print(f"json: {json_path or '(not written)'}")
    print(f"plot: {plot_path or '(not written)'}")


if __name__ == "__main__":
    program.run(NAME, define_flags, main)
