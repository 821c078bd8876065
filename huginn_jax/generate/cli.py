"""`python -m huginn_jax.generate`: generation from the command line (absl flags)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from huginn_jax import costs
from huginn_jax.config import HuginnConfig
from huginn_jax.files import write_text_atomic
from huginn_jax.generate.loop import Generation, make_plan, run_plan
from huginn_jax.generate.options import (
    FLAGS,
    UsageError,
    check_flags,
    check_memory,
    define_flags,
    make_mesh,
    prompt_ids,
)
from huginn_jax.generate.stats import time_parts
from huginn_jax.model import Huginn
from huginn_jax.xla_flags import use_gemm

PROGRAM = "generate"  # the prefix of every error line
_DTYPES = {
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "f32": jnp.float32,
    "float32": jnp.float32,
}


def _config(F) -> HuginnConfig:
    """The model's shape from --checkpoint's config.json or --config, without loading weights,
    with the kernel choices --decode_attention and --decode_gemv and the mesh of --mesh (which
    starts the backend)."""
    config = _shape(F)
    return dataclasses.replace(
        config,
        decode_attention_impl=F.decode_attention,
        decode_gemv=F.decode_gemv,
        mesh=make_mesh(F.mesh),
    )


def _shape(F) -> HuginnConfig:
    from pathlib import Path

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
    """--checkpoint's weights or random ones, under `config` (its kernel choices and its mesh
    included)."""
    from huginn_jax.checkpoint import from_pretrained
    from huginn_jax.model import random_init, with_config

    dtype = _DTYPES[F.dtype]
    if F.checkpoint:
        return with_config(from_pretrained(F.checkpoint, dtype=dtype, mesh=config.mesh), config)
    return random_init(config, jax.random.key(F.seed), dtype=dtype)


def _tokenizer(checkpoint: str | None, required: bool):
    """The checkpoint's tokenizer.json through the optional `tokenizers` package, or None."""
    import importlib.util
    from pathlib import Path

    path = Path(checkpoint) / "tokenizer.json" if checkpoint else None
    if path is None or not path.exists():
        if required:
            raise UsageError(
                "--prompt needs --checkpoint with a tokenizer.json; otherwise pass "
                "--prompt_ids=1,2,3"
            )
        return None
    if importlib.util.find_spec("tokenizers") is None:
        if required:
            raise UsageError(
                '--prompt needs the tokenizers package: pip install -e ".[text]" (or pass '
                "--prompt_ids=1,2,3)"
            )
        return None
    import tokenizers

    return tokenizers.Tokenizer.from_file(str(path))


def _prompt(F, config: HuginnConfig) -> tuple[np.ndarray, Any]:
    """[1, T] prompt ids from --prompt, --prompt_ids or --prompt_len (one of them, as
    `check_flags` made sure), and the tokenizer."""
    tokenizer = _tokenizer(F.checkpoint, required=F.prompt is not None)
    if F.prompt is not None:
        ids = tokenizer.encode(F.prompt).ids
    elif F.prompt_ids is not None:
        ids = prompt_ids(F.prompt_ids).tolist()
    else:
        if F.prompt_len > config.block_size:  # refused before drawing that many ids
            raise UsageError(
                f"--prompt_len={F.prompt_len}: exceeds the model's block_size={config.block_size}"
            )
        ids = np.random.default_rng(F.seed).integers(0, config.vocab_size, F.prompt_len).tolist()
    return np.asarray(ids, np.int64).reshape(1, -1), tokenizer


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
    core_decode = stats.get("core_decode") or "-"
    if stats.get("persistent_schedule"):
        core_decode += f" (schedule {stats['persistent_schedule']})"
    rows = [
        ("compile prefill / decode", f"{compile_s['prefill']:.2f} s / {compile_s['decode']:.2f} s"),
        ("prefill", f"{fmt(stats['prefill_s'], 1e3, ' ms')} ({stats['prompt_len']} tokens)"),
        ("decode latency (median)", fmt(stats["latency_median_s"], 1e3, " ms/token")),
        ("latency budget", fmt(stats.get("latency_budget_s"), 1e3, " ms/token")),
        ("tokens/s", fmt(stats["tokens_per_s"])),
        ("steps/token", fmt(stats["steps_per_token"])),
        ("core decode", core_decode),
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

    if len(argv) > 1:
        raise UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    check_flags(F)  # everything a user can get wrong fails here, before any weights or compiling
    use_gemm(F.gemm)  # before anything starts the backend
    config = _config(F)
    ids, tokenizer = _prompt(F, config)
    plan = make_plan(  # checked for one sequence; --batch copies once they are known to fit
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
        core_decode=F.core_decode,
        persistent_schedule=F.persistent_schedule,
    )
    check_memory(config, plan, F.batch, _DTYPES[F.dtype])
    plan = dataclasses.replace(plan, ids=np.tile(plan.ids, (F.batch, 1)))
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
        write_text_atomic(F.json_out, json.dumps(result, indent=1) + "\n")
    _print_table(stats)


def cli(argv: list[str] | None = None) -> None:
    """`python -m huginn_jax.generate --flag=...`; bad input ends in one line
    `generate: ...` and exit status 2. `--help` lists the flags (key flags of the main
    module, which absl's help shows)."""
    import sys

    from absl import app, flags, logging

    fv = flags.FLAGS
    define_flags(fv)
    flag_names = [name for _, name, *_ in FLAGS]
    for name in flag_names:
        fv.register_key_flag_for_module(sys.argv[0], fv[name])

    def fail(error: Exception):
        print(f"{PROGRAM}: {str(error).strip().splitlines()[0]}", file=sys.stderr)
        sys.exit(2)

    def parse(args):
        try:
            return fv(args)
        except flags.Error as e:
            fail(e)
        except SystemExit as e:  # absl's --help exits with status 1; asked for, it succeeded
            raise SystemExit(0 if e.code == 1 else e.code) from None

    def main(args):
        logging.set_verbosity(logging.WARNING)  # no backend-probing chatter around the output
        try:
            _main(args, fv, flag_names)
        except ValueError as e:  # UsageError, bad settings, CheckpointError
            fail(e)

    app.run(main, argv=argv, flags_parser=parse)
