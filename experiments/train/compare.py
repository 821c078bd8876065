"""Trained vs random weights (`--compare_random`): one decode step's time and memory for each,
and how early the KL exit stops on the task with each.

Fixed-r decode runs the same kernels on the same shapes for both weight sets, so its time and
memory should match; what trained weights change is how many iterations the exit lets a token
stop after.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

GENERATE_PROMPTS = 64  # task prompts `adaptive_generation` decodes one token after


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
    import jax
    from flax import nnx

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
            for x in jax.tree.leaves(nnx.state((model.adapter, model.core_block)))
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
    """First answer token of GENERATE_PROMPTS task prompts through `huginn_jax.generate.generate`
    with the `kl` exit (at most `num_steps` iterations): steps taken and accuracy. A failure is
    recorded as {"skipped": reason}, not raised: it must not cost the trained run its results."""
    import jax

    from huginn_jax.generate import generate

    batch = task.sample(jax.random.key(seed + 11), GENERATE_PROMPTS)
    first = int(np.flatnonzero(np.asarray(batch.loss_mask[0]))[0])  # first answer position
    prompt, answer = np.asarray(batch.tokens[:, :first]), np.asarray(batch.tokens[:, first])
    try:
        t0 = time.perf_counter()
        out = generate(
            model,
            prompt,
            1,
            num_steps,
            criterion="kl",
            threshold=kl_threshold,
            init_scale=init_scale,
        )
        seconds = time.perf_counter() - t0
        steps = np.asarray(out.steps)[:, 0]
        tokens = np.asarray(out.tokens)[:, 0]
    except Exception as e:  # noqa: BLE001 - recorded in the JSON; the run's results come first
        return {"skipped": f"generate(..., criterion='kl') failed: {type(e).__name__}: {e}"[:300]}
    return {
        "prompts": len(prompt),
        "max_steps": num_steps,
        "threshold": kl_threshold,
        "mean_steps": float(steps.mean()),
        "steps_histogram": np.bincount(steps, minlength=num_steps + 1)[1:].tolist(),
        "accuracy": float((tokens == answer).mean()),
        "seconds_incl_compile": seconds,
        "stats": {k: v for k, v in out.stats.items() if isinstance(v, int | float)},
    }


def compare_random(trained, task, *, eval_kwargs: dict, num_steps: int, repeats: int, seed: int):
    """Decode timing, memory and KL-exit statistics for the trained and a random model."""
    import jax

    from huginn_jax import train
    from huginn_jax.evaluation import evaluate

    graphdef, params = train.init_params(trained.config, jax.random.key(seed + 7919))
    random_model = train.merge_model(graphdef, params, trained.dtype)
    models = {"trained": trained, "random": random_model}
    decode = time_decoders(models, task, num_steps=num_steps, repeats=repeats, seed=seed)
    out: dict[str, Any] = {}
    for name, model in models.items():
        evaluation = evaluate(model, task, jax.random.key(seed + 3), **eval_kwargs)
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
