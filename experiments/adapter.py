"""The study's Appendix A: the adapter [M, 2h] @ [2h, h] in decode (M = 1) and prefill (M = 1024).

    python -m experiments.adapter --m=1,1024 --hbm

For each M: time against the roofline (`huginn_jax.costs.matmul_cost` over the device's measured
ceilings, experiments/measure/ceilings.py), "vs best" (the other framework's fastest time for the
same case / this row's), and with `--hbm` the HBM bytes read per call with L2 flushed before it
(Nsight Compute's `--cache-control all`: in the Core, four layers run between two adapter calls)
against the estimate, which counts one access per tensor read or written.

Two variants, as in the study: `matmul` (x @ W alone) and `concat` (concat([s, e]) @ W, what the
Core runs; the estimate then adds the concatenation's reads and write). Timing: `calls` adapter
calls in one executable (XLA: `lax.fori_loop`, each product over its own input; PyTorch: the same
products in one CUDA graph), median per call over repeats; the 106 MiB weight of huginn-0125 is
larger than the H200's L2, so even warm calls read it from HBM. Implementations:
  xla            the products in one jitted `lax.fori_loop`
  torch_graph    the products in PyTorch eager, captured in one CUDA graph and replayed
  torch_compile  the same function through torch.compile (`--torch_compile_mode`), replayed from
                 a CUDA graph; compile time recorded apart (`compile_seconds`)
The first and last product of every row are checked against a float64 product on the host; a
row beyond attention_bench.TOLERANCE makes the program exit 1 after writing its results.
On a CPU the flags not given take the smaller values of CPU_DEFAULTS (one line says which, and
the JSON records them); a problem that cannot fit in memory is refused before anything is
allocated; Ctrl-C or SIGTERM writes the rows measured so far, marked "complete": false.
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
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402

from experiments import attention_bench as bench  # noqa: E402
from experiments import cli, program  # noqa: E402
from experiments.cli import UserError  # noqa: E402
from experiments.measure import compare, memory, timing  # noqa: E402
from experiments.measure import ncu as ncu_lib  # noqa: E402
from experiments.measure.ceilings import Ceilings  # noqa: E402
from huginn_jax import costs  # noqa: E402
from huginn_jax.config import PRESETS, HuginnConfig  # noqa: E402
from huginn_jax.layers import truncated_normal  # noqa: E402

FLAGS = flags.FLAGS
IMPLS = ("xla", *bench.TORCH_IMPLS)
VARIANTS = ("matmul", "concat")
CASE_KEYS = ("m", "variant")  # the fields of one case: its rows are compared in "vs best"
CHECKED = (0, -1)  # the products of a call checked against the float64 reference
# On a CPU, for the flags not given: a decode row and a short prefill, a few calls.
CPU_DEFAULTS = {"m": ["1", "16"], "calls": 2, "warmup": 1, "repeats": 3}


def define_flags() -> None:
    """Defines the flags; called only when this module runs as the program, so that tests
    and other programs can import it without clashing flag names."""
    flags.DEFINE_list(
        "m", ["1", "1024"], "Rows M, a list (1 = decode, 1024 = prefill at batch 1; CPU: 1,16)."
    )
    flags.DEFINE_list("variants", list(VARIANTS), "matmul (x @ W) and/or concat.")
    flags.DEFINE_list("impls", list(IMPLS), f"Any of {', '.join(IMPLS)}.")
    flags.DEFINE_enum(
        "torch_compile_mode", "default", bench.COMPILE_MODES, bench.TORCH_COMPILE_MODE_HELP
    )
    flags.DEFINE_string(
        "config", "huginn_0125", f"Preset whose adapter is measured ({', '.join(PRESETS)})."
    )
    flags.DEFINE_integer("calls", 20, "Adapter calls per timed executable / graph (CPU: 2).")
    flags.DEFINE_integer("warmup", 3, "Untimed repeats of a timed executable (CPU: 1).")
    flags.DEFINE_integer(
        "repeats", 20, "Timed repeats; the median time per call is reported (CPU: 3)."
    )
    flags.DEFINE_string("json_out", "out/adapter.json", "Results JSON ('' to skip).")
    flags.DEFINE_bool("hbm", False, "HBM bytes per call with L2 flushed (GPU + ncu).")
    flags.DEFINE_integer("seed", 0, "Seed of the weight and inputs.")
    flags.DEFINE_string(
        "ceilings", "", "Ceilings JSON the roofline uses ('': the device's default file)."
    )
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


def roofline(est: costs.OpCost, ceilings: Ceilings) -> tuple[float, str]:
    """Ideal seconds and what bounds them: the estimate's FLOPs at the bf16 GEMM rate or its
    bytes at the read-only streaming rate, whichever takes longer."""
    compute = est.flops / ceilings.bf16_flops_per_s
    memory = est.hbm_bytes / ceilings.read_bytes_per_s
    return max(compute, memory), "compute" if compute > memory else "memory"


def stacked_inputs(cfg: HuginnConfig, m: int, calls: int, seed: int):
    """W [2h, h] (reference init) and `calls` different states and embeddings [calls, M, h]."""
    keys = jax.random.split(jax.random.key(seed), 3)
    h = cfg.n_embd
    w = truncated_normal(keys[0], (2 * h, h), cfg.init_std, jnp.bfloat16)
    ss = jax.random.normal(keys[1], (calls, m, h), jnp.bfloat16)
    es = jax.random.normal(keys[2], (calls, m, h), jnp.bfloat16)
    return ss, es, w


def reference(ss, es, w) -> np.ndarray:
    """float64 products concat(s, e) @ W of the CHECKED calls on the host, [len(CHECKED), M, h]."""
    x = jnp.concatenate([ss[jnp.array(CHECKED)], es[jnp.array(CHECKED)]], axis=-1)
    x, w = (np.asarray(a.astype(jnp.float32), np.float64) for a in (x, w))
    return x @ w


def checked(out) -> np.ndarray:
    """The CHECKED products of a JAX [calls, M, h] or torch tuple output, float64."""
    if isinstance(out, jax.Array):
        return np.stack([np.asarray(out[i].astype(jnp.float32), np.float64) for i in CHECKED])
    return np.stack([out[i].float().cpu().numpy() for i in CHECKED]).astype(np.float64)


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


def torch_products(variant: str):
    """The products of one call in PyTorch, a tuple of [M, h] out (what torch_graph captures and
    torch_compile compiles). `matmul`: (xs, W) in; `concat`: (ss, es, W) in, each product over
    torch.cat([s, e]), as the Core runs it."""
    import torch

    def matmul(xs, w):
        return tuple(xs[i] @ w for i in range(xs.shape[0]))

    def concat(ss, es, w):
        return tuple(torch.cat([ss[i], es[i]], dim=-1) @ w for i in range(ss.shape[0]))

    return concat if variant == "concat" else matmul


def torch_args(variant: str, ss, es, w) -> tuple:
    """torch tensors over the JAX arrays (no copy); for `matmul`, xs = cat(s, e) made once."""
    import torch

    ss, es, w = (torch.from_dlpack(a) for a in (ss, es, w))
    return (ss, es, w) if variant == "concat" else (torch.cat([ss, es], dim=-1), w)


def make_runner(impl: str, variant: str, ss, es, w, compile_mode: str = "default"):
    if impl == "xla":
        return XlaRunner(ss, es, w, variant)
    args = torch_args(variant, ss, es, w)
    return bench.TorchRunner(impl, torch_products(variant), args, mode=compile_mode)


def ncu_child(spec: str) -> None:
    """Warm up, then ONE product inside the profiler range (ncu flushes L2 before it)."""
    impl, variant, m = spec.split(":")
    inputs = stacked_inputs(config(), int(m), 1, FLAGS.seed)
    runner = make_runner(impl, variant, *inputs, FLAGS.torch_compile_mode)
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
        f"--torch_compile_mode={FLAGS.torch_compile_mode}",
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
        raise UserError(f"--config: {e}") from None


def bytes_needed(cfg: HuginnConfig, m: int, calls: int) -> tuple[int, int]:
    """(device, host) bytes of the rows M: W [2h, h], and per call s, e [M, h], x = concat(s, e)
    [M, 2h] and the output [M, h], all bf16; on the host the float64 reference of the CHECKED
    calls (x in float32 and float64, the product, and the outputs it is compared with)."""
    h = cfg.n_embd
    device = 2 * (2 * h * h) + 2 * calls * m * (h + h + 2 * h + h)
    host = len(CHECKED) * m * (2 * h * (4 + 8) + h * 8 + h * 8)
    return device, host


def parse_ms() -> list[int]:
    """The rows M; UserError for any flag value that cannot be measured."""
    ms = cli.positive_ints("m", FLAGS.m)
    cli.names_in("variants", FLAGS.variants, VARIANTS)
    bench.known_impls(FLAGS.impls, IMPLS)
    for name, least in (("calls", 1), ("repeats", 1), ("warmup", 0)):
        if FLAGS[name].value < least:
            raise UserError(f"--{name}={FLAGS[name].value}: must be >= {least}")
    return ms


def run(ms: list[int], ceilings: Ceilings | None, records: list[dict] | None = None) -> list[dict]:
    """Every M, variant and runnable impl, in that order: one record each (`bench.time_one`),
    with the estimate's rates, the roofline (with ceilings) and the HBM bytes (with --hbm);
    appended to `records` as they are measured."""
    cfg = config()
    on_gpu = jax.devices()[0].platform == "gpu"
    impls = bench.runnable(bench.known_impls(FLAGS.impls, IMPLS), bench.TORCH_IMPLS, on_gpu)
    ncu = ncu_lib.find_ncu() if FLAGS.hbm else None
    if FLAGS.hbm and (not on_gpu or ncu is None):
        print(ncu_lib.SKIP_LINE)
    profile = bool(ncu and on_gpu and FLAGS.hbm)

    def prepare(m: int):
        ss, es, w = stacked_inputs(cfg, m, FLAGS.calls, FLAGS.seed)
        return ss, es, w, reference(ss, es, w)

    def measure(m: int, variant_impl: tuple[str, str], prepared) -> dict:
        variant, impl = variant_impl
        ss, es, w, ref = prepared
        est = estimate(cfg, m, variant)
        rec = bench.time_one(
            {"impl": impl, "m": m, "variant": variant},
            functools.partial(make_runner, impl, variant, ss, es, w, FLAGS.torch_compile_mode),
            checked,
            ref,
            per_call=FLAGS.calls,
            warmup=FLAGS.warmup,
            repeats=FLAGS.repeats,
        )
        if "error" in rec:
            return rec
        t = rec["us"] / 1e6
        rec.update(
            estimate=dataclasses.asdict(est),
            gbps=est.hbm_bytes / t / 1e9,
            tflops=est.flops / t / 1e12,
        )
        if ceilings:
            ideal, bound = roofline(est, ceilings)
            rec.update(ideal_us=ideal * 1e6, bound=bound, pct_of_roofline=100 * ideal / t)
        if profile:
            try:
                hbm = hbm_pass(impl, variant, m, ncu)
                hbm["read_over_estimate"] = hbm["bytes_read_per_chain"] / est.hbm_read_bytes
                rec["hbm"] = hbm
            except (ncu_lib.NcuError, OSError) as e:
                print(f"note: ncu for {impl} {variant} M={m} failed: {e}")
        return rec

    variant_impls = [(v, i) for v in dict.fromkeys(FLAGS.variants) for i in impls]
    records = bench.sweep("adapter", ms, variant_impls, prepare, measure, records)
    bench.add_vs_best(records, CASE_KEYS)
    return records


def format_table(records: list[dict]) -> str:
    """One row per record; "-" where a value does not apply (no ceilings, no rival, no ncu)."""
    width = max([len("impl"), *(len(r["impl"]) for r in records)]) + 1
    head = (
        f"{'M':>6} {'variant':<8}{'impl':<{width}}{'time/call':>10}{'ideal':>10}{'bound':>8}"
        f"{'%roof':>7}{'GB/s':>7}{'TFLOP/s':>9}{'vs best':>8}{'compile s':>10}{'rel err':>9}"
        f"{'HBM rd/est':>11}"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        if "error" in r:
            lines.append(f"{r['m']:>6} {r['variant']:<8}{r['impl']:<{width}}failed (see notes)")
            continue
        ratio = (r.get("hbm") or {}).get("read_over_estimate")
        ideal = timing.format_us(r.get("ideal_us"))
        pct = f"{r['pct_of_roofline']:.1f}" if "pct_of_roofline" in r else "-"
        lines.append(
            f"{r['m']:>6} {r['variant']:<8}{r['impl']:<{width}}{timing.format_us(r['us']):>10}"
            f"{ideal:>10}"
            f"{r.get('bound', '-'):>8}{pct:>7}{r['gbps']:>7.0f}{r['tflops']:>9.1f}"
            f"{compare.format_vs_best(r.get('vs_best')):>8}{bench.compile_cell(r):>10}"
            f"{r['rel_err_vs_f64']:>9.1e}{(f'{ratio:.4f}' if ratio else '-'):>11}"
        )
    lines.append(
        "time/call: median per adapter call; ideal: the estimate's roofline time, bound by "
        "compute or memory (%roof = ideal / time); GB/s, TFLOP/s over the estimate; HBM rd/est: "
        "bytes read (ncu, --hbm) / estimated; -: not measured (no ceilings, no rival, no --hbm)"
    )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if FLAGS.ncu_child:
        ncu_child(FLAGS.ncu_child)
        return
    parse_ms(), config()  # the user's values, before the backend starts
    program.check_outputs(FLAGS.json_out)
    cpu_line = program.cpu_defaults(CPU_DEFAULTS)
    ms, cfg = parse_ms(), config()  # with the CPU's values
    memory.check_fits(
        f"--m={max(ms)}",
        f"{FLAGS.calls} products [M, {2 * cfg.n_embd}] @ [{2 * cfg.n_embd}, {cfg.n_embd}]",
        *bytes_needed(cfg, max(ms), FLAGS.calls),
        hint="use a smaller --m or fewer --calls",
    )
    bench.measure_and_finish(
        "adapter",
        lambda records, ceilings: run(ms, ceilings, records),
        format_table,
        cpu_line=cpu_line,
        json_out=FLAGS.json_out,
        ceilings_path=FLAGS.ceilings,
        case_keys=CASE_KEYS,
    )


if __name__ == "__main__":
    program.run("adapter", define_flags, main)
