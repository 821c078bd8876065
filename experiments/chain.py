"""Do shared weights reduce HBM traffic? A chain of dependent products, timed per framework.

`steps` dependent products x <- x @ W_i, x [batch, d], W_i [d, d]. Layout "shared": one
allocation used at every step; layout "copies": `steps` distinct allocations holding identical
values. The two layouts must give bit-identical outputs; implementations must agree with a
float32 numpy reference within the dtype's rounding, after one chain and after one call's chains.

    python -m experiments.chain --size=8MiB,72MiB,288MiB --hbm --trace_dir=out/trace

Implementations (`--impls` takes these names or the families "xla" and "torch"; each framework
runs in its fastest known form, so that the "vs best" column compares best with best):
  xla            the chain jitted once, plain `x @ w` in the chain's dtype (the dot accumulates
                 in float32 inside, as cuBLAS does for PyTorch); one dispatch per chain
  xla_loop       N = --chains_per_call chains in one executable (fori_loop, output fed back)
  xla_nocb       as xla, command buffers (CUDA graphs) off; run in a child process (GPU only)
  xla_loop_nocb  as xla_loop, command buffers off (GPU only)
  xla_f32dot, xla_loop_f32dot  as xla, xla_loop, but each product a dot with a float32 result,
                 then a cast to the chain's dtype: the same math, yet XLA picks other kernels
                 for it (see the kernels per chain with --trace_dir); only when named
  xla_loop_unrolled  as xla_loop, but the N chains unrolled in Python inside the jitted function
                 (no while loop), to see what the loop costs; N is capped so that one call holds
                 at most UNROLLED_MAX_PRODUCTS products (compile time grows faster than N); only
                 when named
  torch_eager    PyTorch, one chain per call (CUDA only)
  torch_graph    PyTorch, one captured chain replayed N times per call (CUDA only)
  torch_compile  torch.compile (--torch_compile_mode), replayed as torch_graph (CUDA only)
  pallas         the resident persistent Pallas kernel (pallas_kernels.looped_matmul): all
                 steps of a chain in one launch, N chains per call as xla_loop; copies: the
                 step weights stacked [steps, d, d] (GPU, sm_90)
  pallas_splitk  the split-K persistent kernel (weight in registers + shared memory + L2; the
                 package's default); copies: the stacked resident kernel, as `pallas`
  pallas_splitk_nocb  as pallas_splitk, command buffers off (GPU only)

N chains per call (--chains_per_call) spread a call's fixed cost over N chains: a JAX call
dispatches, copies its inputs and is waited for once; PyTorch's graph replay costs less.
--gemm=cublas turns XLA's Triton GEMMs off (every dot in cuBLAS), in this process and its
children. The floor columns use the read-only streaming rate the project measured on the device
(experiments.measure.ceilings); a device without one gets no floor. A failed check makes the
program exit with status 1 after the results are written.

Data path, one function per arrow: size string -> d (`parse_size`, `dim_for_size`) -> weights
(`host_values`, `make_weights`) -> one jitted chain per implementation (`xla_runner`,
`torch_ref.chain.runner`) -> timing helper (`measure.timing.time_fn`) -> optional ncu / trace
pass (`hbm_pass`, `trace_pass`) -> results JSON -> checks, table (`chain_report`) and plot.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from absl import app, flags, logging

from experiments import cli
from experiments.chain_report import (
    ChainTrace,
    Outputs,
    add_checks,
    add_vs_best,
    failed_checks,
    format_table,
    format_traces,
    size_label,
)
from experiments.cli import UserError
from experiments.measure import ceilings as ceilings_lib
from experiments.measure import ncu as ncu_lib
from experiments.measure import results as results_lib
from experiments.measure import timing
from experiments.measure import trace as trace_lib
from experiments.torch_ref import chain as torch_chain
from huginn_jax.xla_flags import COMMAND_BUFFERS_OFF, GEMM_CHOICES, use_gemm

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Defines the flags; called only when this module runs as the program, so that tests
    and other programs can import it without clashing flag names."""
    flags.DEFINE_string(
        "size", "72MiB", "Weight size W: one value or a comma list (B, KiB, MiB, GiB)."
    )
    flags.DEFINE_integer("d", None, "Set d directly (W = d*d*dtype bytes); overrides --size.")
    flags.DEFINE_integer("steps", 8, "Dependent products per chain.")
    flags.DEFINE_integer("batch", 1, "Rows of the state x [batch, d].")
    flags.DEFINE_string("dtype", "bf16", "bf16, fp16 (float16) or fp32 (float32).")
    flags.DEFINE_list("layouts", ["shared", "copies"], "Weight layouts: shared, copies.")
    flags.DEFINE_list(
        "impls",
        ["xla", "torch", "pallas", "pallas_splitk"],
        "Implementations or families (see module doc); the Pallas kernels need a GPU (sm_90).",
    )
    flags.DEFINE_integer("warmup", 10, "Untimed calls before timing (fewer on CPU unless given).")
    flags.DEFINE_integer("repeats", 50, "Timed calls; the median is reported (fewer on CPU).")
    flags.DEFINE_integer(
        "chains_per_call",
        100,
        "N: chains per call of xla_loop, torch_graph and the Pallas impls; spreads a call's fixed "
        "cost (dispatch, input copies, the wait) over N chains.",
    )
    flags.DEFINE_integer("ncu_chains", 100, "Chains inside each range that --hbm profiles.")
    flags.DEFINE_integer("ncu_timeout", 300, "Seconds an --hbm child may run under ncu.")
    flags.DEFINE_string("json_out", "out/chain.json", "Results JSON ('' to skip).")
    flags.DEFINE_string("plot_out", "out/chain.png", "Plot drawn from the JSON ('' to skip).")
    flags.DEFINE_bool("hbm", False, "Also measure HBM bytes and L2 hit rate with Nsight Compute.")
    flags.DEFINE_string(
        "trace_dir", None, "Write profiler traces here and print kernel breakdowns."
    )
    flags.DEFINE_integer("seed", 0, "Seed of the random weights and state.")
    flags.DEFINE_enum(
        "gemm",
        "xla",
        list(GEMM_CHOICES),
        "Dots of the XLA impls: xla (XLA's own choice) or cublas (Triton GEMMs off).",
    )
    flags.DEFINE_enum(
        "torch_compile_mode",
        "default",
        list(torch_chain.COMPILE_MODES),
        "torch.compile mode of torch_compile.",
    )
    flags.DEFINE_string(
        "ceilings",
        "",
        "Ceilings JSON for the floor columns; '' = results/<device>/ceilings.json if it exists.",
    )
    flags.DEFINE_enum("child", None, ["timing", "ncu", "trace"], "Internal: run as a child.")
    flags.DEFINE_string("child_out", None, "Internal: directory where a child writes its results.")


# XLA impl (without _nocb) -> (form of one product, how a call repeats the chain).
XLA_FORMS = {
    "xla": ("plain", "once"),
    "xla_loop": ("plain", "loop"),
    "xla_f32dot": ("f32dot", "once"),
    "xla_loop_f32dot": ("f32dot", "loop"),
    "xla_loop_unrolled": ("plain", "unrolled"),
}
XLA_FAMILY = ("xla", "xla_loop", "xla_nocb", "xla_loop_nocb")
XLA_IMPLS = XLA_FAMILY + ("xla_f32dot", "xla_loop_f32dot", "xla_loop_unrolled")
PALLAS_IMPLS = ("pallas", "pallas_splitk", "pallas_splitk_nocb")
FAMILIES = {"xla": XLA_FAMILY, "torch": torch_chain.IMPLS}
KNOWN_IMPLS = XLA_IMPLS + torch_chain.IMPLS + PALLAS_IMPLS
# xla_loop_unrolled: at most this many products (chains x steps) in one call; the compile time
# of the unrolled function grows faster than linearly with them.
UNROLLED_MAX_PRODUCTS = 800
# Impls whose two layouts run different kernels: no bit-identity check between them.
_SPLITK_NOT_COMPARABLE = (
    "copies run the resident kernel; split-K also adds its partial sums in a run-dependent "
    "order (TMA reduce-add)"
)
LAYOUTS_NOT_COMPARABLE = {
    "pallas_splitk": _SPLITK_NOT_COMPARABLE,
    "pallas_splitk_nocb": _SPLITK_NOT_COMPARABLE,
}
LAYOUTS = ("shared", "copies")
DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float32": "float32",
}
CPU_DEFAULTS = {"warmup": 2, "repeats": 5, "chains_per_call": 4}
WORKSPACE_BYTES = 256 * 2**20  # state, outputs, cuBLAS workspace, compiled code
_UNITS = {
    "": 1,
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*([+-]?\d+(?:\.\d*)?|[+-]?\.\d+)\s*([a-zA-Z]*)\s*$")
REPO_ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- size string -> d


def parse_size(text: str) -> int:
    """'72MiB' -> 75497472 bytes. Units B, KiB, MiB, GiB, TiB (binary) and KB, MB, GB, TB
    (decimal), case-insensitive; a bare number is bytes. Raises ValueError unless > 0."""
    match = _SIZE_RE.match(text or "")
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"invalid size {text!r}: expected a number and a unit among B, KiB, MiB, GiB, TiB, "
            "KB, MB, GB, TB (e.g. 72MiB)"
        )
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not value > 0:
        raise ValueError(f"invalid size {text!r}: must be positive")
    return round(value)


def parse_sizes(text: str) -> list[int]:
    """A comma list of sizes, each as `parse_size`."""
    parts = [p for p in (text or "").split(",")]
    return [parse_size(p) for p in parts]


def dim_for_size(size_bytes: int, dtype_bytes: int = 2, multiple: int = 64) -> int:
    """d such that d*d*dtype_bytes ~ size: sqrt(size / dtype_bytes) rounded to the nearest
    multiple of `multiple` (8 MiB -> 2048, 72 MiB -> 6144, 288 MiB -> 12288 in bf16)."""
    d = round(math.sqrt(size_bytes / dtype_bytes) / multiple) * multiple
    if d <= 0:
        smallest = (multiple / 2) ** 2 * dtype_bytes
        raise ValueError(
            f"size {size_bytes} B is too small: d rounds to 0 (need >= {smallest:g} B)"
        )
    return d


def _np_dtype(name: str) -> np.dtype:
    """numpy dtype of a name; bfloat16 is ml_dtypes' (the one JAX uses)."""
    import jax.numpy as jnp

    return np.dtype(jnp.dtype(name))


@dataclasses.dataclass(frozen=True)
class ChainConfig:
    """One chain problem. W = d*d*dtype bytes; x [batch, d]."""

    d: int
    steps: int
    batch: int
    dtype: str  # numpy/jax name: bfloat16, float16, float32
    seed: int
    size_bytes: int  # what the user asked for; W is what d gives

    @property
    def dtype_bytes(self) -> int:
        return np.dtype(self.np_dtype).itemsize

    @property
    def np_dtype(self) -> Any:
        return _np_dtype(self.dtype)

    @property
    def weight_bytes(self) -> int:
        return self.d * self.d * self.dtype_bytes


# ---------------------------------------------------------------- d -> weights


def host_values(cfg: ChainConfig) -> tuple[np.ndarray, np.ndarray]:
    """x [batch, d] and W [d, d] as numpy arrays of cfg's dtype, N(0, 1/d) so that |x| stays
    O(1) along the chain; the same seed gives the same values in every process."""
    rng = np.random.default_rng(cfg.seed)
    scale = np.float32(1.0 / math.sqrt(cfg.d))
    w = (rng.standard_normal((cfg.d, cfg.d), dtype=np.float32) * scale).astype(cfg.np_dtype)
    x = rng.standard_normal((cfg.batch, cfg.d), dtype=np.float32).astype(cfg.np_dtype)
    return x, w


def make_weights(w_host: np.ndarray, steps: int, layout: str) -> list[Any]:
    """`steps` JAX arrays [d, d]. shared: the same array object at every step (one buffer);
    copies: `steps` distinct device buffers with identical values. They reach the jitted chain
    as separate arguments, never as constants, so XLA cannot fold the copies into one."""
    import jax
    import jax.numpy as jnp

    w = jax.device_put(w_host)
    if layout == "shared":
        ws = [w] * steps
    elif layout == "copies":
        # device_put may alias host memory on CPU; jnp.array(copy=True) makes a new buffer.
        ws = [jnp.array(w, copy=True) for _ in range(steps)]
    else:
        raise ValueError(f"unknown layout {layout!r}")
    return jax.block_until_ready(ws)


def buffer_pointers(ws: Sequence[Any]) -> list[int]:
    """Device addresses of JAX arrays (to check that copies are distinct buffers)."""
    return [w.unsafe_buffer_pointer() for w in ws]


# ---------------------------------------------------------------- weights -> jitted chains


def _precision(x: Any) -> Any:
    """fp32 chains ask for true fp32 products: the default on GPUs may use TF32."""
    import jax
    import jax.numpy as jnp

    return jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None


def chain_fn(x: Any, *ws: Any) -> Any:
    """x [batch, d] through every W in order, each product `x @ w` in x's dtype (the dot
    accumulates in float32 inside): the fastest form of the chain."""
    import jax.numpy as jnp

    for w in ws:
        x = jnp.dot(x, w, precision=_precision(x))
    return x


def chain_f32dot_fn(x: Any, *ws: Any) -> Any:
    """The same math as `chain_fn`, each product a dot with a float32 result, then a cast to
    x's dtype (xla_f32dot, xla_loop_f32dot): XLA compiles it to other kernels."""
    import jax.numpy as jnp

    dtype, precision = x.dtype, _precision(x)
    for w in ws:
        x = jnp.dot(x, w, preferred_element_type=jnp.float32, precision=precision).astype(dtype)
    return x


CHAIN_FORMS = {"plain": chain_fn, "f32dot": chain_f32dot_fn}


def _loop_fn(x: Any, *ws: Any, n: int, form: str = "plain") -> Any:
    """n chains in one executable; each chain's output is the next one's input, so no chain
    can be hoisted out of the loop."""
    import jax

    return jax.lax.fori_loop(0, n, lambda _, x: CHAIN_FORMS[form](x, *ws), x)


def _unrolled_fn(x: Any, *ws: Any, n: int, form: str = "plain") -> Any:
    """As `_loop_fn`, with the n chains unrolled into one straight-line program (no while)."""
    for _ in range(n):
        x = CHAIN_FORMS[form](x, *ws)
    return x


@dataclasses.dataclass
class Runner:
    """A prepared implementation: `fn()` runs `per_call` chains; `output()` gives float32
    [batch, d] after `chains_in_output` chains from the initial state, `one_chain()` after one
    chain; `compile_seconds`: the first call, where it compiled the chain (else None)."""

    fn: Callable[[], Any]
    per_call: int
    sync: Callable[[], None] | None
    output: Callable[[], np.ndarray]
    chains_in_output: int
    one_chain: Callable[[], np.ndarray]
    compile_seconds: float | None = None


@functools.cache
def _jitted(form: str, repeat: str) -> Any:
    """The jitted chain of one product form, repeated "once", in a "loop" or "unrolled"."""
    import jax

    if repeat == "once":
        return jax.jit(CHAIN_FORMS[form])
    fn = {"loop": _loop_fn, "unrolled": _unrolled_fn}[repeat]
    return jax.jit(functools.partial(fn, form=form), static_argnames="n")


def unrolled_chains(n: int, steps: int) -> int:
    """Chains per call of xla_loop_unrolled: n, capped at UNROLLED_MAX_PRODUCTS products."""
    return max(1, min(n, UNROLLED_MAX_PRODUCTS // steps))


def xla_runner(impl: str, x: Any, ws: Sequence[Any], *, n: int) -> Runner:
    """The XLA impls (XLA_FORMS): one chain per call ("once") or n chains per call in a
    fori_loop or unrolled (at most `unrolled_chains`). The _nocb variants differ only in the
    XLA_FLAGS of the process that runs them. The first call is timed: the compile time when
    it compiled (the other layout or size may have compiled the same executable before)."""
    import jax

    if impl.removesuffix("_nocb") not in XLA_FORMS:
        raise ValueError(f"unknown xla impl {impl!r}")
    form, repeat = XLA_FORMS[impl.removesuffix("_nocb")]
    f = _jitted(form, repeat)
    if repeat == "once":
        per_call = 1

        def call() -> Any:
            return f(x, *ws)

        def one() -> Any:
            return call()

    else:
        per_call = unrolled_chains(n, len(ws)) if repeat == "unrolled" else n

        def call() -> Any:
            return f(x, *ws, n=per_call)

        def one() -> Any:
            return f(x, *ws, n=1)

    cached = f._cache_size()
    t0 = time.perf_counter()
    jax.block_until_ready(call())
    first_call = time.perf_counter() - t0
    return Runner(
        fn=call,
        per_call=per_call,
        sync=None,
        output=lambda: np.asarray(call()).astype(np.float32),
        chains_in_output=per_call,
        one_chain=lambda: np.asarray(one()).astype(np.float32),
        compile_seconds=first_call if f._cache_size() > cached else None,  # None: compiled before
    )


# ---------------------------------------------------------------- flags -> options


@dataclasses.dataclass(frozen=True)
class Options:
    """Validated flag values of one run."""

    configs: tuple[ChainConfig, ...]
    layouts: tuple[str, ...]
    impls: tuple[str, ...]
    warmup: int
    repeats: int
    chains_per_call: int
    ncu_chains: int
    json_out: str
    plot_out: str
    hbm: bool
    trace_dir: str | None
    gemm: str = "xla"
    torch_compile_mode: str = "default"
    ceilings: str = ""  # a ceilings JSON, or "" for the device's default file


def expand_impls(names: Sequence[str], families: bool = True) -> tuple[str, ...]:
    """Family names ("xla", "torch") to their members; unknown names raise ValueError.
    families=False takes every name literally ("xla" is then the one-dispatch impl only)."""
    out: list[str] = []
    for name in names:
        name = name.strip()
        members = FAMILIES.get(name, (name,)) if families else (name,)
        for m in members:
            if m not in KNOWN_IMPLS:
                known = ", ".join((*FAMILIES, *KNOWN_IMPLS))
                raise ValueError(f"unknown impl {name!r}; known: {known}")
            if m not in out:
                out.append(m)
    if not out:
        raise ValueError("--impls is empty")
    return tuple(out)


def options_from_flags() -> Options:
    """Checks every flag (before any backend starts); raises UserError on the first bad one."""
    try:
        dtype = DTYPES[FLAGS.dtype.lower()]
    except KeyError:
        raise UserError(f"unknown --dtype={FLAGS.dtype!r}; use bf16, fp16 or fp32") from None
    for name in ("steps", "batch", "repeats", "chains_per_call", "ncu_chains", "ncu_timeout"):
        if FLAGS[name].value < 1:
            raise UserError(f"--{name} must be >= 1, got {FLAGS[name].value}")
    if FLAGS.warmup < 0:
        raise UserError(f"--warmup must be >= 0, got {FLAGS.warmup}")
    layouts = tuple(v.strip() for v in FLAGS.layouts)
    if not layouts or any(v not in LAYOUTS for v in layouts):
        raise UserError(f"--layouts must be a list of {', '.join(LAYOUTS)}; got {FLAGS.layouts}")
    try:
        # A child gets exact impl names from its parent.
        impls = expand_impls(FLAGS.impls, families=not FLAGS.child)
    except ValueError as e:
        raise UserError(str(e)) from None
    dtype_bytes = _np_dtype(dtype).itemsize
    if FLAGS.d is not None:
        if FLAGS.d < 1:
            raise UserError(f"--d must be >= 1, got {FLAGS.d}")
        sized = [(FLAGS.d * FLAGS.d * dtype_bytes, FLAGS.d)]
    else:
        try:
            sizes = parse_sizes(FLAGS.size)
            sized = [(s, dim_for_size(s, dtype_bytes)) for s in sizes]
        except ValueError as e:
            raise UserError(f"--size: {e}") from None
    configs = tuple(
        ChainConfig(
            d=d, steps=FLAGS.steps, batch=FLAGS.batch, dtype=dtype, seed=FLAGS.seed, size_bytes=s
        )
        for s, d in sized
    )
    return Options(
        configs=configs,
        layouts=layouts,
        impls=impls,
        json_out=FLAGS.json_out,
        plot_out=FLAGS.plot_out,
        hbm=FLAGS.hbm,
        trace_dir=FLAGS.trace_dir,
        ncu_chains=FLAGS.ncu_chains,
        warmup=FLAGS.warmup,
        repeats=FLAGS.repeats,
        chains_per_call=FLAGS.chains_per_call,
        gemm=FLAGS.gemm,
        torch_compile_mode=FLAGS.torch_compile_mode,
        ceilings=FLAGS.ceilings,
    )


def cpu_options(opts: Options, note: Callable[[str], None]) -> Options:
    """Fewer warm-ups, repeats and chains per call on CPU, for the flags the user did not give."""
    reduced = {
        k: v for k, v in CPU_DEFAULTS.items() if not FLAGS[k].present and getattr(opts, k) > v
    }
    if reduced:
        note(
            "CPU: using "
            + ", ".join(f"--{k}={v}" for k, v in reduced.items())
            + " (give the flags to override)"
        )
    return dataclasses.replace(opts, **reduced)


def check_memory(opts: Options, device: Any, holders: int) -> None:
    """Raises UserError, before anything is allocated, when the largest problem cannot fit.

    Device: `holders` processes/libraries may each hold steps*W of copies at once (the JAX
    pool, torch's cache, a child process), plus a workspace, against the JAX allocator's
    limit. Host: the numpy values (W in fp32 for generation and reference, W in the dtype),
    plus the device need when the device is the CPU."""
    copies = "copies" in opts.layouts
    worst = max(opts.configs, key=lambda c: c.weight_bytes)
    w = worst.weight_bytes
    device_need = holders * (worst.steps if copies else 1) * w + WORKSPACE_BYTES
    host_need = 2 * 4 * worst.d * worst.d + w
    gib = 2**30
    if device.platform == "cpu":
        host_need += device_need
    else:
        limit = results_lib.device_memory_bytes(device)
        if limit is not None and device_need > limit:
            raise UserError(
                f"W = {w / gib:.2f} GiB x {worst.steps if copies else 1} "
                f"({'copies' if copies else 'shared'}) x {holders} holder(s) needs "
                f"{device_need / gib:.1f} GiB of device memory; {device.device_kind} allows "
                f"{limit / gib:.1f} GiB: use a smaller --size, fewer --steps or --layouts=shared"
            )
    host = results_lib.host_memory_bytes()
    if host is not None and host_need > 0.9 * host:
        raise UserError(
            f"W = {w / gib:.2f} GiB needs {host_need / gib:.1f} GiB of host memory; this host "
            f"has {host / gib:.1f} GiB: use a smaller --size, fewer --steps or --layouts=shared"
        )


# ---------------------------------------------------------------- timing


def measure(runner: Any, opts: Options) -> tuple[timing.Samples, Outputs]:
    """Times a Runner (JAX or torch) with the one timing helper; returns the samples and the
    outputs after one call's chains and after one chain."""
    samples = timing.time_fn(
        runner.fn,
        warmup=opts.warmup,
        repeats=opts.repeats,
        sync=runner.sync,
        per_call=runner.per_call,
    )
    return samples, Outputs(runner.output(), runner.chains_in_output, runner.one_chain())


def load_ceilings(device_kind: str, path: str) -> ceilings_lib.Ceilings | None:
    """The device's measured ceilings (from `path`, or the device's default file when "");
    None when the project has none for it. A file that cannot be used is a UserError."""
    try:
        return ceilings_lib.for_device(device_kind, path or None)
    except ceilings_lib.CeilingsError as e:
        raise UserError(f"--ceilings: {e}") from None


def run_record(
    cfg: ChainConfig,
    layout: str,
    impl: str,
    samples: timing.Samples,
    bw: float | None,
    compile_seconds: float | None = None,
) -> dict[str, Any]:
    """One row of the results: samples, medians, GB/s, % of the HBM floors (`bw`: the measured
    read-only streaming rate in B/s, or None) and the first call's time."""
    s = samples.summary_us()
    w = cfg.weight_bytes
    t = samples.median
    rec: dict[str, Any] = {
        "size_bytes": cfg.size_bytes,
        "d": cfg.d,
        "weight_bytes": w,
        "layout": layout,
        "impl": impl,
        "chains_per_call": samples.per_call,
        **s,
        "gbps": cfg.steps * w / t / 1e9,
        # floor: the time to read W once, or steps*W, at the device's measured read rate
        "pct_floor_once": 100 * (w / bw) / t if bw else None,
        "pct_floor_steps": 100 * (cfg.steps * w / bw) / t if bw else None,
        "compile_seconds": compile_seconds,
        "samples": samples.to_dict(),
        "hbm": None,
    }
    return rec


# ---------------------------------------------------------------- child processes


def child_argv(
    cfg: ChainConfig,
    opts: Options,
    mode: str,
    layouts: Sequence[str],
    impls: Sequence[str],
    out_dir: str,
) -> list[str]:
    """The command line that re-runs this program as a child for one size."""
    return [
        sys.executable,
        "-m",
        "experiments.chain",
        f"--child={mode}",
        f"--child_out={out_dir}",
        f"--size={cfg.size_bytes}B",
        f"--d={cfg.d}",
        f"--steps={cfg.steps}",
        f"--batch={cfg.batch}",
        f"--dtype={cfg.dtype}",
        f"--seed={cfg.seed}",
        f"--layouts={','.join(layouts)}",
        f"--impls={','.join(impls)}",
        f"--warmup={opts.warmup}",
        f"--repeats={opts.repeats}",
        f"--chains_per_call={opts.chains_per_call}",
        f"--ncu_chains={opts.ncu_chains}",
        f"--gemm={opts.gemm}",
        f"--torch_compile_mode={opts.torch_compile_mode}",
        "--json_out=",
        "--plot_out=",
        *([f"--trace_dir={opts.trace_dir}"] if opts.trace_dir else []),
    ]


def child_env(impls: Sequence[str]) -> dict[str, str]:
    """Environment of a child: importable repo, no JAX preallocation (the parent holds memory
    too), and command buffers off for the _nocb impls (XLA reads XLA_FLAGS once, at start)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    if any(i.endswith("_nocb") for i in impls):
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {COMMAND_BUFFERS_OFF}".strip()
    return env


def run_timing_child(
    cfg: ChainConfig, opts: Options, impls: Sequence[str]
) -> dict[tuple[str, str], tuple[timing.Samples, Outputs, float | None]]:
    """Times the _nocb impls in a child process whose XLA_FLAGS turn command buffers off;
    per (layout, impl): samples, outputs (with the chains they went through), and the first
    call's seconds."""
    with tempfile.TemporaryDirectory(prefix="chain-child-") as out:
        argv = child_argv(cfg, opts, "timing", opts.layouts, impls, out)
        proc = subprocess.run(
            argv, env=child_env(impls), cwd=REPO_ROOT, capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            tail = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
            raise RuntimeError(f"timing child exited with {proc.returncode}: {tail}")
        data = results_lib.read_json(Path(out) / "child.json")
        return {
            (r["layout"], r["impl"]): (
                timing.Samples.from_dict(r["samples"]),
                Outputs(
                    np.load(Path(out) / r["output_file"]),
                    int(r["chains_in_output"]),
                    np.load(Path(out) / r["one_chain_file"]),
                ),
                r["compile_seconds"],
            )
            for r in data["runs"]
        }


def hbm_pass(
    cfg: ChainConfig, opts: Options, impls: Sequence[str], ncu: str
) -> dict[tuple[str, str], ncu_lib.HbmSummary]:
    """Re-runs every layout x impl in one child under ncu (application-range replay), each in
    its own profiler range; HBM bytes and L2 hit rate per chain for each."""
    with tempfile.TemporaryDirectory(prefix="chain-ncu-") as out:
        argv = child_argv(cfg, opts, "ncu", opts.layouts, impls, out)
        text = ncu_lib.run_ncu(
            argv,
            ncu=ncu,
            log_file=str(Path(out) / "ncu.csv"),
            env=child_env(impls),
            cwd=str(REPO_ROOT),
            timeout_s=FLAGS.ncu_timeout,
        )
        ranges = results_lib.read_json(Path(out) / "child.json")["ranges"]
        results = ncu_lib.parse_ncu_csv(text)
        if len(results) != len(ranges):
            raise ncu_lib.NcuError(f"ncu gave {len(results)} results for {len(ranges)} ranges")
        # One result per cuProfilerStart/Stop range, in the order the child opened them.
        return {
            (r["layout"], r["impl"]): ncu_lib.summarize([res], r["chains"])
            for r, res in zip(ranges, results, strict=True)
        }


def child_main(opts: Options) -> None:
    """--child=timing: time the given impls, write samples and outputs. --child=ncu: for each
    layout x impl, warm up, then run --ncu_chains chains inside their own cuProfilerStart/Stop
    range. Both write child.json."""
    out = Path(FLAGS.child_out)
    cfg = opts.configs[0]
    xla_flags = os.environ.get("XLA_FLAGS", "").split()
    if any(i.endswith("_nocb") for i in opts.impls) and COMMAND_BUFFERS_OFF not in xla_flags:
        raise UserError(f"_nocb impls need XLA_FLAGS to contain {COMMAND_BUFFERS_OFF}")
    x_host, w_host = host_values(cfg)
    runs, ranges, traces = [], [], []
    for layout in opts.layouts:
        for impl in opts.impls:
            if FLAGS.child == "trace":
                traced = trace_pass(cfg, opts, layout, impl, x_host, w_host)
                traces.append({"layout": layout, **traced.to_dict()})
                continue
            runner, release = build_runner(impl, layout, x_host, w_host, cfg, opts)
            if FLAGS.child == "timing":
                samples, outputs = measure(runner, opts)
                name = f"{layout}-{impl}"
                np.save(out / f"{name}.npy", outputs.y)
                np.save(out / f"{name}-one.npy", outputs.one_chain)
                runs.append(
                    {
                        "layout": layout,
                        "impl": impl,
                        "samples": samples.to_dict(),
                        "output_file": f"{name}.npy",
                        "one_chain_file": f"{name}-one.npy",
                        "chains_in_output": outputs.chains,
                        "compile_seconds": runner.compile_seconds,
                    }
                )
            else:
                chains = profile_range(runner, opts)
                ranges.append({"layout": layout, "impl": impl, "chains": chains})
            release()
    results_lib.write_json_atomic(
        out / "child.json", {"runs": runs, "ranges": ranges, "traces": traces}
    )


def profile_range(runner: Any, opts: Options) -> int:
    """Warm-up, then ceil(ncu_chains / per_call) calls inside the profiler range; returns the
    chains run inside it. GPU only."""
    for _ in range(max(opts.warmup, 1)):
        timing.wait(runner.fn(), runner.sync)
    calls = math.ceil(opts.ncu_chains / runner.per_call)
    with ncu_lib.cuda_profiler_range():
        for _ in range(calls):
            out = runner.fn()
        timing.wait(out, runner.sync)
    return calls * runner.per_call


def build_runner(
    impl: str, layout: str, x_host: np.ndarray, w_host: np.ndarray, cfg: ChainConfig, opts: Options
) -> tuple[Any, Callable[[], None]]:
    """Weights in `layout` and a Runner for `impl`; plus a function that frees the weights."""
    if impl in torch_chain.IMPLS:
        ws = torch_chain.make_weights(w_host, cfg.steps, layout, cfg.dtype)
        runner = torch_chain.runner(
            impl,
            x_host,
            ws,
            dtype_name=cfg.dtype,
            n=opts.chains_per_call,
            compile_mode=opts.torch_compile_mode,
        )

        def release() -> None:
            ws.clear()
            torch_chain.release()

        return runner, release
    import jax

    ws = make_weights(w_host, cfg.steps, layout)
    if impl in PALLAS_IMPLS:
        variant = "splitk" if impl.startswith("pallas_splitk") else "resident"
        runner = pallas_runner(jax.device_put(x_host), ws, layout, variant, n=opts.chains_per_call)
        return runner, ws.clear
    runner = xla_runner(impl, jax.device_put(x_host), ws, n=opts.chains_per_call)
    return runner, ws.clear


def pallas_runner(x: Any, ws: list[Any], layout: str, variant: str, *, n: int) -> Runner:
    """The persistent kernel, all steps of a chain in one launch; `n` chains per call, each
    chain's output the next one's input, in one executable (as xla_loop and torch_graph, so
    that no dispatch is timed). shared: w used at every step, kernel `variant` ("resident" or
    "splitk"); copies: the step weights stacked [steps, d, d] (one allocation holding `steps`
    distinct copies), always the resident kernel."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.looped_matmul import (
        DeviceInfo,
        looped_matmul,
        looped_matmul_copies,
        pick_any_config,
    )

    steps = len(ws)
    if layout == "shared":
        w = ws[0]
        config = pick_any_config(
            x.shape[0], w.shape[0], variant=variant, device=DeviceInfo.current()
        )

        def one_chain(y: Any, w: Any) -> Any:
            return looped_matmul(y, w, steps, config=config)

    else:
        w = jnp.stack(ws)
        ws.clear()  # the stack holds the copies now

        def one_chain(y: Any, w: Any) -> Any:
            return looped_matmul_copies(y, w)

    loop = jax.jit(lambda x, w: jax.lax.fori_loop(0, n, lambda _, y: one_chain(y, w), x))
    once = jax.jit(one_chain)

    def call() -> Any:
        return loop(x, w)

    return Runner(
        fn=call,
        per_call=n,
        sync=None,
        output=lambda: np.asarray(call()).astype(np.float32),
        chains_in_output=n,
        one_chain=lambda: np.asarray(once(x, w)).astype(np.float32),
    )


# ---------------------------------------------------------------- traces


def trace_pass(
    cfg: ChainConfig, opts: Options, layout: str, impl: str, x_host: np.ndarray, w_host: np.ndarray
) -> ChainTrace:
    """Profiler trace of about `chains_per_call` chains of `impl` (calls of `per_call` chains
    each), compiled and warmed up first; the per-kernel breakdown and the timeline."""
    base = Path(opts.trace_dir) / f"{size_label(cfg.weight_bytes)}-{layout}-{impl}"
    runner, release = build_runner(impl, layout, x_host, w_host, cfg, opts)
    calls = max(1, opts.chains_per_call // runner.per_call)
    chains = calls * runner.per_call
    for _ in range(max(opts.warmup, 1)):  # compile and autotune outside the trace
        timing.wait(runner.fn(), runner.sync)

    def run_all() -> None:
        for _ in range(calls):
            y = runner.fn()
        timing.wait(y, runner.sync)

    torch = impl in torch_chain.IMPLS
    try:
        rows, per_chain = trace_lib.trace_run(
            run_all, f"{base}.trace.json" if torch else base, torch=torch, units=chains
        )
    finally:
        release()
    return ChainTrace(rows, per_chain)


def run_trace_child(cfg: ChainConfig, opts: Options, impl: str) -> dict[str, ChainTrace]:
    """Traces `impl` for every layout in a child process: the torch profiler and JAX's both
    use CUPTI, and once torch's has run in a process, JAX's cannot subscribe there again."""
    with tempfile.TemporaryDirectory(prefix="chain-trace-") as out:
        argv = child_argv(cfg, opts, "trace", opts.layouts, [impl], out)
        proc = subprocess.run(
            argv, env=child_env([impl]), cwd=REPO_ROOT, capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            tail = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
            raise RuntimeError(f"trace child exited with {proc.returncode}: {tail}")
        traces = results_lib.read_json(Path(out) / "child.json")["traces"]
        return {t["layout"]: ChainTrace.from_dict(t) for t in traces}


# ---------------------------------------------------------------- main


def note_fn(notes: list[str]) -> Callable[[str], None]:
    from tqdm import tqdm

    def note(msg: str) -> None:
        notes.append(msg)
        tqdm.write(msg)

    return note


def select_impls(opts: Options, on_gpu: bool, note: Callable[[str], None]) -> tuple[str, ...]:
    """Drops what cannot run here, each with a one-line note."""
    impls = list(opts.impls)
    nocb = [i for i in impls if i.endswith("_nocb")]
    if nocb and not on_gpu:
        note(f"command buffers exist only on GPU; {', '.join(nocb)} skipped")
        impls = [i for i in impls if i not in nocb]
    pallas = [i for i in impls if i in PALLAS_IMPLS]
    if pallas and not (on_gpu and pallas_supported()):
        note(f"the Pallas kernels need a GPU with Mosaic GPU (sm_90); {', '.join(pallas)} skipped")
        impls = [i for i in impls if i not in pallas]
    torch_impls = [i for i in impls if i in torch_chain.IMPLS]
    if torch_impls:
        if not torch_chain.available():
            note(f"torch is not installed; {', '.join(torch_impls)} skipped")
            impls = [i for i in impls if i not in torch_impls]
        elif not on_gpu or not torch_chain.cuda_available():
            note(f"torch impls need a CUDA GPU; {', '.join(torch_impls)} skipped")
            impls = [i for i in impls if i not in torch_impls]
    return tuple(impls)


def pallas_supported() -> bool:
    from pallas_kernels.looped_matmul import device_supported

    return device_supported()


def run(opts: Options, notes: list[str], note: Callable[[str], None]) -> dict[str, Any]:
    """Every size x layout x impl: timing, checks, optional ncu and trace passes."""
    import jax
    from tqdm import tqdm

    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    ceilings = load_ceilings(device.device_kind, opts.ceilings)  # a bad file fails here
    impls = select_impls(opts, on_gpu, note)
    if not impls:
        raise UserError("no implementation can run here (see the notes above)")
    in_process = [i for i in impls if not i.endswith("_nocb")]
    nocb = [i for i in impls if i.endswith("_nocb")]
    ncu = ncu_lib.find_ncu() if opts.hbm and on_gpu else None
    if opts.hbm and ncu is None:
        note(ncu_lib.SKIP_LINE + ("" if on_gpu else " (no GPU here)"))
    holders = 1 + any(i in torch_chain.IMPLS for i in impls) + bool(nocb or ncu)
    check_memory(opts, device, holders)
    unrolled = unrolled_chains(opts.chains_per_call, opts.configs[0].steps)
    if "xla_loop_unrolled" in impls and unrolled < opts.chains_per_call:
        note(f"xla_loop_unrolled: {unrolled} chains per call ({UNROLLED_MAX_PRODUCTS} products)")

    env = results_lib.environment({k: FLAGS[k].value for k in _OWN_FLAGS})
    default_file = ceilings_lib.default_path(device.device_kind)
    env.update(
        ceilings=ceilings.to_dict() if ceilings else None,
        ceilings_source=ceilings.source if ceilings else f"none: no {default_file}",
    )
    bw = ceilings.read_bytes_per_s if ceilings else None
    data: dict[str, Any] = {
        "experiment": "chain",
        "config": {
            "steps": opts.configs[0].steps,
            "batch": opts.configs[0].batch,
            "dtype": opts.configs[0].dtype,
            "layouts": list(opts.layouts),
            "impls": list(impls),
            "warmup": opts.warmup,
            "repeats": opts.repeats,
            "chains_per_call": opts.chains_per_call,
            "ncu_chains": opts.ncu_chains,
            "sizes_bytes": [c.size_bytes for c in opts.configs],
            "gemm": opts.gemm,
            "torch_compile_mode": opts.torch_compile_mode,
        },
        "env": env,
        "runs": [],
        "checks": {"layouts": [], "agreement": [], "one_chain": []},
        "traces": [],
        "notes": notes,
    }
    total = len(opts.configs) * len(opts.layouts) * len(impls)
    bar = tqdm(total=total, disable=total <= 1, leave=False, desc="chain", file=sys.stderr)
    for cfg in opts.configs:
        x_host, w_host = host_values(cfg)
        outputs: dict[tuple[str, str], Outputs] = {}
        for layout in opts.layouts:
            for impl in in_process:
                bar.set_postfix_str(f"{size_label(cfg.weight_bytes)} {layout} {impl}")
                runner, release = build_runner(impl, layout, x_host, w_host, cfg, opts)
                samples, outputs[(layout, impl)] = measure(runner, opts)
                release()
                data["runs"].append(
                    run_record(cfg, layout, impl, samples, bw, runner.compile_seconds)
                )
                bar.update()
        if nocb:
            bar.set_postfix_str(f"{size_label(cfg.weight_bytes)} {', '.join(nocb)} (child)")
            try:
                child = run_timing_child(cfg, opts, nocb)
            except RuntimeError as e:
                note(f"{', '.join(nocb)} at W={cfg.weight_bytes} B: {e}")
                child = {}
            for (layout, impl), (samples, out, seconds) in sorted(
                child.items(), key=lambda item: item[0]
            ):
                data["runs"].append(run_record(cfg, layout, impl, samples, bw, seconds))
                outputs[(layout, impl)] = out
            bar.update(len(opts.layouts) * len(nocb))
        add_checks(data, cfg, x_host, w_host, outputs, LAYOUTS_NOT_COMPARABLE)
        add_vs_best(data["runs"])
        if ncu is not None:
            # Two children at most: default XLA flags, and command buffers off.
            for group in (in_process, nocb):
                if group:
                    bar.set_postfix_str(f"{size_label(cfg.weight_bytes)} ncu {', '.join(group)}")
                    add_hbm(data, cfg, opts, group, ncu, note)
        if opts.trace_dir:
            add_traces(data, cfg, trace_all(cfg, opts, impls, x_host, w_host, note), opts)
        if opts.json_out:  # what is done survives an interrupted sweep
            results_lib.write_json_atomic(opts.json_out, {**data, "complete": False})
    bar.close()
    data["complete"] = True
    return data


def add_hbm(
    data: dict[str, Any],
    cfg: ChainConfig,
    opts: Options,
    impls: Sequence[str],
    ncu: str,
    note: Callable[[str], None],
) -> None:
    """HBM bytes read per chain (in units of W) and L2 hit rate of `impls`, from one ncu child,
    into their run records of this size; a failed pass is a note."""
    try:
        summaries = hbm_pass(cfg, opts, impls, ncu)
    except (ncu_lib.NcuError, ValueError, OSError, subprocess.SubprocessError) as e:
        note(f"ncu at W={size_label(cfg.weight_bytes)} ({', '.join(impls)}): {e}")
        return
    for rec in data["runs"]:
        summary = summaries.get((rec["layout"], rec["impl"]))
        if rec["weight_bytes"] == cfg.weight_bytes and summary is not None:
            rec["hbm"] = {
                **dataclasses.asdict(summary),
                "read_x_w": summary.bytes_read_per_chain / cfg.weight_bytes,
            }


def trace_all(
    cfg: ChainConfig,
    opts: Options,
    impls: Sequence[str],
    x_host: np.ndarray,
    w_host: np.ndarray,
    note: Callable[[str], None],
) -> dict[str, dict[str, ChainTrace]]:
    """layout -> impl -> trace of every impl: in this process, or in a child for the _nocb
    impls (their XLA_FLAGS) and the torch impls (CUPTI, see `run_trace_child`)."""
    traced: dict[str, dict[str, ChainTrace]] = {layout: {} for layout in opts.layouts}
    for impl in impls:
        if impl.endswith("_nocb") or impl in torch_chain.IMPLS:
            try:
                for layout, one in run_trace_child(cfg, opts, impl).items():
                    traced[layout][impl] = one
            except RuntimeError as e:
                note(f"trace of {impl} at W={size_label(cfg.weight_bytes)}: {e}")
            continue
        for layout in opts.layouts:
            traced[layout][impl] = trace_pass(cfg, opts, layout, impl, x_host, w_host)
    for layout, by_impl in traced.items():
        for impl, one in by_impl.items():
            if not one.rows:
                note(f"trace of {impl} {layout}: the profiler recorded no kernels")
    return traced


def add_traces(
    data: dict[str, Any], cfg: ChainConfig, traced: dict[str, dict[str, ChainTrace]], opts: Options
) -> None:
    """Prints the kernels per chain of every traced impl and adds the traces to the results."""
    from tqdm import tqdm

    for layout, by_impl in traced.items():
        tqdm.write(format_traces(cfg.weight_bytes, layout, by_impl, opts.chains_per_call))
        data["traces"].extend(
            {"weight_bytes": cfg.weight_bytes, "layout": layout, "impl": impl, **t.to_dict()}
            for impl, t in by_impl.items()
        )


_OWN_FLAGS = (
    "size d steps batch dtype layouts impls warmup repeats chains_per_call ncu_chains ncu_timeout "
    "json_out plot_out hbm trace_dir seed gemm torch_compile_mode ceilings"
).split()


def main(argv: Sequence[str]) -> None:
    # Before the JAX backend starts: the parent, torch and child processes share the GPU.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # keep backend and profiler INFO lines off stderr
    try:
        if len(argv) > 1:
            raise UserError(f"unexpected arguments: {' '.join(argv[1:])}")
        opts = options_from_flags()
        use_gemm(opts.gemm)  # XLA reads XLA_FLAGS once; children inherit them and get --gemm
        if FLAGS.child:
            child_main(opts)
            return
        import jax

        notes: list[str] = []
        note = note_fn(notes)
        if jax.devices()[0].platform == "cpu":
            opts = cpu_options(opts, note)
        data = run(opts, notes, note)
    except UserError as e:
        print(f"chain: error: {e}", file=sys.stderr)
        sys.exit(2)
    json_path = results_lib.write_json_atomic(opts.json_out, data) if opts.json_out else None
    plot_path = None
    if opts.plot_out and json_path:
        from experiments.measure import plot

        plot_path = plot.plot_chain(json_path, opts.plot_out)
    print()
    print(format_table(data))
    print(f"json: {json_path or '(not written)'}")
    print(f"plot: {plot_path or '(not written)'}")
    failures = failed_checks(data)
    if failures:
        for line in failures:
            print(f"chain: check failed: {line}", file=sys.stderr)
        print(f"chain: {len(failures)} check(s) failed (see the JSON's checks)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.flags_parser("chain"))
