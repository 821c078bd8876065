"""Why XLA's prefill GEMMs are slower than PyTorch's: the products of one Core prefill iteration.

    python -m experiments.kernels.prefill_gemm [--tokens=1024 --forms=x@w,torch_linear
        --gemm=cublas --xla_flags='--xla_gpu_autotune_level=0 ...']

A Core iteration at T tokens (batch 1) runs 17 products: the adapter [T, 2D] @ [2D, D], then per
layer (4) qkv [T, D] @ [D, 3D], proj [T, D] @ [D, D], fc [T, D] @ [D, 2F], mlp_proj [T, F] @
[F, D] (D, F: n_embd, intermediate_size of --config): 5 shapes. A row per shape and form, all
over the same bf16 x and w (bf16 output, float32 sums as the default dot gives):
  x@w           JAX, w stored [k, n]: `x @ w`, what the model runs
  x@wT          JAX, w stored [n, k] (PyTorch Linear's layout): `lax.dot_general` over both k axes
  torch_linear  `torch.nn.functional.linear(x, w)`, w [n, k]: what torch.compile's prefill calls
  torch_matmul  `x @ w` in PyTorch, w [k, n]
Each product is timed alone after --warmup calls: JAX by CUPTI's kernel time per call
(`experiments.measure.probes.device_time`: wall time of calls back to back where CUPTI sees
nothing, e.g. on a CPU), PyTorch by CUDA events around CALLS calls back to back
(`experiments.measure.device_time.torch_us`; wall time on a CPU); the median of --reps samples,
their min-max. huginn-0125's weights take 53 MiB (proj) to 361 MiB (fc), the H200's L2 60 MiB:
all but proj's exceed it alone, proj's with its input and output (and at T = 1024 the products
are compute-bound). TFLOP/s: 2 T k n / median; % GEMM: of the sustained bf16 GEMM ceiling
(results/<device>/ceilings.json or --ceilings; "-" without one); vs best: the other framework's
fastest median for the shape / this row's; rel err: Frobenius, against a float32 product of the
same inputs (beyond attention_bench.TOLERANCE: exit 1 once the results are written). Last, an
"iteration" row per form: each shape's median (min, max) times its count, summed.

Before JAX starts its backend, --gemm (huginn_jax.xla_flags.use_gemm), then the words of the
flag --xla_flags go into XLA_FLAGS (each replacing one of the same name); the JSON's environment
records the final XLA_FLAGS. Run it once per flag set (e.g. --xla_flags=--xla_gpu_autotune_level=0)
to see which closes the gap to PyTorch. PyTorch rows need torch (a note when it is absent).
On a CPU the flags not given take CPU_DEFAULTS (one line says which); Ctrl-C or SIGTERM writes
the rows measured so far, marked "complete": false.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402

from experiments import attention_bench as bench  # noqa: E402
from experiments import cli, program  # noqa: E402
from experiments.cli import UserError  # noqa: E402
from experiments.measure import compare, memory, probes, timing  # noqa: E402
from experiments.measure.device_time import torch_us  # noqa: E402
from huginn_jax import xla_flags  # noqa: E402
from huginn_jax.config import PRESETS, HuginnConfig  # noqa: E402

FLAGS = flags.FLAGS
PROGRAM = "prefill_gemm"
FORMS = ("x@w", "x@wT", "torch_linear", "torch_matmul")
WEIGHT = {"x@w": "w", "x@wT": "wt", "torch_linear": "wt", "torch_matmul": "w"}  # its layout
CASE_KEYS = ("shape",)
CALLS = 5  # calls per timed sample (PyTorch's events; JAX's wall time where CUPTI sees nothing)
# On a CPU, for the flags not given: the small preset, a short prefill, a few samples.
CPU_DEFAULTS = {"config": "small", "tokens": 64, "reps": 3, "warmup": 1}


def define_flags() -> None:
    flags.DEFINE_integer("tokens", 1024, "Prefill tokens T, the rows of every product (CPU: 64).")
    flags.DEFINE_string("config", "huginn_0125", f"Preset ({', '.join(PRESETS)}; CPU: small).")
    flags.DEFINE_list("forms", list(FORMS), f"Any of {', '.join(FORMS)}.")
    flags.DEFINE_integer("reps", 20, "Timed samples per row; the median is reported (CPU: 3).")
    flags.DEFINE_integer("warmup", 3, "Untimed calls before a row's samples (CPU: 1).")
    flags.DEFINE_string("json_out", "out/prefill_gemm.json", "Results JSON ('' to skip).")
    flags.DEFINE_string(
        "xla_flags", "", "XLA flags added to XLA_FLAGS before the backend starts, e.g. "
        "'--xla_gpu_enable_cublaslt=true --xla_gpu_autotune_level=0'."
    )  # fmt: skip
    flags.DEFINE_enum(
        "gemm", "cublas", list(xla_flags.GEMM_CHOICES), "XLA's dots: cublas (no Triton) or xla."
    )
    flags.DEFINE_string("ceilings", "", "Ceilings JSON ('': the device's default file).")


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    k: int
    n: int
    count: int  # products of this shape in one Core iteration


def shapes(cfg: HuginnConfig) -> list[Shape]:
    """The distinct products of one Core iteration, in its order, with their multiplicities."""
    d, f, layers = cfg.n_embd, cfg.intermediate_size, cfg.n_core
    return [
        Shape("adapter", 2 * d, d, 1),
        Shape("qkv", d, 3 * d, layers),
        Shape("proj", d, d, layers),
        Shape("fc", d, 2 * f, layers),
        Shape("mlp_proj", f, d, layers),
    ]


@jax.jit
def x_at_w(x, w):
    """w [k, n], as the model stores it."""
    return x @ w


@jax.jit
def x_at_wt(x, wt):
    """w stored [n, k], as PyTorch's Linear stores it: both contracted on their last axis."""
    return jax.lax.dot_general(x, wt, (((1,), (1,)), ((), ())))


JAX_FORMS = {"x@w": x_at_w, "x@wT": x_at_wt}


@jax.jit
def reference(x, w):
    """x @ w in float32 from the same bf16 values (exact products, float32 sums)."""
    return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")


def check_flags() -> tuple[HuginnConfig, list[str]]:
    """The config and forms; UserError for any flag value that cannot be measured."""
    forms = cli.names_in("forms", FLAGS.forms, FORMS, noun="form")
    for name, least in (("tokens", 1), ("reps", 1), ("warmup", 0)):
        if FLAGS[name].value < least:
            raise UserError(f"--{name}={FLAGS[name].value}: must be >= {least}")
    try:
        return HuginnConfig.from_name(FLAGS.config), forms
    except ValueError as e:
        raise UserError(f"--config: {e}") from None


def bytes_needed(cfg: HuginnConfig, tokens: int) -> tuple[int, int]:
    """(device, host) bytes of the largest shape: x, w, w.T, outputs (bf16), x, w, the reference
    (float32); on the host the reference, an output and their difference (float64)."""
    t, all_shapes = tokens, shapes(cfg)
    device = max(6 * t * s.k + 8 * s.k * s.n + 6 * t * s.n for s in all_shapes)
    return device, max(24 * t * s.n for s in all_shapes)


def prepare(shape: Shape) -> dict:
    """Random bf16 x [T, k], w [k, n] (std 1 / sqrt(k)), wt = w.T stored [n, k], and the float32
    reference on the host as float64."""
    kx, kw = jax.random.split(jax.random.fold_in(jax.random.key(0), shape.k * 7 + shape.n))
    x = jax.random.normal(kx, (FLAGS.tokens, shape.k), jnp.bfloat16)
    w = jax.random.normal(kw, (shape.k, shape.n), jnp.bfloat16) * jnp.bfloat16(shape.k**-0.5)
    wt = jnp.transpose(w)  # a new [n, k] array, row-major
    ref = np.asarray(reference(x, w), np.float64)
    return jax.block_until_ready({"x": x, "w": w, "wt": wt, "ref": ref})


def on_host(out) -> np.ndarray:
    """A JAX or torch output as float64 numpy."""
    if isinstance(out, jax.Array):
        return np.asarray(out.astype(jnp.float32), np.float64)
    return out.float().cpu().numpy().astype(np.float64)


def time_torch(form: str, x, w) -> tuple[np.ndarray, list[float], dict]:
    """A PyTorch form over torch views of the JAX arrays (no copy): its output, its samples, how
    they were taken, and whether cuBLAS may sum bf16 in bf16 (e.g. split-K; torch's default)."""
    import torch

    x, w = torch.from_dlpack(x), torch.from_dlpack(w)
    fn = (lambda: torch.nn.functional.linear(x, w)) if form == "torch_linear" else (lambda: x @ w)
    out = on_host(fn())
    samples = torch_us(fn, FLAGS.reps, warmup=FLAGS.warmup, calls=CALLS, cuda=x.is_cuda)
    kind = "CUDA events around" if x.is_cuda else "wall time of"
    reduced = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    how = f"{kind} {CALLS} calls back to back, per call, median of {FLAGS.reps}"
    return out, samples, dict(method=how, bf16_reduced_precision=reduced)


def time_jax(form: str, x, w) -> tuple[np.ndarray, list[float], dict]:
    """A JAX form: its output, its samples (CUPTI, or wall time) and how they were taken."""
    fn = JAX_FORMS[form]
    out = on_host(fn(x, w))
    for _ in range(FLAGS.warmup):
        jax.block_until_ready(fn(x, w))
    timed = probes.device_time(fn, (x, w), FLAGS.reps, wall_calls=CALLS)
    how = dict(method=timed.describe(), kernels=timed.kernels, note=timed.note)
    return out, timed.samples_us, how


def measure(shape: Shape, form: str, inputs: dict, ceiling: float | None) -> dict:
    """One row: the form's samples, rate and error (or "error" when it failed)."""
    row = dict(shape=shape.name, k=shape.k, n=shape.n, count=shape.count, impl=form)
    timer = time_torch if compare.framework(form) == "torch" else time_jax
    try:
        out, samples, how = timer(form, inputs["x"], inputs[WEIGHT[form]])
    except Exception as e:  # e.g. out of memory: the other rows still run
        message = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        print(f"note: {shape.name} {form} failed: {message}")
        return {**row, "error": message}
    err = float(np.linalg.norm(out - inputs["ref"]) / np.linalg.norm(inputs["ref"]))
    row.update(how, us=float(np.median(samples)), us_min=min(samples), us_max=max(samples))
    row.update(samples_us=samples, rel_err_vs_f32=err, check_ok=bool(err <= bench.TOLERANCE))
    return with_rate(row, 2 * FLAGS.tokens * shape.k * shape.n, ceiling)


def with_rate(row: dict, flops: int, ceiling: float | None) -> dict:
    row.update(flops=flops, tflops=flops / row["us"] / 1e6)
    if ceiling:
        row["pct_of_gemm"] = 100 * flops / (row["us"] * 1e-6) / ceiling
    return row


def iteration_rows(rows: list[dict], shape_list: list[Shape], ceiling: float | None) -> list[dict]:
    """Per form with every shape measured: the iteration's products, each shape's median (min,
    max) times its count, summed."""
    out = []
    for form in dict.fromkeys(r["impl"] for r in rows):
        mine = {r["shape"]: r for r in rows if r["impl"] == form and "us" in r}
        if len(mine) < len(shape_list):
            continue
        total = {
            key: sum(s.count * mine[s.name][key] for s in shape_list)
            for key in ("us", "us_min", "us_max")
        }
        row = dict(shape="iteration", count=sum(s.count for s in shape_list), impl=form, **total)
        row["check_ok"] = all(r["check_ok"] for r in mine.values())
        flops = sum(s.count * 2 * FLAGS.tokens * s.k * s.n for s in shape_list)
        out.append(with_rate(row, flops, ceiling))
    return out


def run(cfg: HuginnConfig, forms: list[str], ceilings, records: list[dict]) -> None:
    """Every shape, then every form, then the iteration rows and "vs best"; into `records`."""
    ceiling = ceilings.bf16_flops_per_s if ceilings else None
    shape_list, forms = shapes(cfg), bench.runnable(forms, (), jax.devices()[0].platform == "gpu")

    def row(shape, form, inputs):
        return measure(shape, form, inputs, ceiling)

    bench.sweep(PROGRAM, shape_list, forms, prepare, row, records)
    records += iteration_rows(records, shape_list, ceiling)
    bench.add_vs_best(records, CASE_KEYS)


def format_table(records: list[dict]) -> str:
    width = max([len("form"), *(len(r["impl"]) for r in records)]) + 2
    head = (
        f"{'shape':<10}{'k':>6}{'n':>7}  {'form':<{width}}{'median':>10}{'min-max':>16}"
        f"{'TFLOP/s':>9}{'% GEMM':>8}{'vs best':>9}{'rel err':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        k, n = (r.get(key, "-") for key in ("k", "n"))
        start = f"{r['shape']:<10}{k:>6}{n:>7}  {r['impl']:<{width}}"
        if "error" in r:
            lines.append(f"{start}failed (see notes)")
            continue
        pct = f"{r['pct_of_gemm']:.1f}" if "pct_of_gemm" in r else "-"
        err = f"{r['rel_err_vs_f32']:.1e}" if "rel_err_vs_f32" in r else "-"
        lines.append(
            f"{start}{timing.format_us(r['us']):>10}"
            f"{timing.format_us_range(r['us_min'], r['us_max']):>16}{r['tflops']:>9.1f}{pct:>8}"
            f"{compare.format_vs_best(r.get('vs_best')):>9}{err:>9}"
        )
    lines.append("iteration: the sum of its products' times; % GEMM: of the bf16 GEMM ceiling")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    check_flags()  # the user's values, before the backend starts
    program.check_outputs(FLAGS.json_out)
    try:  # --gemm, then --xla_flags, before the backend starts
        xla_flags.use_gemm(FLAGS.gemm)
        xla_flags.add_flags(FLAGS.xla_flags)
    except (ValueError, RuntimeError) as e:
        raise UserError(f"--xla_flags: {e}") from None
    cpu_line = program.cpu_defaults(CPU_DEFAULTS)  # the backend starts here
    cfg, forms = check_flags()  # with the CPU's values
    memory.check_fits(
        f"--tokens={FLAGS.tokens}",
        f"the largest product of {FLAGS.config} and its float32 reference",
        *bytes_needed(cfg, FLAGS.tokens),
        hint="use fewer --tokens",
    )
    bench.measure_and_finish(
        PROGRAM,
        lambda records, ceilings: run(cfg, forms, ceilings, records),
        format_table,
        cpu_line=cpu_line,
        json_out=FLAGS.json_out,
        ceilings_path=FLAGS.ceilings,
        case_keys=CASE_KEYS,
    )


if __name__ == "__main__":
    program.run(PROGRAM, define_flags, main)
