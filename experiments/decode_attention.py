"""Decode attention over one Core layer's cache: one new position against S cached ones, the part
of a decode iteration that XLA runs furthest from the bandwidth limit (results/README.md, Core).

    python -m experiments.decode_attention --batch=1,8 --context=1024,4096

Each call attends `slots` different caches in a loop (`lax.scan`; PyTorch: one CUDA graph), so
that, as in the Core, no cache is still in L2 from the call before; the time per attention is the
call's time / slots, compared with reading K and V once at the device's read-only streaming
rate (experiments/measure/ceilings.py; none on a device without a ceilings file), and "vs best":
the other framework's fastest time for the same case / this row's. Caches are not flushed
between calls (they do not fit in L2: 32 slots of 21.6 MB at B = 1, S = 1024).

Implementations, all over the same bf16 data (the first slots of every output checked against a
float64 reference on the host; a row beyond attention_bench.TOLERANCE makes the program exit 1
after writing its results):
  xla             huginn_jax.layers.attend on the model's cache layout [B, S, H, K]
  xla_split       huginn_jax.layers.attend_decode_split: blocks of 128 positions (flash-decoding
                  in XLA), the model's decode_attention_impl="xla_split"
  xla_head_major  the same product on a head-major layout [B, H, S, K] (a candidate layout)
  cudnn           huginn_jax.layers.attend_decode_cudnn (cuDNN fused attention, T = 1, visible
                  keys as a length), the model's decode_attention_impl="cudnn"
  pallas          pallas_kernels.decode_attention: split-KV kernel reading the stacked caches
                  in place, the model's decode_attention_impl="pallas"
  torch_graph     torch's scaled_dot_product_attention on [B, H, S, K] views of [B, S, H, K],
                  output back to [B, 1, H, K] (attention_bench.sdpa_fn), eager, captured in one
                  CUDA graph; one row per SDPA backend (`--sdpa_backends`), e.g. torch_graph/flash
  torch_compile   the same function through torch.compile (`--torch_compile_mode`), replayed
                  from a CUDA graph; compile time recorded apart (`compile_seconds`)
On a CPU the flags not given take the smaller values of CPU_DEFAULTS (one line says which, and
the JSON records them); a problem that cannot fit in memory is refused before anything is
allocated; Ctrl-C or SIGTERM writes the rows measured so far, marked "complete": false.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402

from experiments import attention_bench as bench  # noqa: E402
from experiments import attention_sweep as sweep  # noqa: E402
from experiments import cli, program  # noqa: E402
from experiments.cli import UserError  # noqa: E402
from experiments.measure import memory  # noqa: E402
from experiments.measure.ceilings import Ceilings  # noqa: E402
from huginn_jax.layers import (  # noqa: E402
    DECODE_BLOCK,
    MASKED_SCORE,
    attend,
    attend_decode_cudnn,
    attend_decode_split,
)
from pallas_kernels.decode_attention import decode_attention, pick_config  # noqa: E402

FLAGS = flags.FLAGS
IMPLS = ("xla", "xla_split", "xla_head_major", "cudnn", "pallas", *bench.TORCH_IMPLS)
GPU_ONLY = ("cudnn", *bench.TORCH_IMPLS)
CASE_KEYS = ("batch", "context")  # the fields of one case: its rows are compared in "vs best"
# On a CPU, for the flags not given: one sequence, two short contexts, a few slots and calls.
CPU_DEFAULTS = {"batch": ["1"], "context": ["256", "1024"], "slots": 4, "warmup": 1, "repeats": 3}
MAX_CONTEXT = 2**31 - 1  # positions are int32


def define_flags() -> None:
    sweep.define_flags("decode_attention", IMPLS)
    flags.DEFINE_list("batch", ["1", "8"], "Sequences B, a list (CPU: 1).")
    flags.DEFINE_list("context", ["1024", "4096"], "Cached positions S, a list (CPU: 256,1024).")
    flags.DEFINE_list(
        "split_blocks",
        [str(DECODE_BLOCK)],
        "Block sizes (positions) of xla_split, a list: one row each, named xla_split/BLOCK when "
        "several.",
    )
    flags.DEFINE_list(
        "pallas_configs",
        [],
        "Tunings for pallas, each PROGRAMS_PER_SM:BLOCK_S:NUM_WARPS:NUM_STAGES (a list: one row "
        "each, named pallas/...); empty: the kernel's frozen default.",
    )
    flags.DEFINE_integer(
        "slots", 32, "Caches attended per call (no L2 reuse between them; CPU: 4)."
    )


def inputs(slots: int, batch: int, context: int, heads: int, head_dim: int, seed: int):
    """q [slots, B, 1, H, K] and K, V caches [slots, B, S, H, K], bf16, standard normal."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    cache_shape = (slots, batch, context, heads, head_dim)
    q = jax.random.normal(kq, (slots, batch, 1, heads, head_dim), jnp.bfloat16)
    return (
        q,
        jax.random.normal(kk, cache_shape, jnp.bfloat16),
        jax.random.normal(kv, cache_shape, jnp.bfloat16),
    )


def attend_head_major(q_Bx1xHxK, k_BxHxSxK, v_BxHxSxK, q_pos_T, k_pos_S):
    """`attend` for one query position on a head-major cache; same float32 scores and softmax."""
    scale = 1.0 / jnp.sqrt(jnp.float32(q_Bx1xHxK.shape[-1]))
    scores_BxHxS = jnp.einsum(
        "bhk,bhsk->bhs", q_Bx1xHxK[:, 0], k_BxHxSxK, preferred_element_type=jnp.float32
    )
    visible_S = k_pos_S <= q_pos_T[0]
    scores_BxHxS = jnp.where(visible_S, scores_BxHxS * scale, MASKED_SCORE)
    probs = jax.nn.softmax(scores_BxHxS, axis=-1).astype(v_BxHxSxK.dtype)
    return jnp.einsum("bhs,bhsk->bhk", probs, v_BxHxSxK)[:, None]


ATTENTION = {
    "xla": attend,
    "xla_split": attend_decode_split,
    "xla_head_major": attend_head_major,
    "cudnn": attend_decode_cudnn,
}


def attention_fn(impl: str):
    """The attention function of an impl name; "xla_split/64" is xla_split with blocks of 64."""
    name, _, block = impl.partition("/")
    if block:
        return functools.partial(ATTENTION[name], block=int(block))
    return ATTENTION[name]


def pallas_config(impl: str, batch: int, heads: int, max_len: int):
    """None (the frozen default) for "pallas"; "pallas/P:B:W:S" -> that tuning."""
    _, _, tuning = impl.partition("/")
    if not tuning:
        return None
    programs, block_s, warps, stages = (int(x) for x in tuning.split(":"))
    return pick_config(
        batch,
        heads,
        max_len,
        programs_per_sm=programs,
        block_s=block_s,
        num_warps=warps,
        num_stages=stages,
    )


def expand_impls(
    impls: list[str],
    split_blocks: list[int],
    pallas_configs: list[str],
    sdpa_backends: Sequence[str] = bench.DEFAULT_SDPA_BACKENDS,
):
    """xla_split once per block size (named with its block when there are several), pallas
    once per tuning, each torch impl once per SDPA backend."""
    names = []
    for impl in impls:
        if impl == "xla_split" and split_blocks != [DECODE_BLOCK]:
            names += [f"xla_split/{block}" for block in split_blocks]
        elif impl == "pallas" and pallas_configs:
            names += [f"pallas/{tuning}" for tuning in pallas_configs]
        else:
            names.append(impl)
    return bench.with_sdpa_backends(names, sdpa_backends)


@functools.partial(jax.jit, static_argnames=("impl",))
def attend_slots(qs, ks, vs, *, impl: str):
    """One attention per slot, in a scan: [slots, B, 1, H, K] out."""
    context = ks.shape[3] if impl == "xla_head_major" else ks.shape[2]
    if impl.startswith("pallas"):  # the kernel reads slot i of the stacked caches in place
        config = pallas_config(impl, ks.shape[1], ks.shape[3], ks.shape[2])

        def read_slot(_, i):
            return None, decode_attention(qs[i][:, 0], ks, vs, i, context, config=config)[:, None]

        return jax.lax.scan(read_slot, None, jnp.arange(qs.shape[0]))[1]
    k_pos = jnp.arange(context, dtype=jnp.int32)
    q_pos = jnp.full((1,), context - 1, jnp.int32)  # the new position sees the whole cache

    def body(_, qkv):
        return None, attention_fn(impl)(*qkv, q_pos, k_pos)

    return jax.lax.scan(body, None, (qs, ks, vs))[1]


CHECKED_SLOTS = 2  # slots checked against the float64 reference (on the host)


def reference(q, k, v) -> np.ndarray:
    """float64 attention of the first CHECKED_SLOTS slots on the host, from the bf16 data
    (XLA's float32 product of all slots asked the autotuner for many times the caches' size)."""
    q, k, v = (np.asarray(x[:CHECKED_SLOTS].astype(jnp.float32), np.float64) for x in (q, k, v))
    scores = np.einsum("nbhk,nbshk->nbhs", q[:, :, 0], k) / np.sqrt(q.shape[-1])
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("nbhs,nbshk->nbhk", probs, v)[:, :, None]


class XlaRunner:
    sync = None

    def __init__(self, impl: str, q, k, v):
        if impl == "xla_head_major":  # the candidate layout, made once, outside the timing
            k, v = (jnp.swapaxes(x, 2, 3) for x in (k, v))
        self.impl, self.args = impl, (q, k, v)

    def __call__(self):
        return attend_slots(*self.args, impl=self.impl)


def checked_slots(out) -> np.ndarray:
    """The first CHECKED_SLOTS outputs [CHECKED_SLOTS, B, 1, H, K] as float, from a JAX
    [slots, B, 1, H, K] array or a torch tuple of [B, 1, H, K]."""
    if isinstance(out, jax.Array):
        return np.asarray(out[:CHECKED_SLOTS].astype(jnp.float32))
    return np.stack([o.float().cpu().numpy() for o in out[:CHECKED_SLOTS]])


# The runner of an impl: bench.sdpa_runner (non-causal) for PyTorch, else XlaRunner.
make_runner = functools.partial(bench.attention_runner, causal=False, xla_runner=XlaRunner)


def bytes_needed(batch: int, context: int, impls: list[str]) -> tuple[int, int]:
    """(device, host) bytes of one case: the q and the K, V caches of every slot (bf16), twice
    with xla_head_major (its transposed copy), plus a slot's worth of temporaries; on the host
    the float64 reference of CHECKED_SLOTS slots (K and V in float32 and float64)."""
    slot = batch * context * FLAGS.heads * FLAGS.head_dim
    caches = 2 * FLAGS.slots * slot * 2
    device = caches * (2 if "xla_head_major" in impls else 1) + 4 * slot
    return device, 2 * CHECKED_SLOTS * slot * (4 + 8)


def check_memory(batches: list[int], contexts: list[int], impls: list[str]) -> None:
    """UserError, before anything is allocated, for a context past int32 positions or a
    largest case (max batch, max context) that cannot fit (`memory.check_fits`)."""
    batch, context = max(batches), max(contexts)
    if context > MAX_CONTEXT:
        raise UserError(f"--context={context}: positions are int32, at most {MAX_CONTEXT}")
    memory.check_fits(
        f"--context={context}",
        f"K and V caches of {FLAGS.slots} slots at B={batch}, H={FLAGS.heads}, K={FLAGS.head_dim}",
        *bytes_needed(batch, context, impls),
        hint="use a smaller --context or --batch, or fewer --slots",
    )


def run(
    batches: list[int],
    contexts: list[int],
    impls: list[str],
    ceilings: Ceilings | None,
    records: list[dict] | None = None,
) -> list[dict]:
    """Every (batch, context), then every runnable impl (`sweep.sweep_attention`), with the K
    and V bytes of one slot and their rate (and % of the read rate, with ceilings); appended to
    `records` as they are measured."""

    def add_rates(record: dict, q, k, v) -> None:
        kv_bytes = 2 * k[0].size * k.dtype.itemsize  # K and V of one slot
        seconds = record["us"] / 1e6
        record.update(kv_bytes=kv_bytes, gb_per_s=kv_bytes / seconds / 1e9)
        if ceilings:
            record["pct_of_read_rate"] = 100 * kv_bytes / seconds / ceilings.read_bytes_per_s

    return sweep.sweep_attention(
        "decode_attention",
        [(b, c) for b in batches for c in contexts],
        bench.runnable(impls, GPU_ONLY, jax.devices()[0].platform == "gpu"),
        records,
        case_keys=CASE_KEYS,
        per_call="slots",
        inputs=inputs,
        reference=reference,
        checked=checked_slots,
        make_runner=make_runner,
        add_rates=add_rates,
    )


# One row per record (sweep.format_table): B and S, and after the time the K and V read rate.
format_table = functools.partial(
    sweep.format_table,
    case=(sweep.field("B", 3, "batch"), sweep.field("S", 5, "context")),
    rates=(
        sweep.field("GB/s", 6, "gb_per_s", ".0f"),
        sweep.field("%read", 6, "pct_of_read_rate", ".1f"),
    ),
    note="time: median per attention (a call's time / slots); GB/s: K and V of one slot / time; "
    "%read: of the read-only streaming rate; -: no ceilings file or no rival",
)


def check_flags() -> tuple[list[int], list[int], list[str]]:
    """The batches, contexts and impl rows of the flags; UserError for a bad value."""
    batches = cli.positive_ints("batch", FLAGS.batch)
    contexts = cli.positive_ints("context", FLAGS.context)
    impls, sdpa_backends = sweep.check_flags(IMPLS, "slots")
    if FLAGS.head_dim % 2:
        raise UserError(f"--head_dim must be even, got {FLAGS.head_dim}")
    split_blocks = cli.positive_ints("split_blocks", FLAGS.split_blocks)
    for tuning in FLAGS.pallas_configs:
        parts = tuning.split(":")
        if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise UserError(
                f"--pallas_configs: {tuning!r} is not PROGRAMS_PER_SM:BLOCK_S:NUM_WARPS:NUM_STAGES"
            )
    return batches, contexts, expand_impls(impls, split_blocks, FLAGS.pallas_configs, sdpa_backends)


def main(argv: list[str]) -> None:
    check_flags()  # the user's values, before the backend starts
    program.check_outputs(FLAGS.json_out)
    cpu_line = program.cpu_defaults(CPU_DEFAULTS)
    batches, contexts, impls = check_flags()  # with the CPU's values
    check_memory(batches, contexts, impls)
    bench.measure_and_finish(
        "decode_attention",
        lambda records, ceilings: run(batches, contexts, impls, ceilings, records),
        format_table,
        cpu_line=cpu_line,
        json_out=FLAGS.json_out,
        ceilings_path=FLAGS.ceilings,
        case_keys=CASE_KEYS,
    )


if __name__ == "__main__":
    program.run("decode_attention", define_flags, main)
