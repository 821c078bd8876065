"""The training run: a fresh or resumed state, the step loop with its history, and checkpoints.

Data are drawn in-graph from fold_in(seed, step) (huginn_jax.tasks), so a run resumed from a
checkpoint continues bit for bit; a checkpoint resumes only a run of the same model, task and
seed.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from experiments.program import UserError
from experiments.train.options import Options

MAX_STEPS_IN_FLIGHT = 4  # steps the host may dispatch ahead of the device


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
    (it includes compilation): the bar starts after it, so that its rate and ETA count compiled
    steps only.
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

    def new_bar(initial: int):
        return tqdm(
            total=steps,
            initial=initial,
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
            mininterval=0.5 if sys.stderr.isatty() else 15.0,  # a log file gets a line per 15 s
        )

    bar = None
    if start < steps:
        print(f"compiling the training step (step {start + 1})", file=sys.stderr, flush=True)
    loop_t0 = time.perf_counter()
    for step in range(start + 1, steps + 1):
        t0 = time.perf_counter()
        state, metrics = step_fn(state)
        if step == start + 1:
            jax.block_until_ready(metrics)
            timing["compile_and_first_step_s"] = time.perf_counter() - t0
            window_t0, window_steps = time.perf_counter(), 0
            bar = new_bar(step)  # rate and ETA from here: compiled steps only
        else:
            window_steps += 1
            bar.update(1)
        pending.append((step, metrics))
        if len(pending) > MAX_STEPS_IN_FLIGHT:
            jax.block_until_ready(pending[-1 - MAX_STEPS_IN_FLIGHT][1])
        timing["steps_run"] += 1
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
    if bar is not None:
        bar.close()
    if steady_steps:
        timing["steady_tokens_per_s"] = steady_steps * tokens_per_step / steady_s
        timing["steady_step_s"] = steady_s / steady_steps
    return state, history, timing


def data_mesh(devices: int):
    """A mesh of `devices` devices over a "data" axis (None for one); UserError when fewer are
    present."""
    if devices == 1:
        return None
    from huginn_jax import parallel

    try:
        return parallel.make_mesh({parallel.DATA_AXIS: devices})
    except ValueError as e:
        raise UserError(f"--mesh: {e}") from None


@dataclasses.dataclass
class Trained:
    """A finished (or time-limited) training run."""

    graphdef: Any  # the model's nnx graph; params live in state
    state: Any  # huginn_jax.train.TrainState after the last step run
    history: list[dict]  # `window_entry`s, a resumed run's earlier ones included
    timing: dict[str, Any]  # `train_loop`'s
    resumed_from: int | None  # the checkpoint's step, or None for a fresh start
    tokens_per_step: int


def check_fits(opts: Options) -> None:
    """UserError when a training step cannot fit on a device: float32 parameters, their
    gradients and AdamW's two moments, and what the backward pass keeps at least (one float32
    [batch, T, n_embd] tensor per layer run with gradient, and the [batch, T, vocab] logits) for
    the device's share of --batch. A lower bound, checked before anything is allocated; starts
    the backend."""
    from experiments.measure import memory
    from huginn_jax import costs

    config, cfg = opts.config, opts.train
    state = 4 * 4 * costs.model_param_count(config)
    layers = (
        config.n_layers_in_prelude
        + cfg.backprop_depth * config.n_layers_in_recurrent_block
        + config.n_layers_in_coda
    )
    tokens = -(-cfg.batch // opts.data_devices) * opts.task.seq_len
    kept = 4 * tokens * (layers * config.n_embd + config.vocab_size)
    memory.check_fits(
        f"--batch={cfg.batch}",
        "a training step (parameters, gradients, optimizer state, activations)",
        state + kept,
        hint="use a smaller --batch or --backprop_depth",
    )


def run_training(opts: Options, note: Callable[[str], None]) -> Trained:
    """Initial state (or with --resume the newest good checkpoint, which must match model, task
    and seed), `train_loop` to --steps, and the checkpoints closed. UserError where a
    checkpoint directory already holds a run and --resume is off, or is past --steps."""
    import jax

    from huginn_jax import train
    from huginn_jax.orbax_checkpoint import TrainCheckpoints

    config, task, cfg, ckpt_dir = opts.config, opts.task, opts.train, opts.paths.ckpt_dir
    mesh = data_mesh(opts.data_devices)
    tx = train.make_optimizer(cfg)
    graphdef, state = train.init_train_state(config, tx, opts.seed)
    meta = run_meta(config, task, cfg, opts.seed)
    history: list[dict] = []
    resumed_from = None

    ckpt = None
    if ckpt_dir is not None:
        ckpt = TrainCheckpoints(
            ckpt_dir, max_to_keep=opts.keep, save_interval_steps=opts.save_every, report=note
        )
        latest = ckpt.latest_step()
        if latest is not None and not opts.resume:
            raise UserError(
                f"{ckpt_dir} already holds checkpoints (newest step {latest}); pass "
                "--resume to continue or choose another --ckpt_dir/--out_dir"
            )
        if opts.resume:
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
                note(f"resumed from step {resumed_from} in {ckpt_dir}")
    if resumed_from is not None and resumed_from > opts.steps:
        raise UserError(f"checkpoint is at step {resumed_from}, beyond --steps={opts.steps}")

    if mesh is not None:
        from huginn_jax import parallel

        state = parallel.replicate(state, mesh)
    step_fn = train.make_train_step(graphdef, task, tx, cfg, mesh)
    tokens_per_step = cfg.batch * (task.seq_len - 1)
    state, history, timing = train_loop(
        step_fn,
        state,
        steps=opts.steps,
        tokens_per_step=tokens_per_step,
        log_every=opts.log_every,
        ckpt=ckpt,
        meta=meta,
        history=history,
        max_seconds=opts.max_train_seconds,
    )
    if ckpt is not None:
        ckpt.wait()
        ckpt.close()
    return Trained(graphdef, state, history, timing, resumed_from, tokens_per_step)
