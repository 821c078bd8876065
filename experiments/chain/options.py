"""Flags of experiments.chain, and their validation into one `Options` value.

Flags -> `Options` (`options_from_flags`): sizes parsed and turned into d, family names expanded
to implementations, every number checked; a bad value is a UserError before any backend starts.
`cpu_options` scales the timing down on CPU; `check_memory` refuses a problem that cannot fit
before anything is allocated.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from absl import flags

from experiments import program
from experiments.cli import UserError
from experiments.measure import memory
from experiments.torch_ref import chain as torch_chain
from huginn_jax.xla_flags import GEMM_CHOICES

FLAGS = flags.FLAGS

XLA_FAMILY = ("xla", "xla_loop", "xla_no_cmdbuf", "xla_loop_no_cmdbuf")
XLA_IMPLS = XLA_FAMILY + ("xla_f32dot", "xla_loop_f32dot", "xla_loop_unrolled")
PALLAS_IMPLS = ("pallas", "pallas_splitk", "pallas_splitk_no_cmdbuf")
FAMILIES = {"xla": XLA_FAMILY, "torch": torch_chain.IMPLS}
KNOWN_IMPLS = XLA_IMPLS + torch_chain.IMPLS + PALLAS_IMPLS
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


def define_flags() -> None:
    """Defines the flags; called only when the chain runs as the program, so that tests and
    other programs can import it without clashing flag names."""
    flags.DEFINE_string(
        "size", "72MiB", "Weight size W: one value or a comma list (B, KiB, MiB, GiB)."
    )
    flags.DEFINE_integer("d", None, "Set d directly (W = d*d*dtype bytes); overrides --size.")
    flags.DEFINE_integer("steps", 8, "Dependent products per chain.")
    flags.DEFINE_integer("batch", 1, "Rows of the state x [batch, d].")
    flags.DEFINE_string("dtype", "bf16", "bf16, fp16 (float16) or fp32 (float32).")
    flags.DEFINE_list("layouts", list(LAYOUTS), "Weight layouts: shared, copies.")
    flags.DEFINE_list(
        "impls",
        ["xla", "torch", "pallas", "pallas_splitk"],
        "Implementations or families (see the program's doc); the Pallas kernels need a GPU "
        "(sm_90).",
    )
    flags.DEFINE_integer("warmup", 10, "Untimed calls before timing (fewer on CPU unless given).")
    flags.DEFINE_integer("repeats", 50, "Timed calls; the median is reported (fewer on CPU).")
    flags.DEFINE_integer(
        "chains_per_call",
        100,
        "N: chains per call of xla_loop, torch_graph and the Pallas impls; spreads a call's fixed "
        "cost (dispatch, input copies, the wait) over N chains (fewer on CPU unless given).",
    )
    flags.DEFINE_integer("ncu_chains", 100, "Chains inside each range that --hbm profiles.")
    flags.DEFINE_integer("ncu_timeout", 300, "Seconds an --hbm child may run under ncu.")
    flags.DEFINE_string("json_out", "out/chain.json", "Results JSON ('' to skip).")
    flags.DEFINE_string(
        "plot_out",
        None,
        "Plot drawn from the results JSON ('' to skip). Unset: next to --json_out, same stem, "
        ".png, so that a plot and a JSON always come from one run; no JSON, no plot.",
    )
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
    return [parse_size(p) for p in (text or "").split(",")]


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


# ---------------------------------------------------------------- flags -> options


@dataclasses.dataclass(frozen=True)
class Options:
    """Validated flag values of one run; `plot_out` is the path the plot goes to ('' for none),
    with the default already applied (`plot_path`)."""

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
    ncu_timeout: int = 300


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


def plot_path(json_out: str, plot_out: str | None) -> str:
    """Where the plot goes: `plot_out` when given ('' for none); unset, the JSON's path with
    the suffix .png ('' without a JSON), so that a plot never shows another run's JSON."""
    if plot_out is not None:
        return plot_out
    if not json_out:
        return ""
    path = Path(json_out)
    plot = path.with_suffix(".png") if path.suffix != ".png" else path.with_name(f"{path.name}.png")
    return str(plot)


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
            sized = [(s, dim_for_size(s, dtype_bytes)) for s in parse_sizes(FLAGS.size)]
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
        plot_out=plot_path(FLAGS.json_out, FLAGS.plot_out),
        hbm=FLAGS.hbm,
        trace_dir=FLAGS.trace_dir,
        ncu_chains=FLAGS.ncu_chains,
        warmup=FLAGS.warmup,
        repeats=FLAGS.repeats,
        chains_per_call=FLAGS.chains_per_call,
        gemm=FLAGS.gemm,
        torch_compile_mode=FLAGS.torch_compile_mode,
        ceilings=FLAGS.ceilings,
        ncu_timeout=FLAGS.ncu_timeout,
    )


def cpu_options(opts: Options, note: Callable[[str], None]) -> Options:
    """Fewer warm-ups, repeats and chains per call on CPU, for the flags the user did not give
    (`program.cpu_defaults`)."""
    line = program.cpu_defaults(CPU_DEFAULTS)
    if line:
        note(line)
    return dataclasses.replace(opts, **{k: FLAGS[k].value for k in CPU_DEFAULTS})


def check_memory(opts: Options, device: Any, holders: int) -> None:
    """Raises UserError, before anything is allocated, when the largest problem cannot fit.

    Device: `holders` processes/libraries may each hold steps*W of copies at once (the JAX
    pool, torch's cache, a child process), plus a workspace. Host: the numpy values (W in fp32
    for generation and reference, W in the dtype); on a CPU the device's arrays too
    (`memory.check_fits`)."""
    copies = "copies" in opts.layouts
    worst = max(opts.configs, key=lambda c: c.weight_bytes)
    w = worst.weight_bytes
    held = worst.steps if copies else 1
    memory.check_fits(
        "--d" if "d" in FLAGS and FLAGS["d"].present else "--size",
        f"W = {memory.format_bytes(w)} x {held} ({'copies' if copies else 'shared'}) x "
        f"{holders} holder(s)",
        holders * held * w + WORKSPACE_BYTES,
        2 * 4 * worst.d * worst.d + w,
        device=device,
        hint="use a smaller --size, fewer --steps or --layouts=shared",
    )
