"""`python -m huginn_jax.generate`: generation from the command line (absl flags)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from huginn_jax import costs
from huginn_jax.config import DECODE_ATTENTION_IMPLS, DECODE_GEMV_IMPLS, HuginnConfig
from huginn_jax.generate.loop import ATTENTION_WINDOW, Generation, make_plan, run_plan
from huginn_jax.generate.stats import time_parts
from huginn_jax.model import Huginn
from huginn_jax.xla_flags import use_gemm

_DTYPES = {
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "f32": jnp.float32,
    "float32": jnp.float32,
}

# (kind, name, default, help[, enum values]); defined only by `cli`, so importing defines nothing
_FLAGS = (
    ("string", "checkpoint", None, "Hugging Face checkpoint directory (config.json, safetensors)."),
    ("string", "config", None, "Preset name instead of --checkpoint; needs --random_weights."),
    ("bool", "random_weights", False, "Random weights (the reference's init) for --config."),
    ("string", "dtype", "bf16", "Parameter dtype: bf16 or f32."),
    ("string", "gemm", "cublas", "Dots: cublas (XLA's Triton GEMMs off) or xla (XLA's choice)."),
    ("string", "prompt", None, "Prompt text, tokenized with --checkpoint's tokenizer.json."),
    ("list", "prompt_ids", None, "Prompt token ids, e.g. 1,2,3."),
    ("integer", "prompt_len", 0, "A random prompt of this many ids (drawn from --seed)."),
    ("integer", "batch", 1, "Sequences: copies of the prompt."),
    ("integer", "max_new_tokens", 32, "Tokens to generate."),
    ("integer", "num_steps", 32, "Recurrence steps per token (the most, with --criterion)."),
    ("string", "criterion", "none", "Exit: none, kl, entropy-diff, latent-diff, argmax-stability."),
    ("float", "threshold", None, "Exit threshold (default: the criterion's)."),
    ("integer", "min_steps", 0, "No exit before this many steps."),
    ("float", "temperature", 0.0, "Sampling temperature; 0: greedy."),
    ("integer", "top_k", 0, "Keep only the k most likely tokens; 0: off."),
    ("float", "top_p", 1.0, "Nucleus sampling mass; 1: off."),
    ("integer", "seed", 0, "Seed of weights, random prompt, initial states and sampling."),
    ("float", "init_scale", 1.0, "Scale of the random initial state; 0: zeros."),
    ("string", "strategy", None, "KV cache: full, latest-m4, compress-sN (default: by criterion)."),
    ("bool", "continuous", False, "Start each token's recurrence from the previous final state."),
    ("integer", "cache_len", 0, "Cache positions to allocate; 0: prompt + max_new_tokens."),
    (
        "integer",
        "attention_window",
        ATTENTION_WINDOW,
        "Decode reads the cache's filled positions rounded up to this; 0: the whole cache.",
    ),
    (
        "enum",
        "decode_attention",
        "xla",
        "Decode attention (HuginnConfig.decode_attention_impl).",
        DECODE_ATTENTION_IMPLS,
    ),
    (
        "enum",
        "decode_gemv",
        "xla",
        "A Core step's GEMVs at batch 1 (HuginnConfig.decode_gemv).",
        DECODE_GEMV_IMPLS,
    ),
    ("bool", "breakdown", False, "Also time the prelude, one Core iteration and the coda alone."),
    ("string", "roofline_device", "h200_measured", "costs.DEVICES entry for % of roofline."),
    ("bool", "progress", True, "Progress bar on stderr."),
    ("string", "json_out", None, "Write the results JSON here."),
)


class UsageError(ValueError):
    """A bad command line: one line on stderr, exit status 2."""


def _config(F) -> HuginnConfig:
    """The model's shape from --checkpoint's config.json or --config, without loading weights,
    with the kernel choices --decode_attention and --decode_gemv."""
    import dataclasses

    config = _shape(F)
    return dataclasses.replace(
        config, decode_attention_impl=F.decode_attention, decode_gemv=F.decode_gemv
    )


def _shape(F) -> HuginnConfig:
    from pathlib import Path

    if F.dtype not in _DTYPES:
        raise UsageError(f"--dtype={F.dtype} must be one of {', '.join(_DTYPES)}")
    if F.checkpoint and F.config:
        raise UsageError("give --checkpoint or --config, not both")
    if F.checkpoint:
        path = Path(F.checkpoint) / "config.json"
        if not path.exists():
            raise UsageError(f"--checkpoint: {path} does not exist")
        return HuginnConfig.from_hf_json(path)
    if F.config:
        if not F.random_weights:
            raise UsageError("--config has no weights of its own: add --random_weights")
        return HuginnConfig.from_name(F.config)
    raise UsageError("give --checkpoint=DIR, or --config=PRESET --random_weights")


def _load_model(F, config: HuginnConfig) -> Huginn:
    """--checkpoint's weights or random ones, under `config` (its kernel choices included)."""
    from huginn_jax.checkpoint import from_pretrained
    from huginn_jax.model import random_init, with_config

    if F.checkpoint:
        return with_config(from_pretrained(F.checkpoint, dtype=_DTYPES[F.dtype]), config)
    return random_init(config, jax.random.key(F.seed), dtype=_DTYPES[F.dtype])


def _tokenizer(checkpoint: str | None, required: bool):
    """The checkpoint's tokenizer.json through the optional `tokenizers` package, or None."""
    import importlib.util
    from pathlib import Path

    path = Path(checkpoint) / "tokenizer.json" if checkpoint else None
    if path is None or not path.exists() or importlib.util.find_spec("tokenizers") is None:
        if required:
            raise UsageError(
                "--prompt needs --checkpoint with a tokenizer.json and the `tokenizers` package; "
                "otherwise pass --prompt_ids=1,2,3"
            )
        return None
    import tokenizers

    return tokenizers.Tokenizer.from_file(str(path))


def _prompt(F, vocab: int) -> tuple[np.ndarray, Any]:
    """[batch, T] prompt ids from --prompt, --prompt_ids or --prompt_len, and the tokenizer."""
    if sum([F.prompt is not None, F.prompt_ids is not None, F.prompt_len > 0]) != 1:
        raise UsageError("give exactly one of --prompt, --prompt_ids, --prompt_len")
    if F.batch < 1:
        raise UsageError(f"--batch={F.batch} must be at least 1")
    tokenizer = _tokenizer(F.checkpoint, required=F.prompt is not None)
    if F.prompt is not None:
        ids = tokenizer.encode(F.prompt).ids
    elif F.prompt_ids is not None:
        try:
            ids = [int(x) for x in F.prompt_ids]
        except ValueError:
            raise UsageError(f"--prompt_ids must be integers: {','.join(F.prompt_ids)}") from None
    else:
        ids = np.random.default_rng(F.seed).integers(0, vocab, F.prompt_len).tolist()
    return np.tile(np.asarray(ids, np.int64).reshape(1, -1), (F.batch, 1)), tokenizer


def _versions() -> dict[str, str | None]:
    import importlib.metadata
    import platform

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "flax", "numpy", "tokenizers"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _bounds(F, gen: Generation, model: Huginn, prompt_len: int) -> dict[str, Any]:
    """% of the roofline's bandwidth, and two bounds: the median latency at most 5 % above
    r x (one Core iteration) + prelude + coda and head, each timed alone; the peak memory at
    most 10 % above weights + cache."""
    out: dict[str, Any] = {}
    stats = gen.stats
    device = costs.get_device(F.roofline_device)
    if stats["achieved_gb_s"] is not None:
        out["roofline_device"] = device.name
        out["pct_of_roofline_bandwidth"] = 100 * stats["achieved_gb_s"] * 1e9 / device.hbm_bandwidth
        out["roofline_latency_s"] = (
            statistics.median(stats["decode_step_bytes"]) / device.hbm_bandwidth
        )
    if F.breakdown:
        position = min(prompt_len + F.max_new_tokens - 1, gen.cache.max_len - 1)
        parts, _ = time_parts(model, gen.cache, position)
        budget = F.num_steps * parts["core_iteration_s"] + parts["prelude_s"] + parts["coda_head_s"]
        out["parts"] = parts
        out["latency_budget_s"] = 1.05 * budget  # r x Core iteration + prelude + coda, + 5 %
        if stats["latency_median_s"] is not None:
            out["within_latency_budget"] = stats["latency_median_s"] <= out["latency_budget_s"]
    if stats["peak_bytes_in_use"] is not None:
        out["memory_bound_bytes"] = 1.10 * (stats["weight_bytes"] + stats["cache_bytes"])
        out["within_memory_bound"] = stats["peak_bytes_in_use"] <= out["memory_bound_bytes"]
    return out


def _print_table(stats: dict) -> None:
    def fmt(value, scale=1.0, unit=""):
        return "-" if value is None else f"{value * scale:.4g}{unit}"

    compile_s = stats["compile_s"]
    achieved = fmt(stats["achieved_gb_s"], 1, " GB/s")
    if "pct_of_roofline_bandwidth" in stats:
        achieved += f" ({stats['pct_of_roofline_bandwidth']:.1f} % of {stats['roofline_device']})"
    rows = [
        ("compile prefill / decode", f"{compile_s['prefill']:.2f} s / {compile_s['decode']:.2f} s"),
        ("prefill", f"{fmt(stats['prefill_s'], 1e3, ' ms')} ({stats['prompt_len']} tokens)"),
        ("decode latency (median)", fmt(stats["latency_median_s"], 1e3, " ms/token")),
        ("latency budget", fmt(stats.get("latency_budget_s"), 1e3, " ms/token")),
        ("tokens/s", fmt(stats["tokens_per_s"])),
        ("steps/token", fmt(stats["steps_per_token"])),
        ("achieved", achieved),
        (
            "cache / weights",
            f"{stats['cache_bytes'] / 1e9:.3f} GB / {stats['weight_bytes'] / 1e9:.3f} GB",
        ),
        (
            "decode attends over",
            " / ".join(map(str, stats["attention_windows"])) + " positions"
            if stats["attention_windows"]
            else "-",
        ),
        ("peak device memory", fmt(stats["peak_bytes_in_use"], 1e-9, " GB")),
        ("peak before generation", fmt(stats.get("peak_bytes_before_generation"), 1e-9, " GB")),
        (
            "XLA temp prefill / decode",
            " / ".join(
                fmt(stats.get("executable_temp_bytes", {}).get(n), 1e-9, " GB")
                for n in ("prefill", "decode")
            ),
        ),
        ("memory bound", fmt(stats.get("memory_bound_bytes"), 1e-9, " GB")),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def _main(argv, F, flag_names) -> None:
    import json
    from pathlib import Path

    if len(argv) > 1:
        raise UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    use_gemm(F.gemm)  # before anything starts the backend
    costs.get_device(F.roofline_device)
    # Everything a user can get wrong fails here, before any weights are loaded or compiled.
    config = _config(F)
    ids, tokenizer = _prompt(F, config.vocab_size)
    plan = make_plan(
        config,
        ids,
        F.max_new_tokens,
        F.num_steps,
        criterion=F.criterion,
        threshold=F.threshold,
        min_steps=F.min_steps,
        temperature=F.temperature,
        top_k=F.top_k,
        top_p=F.top_p,
        seed=F.seed,
        init_scale=F.init_scale,
        continuous=F.continuous,
        strategy=F.strategy,
        cache_len=F.cache_len or None,
        attention_window=F.attention_window,
    )
    model = _load_model(F, config)
    gen = run_plan(model, plan, progress=F.progress)
    stats = {**gen.stats, **_bounds(F, gen, model, ids.shape[1])}
    for b, tokens in enumerate(gen.tokens.tolist()):
        print(f"[{b}] {tokenizer.decode(tokens)!r}" if tokenizer else f"[{b}] {tokens}")
    if F.json_out:
        result = {
            "program": "huginn_jax.generate",
            "flags": {name: F[name].value for name in flag_names},
            "env": {
                "device": jax.local_devices()[0].device_kind,
                "platform": jax.default_backend(),
                "versions": _versions(),
                "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            },
            "stats": stats,
            "tokens": gen.tokens.tolist(),
            "steps": gen.steps.tolist(),
        }
        path = Path(F.json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
    _print_table(stats)


def define_flags(fv) -> None:
    """Defines the command line's flags on the absl FlagValues `fv`."""
    from absl import flags

    for kind, name, default, help_text, *values in _FLAGS:
        if kind == "enum":
            flags.DEFINE_enum(name, default, list(values[0]), help_text, flag_values=fv)
        else:
            getattr(flags, f"DEFINE_{kind}")(name, default, help_text, flag_values=fv)


def cli(argv: list[str] | None = None) -> None:
    """`python -m huginn_jax.generate --flag=...`; bad input ends in one line and exit status 2."""
    import sys

    from absl import app, flags, logging

    fv = flags.FLAGS
    define_flags(fv)
    flag_names = [name for _, name, *_ in _FLAGS]

    def fail(error: Exception):
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)

    def parse(args):
        try:
            return fv(args)
        except flags.Error as e:
            fail(e)

    def main(args):
        logging.set_verbosity(logging.WARNING)  # no backend-probing chatter around the output
        try:
            _main(args, fv, flag_names)
        except ValueError as e:  # UsageError, bad settings, CheckpointError
            fail(e)

    app.run(main, argv=argv, flags_parser=parse)
