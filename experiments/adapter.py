"""The seeds' Appendix A: the adapter [M, 2h] @ [2h, h] in decode (M = 1) and prefill (M = 1024).

    python -m experiments.adapter --m=1,1024 --hbm

For each M: time against the roofline (`huginn_jax.costs.matmul_cost`, measured ceilings), and
with `--hbm` the HBM bytes read per call with L2 flushed before it (Nsight Compute's
`--cache-control all`: in the Core, four layers run between two adapter calls) against the
estimate, which counts one access per tensor read or written.

Two variants, as in the seeds: `matmul` (x @ W alone) and `concat` (concat([s, e]) @ W, what the
Core runs; the estimate then adds the concatenation's reads and write). Timing: `calls` adapter
calls in one executable (XLA: `lax.fori_loop`, each input depending on the previous output;
PyTorch: a CUDA graph of the same), median per call over repeats; the 106 MiB weight of
huginn-0125 is larger than the H200's L2, so even warm calls read it from HBM.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402

from experiments import cli  # noqa: E402
from experiments.cli import UserError  # noqa: E402
from experiments.measure import ncu as ncu_lib  # noqa: E402
from experiments.measure import results as results_lib  # noqa: E402
from experiments.measure import timing  # noqa: E402
from experiments.torch_ref import chain as torch_chain  # noqa: E402 (imports no torch)
from huginn_jax import costs  # noqa: E402
from huginn_jax.config import HuginnConfig  # noqa: E402
from huginn_jax.layers import truncated_normal  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Defines the flags; called only when this module runs as the program, so that tests
    and other programs can import it without clashing flag names."""
    flags.DEFINE_list("m", ["1", "1024"], "Rows M (1 = decode, 1024 = prefill at batch 1).")
    flags.DEFINE_list("variants", ["matmul", "concat"], "matmul (x @ W) and/or concat.")
    flags.DEFINE_list("impls", ["xla", "torch"], "xla and/or torch.")
    flags.DEFINE_string("config", "huginn_0125", "Preset whose adapter is measured.")
    flags.DEFINE_integer("calls", 20, "Adapter calls per timed executable / graph.")
    flags.DEFINE_integer("warmup", 3, "Untimed repeats.")
    flags.DEFINE_integer("repeats", 20, "Timed repeats (median reported).")
    flags.DEFINE_string("json_out", "out/adapter.json", "Results JSON ('' to skip).")
    flags.DEFINE_bool("hbm", False, "HBM bytes per call with L2 flushed (GPU + ncu).")
    flags.DEFINE_integer("seed", 0, "Seed of the weight and inputs.")
    flags.DEFINE_string("ncu_child", None, "Internal: impl:variant:m run under ncu.")


def estimate(cfg: HuginnConfig, m: int, variant: str) -> costs.OpCost:
    """One HBM access per tensor read or written (bf16); concat adds reading s, e and writing x."""
    h = cfg.n_embd
    op = costs.matmul_cost(m, 2 * h, h, name=f"adapter M={m}")
    if variant == "concat":
        concat_bytes = 2 * (2 * m * h)  # read s and e ([M, h] each), write x [M, 2h]
        op = dataclasses.replace(
            op,
            hbm_read_bytes=op.hbm_read_bytes + m * 2 * h * 2,
            hbm_write_bytes=op.hbm_write_bytes + concat_bytes,
        )
    return op


def stacked_inputs(cfg: HuginnConfig, m: int, calls: int):
    """W [2h, h] (reference init) and `calls` different states and embeddings [calls, M, h]."""
    keys = jax.random.split(jax.random.key(FLAGS.seed), 3)
    h = cfg.n_embd
    w = truncated_normal(keys[0], (2 * h, h), cfg.init_std, jnp.bfloat16)
    ss = jax.random.normal(keys[1], (calls, m, h), jnp.bfloat16)
    es = jax.random.normal(keys[2], (calls, m, h), jnp.bfloat16)
    return ss, es, w


@functools.partial(jax.jit, static_argnames=("variant",))
def xla_calls(ss, es, xs, w, *, variant: str):
    """One adapter product per input in the stack, in a loop (independent products over
    different inputs; nothing to hoist). `matmul`: xs[i] @ W; `concat`: concat(ss[i], es[i]) @ W."""
    calls, m, h = ss.shape

    def body(i, ys):
        if variant == "concat":
            x = jnp.concatenate([ss[i], es[i]], axis=-1)
        else:
            x = xs[i]
        return ys.at[i].set(x @ w)

    return jax.lax.fori_loop(0, calls, body, jnp.zeros((calls, m, w.shape[1]), w.dtype))


class XlaRunner:
    sync = None

    def __init__(self, ss, es, w, variant: str):
        self.args = (ss, es, jnp.concatenate([ss, es], axis=-1), w)
        self.variant = variant

    def __call__(self):
        return xla_calls(*self.args, variant=self.variant)


class TorchRunner:
    """The same products in PyTorch, `calls` of them captured in one CUDA graph."""

    def __init__(self, ss, es, w, variant: str):
        import torch

        self.sync = torch.cuda.synchronize
        ss, es, w = (torch.from_dlpack(a) for a in (ss, es, w))
        xs = torch.cat([ss, es], dim=-1)
        ys = torch.empty(ss.shape[0], ss.shape[1], w.shape[1], dtype=w.dtype, device=w.device)

        def run():
            for i in range(ss.shape[0]):
                x = torch.cat([ss[i], es[i]], dim=-1) if variant == "concat" else xs[i]
                torch.matmul(x, w, out=ys[i])
            return ys

        self.graph, self.out = torch_chain.capture_graph(run, warmup=1)

    def __call__(self):
        self.graph.replay()
        return self.out


def make_runner(impl: str, cfg: HuginnConfig, m: int, variant: str, calls: int):
    ss, es, w = stacked_inputs(cfg, m, calls)
    return (XlaRunner if impl == "xla" else TorchRunner)(ss, es, w, variant)


def ncu_child(spec: str) -> None:
    """Warm up, then ONE product inside the profiler range (ncu flushes L2 before it)."""
    impl, variant, m = spec.split(":")
    runner = make_runner(impl, config(), int(m), variant, 1)
    timing.wait(runner(), runner.sync)
    with ncu_lib.cuda_profiler_range():
        timing.wait(runner(), runner.sync)


def hbm_pass(impl: str, variant: str, m: int, ncu: str) -> dict:
    argv = [
        sys.executable,
        "-m",
        "experiments.adapter",
        f"--ncu_child={impl}:{variant}:{m}",
        f"--config={FLAGS.config}",
        f"--seed={FLAGS.seed}",
    ]
    with tempfile.TemporaryDirectory(prefix="adapter-ncu-") as out:
        text = ncu_lib.run_ncu(
            argv, ncu=ncu, log_file=str(Path(out) / "ncu.csv"), cache_control="all"
        )
    kernels = ncu_lib.parse_ncu_csv(text)
    return dataclasses.asdict(ncu_lib.summarize(kernels, 1)) | {
        "kernel_names": sorted({k.name for k in kernels})
    }


def config() -> HuginnConfig:
    try:
        return HuginnConfig.from_name(FLAGS.config)
    except ValueError as e:
        raise UserError(str(e)) from None


def parse_ms() -> list[int]:
    ms = cli.positive_ints("m", FLAGS.m)
    for name, allowed in (("variants", ("matmul", "concat")), ("impls", ("xla", "torch"))):
        for value in FLAGS[name].value:
            if value not in allowed:
                raise UserError(f"--{name}: unknown {value!r}; known: {', '.join(allowed)}")
    if FLAGS.calls < 1 or FLAGS.repeats < 1 or FLAGS.warmup < 0:
        raise UserError("--calls and --repeats must be >= 1, --warmup >= 0")
    return ms


def run(ms: list[int]) -> list[dict]:
    cfg = config()
    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    impls = list(FLAGS.impls)
    if "torch" in impls and not on_gpu:
        print("note: the torch adapter needs CUDA; skipped on this device")
        impls.remove("torch")
    ceiling = costs.get_device("h200_measured") if "H200" in device.device_kind else None
    ncu = ncu_lib.find_ncu() if FLAGS.hbm else None
    if FLAGS.hbm and (not on_gpu or ncu is None):
        print(ncu_lib.SKIP_LINE)
    records = []
    for m in ms:
        for variant in FLAGS.variants:
            est = estimate(cfg, m, variant)
            for impl in impls:
                runner = make_runner(impl, cfg, m, variant, FLAGS.calls)
                samples = timing.time_fn(
                    runner,
                    warmup=FLAGS.warmup,
                    repeats=FLAGS.repeats,
                    sync=runner.sync,
                    per_call=FLAGS.calls,
                )
                t = samples.median
                rec = {
                    "m": m,
                    "variant": variant,
                    "impl": impl,
                    "us_per_call": t * 1e6,
                    "samples": samples.to_dict(),
                    "estimate": dataclasses.asdict(est),
                    "gbps": est.hbm_bytes / t / 1e9,
                    "tflops": est.flops / t / 1e12,
                }
                if ceiling:
                    ideal, bound = est.roofline(ceiling)
                    rec.update(ideal_us=ideal * 1e6, bound=bound, pct_of_roofline=100 * ideal / t)
                if ncu and on_gpu and FLAGS.hbm:
                    try:
                        hbm = hbm_pass(impl, variant, m, ncu)
                        hbm["read_over_estimate"] = hbm["bytes_read_per_chain"] / est.hbm_read_bytes
                        rec["hbm"] = hbm
                    except (ncu_lib.NcuError, OSError) as e:
                        print(f"note: ncu for {impl} {variant} M={m} failed: {e}")
                records.append(rec)
    return records


def format_table(records: list[dict]) -> str:
    head = (
        f"{'M':>6} {'variant':<8}{'impl':<7}{'us/call':>9}{'ideal us':>9}{'bound':>8}"
        f"{'%roof':>7}{'GB/s':>7}{'TFLOP/s':>9}{'HBM rd/est':>11}"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        ratio = (r.get("hbm") or {}).get("read_over_estimate")
        lines.append(
            f"{r['m']:>6} {r['variant']:<8}{r['impl']:<7}{r['us_per_call']:>9.1f}"
            f"{r.get('ideal_us', float('nan')):>9.1f}{r.get('bound', '-'):>8}"
            f"{r.get('pct_of_roofline', float('nan')):>7.1f}{r['gbps']:>7.0f}{r['tflops']:>9.1f}"
            f"{(f'{ratio:.4f}' if ratio else '-'):>11}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise UserError(f"unexpected arguments: {' '.join(argv[1:])}")
    if FLAGS.ncu_child:
        ncu_child(FLAGS.ncu_child)
        return
    records = run(parse_ms())
    if FLAGS.json_out:
        names = "m variants impls config calls warmup repeats json_out hbm seed".split()
        path = results_lib.write_results(
            FLAGS.json_out, cli.flag_values(names), {"records": records}
        )
        print(f"results: {path}")
    print(format_table(records))


run_main = cli.main_runner("adapter", main)


if __name__ == "__main__":
    define_flags()
    app.run(run_main, flags_parser=cli.flags_parser("adapter"))
