"""Trains a small Huginn on a synthetic task with the reference recipe; evaluates test-time compute.

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

Outputs (all optional; `--out_dir` sets the defaults):
  DIR/train.json   flags, environment, training history (loss, accuracy, tokens/s), the
                   accuracy-against-iterations curve, adaptive-exit statistics, trained vs random
  DIR/train.png    drawn from the JSON only (`plot_results`)
  DIR/ckpt/        orbax checkpoints (every --save_every steps, newest --keep kept)
  DIR/export/      the trained weights in the safetensors layout `huginn_jax.from_pretrained` reads

Trained vs random (`--compare_random`): times one decode step (a token through prelude, r Core
iterations with a full KV cache, coda) for the trained weights and for random weights of the same
shape, with `experiments.measure.timing` (warm-up calls, then the median of timed calls, caches
not flushed), and reports the KL-exit statistics of both on the task, and of
`huginn_jax.generate.generate(..., criterion="kl")` where that exists.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from absl import app, flags, logging

from experiments import cli
from experiments.cli import UserError
from huginn_jax.config import PRESETS
from huginn_jax.tasks import TASKS

_CONFIG = flags.DEFINE_enum("config", "micro", list(PRESETS), "Model preset.")
_TASK = flags.DEFINE_enum("task", "root", list(TASKS), "Synthetic task (huginn_jax.tasks).")
_NODES = flags.DEFINE_integer("nodes", 16, "root, khop: node symbols.")
_MAX_CHAIN = flags.DEFINE_integer("max_chain", 8, "root: longest chain (nodes); depth < this.")
_UNIFORM = flags.DEFINE_bool(
    "uniform_lengths", True, "root: chain lengths uniform in 1..max_chain (else all max_chain)."
)
_EDGE_TOKENS = flags.DEFINE_bool(
    "edge_tokens", True, "root: one token per edge (else two, 'a parent(a)')."
)
_VOCAB = flags.DEFINE_integer(
    "vocab_size", None, "Override the preset's vocabulary (e.g. to fit a task's edge tokens)."
)
_LAYERS = flags.DEFINE_list(
    "layers",
    None,
    "Override the preset's depth: prelude,core,coda layers (e.g. 1,1,1: a single pass is 3 "
    "layers, so deep queries must be solved by Core iterations).",
)
_MAX_HOPS = flags.DEFINE_integer("max_hops", 8, "khop: hops per query, uniform in 1..max_hops.")
_QUERIES = flags.DEFINE_integer("queries", 4, "root, khop: queries per sequence.")
_DIGITS = flags.DEFINE_integer("digits", 8, "add: digits per operand.")
_STEPS = flags.DEFINE_integer("steps", 1000, "Total optimizer steps (a resumed run continues).")
_BATCH = flags.DEFINE_integer("batch", 64, "Sequences per step.")
_LR = flags.DEFINE_float("lr", 1e-3, "Peak learning rate.")
_SCHEDULE = flags.DEFINE_enum(
    "schedule", "constant", ["constant", "cosine"], "After warm-up: flat, or cosine to lr/10."
)
_WARMUP = flags.DEFINE_integer("warmup_steps", 100, "Linear warm-up steps.")
_CLIP = flags.DEFINE_float("clip", 1.0, "Max global gradient norm.")
_WD = flags.DEFINE_float("weight_decay", 0.1, "Decoupled weight decay (matrices only).")
_MEAN_R = flags.DEFINE_float("mean_recurrence", 32.0, "Mean of τ (E[p] = mean + 1).")
_K = flags.DEFINE_integer("backprop_depth", 8, "k: iterations with gradient.")
_TRAIN_INIT = flags.DEFINE_float("init_scale", 1.0, "Random initial state scale when training.")
_DTYPE = flags.DEFINE_enum(
    "dtype", "float32", ["float32", "bfloat16"], "Compute dtype (params stay float32)."
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of init, data, recurrence and evaluation.")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Default home of json, plot, ckpt and export.")
_CKPT_DIR = flags.DEFINE_string("ckpt_dir", None, "Orbax checkpoints (default OUT_DIR/ckpt).")
_SAVE_EVERY = flags.DEFINE_integer("save_every", 500, "Save a checkpoint every N steps.")
_KEEP = flags.DEFINE_integer("keep", 3, "Checkpoints kept.")
_RESUME = flags.DEFINE_bool("resume", False, "Continue from the newest good checkpoint.")
_LOG_EVERY = flags.DEFINE_integer(
    "log_every", 50, "Steps per history entry (window means) and per host sync / time check."
)
_MAX_SECONDS = flags.DEFINE_float(
    "max_train_seconds", 0.0, "Stop training (save, evaluate) after this wall time; 0: no limit."
)
_EVAL_ITERS = flags.DEFINE_list(
    "eval_iterations", ["1", "2", "4", "8", "16", "32", "64"], "Test-time iterations to score."
)
_EVAL_EXAMPLES = flags.DEFINE_integer("eval_examples", 1024, "Evaluation sequences.")
_EVAL_INIT = flags.DEFINE_float(
    "eval_init_scale", 1.0, "Initial state at test time: 1 as in training, 0 zeros."
)
_KL = flags.DEFINE_float("kl_threshold", 5e-4, "Adaptive exit: KL(prev || current) threshold.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Results JSON (default OUT_DIR/train.json).")
_PLOT_OUT = flags.DEFINE_string("plot_out", None, "Plot from the JSON (default OUT_DIR/train.png).")
_EXPORT = flags.DEFINE_string("export_dir", None, "safetensors export (default OUT_DIR/export).")
_COMPARE = flags.DEFINE_bool("compare_random", False, "Trained vs random weights (timing, exits).")
_COMPARE_R = flags.DEFINE_integer("compare_steps", 32, "Core iterations per decoded token.")
_COMPARE_REPEATS = flags.DEFINE_integer("compare_repeats", 50, "Timed decode steps per model.")

_NAME = "train"


def _fail(message: str, code: int = 2) -> NoReturn:
    cli.fail(_NAME, f"error: {message}", code)


@dataclasses.dataclass(frozen=True)
class Paths:
    json_out: Path | None
    plot_out: Path | None
    ckpt_dir: Path | None
    export_dir: Path | None


def paths_from_flags() -> Paths:
    out = Path(_OUT_DIR.value) if _OUT_DIR.value else None

    def pick(value: str | None, default: str) -> Path | None:
        if value is not None:
            return Path(value) if value else None  # '' turns an output off
        return out / default if out else None

    return Paths(
        json_out=pick(_JSON_OUT.value, "train.json"),
        plot_out=pick(_PLOT_OUT.value, "train.png"),
        ckpt_dir=pick(_CKPT_DIR.value, "ckpt"),
        export_dir=pick(_EXPORT.value, "export"),
    )


def eval_iterations_from_flags() -> list[int]:
    try:
        values = sorted({int(v) for v in _EVAL_ITERS.value})
    except ValueError:
        raise UserError(f"--eval_iterations must be integers, got {_EVAL_ITERS.value}") from None
    if not values or values[0] < 1:
        raise UserError(f"--eval_iterations must be >= 1, got {_EVAL_ITERS.value}")
    return values


def setup_from_flags():
    """(model config, task, TrainConfig) from the flags; UserError on the first bad value."""
    from huginn_jax import tasks, train
    from huginn_jax.config import HuginnConfig

    for flag in ("steps", "batch", "save_every", "keep", "log_every", "eval_examples"):
        minimum = 0 if flag == "steps" else 1
        if flags.FLAGS[flag].value < minimum:
            raise UserError(f"--{flag} must be >= {minimum}, got {flags.FLAGS[flag].value}")
    if _COMPARE_R.value < 1 or _COMPARE_REPEATS.value < 1:
        raise UserError("--compare_steps and --compare_repeats must be >= 1")
    if _RESUME.value and paths_from_flags().ckpt_dir is None:
        raise UserError("--resume needs --ckpt_dir (or --out_dir)")
    try:
        cfg = train.TrainConfig(
            batch=_BATCH.value,
            lr=_LR.value,
            warmup_steps=_WARMUP.value,
            total_steps=max(_STEPS.value, 1),
            schedule=_SCHEDULE.value,
            clip=_CLIP.value,
            weight_decay=_WD.value,
            mean_recurrence=_MEAN_R.value,
            backprop_depth=_K.value,
            init_scale=_TRAIN_INIT.value,
            compute_dtype=_DTYPE.value,
        )
        task = tasks.make_task(
            _TASK.value,
            nodes=_NODES.value,
            max_chain=_MAX_CHAIN.value,
            uniform_lengths=_UNIFORM.value,
            edge_tokens=_EDGE_TOKENS.value,
            max_hops=_MAX_HOPS.value,
            queries=_QUERIES.value,
            digits=_DIGITS.value,
        )
    except ValueError as e:
        raise UserError(str(e)) from None
    config = HuginnConfig.from_name(_CONFIG.value)
    if _VOCAB.value is not None:
        if _VOCAB.value < 1:
            raise UserError(f"--vocab_size must be >= 1, got {_VOCAB.value}")
        config = dataclasses.replace(config, vocab_size=_VOCAB.value)
    if _LAYERS.value is not None:
        try:
            prelude, core, coda = (int(n) for n in _LAYERS.value)
        except ValueError:
            raise UserError(
                f"--layers takes three integers prelude,core,coda; got {','.join(_LAYERS.value)}"
            ) from None
        if min(prelude, core, coda) < 1:
            raise UserError(
                f"--layers needs at least one layer in each part; got {','.join(_LAYERS.value)}"
            )
        config = dataclasses.replace(
            config,
            n_layers_in_prelude=prelude,
            n_layers_in_recurrent_block=core,
            n_layers_in_coda=coda,
        )
    config = train.run_config(config, cfg)
    if task.vocab_size > config.vocab_size:
        raise UserError(
            f"task {task.name} needs {task.vocab_size} tokens; --config={_CONFIG.value} has "
            f"vocab_size={config.vocab_size} (raise it with --vocab_size)"
        )
    if task.seq_len - 1 > config.block_size:
        raise UserError(
            f"task {task.name} sequences have {task.seq_len - 1} positions; --config="
            f"{_CONFIG.value} has block_size={config.block_size}"
        )
    eval_iterations_from_flags()
    return config, task, cfg


# ----------------------------------------------------------------------------- checkpoints


def run_meta(config, task, cfg, seed: int) -> dict[str, Any]:
    """What a checkpoint must agree with to be resumed."""
    return {
        "model": dataclasses.asdict(config),
        "task": task.to_dict(),
        "train": cfg.to_dict(),
        "seed": seed,
    }


def check_resumable(saved: dict, current: dict, note) -> None:
    """Model, task and seed must match; other differences are noted (they change the curve)."""
    for key in ("model", "task", "seed"):
        old, new = saved.get(key), current[key]
        if old == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            fields = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
            old = ", ".join(f"{k}={old.get(k)}" for k in fields)
            new = ", ".join(f"{k}={new.get(k)}" for k in fields)
        raise UserError(f"checkpoint was written with {key} {old}; the flags give {new}")
    old, new = saved.get("train", {}), current["train"]
    changed = [f"{k}: {old.get(k)} -> {new[k]}" for k in new if old.get(k) != new[k]]
    if old.get("schedule") == new["schedule"] == "constant":  # total_steps shapes cosine only
        changed = [c for c in changed if not c.startswith("total_steps")]
    if changed:
        note(f"resuming with changed settings (the curve will differ): {'; '.join(changed)}")


# ----------------------------------------------------------------------------- training loop


def window_entry(steps: list[int], metrics: list[dict], tokens_per_s: float | None) -> dict:
    """One history entry for the steps since the last sync: means over the window (loss, answer
    accuracy, gradient norm, recurrence p = n_nograd + n_grad), the last step's lr and loss."""
    mean = {
        k: float(np.mean([float(m[k]) for m in metrics])) for k in ("loss", "accuracy", "grad_norm")
    }
    depths = [float(m["n_nograd"]) + float(m["n_grad"]) for m in metrics]
    return {
        "step": steps[-1],
        "steps": len(steps),
        **mean,
        "last_loss": float(metrics[-1]["loss"]),
        "lr": float(metrics[-1]["lr"]),
        "mean_recurrence": float(np.mean(depths)),
        "tokens_per_s": tokens_per_s,
    }


MAX_STEPS_IN_FLIGHT = 4  # steps the host may dispatch ahead of the device


def train_loop(
    step_fn,
    state,
    *,
    steps: int,
    tokens_per_step: int,
    log_every: int,
    ckpt,
    meta,
    history,
    max_seconds: float = 0.0,
):
    """Runs steps until state.step == steps (or `max_seconds` of wall time have passed, checked
    after every step); returns (state, history, timing dict).

    Metrics stay on the device between log points (no per-step host sync); each log point appends
    one `window_entry` to `history`, and the bar shows its loss and tokens/s. The host runs at
    most MAX_STEPS_IN_FLIGHT steps ahead of the device, so that the clock (and the bar) follow
    the device and a time limit stops within a few steps of it. The first step is timed apart
    (it includes compilation).
    """
    import jax
    from tqdm import tqdm

    start = int(jax.device_get(state.step))
    pending: list[tuple[int, Any]] = []
    timing = {"compile_and_first_step_s": None, "steady_tokens_per_s": None, "steps_run": 0}
    window_t0, window_steps, steady_s, steady_steps = None, 0, 0.0, 0

    def flush():
        nonlocal window_t0, window_steps, steady_s, steady_steps
        if not pending:
            return
        values = jax.device_get([m for _, m in pending])
        now = time.perf_counter()
        rate = None
        if window_t0 is not None and window_steps:
            steady_s += now - window_t0
            steady_steps += window_steps
            rate = window_steps * tokens_per_step / (now - window_t0)
        history.append(window_entry([s for s, _ in pending], values, rate))
        last = history[-1]
        bar.set_postfix(
            loss=f"{last['loss']:.4f}",
            acc=f"{last['accuracy']:.3f}",
            tok_s=f"{rate:,.0f}" if rate else "-",
        )
        pending.clear()
        window_t0, window_steps = time.perf_counter(), 0

    bar = tqdm(
        total=steps,
        initial=start,
        unit="step",
        dynamic_ncols=True,
        file=sys.stderr,
        mininterval=0.5 if sys.stderr.isatty() else 15.0,  # a log file gets a line per 15 s
    )
    loop_t0 = time.perf_counter()
    for step in range(start + 1, steps + 1):
        t0 = time.perf_counter()
        state, metrics = step_fn(state)
        if step == start + 1:
            jax.block_until_ready(metrics)
            timing["compile_and_first_step_s"] = time.perf_counter() - t0
            window_t0, window_steps = time.perf_counter(), 0
        else:
            window_steps += 1
        pending.append((step, metrics))
        if len(pending) > MAX_STEPS_IN_FLIGHT:
            jax.block_until_ready(pending[-1 - MAX_STEPS_IN_FLIGHT][1])
        timing["steps_run"] += 1
        bar.update(1)
        log_point = step % log_every == 0
        if log_point:
            flush()  # also waits for the device
        out_of_time = 0 < max_seconds < time.perf_counter() - loop_t0
        last = step == steps or out_of_time
        save_now = ckpt is not None and (ckpt.should_save(step) or last)
        if last or save_now:
            flush()
        if save_now:
            ckpt.save(step, state._asdict(), {**meta, "history": history}, force=last)
        if out_of_time:
            timing["stopped_by_time_limit_at_step"] = step
            break
    flush()
    bar.close()
    if steady_steps:
        timing["steady_tokens_per_s"] = steady_steps * tokens_per_step / steady_s
        timing["steady_step_s"] = steady_s / steady_steps
    return state, history, timing


# ----------------------------------------------------------------------------- trained vs random


def decoder(model, task, *, num_steps: int, seed: int):
    """A callable that decodes one token (prelude, `num_steps` Core iterations with a full KV
    cache, coda) after a prompt of the task's length; batch 1, zero initial state. Returns
    (decode, context length)."""
    import jax

    from huginn_jax.kv_cache import KVCache

    tokens = task.sample(jax.random.key(seed), 1).tokens[:, :-1]
    length = tokens.shape[1]
    cache = KVCache.create(
        model.config, batch=1, max_len=length, num_steps=num_steps, dtype=model.dtype
    )
    out = model(tokens[:, :-1], num_steps=num_steps, init_scale=0.0, cache=cache)
    held = {"cache": out.cache}  # the cache is donated: thread it through the calls
    last = tokens[:, -1:]

    def decode():
        o = model(last, num_steps=num_steps, init_scale=0.0, cache=held["cache"], start=length - 1)
        held["cache"] = o.cache
        return o.logits

    return decode, length


def time_decoders(models: dict, task, *, num_steps: int, repeats: int, seed: int) -> dict:
    """Decode time per model, measured in alternating rounds (A, B, A, B, ...) so that clock and
    cache warm-up drift hit every model alike; each round is `experiments.measure.timing.time_fn`
    (3 warm-up calls, then timed calls until the device is done). Summary: median and spread over
    all rounds, the achieved Core weight-read rate, and the allocator's memory afterwards."""
    from experiments.measure import timing as timing_lib

    rounds = 5
    decoders = {
        name: decoder(m, task, num_steps=num_steps, seed=seed) for name, m in models.items()
    }
    seconds: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(rounds):
        for name, (decode, _) in decoders.items():
            per_round = max(1, repeats // rounds)
            seconds[name] += timing_lib.time_fn(decode, warmup=3, repeats=per_round).seconds
    out = {}
    for name, model in models.items():
        samples = timing_lib.Samples(seconds=seconds[name], warmup=3 * rounds)
        core_bytes = sum(
            x.size * x.dtype.itemsize
            for x in jax_leaves(nnx_state((model.adapter, model.core_block)))
        )
        per_iter_s = samples.median / num_steps
        out[name] = {
            **samples.summary_us(),
            "repeats": len(samples.seconds),
            "num_steps": num_steps,
            "context": decoders[name][1],
            "us_per_iteration": per_iter_s * 1e6,
            "core_param_bytes": core_bytes,
            # Every iteration re-reads the Core + adapter weights: the achieved weight-read rate.
            "core_weight_gb_per_s": core_bytes / per_iter_s / 1e9,
            "memory": device_memory(),
        }
    return out


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def nnx_state(obj):
    from flax import nnx

    return nnx.state(obj)


def device_memory() -> dict[str, int] | None:
    """The allocator's bytes in use and peak (GPU); None where the backend has no stats."""
    import jax

    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - CPU and some backends raise instead of returning None
        return None
    if not stats:
        return None
    return {k: int(stats[k]) for k in ("bytes_in_use", "peak_bytes_in_use") if k in stats}


def adaptive_generation(
    model, task, *, num_steps: int, kl_threshold: float, init_scale: float, seed: int
):
    """First answer token of 64 task prompts through `huginn_jax.generate.generate` with the `kl`
    exit (at most `num_steps` iterations): steps taken and accuracy. A note instead where that
    module has no such entry point."""
    import inspect

    import jax

    try:
        from huginn_jax import generate as generate_lib
    except ImportError as e:
        return {"skipped": f"huginn_jax.generate not importable: {e}"}
    fn = getattr(generate_lib, "generate", None)
    params = inspect.signature(fn).parameters if fn is not None else {}
    if "criterion" not in params:
        return {"skipped": "huginn_jax.generate has no generate(..., criterion=...) yet"}
    batch = task.sample(jax.random.key(seed + 11), 64)
    first = int(np.flatnonzero(np.asarray(batch.loss_mask[0]))[0])  # first answer position
    prompt, answer = np.asarray(batch.tokens[:, :first]), np.asarray(batch.tokens[:, first])
    kwargs = {"criterion": "kl", "threshold": kl_threshold}
    if "init_scale" in params:
        kwargs["init_scale"] = init_scale
    try:
        t0 = time.perf_counter()
        out = fn(model, prompt, 1, num_steps, **kwargs)
        seconds = time.perf_counter() - t0
        steps = np.asarray(out.steps)[:, 0]
        tokens = np.asarray(out.tokens)[:, 0]
    except Exception as e:  # noqa: BLE001 - another module's API in flux: record, do not crash
        return {"skipped": f"generate(..., criterion='kl') failed: {type(e).__name__}: {e}"[:300]}
    stats = getattr(out, "stats", {}) or {}
    return {
        "prompts": len(prompt),
        "max_steps": num_steps,
        "threshold": kl_threshold,
        "mean_steps": float(steps.mean()),
        "steps_histogram": np.bincount(steps, minlength=num_steps + 1)[1:].tolist(),
        "accuracy": float((tokens == answer).mean()),
        "seconds_incl_compile": seconds,
        "stats": {k: v for k, v in stats.items() if isinstance(v, int | float)},
    }


def compare_random(trained, task, *, eval_kwargs: dict, num_steps: int, repeats: int, seed: int):
    """Decode timing, memory and KL-exit statistics for the trained and a random model."""
    import jax

    from huginn_jax import train

    graphdef, params = train.init_params(trained.config, jax.random.key(seed + 7919))
    random_model = train.merge_model(graphdef, params, trained.dtype)
    models = {"trained": trained, "random": random_model}
    decode = time_decoders(models, task, num_steps=num_steps, repeats=repeats, seed=seed)
    out: dict[str, Any] = {}
    for name, model in models.items():
        evaluation = train.evaluate(model, task, jax.random.key(seed + 3), **eval_kwargs)
        out[name] = {
            "decode": decode[name],
            "adaptive_exit": evaluation["adaptive_exit"],
            "accuracy": evaluation["accuracy"],
            "generate_kl": adaptive_generation(
                model,
                task,
                num_steps=max(eval_kwargs["iterations"]),
                kl_threshold=eval_kwargs["kl_threshold"],
                init_scale=eval_kwargs["init_scale"],
                seed=seed,
            ),
        }
    t, r = out["trained"]["decode"]["median_us"], out["random"]["decode"]["median_us"]
    te = out["trained"]["adaptive_exit"]["mean_exit"]
    re_ = out["random"]["adaptive_exit"]["mean_exit"]
    out["summary"] = {
        "decode_median_ratio_trained_over_random": t / r,
        "mean_exit_trained": te,
        "mean_exit_random": re_,
        "note": (
            "Fixed-r decode runs the same kernels on the same shapes for both weight sets, so its "
            "time and memory should match (ratio ~1); what differs with trained weights is how "
            "many iterations the KL exit lets a token stop after."
        ),
    }
    return out


# ----------------------------------------------------------------------------- plot and table


def plot_results(json_path: str | Path, out_path: str | Path) -> Path:
    """Accuracy against test-time iterations (overall and per difficulty) and the training loss,
    drawn from the results JSON alone; saved atomically."""
    import os
    import tempfile

    import matplotlib

    matplotlib.use("Agg")  # no display on GPU machines or CI
    import matplotlib.pyplot as plt

    from experiments.measure import results as results_lib

    data = results_lib.read_json(json_path)
    ev = data["eval"]
    its = ev["iterations"]
    fig, (ax, ax_loss) = plt.subplots(1, 2, figsize=(12, 4.5))
    cmap = plt.get_cmap("viridis")
    diffs = sorted(ev["by_difficulty"], key=int)
    for i, d in enumerate(diffs):
        color = cmap(i / max(1, len(diffs) - 1))
        label = data["config"].get("difficulty_labels", {}).get(d, f"difficulty {d}")
        ax.plot(its, ev["by_difficulty"][d]["accuracy"], "-", lw=1, color=color, alpha=0.8,
                label=label)  # fmt: skip
    ax.plot(its, ev["accuracy"], "k-o", lw=2.2, label="all answers")
    if ev.get("sequence_accuracy"):
        ax.plot(its, ev["sequence_accuracy"], "k--s", lw=1.4, ms=4, label="whole sequence")
    random_acc = data.get("compare_random", {}).get("random", {}).get("accuracy")
    if random_acc:
        ax.plot(its, random_acc, "k:", lw=1.2, label="random weights")
    ax.set_xscale("log", base=2)
    ax.set_xticks(its, [str(r) for r in its])
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("Core iterations at test time")
    ax.set_ylabel("answer-token accuracy")
    cfg = data["config"]
    train_cfg = cfg["train"]
    model = cfg["model"]
    layers = "+".join(
        str(model[f"n_layers_in_{part}"]) for part in ("prelude", "recurrent_block", "coda")
    )
    ax.set_title(
        f"{cfg['preset']} ({layers} layers) on {cfg['task']['name']}, trained at mean r="
        f"{train_cfg['mean_recurrence']:g}, k={train_cfg['backprop_depth']}",
        fontsize=10,
    )
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    hist = data["train"]["history"]
    ax_loss.plot([h["step"] for h in hist], [h["loss"] for h in hist], lw=1)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss (answer tokens)")
    ax_loss.set_yscale("log")
    ax_loss.grid(alpha=0.3)
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=out_path.suffix,
                               dir=out_path.parent)  # fmt: skip
    os.close(fd)
    fig.savefig(tmp, dpi=130)
    plt.close(fig)
    os.chmod(tmp, 0o644)  # mkstemp makes it private
    os.replace(tmp, out_path)
    return out_path


def format_table(data: dict) -> str:
    ev = data["eval"]
    diffs = sorted(ev["by_difficulty"], key=int)
    labels = data["config"].get("difficulty_labels", {})  # the task's words, e.g. "depth 0"
    header = ["iterations", "accuracy", "seq acc", *[labels.get(d, f"d={d}") for d in diffs]]
    rows = []
    for i, r in enumerate(ev["iterations"]):
        per = [f"{ev['by_difficulty'][d]['accuracy'][i]:.3f}" for d in diffs]
        rows.append([str(r), f"{ev['accuracy'][i]:.3f}", f"{ev['sequence_accuracy'][i]:.3f}", *per])
    widths = [max(len(x[c]) for x in [header, *rows]) for c in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
             for row in [header, *rows]]  # fmt: skip
    ax = ev["adaptive_exit"]
    lines.append(
        f"KL exit (< {ax['threshold']:g}): mean {ax['mean_exit']:.2f} iterations, median "
        f"{ax['median_exit']:.0f}, accuracy at exit {ax['accuracy_at_exit']:.3f} vs "
        f"{ax['accuracy_at_max']:.3f} at {ax['max_iterations']}"
    )
    cmp_ = data.get("compare_random")
    if cmp_:
        t, r = cmp_["trained"]["decode"], cmp_["random"]["decode"]
        lines.append(
            f"decode r={t['num_steps']}: trained {t['median_us']:.0f} us, random "
            f"{r['median_us']:.0f} us (ratio {t['median_us'] / r['median_us']:.3f}); mean KL exit "
            f"trained {cmp_['summary']['mean_exit_trained']:.2f}, random "
            f"{cmp_['summary']['mean_exit_random']:.2f}"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def run(notes: list[str]) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    import huginn_jax
    from experiments.measure import results as results_lib
    from huginn_jax import train
    from huginn_jax.orbax_checkpoint import TrainCheckpoints

    def note(message: str) -> None:
        notes.append(message)
        print(f"{_NAME}: {message}", file=sys.stderr, flush=True)

    run_t0 = time.perf_counter()
    config, task, cfg = setup_from_flags()
    paths = paths_from_flags()
    iterations = eval_iterations_from_flags()
    seed = _SEED.value
    tx = train.make_optimizer(cfg)
    graphdef, state = train.init_train_state(config, tx, seed)
    meta = run_meta(config, task, cfg, seed)
    history: list[dict] = []
    resumed_from = None

    ckpt = None
    if paths.ckpt_dir is not None:
        ckpt = TrainCheckpoints(
            paths.ckpt_dir, max_to_keep=_KEEP.value, save_interval_steps=_SAVE_EVERY.value,
            report=note,
        )  # fmt: skip
        latest = ckpt.latest_step()
        if latest is not None and not _RESUME.value:
            raise UserError(
                f"{paths.ckpt_dir} already holds checkpoints (newest step {latest}); pass "
                "--resume to continue or choose another --ckpt_dir/--out_dir"
            )
        if _RESUME.value:
            abstract = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state._asdict()
            )
            found = ckpt.restore_latest(
                abstract, validate=lambda saved: check_resumable(saved, meta, note)
            )
            if found is None:
                note("starting from step 0")
            else:
                resumed_from, tree, saved = found
                state = train.TrainState(**tree)
                history = [h for h in saved.get("history", []) if h["step"] <= resumed_from]
                note(f"resumed from step {resumed_from} in {paths.ckpt_dir}")
    if resumed_from is not None and resumed_from > _STEPS.value:
        raise UserError(f"checkpoint is at step {resumed_from}, beyond --steps={_STEPS.value}")

    step_fn = train.make_train_step(graphdef, task, tx, cfg)
    tokens_per_step = cfg.batch * (task.seq_len - 1)
    state, history, timing = train_loop(
        step_fn,
        state,
        steps=_STEPS.value,
        tokens_per_step=tokens_per_step,
        log_every=_LOG_EVERY.value,
        ckpt=ckpt,
        meta=meta,
        history=history,
        max_seconds=_MAX_SECONDS.value,
    )
    if ckpt is not None:
        ckpt.wait()
        ckpt.close()

    params_f32 = train.merge_model(graphdef, state.params, jnp.float32)
    model = train.merge_model(graphdef, state.params, cfg.dtype)
    eval_kwargs = dict(
        iterations=iterations,
        num_examples=_EVAL_EXAMPLES.value,
        init_scale=_EVAL_INIT.value,
        kl_threshold=_KL.value,
    )
    t0 = time.perf_counter()
    evaluation = train.evaluate(model, task, jax.random.fold_in(jax.random.key(seed), 2),
                                **eval_kwargs)  # fmt: skip
    eval_s = time.perf_counter() - t0
    if paths.export_dir is not None:
        huginn_jax.save_pretrained(params_f32, paths.export_dir)
        note(f"exported float32 weights to {paths.export_dir}")

    data: dict[str, Any] = {
        "experiment": "train",
        "env": results_lib.environment(own_flag_values()),
        "config": {
            "preset": _CONFIG.value,
            "model": dataclasses.asdict(config),
            "task": task.to_dict(),
            "difficulty_labels": {str(d): task.label(d) for d in task.difficulties},
            "train": cfg.to_dict(),
            "seed": seed,
            "tokens_per_step": tokens_per_step,
        },
        "train": {
            "history": history,
            "resumed_from": resumed_from,
            "final_step": int(jax.device_get(state.step)),
            **timing,
        },
        "eval": {**evaluation, "seconds": eval_s},
        "notes": notes,
    }
    if _COMPARE.value:
        small_eval = {**eval_kwargs, "num_examples": min(256, _EVAL_EXAMPLES.value)}
        data["compare_random"] = compare_random(
            model,
            task,
            eval_kwargs=small_eval,
            num_steps=_COMPARE_R.value,
            repeats=_COMPARE_REPEATS.value,
            seed=seed,
        )
    if not math.isfinite(history[-1]["loss"] if history else 0.0):
        note("the training loss is not finite")
    data["wall_s"] = time.perf_counter() - run_t0  # backend start-up to here; not plot/JSON
    return data


def own_flag_values() -> dict[str, Any]:
    """The values of the flags this program defines (not absl's or JAX's)."""
    return {h.name: h.value for h in globals().values() if isinstance(h, flags.FlagHolder)}


def main(argv: Sequence[str]) -> None:
    from experiments.measure import results as results_lib
    from huginn_jax.checkpoint import CheckpointError

    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # keep orbax/backend INFO lines off stderr
    notes: list[str] = []
    try:
        if len(argv) > 1:
            raise UserError(f"unexpected arguments: {' '.join(argv[1:])}")
        setup_from_flags()  # every flag checked before the backend starts
        data = run(notes)
    except UserError as e:
        _fail(str(e))
    except CheckpointError as e:
        _fail(f"checkpoint: {e}", code=1)
    paths = paths_from_flags()
    json_path = results_lib.write_json_atomic(paths.json_out, data) if paths.json_out else None
    plot_path = plot_results(json_path, paths.plot_out) if json_path and paths.plot_out else None
    print()
    print(format_table(data))
    print(f"json: {json_path or '(not written)'}")
    print(f"plot: {plot_path or '(not written)'}")


if __name__ == "__main__":
    app.run(main, flags_parser=cli.flags_parser(f"{_NAME}: error"))
