"""Decode attention over one Core layer's cache: one new position against S cached ones, the part
of a decode iteration that XLA runs furthest from the bandwidth limit (results/README.md, Core).

    python -m experiments.decode_attention --batch=1,8 --context=1024,4096

Each call attends `slots` different caches in a loop (`lax.scan`; PyTorch: one CUDA graph), so
that, as in the Core, no cache is still in L2 from the call before; the time per attention is the
call's time / slots, compared with reading K and V once at the measured 4.25 TB/s. Caches are
not flushed between calls (they do not fit in L2: 32 slots of 21.6 MB at B = 1, S = 1024).

Implementations, all over the same bf16 data (every output checked against a float32 reference):
  xla             huginn_jax.layers.attend on the model's cache layout [B, S, H, K]
  xla_split       the same split into blocks of 128 positions (flash-decoding in XLA)
  xla_head_major  the same product on a head-major layout [B, H, S, K] (a candidate layout)
  cudnn           huginn_jax.layers.attend_cudnn (cuDNN fused attention, T = 1) on [B, S, H, K]
  torch           torch's scaled_dot_product_attention on [B, H, S, K] views of [B, S, H, K]
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from experiments import cli  # noqa: E402
from experiments.cli import UserError  # noqa: E402
from experiments.measure import results as results_lib  # noqa: E402
from experiments.measure import timing  # noqa: E402
from experiments.torch_ref import chain as torch_chain  # noqa: E402 (imports no torch)
from huginn_jax import costs  # noqa: E402
from huginn_jax.layers import MASKED_SCORE, attend, attend_cudnn  # noqa: E402

FLAGS = flags.FLAGS
IMPLS = ("xla", "xla_split", "xla_head_major", "cudnn", "torch")
GPU_ONLY = ("cudnn", "torch")


def define_flags() -> None:
    flags.DEFINE_list("batch", ["1", "8"], "Sequences (a list).")
    flags.DEFINE_list("context", ["1024", "4096"], "Cached positions S (a list).")
    flags.DEFINE_list("impls", list(IMPLS), f"Any of {', '.join(IMPLS)}.")
    flags.DEFINE_integer("heads", 55, "Heads H (huginn-0125: 55).")
    flags.DEFINE_integer("head_dim", 96, "Head dimension K (huginn-0125: 96).")
    flags.DEFINE_integer("slots", 32, "Caches attended per call (no L2 reuse between them).")
    flags.DEFINE_integer("warmup", 3, "Untimed calls.")
    flags.DEFINE_integer("repeats", 20, "Timed calls (median reported).")
    flags.DEFINE_integer("seed", 0, "Seed of queries and caches.")
    flags.DEFINE_string("json_out", "out/decode_attention.json", "Results JSON ('' to skip).")


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


def attend_split(q_Bx1xHxK, k_BxSxHxK, v_BxSxHxK, q_pos_T, k_pos_S, *, block: int = 128):
    """`attend` for one query position, split over the cache (flash-decoding written in XLA): the
    S positions in blocks of `block` (a shorter one last), a softmax per block, the blocks
    combined through their maxima and sums. Many short reductions instead of one over all S."""
    batch, s, heads, head_dim = k_BxSxHxK.shape
    scale = 1.0 / jnp.sqrt(jnp.float32(head_dim))
    q_BxHxK = q_Bx1xHxK[:, 0]

    def partial(k_BxCxLxHxK, v_BxCxLxHxK, pos_CxL):
        scores = jnp.einsum(
            "bhk,bclhk->bchl", q_BxHxK, k_BxCxLxHxK, preferred_element_type=jnp.float32
        )
        visible = (pos_CxL <= q_pos_T[0])[None, :, None, :]
        scores = jnp.where(visible, scores * scale, MASKED_SCORE)
        m_BxCxH = scores.max(axis=-1)
        p = jnp.exp(scores - m_BxCxH[..., None])
        acc = jnp.einsum(
            "bchl,bclhk->bchk",
            p.astype(v_BxCxLxHxK.dtype),
            v_BxCxLxHxK,
            preferred_element_type=jnp.float32,
        )
        return m_BxCxH, p.sum(axis=-1), acc

    full = s // block * block
    parts = []
    if full:
        blocks = (batch, full // block, block, heads, head_dim)
        parts.append(
            partial(
                k_BxSxHxK[:, :full].reshape(blocks),
                v_BxSxHxK[:, :full].reshape(blocks),
                k_pos_S[:full].reshape(-1, block),
            )
        )
    if full < s:
        parts.append(
            partial(k_BxSxHxK[:, None, full:], v_BxSxHxK[:, None, full:], k_pos_S[None, full:])
        )
    m, total, acc = (jnp.concatenate(x, axis=1) for x in zip(*parts, strict=True))
    weight_BxCxH = jnp.exp(m - m.max(axis=1, keepdims=True))
    out = (acc * weight_BxCxH[..., None]).sum(1) / (total * weight_BxCxH).sum(1)[..., None]
    return out[:, None].astype(v_BxSxHxK.dtype)


ATTENTION = {
    "xla": attend,
    "xla_split": attend_split,
    "xla_head_major": attend_head_major,
    "cudnn": attend_cudnn,
}


@functools.partial(jax.jit, static_argnames=("impl",))
def attend_slots(qs, ks, vs, *, impl: str):
    """One attention per slot, in a scan: [slots, B, 1, H, K] out."""
    context = ks.shape[3] if impl == "xla_head_major" else ks.shape[2]
    k_pos = jnp.arange(context, dtype=jnp.int32)
    q_pos = jnp.full((1,), context - 1, jnp.int32)  # the new position sees the whole cache

    def body(_, qkv):
        return None, ATTENTION[impl](*qkv, q_pos, k_pos)

    return jax.lax.scan(body, None, (qs, ks, vs))[1]


def reference(q, k, v) -> np.ndarray:
    """float32 attention of every slot, from the bf16 data."""
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    return np.asarray(attend_slots(*f32, impl="xla"))


class XlaRunner:
    sync = None

    def __init__(self, impl: str, q, k, v):
        if impl == "xla_head_major":  # the candidate layout, made once, outside the timing
            k, v = (jnp.swapaxes(x, 2, 3) for x in (k, v))
        self.impl, self.args = impl, (q, k, v)

    def __call__(self):
        return attend_slots(*self.args, impl=self.impl)


class TorchRunner:
    """scaled_dot_product_attention per slot on [B, H, S, K] views (no copy), in one CUDA graph."""

    def __init__(self, q, k, v):
        import torch
        import torch.nn.functional as F

        self.sync = torch.cuda.synchronize
        q, k, v = (torch.from_dlpack(x).transpose(2, 3) for x in (q, k, v))  # [slots,B,H,S,K]
        out = torch.empty_like(q)

        def run():
            for i in range(q.shape[0]):
                out[i] = F.scaled_dot_product_attention(q[i], k[i], v[i])
            return out

        self.graph, self.out = torch_chain.capture_graph(run, warmup=1)

    def __call__(self):
        self.graph.replay()
        return self.out


def to_numpy(out) -> np.ndarray:
    if isinstance(out, jax.Array):
        return np.asarray(out.astype(jnp.float32))
    return out.float().transpose(2, 3).cpu().numpy()  # torch [slots,B,H,1,K] -> [slots,B,1,H,K]


def run(batches: list[int], contexts: list[int], impls: list[str]) -> list[dict]:
    on_gpu = jax.devices()[0].platform == "gpu"
    if not on_gpu and any(i in GPU_ONLY for i in impls):
        print(f"note: {', '.join(i for i in impls if i in GPU_ONLY)} need(s) CUDA; skipped")
        impls = [i for i in impls if i not in GPU_ONLY]
    if "torch" in impls and not torch_chain.available():
        print("note: PyTorch is not installed; torch skipped")
        impls = [i for i in impls if i != "torch"]
    floor_bw = costs.DEVICES["h200_measured"].hbm_bandwidth
    records = []
    for batch in batches:
        for context in contexts:
            q, k, v = inputs(FLAGS.slots, batch, context, FLAGS.heads, FLAGS.head_dim, FLAGS.seed)
            ref = reference(q, k, v)
            kv_bytes = 2 * k[0].size * k.dtype.itemsize  # K and V of one slot
            for impl in impls:
                try:  # one implementation failing (e.g. cuDNN refusing a shape) is a result too
                    runner = TorchRunner(q, k, v) if impl == "torch" else XlaRunner(impl, q, k, v)
                    out = to_numpy(runner())
                    samples = timing.time_fn(
                        runner,
                        warmup=FLAGS.warmup,
                        repeats=FLAGS.repeats,
                        sync=runner.sync,
                        per_call=FLAGS.slots,
                    )
                except Exception as e:
                    message = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
                    print(f"note: {impl} B={batch} S={context} failed: {message}")
                    records.append(
                        {"impl": impl, "batch": batch, "context": context, "error": message}
                    )
                    continue
                err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
                seconds = samples.median
                records.append(
                    {
                        "impl": impl,
                        "batch": batch,
                        "context": context,
                        "kv_bytes": kv_bytes,
                        "us": seconds * 1e6,
                        "us_p10": samples.quantile(0.1) * 1e6,
                        "us_p90": samples.quantile(0.9) * 1e6,
                        "gb_per_s": kv_bytes / seconds / 1e9,
                        "pct_of_h200_bandwidth": 100 * kv_bytes / seconds / floor_bw,
                        "rel_err_vs_f32": err,
                        "samples_s": samples.seconds,
                    }
                )
                print(f"{impl} B={batch} S={context}: {seconds * 1e6:.1f} us, rel err {err:.1e}")
            del q, k, v
    return records


def format_table(records: list[dict]) -> str:
    lines = [
        f"{'impl':<16} {'B':>3} {'S':>5} {'µs':>8} {'p10-p90':>15} {'GB/s':>6} {'%4.25TB/s':>9} "
        f"{'rel err':>8}",
        "-" * 76,
    ]
    for r in records:
        if "error" in r:
            lines.append(f"{r['impl']:<16} {r['batch']:>3} {r['context']:>5} failed (see notes)")
            continue
        spread = f"{r['us_p10']:.1f}-{r['us_p90']:.1f}"
        lines.append(
            f"{r['impl']:<16} {r['batch']:>3} {r['context']:>5} {r['us']:>8.1f} {spread:>15} "
            f"{r['gb_per_s']:>6.0f} {r['pct_of_h200_bandwidth']:>9.1f} {r['rel_err_vs_f32']:>8.1e}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise UserError(f"unexpected arguments: {' '.join(argv[1:])}")
    batches = cli.positive_ints("batch", FLAGS.batch)
    contexts = cli.positive_ints("context", FLAGS.context)
    unknown = [i for i in FLAGS.impls if i not in IMPLS]
    if unknown:
        raise UserError(f"unknown impl {unknown[0]!r}; known: {', '.join(IMPLS)}")
    for name in ("heads", "head_dim", "slots", "repeats"):
        if FLAGS[name].value < 1:
            raise UserError(f"--{name} must be >= 1, got {FLAGS[name].value}")
    if FLAGS.head_dim % 2:
        raise UserError(f"--head_dim must be even, got {FLAGS.head_dim}")
    records = run(batches, contexts, list(dict.fromkeys(FLAGS.impls)))
    if FLAGS.json_out:
        names = "batch context impls heads head_dim slots warmup repeats seed json_out".split()
        env = results_lib.environment({name: FLAGS[name].value for name in names})
        path = results_lib.write_json_atomic(
            FLAGS.json_out, {"environment": env, "records": records}
        )
        print(f"results: {path}")
    print(format_table(records))


run_main = cli.main_runner("decode_attention", main)


if __name__ == "__main__":
    define_flags()
    app.run(run_main, flags_parser=cli.flags_parser("decode_attention"))
