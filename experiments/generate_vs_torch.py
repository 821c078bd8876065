"""Per-token decode latency of the JAX generation loop and of a PyTorch loop over the same weights,
in the same run (the Generation issue's comparison).

    python -m experiments.generate_vs_torch --config=huginn_0125 --prompt_len=1024 \
        --max_new_tokens=32 --num_steps=32 --json_out=out/generate_vs_torch.json

JAX: `huginn_jax.generate.make_plan` + `run_plan`, what `python -m huginn_jax.generate` runs, with
a fixed `num_steps`, a zero initial state (init_scale 0), greedy tokens and the `full` cache; the
latency of a token is one compiled step until its token is ready. PyTorch
(`experiments.torch_ref.huginn`): the same weights (DLPack, no copy), an eager prefill, then per
token a CUDA graph of the whole step captured at that position (untimed) and replayed once, timed
until `torch.cuda.synchronize` returns. Both loops feed back their own greedy tokens; the report
gives both medians, their ratio, whether the tokens agree and, where they part, the logit
difference and JAX's top-1/top-2 gap there (random weights make near-ties likely in bf16).
Without torch the JAX half runs alone (one note line); without CUDA torch runs eager on the CPU.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
from typing import Any

# PyTorch runs in the same process: JAX must not grab 75 % of the GPU up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from flax import nnx  # noqa: E402

import pallas_kernels.decode_attention  # noqa: E402, F401 (registers the "pallas" decode)
import pallas_kernels.fused_gemv  # noqa: E402, F401 (registers the "pallas" row GEMV)
from experiments import cli  # noqa: E402
from experiments.measure import results as results_lib  # noqa: E402
from experiments.torch_ref import chain as torch_chain  # noqa: E402 (imports no torch)
from huginn_jax.checkpoint import from_pretrained  # noqa: E402
from huginn_jax.config import DECODE_ATTENTION_IMPLS, DECODE_GEMV_IMPLS, HuginnConfig  # noqa: E402
from huginn_jax.generate import Generation, Plan, make_plan, run_plan  # noqa: E402
from huginn_jax.model import Huginn, random_init  # noqa: E402
from huginn_jax.xla_flags import GEMM_CHOICES, use_gemm  # noqa: E402

FLAGS = flags.FLAGS
_DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}


def define_flags() -> None:
    """Defines the flags; called only when this module runs as the program."""
    flags.DEFINE_string("config", "huginn_0125", "Model preset (random weights, reference init).")
    flags.DEFINE_string("checkpoint", None, "Hugging Face checkpoint directory instead.")
    flags.DEFINE_enum("dtype", "bf16", list(_DTYPES), "Weights, activations and cache dtype.")
    flags.DEFINE_enum(
        "gemm", "cublas", list(GEMM_CHOICES), "JAX's dots: cublas (Triton GEMMs off) or xla."
    )
    flags.DEFINE_integer("prompt_len", 1024, "Random prompt ids (drawn from --seed): the context.")
    flags.DEFINE_integer("batch", 1, "Sequences: copies of the prompt.")
    flags.DEFINE_integer("max_new_tokens", 32, "Tokens to generate (token 0 from the prefill).")
    flags.DEFINE_integer("num_steps", 32, "Core iterations per token (fixed, no exit).")
    flags.DEFINE_integer("seed", 0, "Seed of the weights and the prompt.")
    flags.DEFINE_enum(
        "decode_attention",
        "xla",
        list(DECODE_ATTENTION_IMPLS),
        "JAX's decode attention (HuginnConfig.decode_attention_impl); pallas: the kernel in "
        "pallas_kernels.decode_attention.",
    )
    flags.DEFINE_enum(
        "decode_gemv",
        "xla",
        list(DECODE_GEMV_IMPLS),
        "JAX's decode GEMVs at batch 1 (HuginnConfig.decode_gemv); pallas: the row GEMVs of "
        "huginn_jax.decode_row with pallas_kernels.fused_gemv.",
    )
    flags.DEFINE_integer("graph_warmup", 2, "Eager runs of each token's step before its capture.")
    flags.DEFINE_bool("torch_eager", False, "Also time the eager PyTorch loop (no CUDA graph).")
    flags.DEFINE_bool("progress", False, "JAX's progress bar on stderr.")
    flags.DEFINE_string("json_out", "out/generate_vs_torch.json", "Results JSON ('' to skip).")


_OWN_FLAGS = (
    "config checkpoint dtype prompt_len batch max_new_tokens num_steps seed decode_attention "
    "decode_gemv graph_warmup torch_eager progress json_out"
).split()


def _config() -> HuginnConfig:
    from pathlib import Path

    if FLAGS.checkpoint:
        path = Path(FLAGS.checkpoint) / "config.json"
        if not path.exists():
            raise ValueError(f"--checkpoint: {path} does not exist")
        config = HuginnConfig.from_hf_json(path)
    else:
        config = HuginnConfig.from_name(FLAGS.config)
    return dataclasses.replace(
        config, decode_attention_impl=FLAGS.decode_attention, decode_gemv=FLAGS.decode_gemv
    )


def _plan(config: HuginnConfig) -> Plan:
    """The request, checked before any weights exist; the prompt as the generate CLI draws it."""
    if FLAGS.prompt_len < 1 or FLAGS.batch < 1:
        raise ValueError("--prompt_len and --batch must be at least 1")
    ids = np.random.default_rng(FLAGS.seed).integers(0, config.vocab_size, FLAGS.prompt_len)
    return make_plan(
        config,
        np.tile(ids.reshape(1, -1), (FLAGS.batch, 1)),
        FLAGS.max_new_tokens,
        FLAGS.num_steps,
        init_scale=0.0,
        strategy="full",
        seed=FLAGS.seed,
    )


def _model(config: HuginnConfig) -> Huginn:
    dtype = _DTYPES[FLAGS.dtype]
    if FLAGS.checkpoint:
        return from_pretrained(FLAGS.checkpoint, dtype=dtype)
    return random_init(config, jax.random.key(FLAGS.seed), dtype=dtype)


def run_torch(model: Huginn, plan: Plan, notes: list[str]) -> tuple[dict[str, Any], Any] | None:
    """The PyTorch loop over `model`'s weights: (its JSON record, the timed run's
    `TorchGeneration`); None (with a note) when torch is missing."""
    if not torch_chain.available():
        notes.append("torch is not installed: the PyTorch loop is skipped")
        return None
    import torch

    from experiments.torch_ref.core import to_torch_fn
    from experiments.torch_ref.huginn import TorchHuginn, generate_greedy

    cuda = jax.default_backend() == "gpu" and torch.cuda.is_available()
    if not cuda:
        notes.append("no CUDA for torch: its loop runs eager on the CPU, without a CUDA graph")
    dtype = torch_chain.torch_dtype(str(jnp.dtype(model.dtype)))
    params = nnx.to_pure_dict(nnx.state(model))
    tmodel = TorchHuginn(params, model.config, to_torch_fn("cuda" if cuda else "cpu", dtype))
    args = (tmodel, plan.ids, plan.max_new_tokens, plan.spec.num_steps)
    runs = {
        "graph" if cuda else "eager": generate_greedy(*args, graph=cuda, warmup=FLAGS.graph_warmup)
    }
    if cuda and FLAGS.torch_eager:
        runs["eager"] = generate_greedy(*args, graph=False)
    main = runs["graph" if cuda else "eager"]
    out: dict[str, Any] = {
        "mode": "graph" if cuda else "eager",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "head_f32_out": main.head_f32_out,
        "cache_bytes": tmodel.cache_bytes,
        "peak_bytes_allocated": torch.cuda.max_memory_allocated() if cuda else None,
    }
    for name, gen in runs.items():
        out[name] = {
            "prefill_s": gen.prefill_s,
            "decode_latency_s": gen.latencies_s,
            "latency_median_s": gen.latency_median_s,
            "capture_s": gen.capture_s,
            "tokens": gen.tokens.tolist(),
        }
    if "eager" in runs and cuda:
        out["eager_tokens_equal_graph"] = bool(np.array_equal(runs["eager"].tokens, main.tokens))
    return out, main


def compare(jax_gen: Generation, torch_tokens: np.ndarray, torch_logits: np.ndarray) -> dict:
    """Token agreement and logit differences where both loops had the same inputs."""
    jax_tokens, jax_logits = jax_gen.tokens, jax_gen.logits
    differ = np.nonzero((jax_tokens != torch_tokens).any(axis=0))[0]
    first = int(differ[0]) if differ.size else None
    # Token n is computed from tokens < n: up to the first mismatch both loops saw the same ids.
    upto = jax_tokens.shape[1] if first is None else first + 1
    diff = np.abs(jax_logits[:, :upto] - torch_logits[:, :upto])
    out = {
        "tokens_agree": first is None,
        "first_mismatch": first,
        "tokens_agreeing": int((jax_tokens == torch_tokens).sum()),
        "tokens_total": int(jax_tokens.size),
        "prefill_logits_max_abs_diff": float(diff[:, 0].max()),
        "logits_max_abs_diff_same_inputs": float(diff.max()),
        "logits_abs_max": float(np.abs(jax_logits[:, :upto]).max()),
    }
    if first is not None:
        top2 = np.sort(jax_logits[:, first], axis=-1)[:, -2:]
        out["jax_top2_gap_at_mismatch"] = float((top2[:, 1] - top2[:, 0]).min())
    return out


def _ms(seconds: float | None, unit: str = "ms") -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f} {unit}"


def print_table(jax_stats: dict, torch_out: dict | None, comparison: dict | None) -> None:
    rows = [("", "JAX (XLA)", "PyTorch" + (f" ({torch_out['mode']})" if torch_out else ""))]
    main = torch_out[torch_out["mode"]] if torch_out else {}
    rows.append(("prefill", _ms(jax_stats["prefill_s"]), _ms(main.get("prefill_s"))))
    rows.append(
        (
            "decode latency (median)",
            _ms(jax_stats["latency_median_s"], "ms/token"),
            _ms(main.get("latency_median_s"), "ms/token"),
        )
    )
    if torch_out and torch_out["mode"] == "graph":
        capture = statistics.median(main["capture_s"]) if main["capture_s"] else None
        rows.append(("capture + warm-up (untimed)", "", _ms(capture, "ms/token")))
        if "eager" in torch_out:
            eager = torch_out["eager"]["latency_median_s"]
            rows.append(("PyTorch eager (median)", "", _ms(eager, "ms/token")))
    if comparison:
        ratio = comparison.get("latency_ratio_jax_over_torch")
        rows.append(("JAX / PyTorch latency", "-" if ratio is None else f"{ratio:.3f}", ""))
        agree = (
            "yes"
            if comparison["tokens_agree"]
            else f"no, from token {comparison['first_mismatch']}"
        )
        rows.append(("greedy tokens agree", agree, ""))
        rows.append(
            (
                "max |logit diff| (same ids)",
                f"{comparison['logits_max_abs_diff_same_inputs']:.3g}",
                "",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise ValueError(f"unexpected arguments: {' '.join(argv[1:])}")
    if FLAGS.graph_warmup < 1:
        raise ValueError("--graph_warmup must be at least 1 (cuBLAS and friends initialise there)")
    use_gemm(FLAGS.gemm)  # before anything starts the backend
    config = _config()
    plan = _plan(config)  # every bad setting fails here, before weights or compilation
    model = _model(config)
    jax_gen = run_plan(model, plan, return_logits=True, progress=FLAGS.progress)
    notes: list[str] = []
    torch_run = run_torch(model, plan, notes)
    torch_out, comparison = None, None
    if torch_run is not None:
        torch_out, tgen = torch_run
        comparison = compare(jax_gen, tgen.tokens, tgen.logits)
        jax_s, torch_s = jax_gen.stats["latency_median_s"], tgen.latency_median_s
        if jax_s and torch_s:
            comparison["latency_ratio_jax_over_torch"] = jax_s / torch_s
    if FLAGS.json_out:
        result = {
            "jax": {**jax_gen.stats, "tokens": jax_gen.tokens.tolist()},
            "torch": torch_out,
            "comparison": comparison,
            "notes": notes,
        }
        path = results_lib.write_results(FLAGS.json_out, cli.flag_values(_OWN_FLAGS), result)
    for line in notes:
        print(f"note: {line}")
    if FLAGS.json_out:
        print(f"results: {path}")
    print_table(jax_gen.stats, torch_out, comparison)


def run_main(argv: list[str]) -> None:
    logging.set_verbosity(logging.WARNING)  # no backend-probing chatter around the output
    try:
        main(argv)
    except ValueError as e:  # bad flags or settings (make_plan, presets, checkpoints)
        print(f"generate_vs_torch: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    define_flags()
    app.run(run_main, flags_parser=cli.flags_parser("generate_vs_torch"))
