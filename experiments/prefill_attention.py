"""Prefill attention of one Core layer: T new positions attending causally to themselves.

    python -m experiments.prefill_attention --tokens=1024,4096 [--trace_dir=DIR]

Each call runs `--sets` attentions over different inputs in a loop (`lax.scan`; PyTorch: one
CUDA graph), so that the call's fixed cost is spread over them; the time per attention is the
call's wall time / sets. FLOPs count the causal half only: 2 products x 2 x B x H x T^2 x K / 2;
% of floor is against the device's measured bf16 GEMM rate (experiments/measure/ceilings.py;
none on a device without a ceilings file), and "vs best" is the other framework's fastest time
for the same case / this row's. Inputs are not flushed from L2 between calls. The wall time is
not the kernel's: a JAX call also runs layout copies around a custom call (which the Core does
not have: its RoPE fusion writes the layout) and pays the call's own cost; `--trace_dir` prints
that breakdown per JAX impl (results/README.md, prefill attention with a trace).

Implementations, all over the same bf16 data (the first set's first heads checked against a
float64 reference on the host; a row beyond attention_bench.TOLERANCE makes the program exit 1
after writing its results):
  xla    huginn_jax.layers.attend: float32 scores, masked softmax (the model's default)
  cudnn  huginn_jax.layers.attend_cudnn(causal=True): cuDNN's fused causal kernel (the model's
         attention_impl="cudnn")
  mgpu   jax.experimental.pallas.ops.gpu.attention_mgpu (Mosaic GPU flash attention, causal)
         through huginn_jax.layers.attend_mgpu_causal (the model's attention_impl="mgpu"): q
         pre-scaled, K padded 96 -> 128, T padded to a multiple of 256, float16 operands (this
         JAX's kernel fails on bf16); the casts and pads are timed with it, as the model pays them
  torch_graph    torch's scaled_dot_product_attention(is_causal=True) on [B, H, T, K] views of
                 [B, T, H, K], output back to [B, T, H, K] (attention_bench.sdpa_fn), eager,
                 captured in one CUDA graph; one row per SDPA backend (`--sdpa_backends`), e.g.
                 torch_graph/flash
  torch_compile  the same function through torch.compile (`--torch_compile_mode`), replayed
                 from a CUDA graph; compile time recorded apart (`compile_seconds`)
On a CPU the flags not given take the smaller values of CPU_DEFAULTS (one line says which, and
the JSON records them); a problem that cannot fit in memory is refused before anything is
allocated; Ctrl-C or SIGTERM writes the rows measured so far, marked "complete": false.
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
from absl import flags  # noqa: E402

from experiments import attention_bench as bench  # noqa: E402
from experiments import attention_sweep as sweep  # noqa: E402
from experiments import cli, program  # noqa: E402
from experiments.measure import compare, memory  # noqa: E402
from experiments.measure import trace as trace_lib  # noqa: E402
from experiments.measure.ceilings import Ceilings  # noqa: E402
from huginn_jax.layers import attend, attend_cudnn, attend_mgpu_causal  # noqa: E402

FLAGS = flags.FLAGS
IMPLS = ("xla", "cudnn", "mgpu", *bench.TORCH_IMPLS)
GPU_ONLY = ("cudnn", "mgpu", *bench.TORCH_IMPLS)
CASE_KEYS = ("batch", "tokens")  # the fields of one case: its rows are compared in "vs best"
CHECKED_HEADS = 4  # heads of the first set checked against the float64 reference
# On a CPU, for the flags not given: two short prompts, two sets, a few calls.
CPU_DEFAULTS = {"tokens": ["256", "1024"], "sets": 2, "warmup": 1, "repeats": 3}


def define_flags() -> None:
    sweep.define_flags("prefill_attention", IMPLS)
    flags.DEFINE_list("batch", ["1"], "Sequences B, a list.")
    flags.DEFINE_list("tokens", ["1024", "4096"], "New positions T, a list (CPU: 256,1024).")
    flags.DEFINE_integer("sets", 8, "Attentions per call, each over its own inputs (CPU: 2).")
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
    """[B, T, CHECKED_HEADS, K] float of set 0 from a JAX [sets, B, T, H, K] output or a torch
    tuple of [B, T, H, K]."""
    if isinstance(out, jax.Array):
        return np.asarray(out[0, :, :, :CHECKED_HEADS].astype(jnp.float32), np.float64)
    return out[0][:, :, :CHECKED_HEADS].float().cpu().numpy().astype(np.float64)


# The runner of an impl: bench.sdpa_runner (causal) for PyTorch, else XlaRunner.
make_runner = functools.partial(bench.attention_runner, causal=True, xla_runner=XlaRunner)


def bytes_needed(batch: int, tokens: int, impls: list[str]) -> tuple[int, int]:
    """(device, host) bytes of one case: q, k, v and the output of every set (bf16), and with
    xla one set's float32 scores and probabilities and bf16 probabilities [B, H, T, T]; on the
    host the float64 reference of CHECKED_HEADS heads (scores, mask, exponentials)."""
    seq = batch * tokens * FLAGS.heads * FLAGS.head_dim
    scores = batch * FLAGS.heads * tokens * tokens * (4 + 4 + 2) if "xla" in impls else 0
    host = batch * CHECKED_HEADS * tokens * tokens * 8 * 3 + tokens * tokens
    return 4 * FLAGS.sets * seq * 2 + scores, host


def run(
    batches: list[int],
    token_counts: list[int],
    impls: list[str],
    ceilings: Ceilings | None,
    records: list[dict] | None = None,
) -> list[dict]:
    """Every (batch, tokens), then every runnable impl (`sweep.sweep_attention`), with the causal
    FLOPs and their rate (and % of the GEMM rate, with ceilings); with --trace_dir a JAX impl's
    record also holds its call's kernels (`trace_call`). Appended to `records` as they are
    measured."""

    def add_rates(record: dict, q, k, v) -> None:
        impl, batch, tokens = record["impl"], record["batch"], record["tokens"]
        flops = causal_flops(batch, tokens, FLAGS.heads, FLAGS.head_dim)
        seconds = record["us"] / 1e6
        record.update(flops=flops, tflop_per_s=flops / seconds / 1e12)
        if ceilings:
            record["pct_of_gemm_rate"] = 100 * flops / seconds / ceilings.bf16_flops_per_s
        if FLAGS.trace_dir and compare.framework(impl) == "jax":
            record.update(trace_call(impl, q, k, v, f"{impl}-{batch}-{tokens}"))

    return sweep.sweep_attention(
        "prefill_attention",
        [(b, t) for b in batches for t in token_counts],
        bench.runnable(impls, GPU_ONLY, jax.devices()[0].platform == "gpu"),
        records,
        case_keys=CASE_KEYS,
        per_call="sets",
        inputs=inputs,
        reference=reference,
        checked=first_set_checked_heads,
        make_runner=make_runner,
        add_rates=add_rates,
    )


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


# One row per record (sweep.format_table): B and T, and after the time the causal FLOP rate.
format_table = functools.partial(
    sweep.format_table,
    case=(sweep.field("B", 3, "batch"), sweep.field("T", 5, "tokens")),
    rates=(
        sweep.field("TFLOP/s", 8, "tflop_per_s", ".1f"),
        sweep.field("%GEMM", 6, "pct_of_gemm_rate", ".1f"),
    ),
    note="time: median per attention (a call's time / sets); TFLOP/s over the causal half "
    "(2 x 2 x B x H x T(T+1)/2 x K); %GEMM: of the bf16 GEMM rate of the ceilings below; "
    "-: no ceilings file or no rival.",
)


def check_flags() -> tuple[list[int], list[int], list[str]]:
    """The batches, token counts and impl rows of the flags; UserError for a bad value."""
    batches = cli.positive_ints("batch", FLAGS.batch)
    token_counts = cli.positive_ints("tokens", FLAGS.tokens)
    impls, sdpa_backends = sweep.check_flags(IMPLS, "sets")
    return batches, token_counts, bench.with_sdpa_backends(impls, sdpa_backends)


def main(argv: list[str]) -> None:
    check_flags()  # the user's values, before the backend starts
    # The traces go into folders under --trace_dir: a file there must be creatable.
    program.check_outputs(FLAGS.json_out, FLAGS.trace_dir and str(Path(FLAGS.trace_dir) / "probe"))
    cpu_line = program.cpu_defaults(CPU_DEFAULTS)
    batches, token_counts, impls = check_flags()  # with the CPU's values
    memory.check_fits(
        f"--tokens={max(token_counts)}",
        f"{FLAGS.sets} sets of q, k, v at B={max(batches)}, H={FLAGS.heads}, K={FLAGS.head_dim} "
        "(and XLA's [B, H, T, T] scores)",
        *bytes_needed(max(batches), max(token_counts), impls),
        hint="use fewer --tokens, a smaller --batch or fewer --sets",
    )
    bench.measure_and_finish(
        "prefill_attention",
        lambda records, ceilings: run(batches, token_counts, impls, ceilings, records),
        format_table,
        cpu_line=cpu_line,
        json_out=FLAGS.json_out,
        ceilings_path=FLAGS.ceilings,
        case_keys=CASE_KEYS,
    )


if __name__ == "__main__":
    program.run("prefill_attention", define_flags, main)
