"""Prefill attention of one Core layer: T new positions attending causally to themselves.

    python -m experiments.prefill_attention --tokens=1024,4096 [--trace_dir=DIR]

Each call runs `--sets` attentions over different inputs in a loop (`lax.scan`; PyTorch: one
CUDA graph), so that the call's fixed cost is spread over them; the time per attention is the
call's wall time / sets. FLOPs count the causal half only: 2 products x 2 x B x H x T^2 x K / 2.
Inputs are not flushed from L2 between calls. The wall time is not the kernel's: on the H200 at
T = 1024 (results/2026-11-30-h200/prefill_attention_trace_session8.txt) cuDNN's kernel took
42.7 us per attention, its call 134.2 us per attention: 27.0 us of layout copies (memcpy128)
around the custom call, which the Core does not have (its RoPE fusion writes the layout), and
~0.34 ms of JAX call cost per call of 8. `--trace_dir` prints that breakdown per JAX impl.

Implementations, all over the same bf16 data (the first set's first heads checked against a
float64 reference on the host):
  xla    huginn_jax.layers.attend: float32 scores, masked softmax (the model's default)
  cudnn  huginn_jax.layers.attend_cudnn(causal=True): cuDNN's fused causal kernel (the model's
         attention_impl="cudnn")
  mgpu   jax.experimental.pallas.ops.gpu.attention_mgpu (Mosaic GPU flash attention, causal)
         through huginn_jax.layers.attend_mgpu_causal (the model's attention_impl="mgpu"): q
         pre-scaled, K padded 96 -> 128, T padded to a multiple of 256, float16 operands (this
         JAX's kernel fails on bf16); the casts and pads are timed with it, as the model pays them
  torch  torch's scaled_dot_product_attention(is_causal=True) on [B, H, T, K] views
         (attention_bench.SdpaRunner)
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from experiments import attention_bench as bench  # noqa: E402
from experiments import cli  # noqa: E402
from experiments.cli import UserError  # noqa: E402
from experiments.measure import results as results_lib  # noqa: E402
from experiments.measure import trace as trace_lib  # noqa: E402
from huginn_jax import costs  # noqa: E402
from huginn_jax.layers import attend, attend_cudnn, attend_mgpu_causal  # noqa: E402

FLAGS = flags.FLAGS
IMPLS = ("xla", "cudnn", "mgpu", "torch")
GPU_ONLY = ("cudnn", "mgpu", "torch")
CHECKED_HEADS = 4  # heads of the first set checked against the float64 reference


def define_flags() -> None:
    flags.DEFINE_list("batch", ["1"], "Sequences (a list).")
    flags.DEFINE_list("tokens", ["1024", "4096"], "New positions T (a list).")
    flags.DEFINE_list("impls", list(IMPLS), f"Any of {', '.join(IMPLS)}.")
    flags.DEFINE_integer("heads", 55, "Heads H (huginn-0125: 55).")
    flags.DEFINE_integer("head_dim", 96, "Head dimension K (huginn-0125: 96).")
    flags.DEFINE_integer("sets", 8, "Attentions per call, each over its own inputs.")
    flags.DEFINE_integer("warmup", 3, "Untimed calls.")
    flags.DEFINE_integer("repeats", 20, "Timed calls (median reported).")
    flags.DEFINE_integer("seed", 0, "Seed of the inputs.")
    flags.DEFINE_string("json_out", "out/prefill_attention.json", "Results JSON ('' to skip).")
    flags.DEFINE_string(
        "trace_dir",
        None,
        "Trace one call of each JAX impl here and print its kernels per attention (what a call "
        "runs besides the attention kernel).",
    )


def inputs(sets: int, batch: int, tokens: int, heads: int, head_dim: int, seed: int):
    """q, k, v [sets, B, T, H, K], bf16, standard normal."""
    shape = (sets, batch, tokens, heads, head_dim)
    return tuple(
        jax.random.normal(key, shape, jnp.bfloat16)
        for key in jax.random.split(jax.random.key(seed), 3)
    )


def attend_causal(impl: str, q, k, v) -> jax.Array:
    """One layer's causal self-attention, [B, T, H, K] in and out."""
    if impl == "mgpu":
        return attend_mgpu_causal(q, k, v)
    positions = jnp.arange(q.shape[1], dtype=jnp.int32)
    if impl == "cudnn":
        return attend_cudnn(q, k, v, positions, positions, causal=True)
    return attend(q, k, v, positions, positions)


@functools.partial(jax.jit, static_argnames=("impl",))
def attend_sets(qs, ks, vs, *, impl: str):
    """One attention per set, in a scan: [sets, B, T, H, K] out."""
    return jax.lax.scan(lambda _, qkv: (None, attend_causal(impl, *qkv)), None, (qs, ks, vs))[1]


def reference(q, k, v) -> np.ndarray:
    """float64 causal attention of the first set, first CHECKED_HEADS heads, on the host."""
    q, k, v = (
        np.asarray(x[0, :, :, :CHECKED_HEADS].astype(jnp.float32), np.float64) for x in (q, k, v)
    )
    scores = np.einsum("bthk,bshk->bhts", q, k) / np.sqrt(q.shape[-1])
    tokens = q.shape[1]
    scores = np.where(np.tril(np.ones((tokens, tokens), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("bhts,bshk->bthk", probs, v)


def causal_flops(batch: int, tokens: int, heads: int, head_dim: int) -> int:
    """QK^T and PV over the visible (lower-triangle) pairs: 2 x 2 x B x H x T(T+1)/2 x K."""
    return 2 * 2 * batch * heads * (tokens * (tokens + 1) // 2) * head_dim


class XlaRunner:
    sync = None

    def __init__(self, impl: str, q, k, v):
        self.impl, self.args = impl, (q, k, v)

    def __call__(self):
        return attend_sets(*self.args, impl=self.impl)


def first_set_checked_heads(out) -> np.ndarray:
    """[B, T, CHECKED_HEADS, K] float of set 0 from a JAX [sets,B,T,H,K] or torch
    [sets,B,H,T,K] output."""
    if isinstance(out, jax.Array):
        return np.asarray(out[0, :, :, :CHECKED_HEADS].astype(jnp.float32), np.float64)
    return out[0, :, :CHECKED_HEADS].float().transpose(1, 2).cpu().numpy().astype(np.float64)


def make_runner(impl: str, q, k, v):
    return bench.SdpaRunner(q, k, v, causal=True) if impl == "torch" else XlaRunner(impl, q, k, v)


def run(batches: list[int], token_counts: list[int], impls: list[str]) -> list[dict]:
    impls = bench.runnable(impls, GPU_ONLY, jax.devices()[0].platform == "gpu")
    gemm_rate = costs.DEVICES["h200_measured"].peak_bf16_flops
    records = []
    for batch in batches:
        for tokens in token_counts:
            q, k, v = inputs(FLAGS.sets, batch, tokens, FLAGS.heads, FLAGS.head_dim, FLAGS.seed)
            ref = reference(q, k, v)
            flops = causal_flops(batch, tokens, FLAGS.heads, FLAGS.head_dim)
            for impl in impls:
                record = bench.time_one(
                    {"impl": impl, "batch": batch, "tokens": tokens},
                    functools.partial(make_runner, impl, q, k, v),
                    first_set_checked_heads,
                    ref,
                    per_call=FLAGS.sets,
                    warmup=FLAGS.warmup,
                    repeats=FLAGS.repeats,
                )
                if "error" not in record:
                    seconds = record["us"] / 1e6
                    record.update(
                        flops=flops,
                        tflop_per_s=flops / seconds / 1e12,
                        pct_of_gemm_rate=100 * flops / seconds / gemm_rate,
                    )
                    if FLAGS.trace_dir and impl != "torch":
                        record.update(trace_call(impl, q, k, v, f"{impl}-{batch}-{tokens}"))
                records.append(record)
            del q, k, v
    return records


def trace_call(impl: str, q, k, v, label: str) -> dict:
    """One traced call: the kernels per attention (rows) and the call's span, busy time and gaps
    per attention (µs), printed and returned for the record. JAX impls only: once torch's
    profiler has run in a process, JAX's can no longer subscribe to CUPTI."""
    runner = make_runner(impl, q, k, v)
    jax.block_until_ready(runner())
    rows, spent = trace_lib.trace_run(
        lambda: jax.block_until_ready(runner()),
        Path(FLAGS.trace_dir) / label,
        torch=False,
        units=FLAGS.sets,
    )
    print(trace_lib.side_by_side({label: rows}, top=8, per="attn"))
    print(trace_lib.per_unit_line(spent, "attention"))
    return {"trace": [dataclasses.asdict(r) for r in rows], "trace_us_per_attention": spent}


def format_table(records: list[dict]) -> str:
    lines = [
        f"{'impl':<8} {'B':>3} {'T':>5} {'µs':>9} {'p10-p90':>17} {'TFLOP/s':>8} {'%GEMM':>6} "
        f"{'rel err':>8}",
        "-" * 72,
    ]
    for r in records:
        if "error" in r:
            lines.append(f"{r['impl']:<8} {r['batch']:>3} {r['tokens']:>5} failed (see notes)")
            continue
        spread = f"{r['us_p10']:.1f}-{r['us_p90']:.1f}"
        lines.append(
            f"{r['impl']:<8} {r['batch']:>3} {r['tokens']:>5} {r['us']:>9.1f} {spread:>17} "
            f"{r['tflop_per_s']:>8.1f} {r['pct_of_gemm_rate']:>6.1f} {r['rel_err_vs_f64']:>8.1e}"
        )
    lines.append(
        "TFLOP/s over the causal half (2 x 2 x B x H x T(T+1)/2 x K); %GEMM: of the measured "
        "bf16 GEMM rate (huginn_jax.costs, h200_measured)."
    )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise UserError(f"unexpected arguments: {' '.join(argv[1:])}")
    batches = cli.positive_ints("batch", FLAGS.batch)
    token_counts = cli.positive_ints("tokens", FLAGS.tokens)
    unknown = [i for i in FLAGS.impls if i not in IMPLS]
    if unknown:
        raise UserError(f"unknown impl {unknown[0]!r}; known: {', '.join(IMPLS)}")
    for name in ("heads", "head_dim", "sets", "repeats"):
        if FLAGS[name].value < 1:
            raise UserError(f"--{name} must be >= 1, got {FLAGS[name].value}")
    if FLAGS.warmup < 0:
        raise UserError(f"--warmup must be >= 0, got {FLAGS.warmup}")
    records = run(batches, token_counts, list(dict.fromkeys(FLAGS.impls)))
    if FLAGS.json_out:
        names = "batch tokens impls heads head_dim sets warmup repeats seed json_out trace_dir"
        names = names.split()
        path = results_lib.write_results(
            FLAGS.json_out, cli.flag_values(names), {"records": records}
        )
        print(f"results: {path}")
    print(format_table(records))


run_main = cli.main_runner("prefill_attention", main)


if __name__ == "__main__":
    define_flags()
    app.run(run_main, flags_parser=cli.flags_parser("prefill_attention"))
