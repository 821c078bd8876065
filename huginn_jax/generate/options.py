"""The flags of `python -m huginn_jax.generate` and their checks, made before any weights are
loaded or compiled: a bad value is a UsageError (one line on stderr, exit status 2)."""

from __future__ import annotations

import math

import numpy as np

from huginn_jax import costs
from huginn_jax.config import (
    CORE_DECODE_IMPLS,
    DECODE_ATTENTION_IMPLS,
    DECODE_GEMV_IMPLS,
    PRESETS,
)
from huginn_jax.files import check_writable
from huginn_jax.generate.exits import CRITERIA
from huginn_jax.generate.plan import ATTENTION_WINDOW
from huginn_jax.xla_flags import GEMM_CHOICES

DTYPES = ("bf16", "bfloat16", "f32", "float32")
PERSISTENT_SCHEDULE_HELP = (
    "With --core_decode=persistent, the kernel's schedule RING:KV_STAGES[:...] "
    "(pallas_kernels.core_step.fused_plan.Schedule); '': the case's default."
)


def _threshold_help() -> str:
    below = [
        f"{c.name} {c.default_threshold:g}" for c in CRITERIA.values() if not c.exit_when_at_least
    ]
    counts = [
        f"{c.name} {c.default_threshold:g}" for c in CRITERIA.values() if c.exit_when_at_least
    ]
    return (
        f"Adaptive exit threshold; unset: the criterion's default. {', '.join(below)}: exit once "
        f"the step's change falls below it (> 0); {', '.join(counts)}: exit once the argmax held "
        "this many steps (>= 1)."
    )


# (kind, name, default, help[, enum values]); defined only by `cli`, so importing defines nothing
FLAGS = (
    (
        "string",
        "checkpoint",
        None,
        "Model directory: config.json and model.safetensors (or shards).",
    ),
    (
        "string",
        "config",
        None,
        f"Preset instead of --checkpoint ({', '.join(PRESETS)}); needs --random_weights.",
    ),
    (
        "bool",
        "random_weights",
        False,
        "With --config: random weights (the reference's init, from --seed).",
    ),
    ("enum", "dtype", "bf16", "Parameter and compute dtype.", DTYPES),
    (
        "enum",
        "gemm",
        "cublas",
        "Dense products: cublas (XLA's Triton GEMMs off) or xla (XLA's choice).",
        GEMM_CHOICES,
    ),
    ("string", "prompt", None, "Prompt text, tokenized with --checkpoint's tokenizer.json."),
    ("list", "prompt_ids", None, "Prompt as comma-separated token ids, e.g. 1,2,3."),
    ("integer", "prompt_len", 0, "A random prompt of this many token ids (from --seed); 0: none."),
    ("integer", "batch", 1, "Sequences generated at once, each a copy of the prompt (>= 1)."),
    ("integer", "max_new_tokens", 32, "Tokens to generate per sequence (>= 1)."),
    (
        "integer",
        "num_steps",
        32,
        "Core recurrence steps per token (>= 1); with --criterion the most.",
    ),
    (
        "enum",
        "criterion",
        "none",
        "Adaptive exit per token; none: always --num_steps.",
        ("none", *CRITERIA),
    ),
    ("float", "threshold", None, _threshold_help()),
    (
        "integer",
        "min_steps",
        0,
        "With --criterion: steps before an exit may happen (0 to --num_steps).",
    ),
    ("float", "temperature", 0.0, "Sampling temperature (>= 0); 0: greedy (the argmax)."),
    (
        "integer",
        "top_k",
        0,
        "With --temperature > 0: sample among the k most likely tokens; 0: all.",
    ),
    ("float", "top_p", 1.0, "With --temperature > 0: nucleus sampling mass, in (0, 1]; 1: all."),
    (
        "integer",
        "seed",
        0,
        "Seed (>= 0) of random weights, random prompt, initial states, sampling.",
    ),
    ("float", "init_scale", 1.0, "Std multiplier of the random initial state (>= 0); 0: zeros."),
    (
        "string",
        "strategy",
        None,
        "KV cache: full, latest-m4 or compress-sN (N Core slots); unset: full (latest-m4 with "
        "--criterion).",
    ),
    (
        "bool",
        "continuous",
        False,
        "Start each token's recurrence from the previous token's final state.",
    ),
    (
        "integer",
        "cache_len",
        0,
        "Cache positions to allocate (>= 0); 0: prompt + --max_new_tokens.",
    ),
    (
        "integer",
        "attention_window",
        ATTENTION_WINDOW,
        "Decode reads the cache's filled positions rounded up to this many; 0: all.",
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
        "A Core step's matrix-vector products at batch 1 (HuginnConfig.decode_gemv).",
        DECODE_GEMV_IMPLS,
    ),
    (
        "enum",
        "core_decode",
        "xla",
        "The decode steps' Core iterations: xla (run_core) or persistent (one persistent kernel, "
        "huginn_jax.persistent: an sm_90 GPU, a fixed --num_steps; otherwise xla, with a line "
        "saying why). persistent rounds the default --cache_len up to a multiple of the "
        "schedule's blocks of cached positions (64 by default).",
        CORE_DECODE_IMPLS,
    ),
    (
        "string",
        "persistent_schedule",
        "",
        PERSISTENT_SCHEDULE_HELP,
    ),
    (
        "string",
        "mesh",
        "",
        "Tensor parallelism: model:N splits every layer's heads and MLP columns over the first N "
        "devices (XLA or cuDNN kernels only); '': one device.",
    ),
    (
        "bool",
        "breakdown",
        False,
        "Also time the prelude, one Core iteration and coda + head alone.",
    ),
    (
        "enum",
        "roofline_device",
        "h200_measured",
        "Device whose bandwidth gives '% of roofline'.",
        tuple(costs.DEVICES),
    ),
    ("bool", "progress", True, "Progress bar on stderr."),
    (
        "string",
        "json_out",
        None,
        "Results JSON (flags, environment, statistics, tokens); unset: none.",
    ),
)


class UsageError(ValueError):
    """A bad command line: one line on stderr, exit status 2."""


def define_flags(fv) -> None:
    """Defines the command line's flags on the absl FlagValues `fv`."""
    from absl import flags

    for kind, name, default, help_text, *values in FLAGS:
        if kind == "enum":
            flags.DEFINE_enum(name, default, list(values[0]), help_text, flag_values=fv)
        else:
            getattr(flags, f"DEFINE_{kind}")(name, default, help_text, flag_values=fv)


def check_flags(F) -> None:
    """UsageError for the first value out of its range or a flag that would be ignored; the
    checks that need the model's shape (vocabulary, block size) are `make_plan`'s."""
    if F.checkpoint and F.random_weights:
        raise UsageError("--random_weights goes with --config, not --checkpoint")
    if F.prompt_len < 0:
        raise UsageError(f"--prompt_len={F.prompt_len}: must be positive (random prompt length)")
    given = [F.prompt is not None, F.prompt_ids is not None, F.prompt_len > 0]
    if sum(given) != 1:
        raise UsageError("give exactly one of --prompt, --prompt_ids, --prompt_len")
    if F.prompt_ids is not None:
        prompt_ids(F.prompt_ids)
    for name in ("batch", "max_new_tokens", "num_steps"):
        if F[name].value < 1:
            raise UsageError(f"--{name}={F[name].value}: must be at least 1")
    for name in ("seed", "cache_len", "attention_window"):
        if F[name].value < 0:
            raise UsageError(f"--{name}={F[name].value}: must be >= 0")
    for name in ("temperature", "init_scale"):
        if not (math.isfinite(F[name].value) and F[name].value >= 0):
            raise UsageError(f"--{name}={F[name].value}: must be a number >= 0")
    if not 0 < F.top_p <= 1:
        raise UsageError(f"--top_p={F.top_p}: must lie in (0, 1] (1: off)")
    if F.top_k < 0:
        raise UsageError(f"--top_k={F.top_k}: must be >= 0 (0: off)")
    if F.temperature == 0 and (F.top_k != 0 or F.top_p != 1):
        raise UsageError("--top_k and --top_p need --temperature > 0 (0 decodes greedily)")
    _check_exit(F)
    _check_mesh(F)
    if F.json_out:
        try:
            check_writable(F.json_out)
        except ValueError as e:
            raise UsageError(f"--json_out={e}") from None


def _check_exit(F) -> None:
    """--threshold and --min_steps only with a criterion, each in its range."""
    if F.criterion == "none":
        for name, unset in (("threshold", None), ("min_steps", 0)):
            if F[name].value != unset:
                raise UsageError(f"--{name} applies to an adaptive exit: add --criterion")
        return
    if not 0 <= F.min_steps <= F.num_steps:
        raise UsageError(f"--min_steps={F.min_steps}: must lie in [0, --num_steps={F.num_steps}]")
    if F.threshold is None:
        return
    if CRITERIA[F.criterion].exit_when_at_least:
        ok, valid = math.isfinite(F.threshold) and F.threshold >= 1, ">= 1 (unchanged steps)"
    else:
        ok, valid = math.isfinite(F.threshold) and F.threshold > 0, "> 0 (a change to fall below)"
    if not ok:
        raise UsageError(f"--threshold={F.threshold}: --criterion={F.criterion} needs {valid}")


def _check_mesh(F) -> None:
    """--mesh: a "model" axis alone, and no kernel choice that runs on one device only."""
    if not F.mesh:
        return
    model_shards(F.mesh)
    if F.decode_attention == "pallas":
        raise UsageError(
            f"--decode_attention=pallas runs on one device; --mesh={F.mesh} needs xla (or cudnn)"
        )
    if F.decode_gemv != "xla":
        raise UsageError(
            f"--decode_gemv={F.decode_gemv} is a batch-1 path of one device; --mesh={F.mesh} "
            "needs xla"
        )


def model_shards(spec: str) -> int:
    """N of --mesh=model:N; UsageError for a bad string or another axis."""
    from huginn_jax import parallel

    try:
        sizes = parallel.parse_mesh_spec(spec)
    except ValueError:
        sizes = {}
    if set(sizes) != {parallel.MODEL_AXIS}:
        raise UsageError(f"--mesh={spec}: expected model:N with N >= 1 devices, e.g. model:2")
    return sizes[parallel.MODEL_AXIS]


def make_mesh(spec: str):
    """The mesh of --mesh over the first N devices (None for ''); UsageError when fewer devices
    are present. Starts the backend."""
    from huginn_jax import parallel

    if not spec:
        return None
    try:
        return parallel.make_mesh({parallel.MODEL_AXIS: model_shards(spec)})
    except ValueError as e:
        raise UsageError(f"--mesh={spec}: {e}") from None


def check_memory(config, plan, batch: int, dtype) -> None:
    """UsageError when the weights and the KV cache of `batch` copies of `plan`'s prompt, a lower
    bound of what generation holds, exceed what the device may allocate
    (`huginn_jax.memory.available_bytes`; nothing is checked where that is unknown). Under a
    mesh each accelerator holds at least 1/N of them; CPU devices share the host's memory.
    Starts the backend."""
    import jax
    import jax.numpy as jnp

    from huginn_jax.kv_cache import KVCache
    from huginn_jax.memory import available_bytes, format_bytes

    weights = costs.model_param_count(config) * jnp.dtype(dtype).itemsize
    if plan.core_decode == "persistent":  # the Core's weights packed again, for the kernel
        from huginn_jax.persistent import packed_bytes

        weights += packed_bytes(config, batch, dtype=dtype)
    cache = KVCache.bytes_needed(
        config,
        batch=batch,
        max_len=plan.cache_len,
        num_steps=plan.spec.num_steps,
        dtype=dtype,
        strategy=plan.strategy,
    )
    available, where = available_bytes()
    shards = 1 if jax.devices()[0].platform == "cpu" else config.model_shards
    need = (weights + cache) // shards
    if available is not None and need > available:
        each = f" ({shards} devices: {format_bytes(need)} each)" if shards > 1 else ""
        raise UsageError(
            f"--batch={batch}: the weights ({format_bytes(weights)}) and the KV cache of "
            f"{plan.cache_len} positions ({format_bytes(cache)}) need "
            f"{format_bytes(weights + cache)}{each}; {where} has {format_bytes(available)}"
        )


def prompt_ids(values: list[str]) -> np.ndarray:
    """--prompt_ids as an int64 array; UsageError for anything but non-negative integers."""
    try:
        ids = [int(x) for x in values]
    except ValueError:
        raise UsageError(f"--prompt_ids must be integers: {','.join(values)}") from None
    if any(i < 0 for i in ids):
        raise UsageError(f"--prompt_ids must be token ids >= 0: {','.join(values)}")
    return np.asarray(ids, np.int64)
