"""The seeds' "From One Matrix to a Recurrent Core": the Core alone, r iterations per call.

Adapter + 4 sandwich layers at huginn-0125 size, random weights with the reference init, through
the project's own model code (`huginn_jax.model.Core` and `run_core`). Every (iteration, layer)
has its own KV slot.

    python -m experiments.core --mode=decode,prefill --iterations=1,8 --context=1024 --hbm

Modes: decode = one new position per sequence over `context` cached positions (the history is
random, never zeros); prefill = `context` new positions from position 0. Implementations:
  xla             `lax.scan` over iterations, the cache donated and updated in place
  xla_cudnn       as xla, attention fused by cuDNN in prefill and decode (GPU only)
  xla_split       as xla, decode attention split into blocks of 128 positions (flash-decoding
                  in XLA; the model's decode_attention_impl="xla_split")
  xla_pallas      as xla, decode attention by the Pallas split-KV kernel that reads the cache
                  slot in place (pallas_kernels.decode_attention)
  xla_rows        as xla_pallas, and at batch 1 each GEMV one Pallas kernel that returns
                  split-K partial sums unreduced or applies the SiLU gate, XLA adding the
                  partials up where it builds the next row (huginn_jax.decode_row with
                  pallas_kernels.fused_gemv)
  xla_mgpu        as xla_pallas, prefill attention by jax's Mosaic GPU flash attention on
                  float16 copies (the model's attention_impl="mgpu"; GPU only)
  xla_probe       the issue's plain-XLA probe: the same Core, the cache as [r, L, B, S, H, K]
                  arrays in the scan carry written with `.at[i, j, :, pos].set`, not donated
  torch_compile   the same Core in PyTorch, the fast Core's iteration through torch.compile
                  (--torch_compile_mode), compiled once, r iterations replayed from one CUDA
                  graph (reduce-overhead: Inductor's own CUDA graphs); compile time reported
                  apart (compile_seconds)
  torch_graph     the fast Core written by hand (fused RMSNorm, cached RoPE tables, SDPA, views,
                  static cache written in place), r iterations replayed from one CUDA graph
  torch_eager     the same, eager
  torch_reference the reference-faithful Core (float32 RMSNorm by hand, RoPE recomputed with
                  torch.stack), r iterations replayed from one CUDA graph
  torch_teaching  the seeds' teaching cache: history re-concatenated with torch.cat (eager)
(`--impls=torch` means all five; experiments.torch_ref.core_runner; torch_compile, torch_graph
and torch_reference need CUDA.) Each torch impl's Core code is also checked once per process
against the conformance checkpoint (experiments.torch_ref.conformance); a failure ends the run.
Timing: `measure.timing.time_fn`, caches not flushed; each call restarts from the same state and
history, as in the seeds.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

# PyTorch runs in the same process: JAX must not grab 75 % of the GPU up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402

import pallas_kernels.decode_attention  # noqa: E402, F401 (registers the "pallas" decode)
import pallas_kernels.fused_gemv  # noqa: E402, F401 (registers the "pallas" row GEMV)
from experiments import cli  # noqa: E402
from experiments.cli import UserError  # noqa: E402
from experiments.measure import ceilings as ceilings_lib  # noqa: E402
from experiments.measure import (
    compare,  # noqa: E402
    timing,  # noqa: E402
)
from experiments.measure import hlo as hlo_lib  # noqa: E402
from experiments.measure import ncu as ncu_lib  # noqa: E402
from experiments.measure import results as results_lib  # noqa: E402
from experiments.measure import trace as trace_lib  # noqa: E402
from experiments.torch_ref import chain as torch_chain  # noqa: E402 (imports no torch)
from experiments.torch_ref.core_runner import (  # noqa: E402 (imports no torch)
    COMPILE_MODES,
    CUDA_ONLY_IMPLS,
    TORCH_IMPLS,
    TorchRunner,
    torch_device,
)
from huginn_jax import costs  # noqa: E402
from huginn_jax.checkpoint import CheckpointError, from_pretrained  # noqa: E402
from huginn_jax.config import HuginnConfig  # noqa: E402
from huginn_jax.kv_cache import KVCache  # noqa: E402
from huginn_jax.model import Core, run_core  # noqa: E402
from huginn_jax.xla_flags import GEMM_CHOICES, use_command_buffers, use_gemm  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Defines the flags; called only when this module runs as the program, so that tests
    and other programs can import it without clashing flag names."""
    flags.DEFINE_list("mode", ["decode", "prefill"], "decode and/or prefill.")
    flags.DEFINE_list("iterations", ["1", "8"], "Core iterations per call (a list).")
    flags.DEFINE_list("context", ["1024"], "Cached positions (decode) or new positions (prefill).")
    flags.DEFINE_list("batch", ["1"], "Sequences (a list).")
    flags.DEFINE_list("impls", ["xla", "torch"], "xla, torch (= the five torch_* impls) or names.")
    flags.DEFINE_enum(
        "torch_compile_mode",
        "default",
        list(COMPILE_MODES),
        "torch.compile's mode for torch_compile (reduce-overhead: Inductor's CUDA graphs, "
        "otherwise one CUDA graph captured around the r compiled iterations).",
    )
    flags.DEFINE_string(
        "config",
        "huginn_0125",
        "Model preset whose Core is measured, or a from_pretrained directory (its config.json).",
    )
    flags.DEFINE_enum(
        "weights",
        "random",
        ["random", "trained"],
        "random: the reference init; trained: the Core weights of the --config directory "
        "(e.g. an experiments.train export), to compare timing and HBM bytes with random ones.",
    )
    flags.DEFINE_enum("dtype", "bf16", ["bf16", "fp32"], "Weights, state and cache dtype.")
    flags.DEFINE_enum(
        "gemm", "cublas", list(GEMM_CHOICES), "Dots: cublas (Triton GEMMs off) or xla's choice."
    )
    flags.DEFINE_bool(
        "command_buffers",
        True,
        "XLA's command buffers (CUDA graphs; XLA's default). --nocommand_buffers launches each "
        "kernel on its own (the Core decode was 3-4 % slower so on the H200).",
    )
    flags.DEFINE_string(
        "ceilings",
        "",
        "Measured ceilings JSON (experiments.ceilings); '' = results/<device>/ceilings.json "
        "when it exists.",
    )
    flags.DEFINE_integer("warmup", 3, "Untimed calls.")
    flags.DEFINE_integer("repeats", 20, "Timed calls (median reported).")
    flags.DEFINE_integer("seed", 0, "Seed of weights, state and history.")
    flags.DEFINE_string("json_out", "out/core.json", "Results JSON ('' to skip).")
    flags.DEFINE_bool("hbm", False, "HBM bytes per iteration from Nsight Compute (GPU + ncu).")
    flags.DEFINE_list("hbm_impls", ["xla", "torch_graph"], "Impls that --hbm profiles.")
    flags.DEFINE_integer("ncu_timeout", 300, "Seconds an --hbm child may run under ncu.")
    flags.DEFINE_string("trace_dir", None, "Write profiler traces; print per-kernel breakdowns.")
    flags.DEFINE_string("hlo_dir", None, "Write each XLA executable's optimized HLO here.")
    flags.DEFINE_string(
        "ncu_child", None, "Internal: impl:mode:batch:context:iterations under ncu."
    )


# XLA impls that are `xla` with other attention / decode settings of the model config.
XLA_VARIANTS = {
    "xla_cudnn": {"attention_impl": "cudnn", "decode_attention_impl": "cudnn"},
    "xla_split": {"decode_attention_impl": "xla_split"},
    "xla_pallas": {"decode_attention_impl": "pallas"},
    "xla_rows": {"decode_attention_impl": "pallas", "decode_gemv": "pallas"},
    "xla_mgpu": {"attention_impl": "mgpu", "decode_attention_impl": "pallas"},
}
GPU_ONLY_IMPLS = (*CUDA_ONLY_IMPLS, "xla_cudnn", "xla_mgpu")
XLA_IMPLS = ("xla", *XLA_VARIANTS, "xla_probe")
IMPLS = (*XLA_IMPLS, *TORCH_IMPLS)
NCU_CALLS = 2


@dataclasses.dataclass(frozen=True)
class Case:
    mode: str
    batch: int
    context: int
    iterations: int

    @property
    def new_tokens(self) -> int:
        return 1 if self.mode == "decode" else self.context

    @property
    def start(self) -> int:
        return self.context if self.mode == "decode" else 0

    @property
    def max_len(self) -> int:
        return self.context + self.new_tokens if self.mode == "decode" else self.context

    def spec(self) -> str:
        return f"{self.mode}:{self.batch}:{self.context}:{self.iterations}"


def cases_from_flags() -> list[Case]:
    for mode in FLAGS.mode:
        if mode not in ("decode", "prefill"):
            raise UserError(f"--mode={mode}: expected decode or prefill")
    grid = itertools.product(
        FLAGS.mode,
        cli.positive_ints("batch", FLAGS.batch),
        cli.positive_ints("context", FLAGS.context),
        cli.positive_ints("iterations", FLAGS.iterations),
    )
    return [Case(*values) for values in grid]


def impls_from_flags() -> list[str]:
    names = []
    for name in FLAGS.impls:
        expanded = TORCH_IMPLS if name == "torch" else (name,)
        for impl in expanded:
            if impl not in IMPLS:
                raise UserError(f"--impls: unknown {impl!r}; known: torch, {', '.join(IMPLS)}")
            names.append(impl)
    return list(dict.fromkeys(names))


def core_config(preset: str):
    """The preset's (or checkpoint directory's) config without prelude and coda layers, so that
    caches hold Core slots only. RoPE is computed on the fly, so positions may run past the
    preset's block_size (decode at 4096)."""
    if Path(preset).is_dir():
        if not (Path(preset) / "config.json").exists():
            raise UserError(f"--config={preset} is a directory without config.json")
        cfg = HuginnConfig.from_hf_json(Path(preset) / "config.json")
    else:
        try:
            cfg = HuginnConfig.from_name(preset)
        except ValueError as e:
            raise UserError(f"{e} (or pass a from_pretrained directory)") from None
    return dataclasses.replace(
        cfg, n_layers_in_prelude=0, n_layers_in_coda=0, block_size=max(cfg.block_size, 1 << 20)
    )


def jax_dtype(name: str):
    return jnp.bfloat16 if name == "bf16" else jnp.float32


# ---------------------------------------------------------------- inputs and runners


def build_core(cfg, dtype, seed: int):
    """Random Core weights with the reference init, created on the device (jitted init)."""

    @jax.jit
    def init(key):
        return nnx.split(Core(cfg, rngs=nnx.Rngs(params=key), dtype=dtype))[1]

    return core_graphdef(cfg, dtype), init(jax.random.key(seed))


def load_core(cfg, dtype, path: str):
    """The adapter and Core layers of the from_pretrained directory `path`, as `build_core`'s
    (graphdef, params)."""
    try:
        model = from_pretrained(path, dtype)
    except CheckpointError as e:
        raise UserError(str(e)) from None
    state = nnx.state(model)
    params = nnx.State({"adapter": state["adapter"], "core_block": state["core_block"]})
    graphdef = core_graphdef(cfg, dtype)
    nnx.merge(graphdef, params)  # the structures agree
    return graphdef, params


def core_weights(cfg, dtype):
    """(graphdef, params) as --weights says."""
    if FLAGS.weights == "trained":
        return load_core(cfg, dtype, FLAGS.config)
    return build_core(cfg, dtype, FLAGS.seed)


def core_graphdef(cfg, dtype):
    """The Core's structure (static: it carries the config) without allocating weights."""
    return nnx.graphdef(nnx.eval_shape(lambda: Core(cfg, rngs=nnx.Rngs(0), dtype=dtype)))


def case_inputs(cfg, case: Case, dtype, seed: int):
    """(state, embedded) [B, T, D] and a cache whose history positions [0, start) are random."""
    keys = jax.random.split(jax.random.key(seed + 1), 4)
    shape = (case.batch, case.new_tokens, cfg.n_embd)
    state = jax.random.normal(keys[0], shape, dtype)
    embedded = jax.random.normal(keys[1], shape, dtype)
    cache = KVCache.create(
        cfg, batch=case.batch, max_len=case.max_len, num_steps=case.iterations, dtype=dtype
    )
    if case.mode == "decode":

        @functools.partial(jax.jit, donate_argnums=0)
        def fill(cache):
            """One slot at a time, in place: drawing the whole cache at once needs float32
            temporaries of its size (batch 32 x 4096 ran out of memory on the H200)."""

            def fill_slot(slot, kv):
                shape = kv[0].shape[1:]
                return tuple(
                    x.at[slot].set(jax.random.normal(jax.random.fold_in(key, slot), shape, dtype))
                    for x, key in zip(kv, keys[2:], strict=True)
                )

            k, v = jax.lax.fori_loop(0, cache.k.shape[0], fill_slot, (cache.k, cache.v))
            return dataclasses.replace(cache, k=k, v=v)

        cache = fill(cache)
    return state, embedded, cache


def jit_core(graphdef, params, *, iterations: int, from_zero=False, probe=False):
    """The Core's r iterations, jitted: returns (fn, weights); `fn(weights, state, embedded,
    cache, start)` returns (state, cache). `weights` are the leaves of the nnx.State `params`: a
    tuple of arrays is flattened in C++ at each call, where flattening the State itself took
    178 us of Python per call on the H200's host.

    `from_zero`: a prefill into an empty cache; start is then the constant 0, so attention reads
    the new positions alone with a plain causal mask (as generation's prefill does). The cache is
    donated, so XLA updates it in place, except with `probe` (the issue's plain-XLA probe as it
    was: `ProbeCache`, nothing donated).
    """
    leaves, treedef = jax.tree.flatten(params)

    def core(weights, state, embedded, cache, start):
        model = nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))
        return run_core(model, state, embedded, 0 if from_zero else start, cache, iterations)

    return (jax.jit(core) if probe else jax.jit(core, donate_argnames="cache")), tuple(leaves)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ProbeCache:
    """The issue's plain-XLA probe: K and V as [r, L, B, S, H, K] arrays in the scan carry,
    written with `.at[i, j, :, positions].set` (a scatter) and not donated; it has the methods
    of `KVCache` that `run_core` uses, so the Core code is the same as the `xla` impl's."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def from_cache(cls, cache: KVCache, iterations: int) -> ProbeCache:
        shape = (iterations, -1, *cache.k.shape[1:])
        return cls(cache.k.reshape(shape), cache.v.reshape(shape))

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def core_slot(self, iteration, layer: int):
        return iteration, layer

    def write(self, slot, start, k_BxTxHxK, v_BxTxHxK) -> ProbeCache:
        i, j = slot
        positions = start + jnp.arange(k_BxTxHxK.shape[1])
        # scalar, scalar, slice, vector indices: the indexed dims come first, [T, B, H, K]
        k = self.k.at[i, j, :, positions].set(k_BxTxHxK.swapaxes(0, 1).astype(self.k.dtype))
        v = self.v.at[i, j, :, positions].set(v_BxTxHxK.swapaxes(0, 1).astype(self.v.dtype))
        return ProbeCache(k, v)

    def read(self, slot):
        i, j = slot
        return self.k[i, j], self.v[i, j]


class XlaRunner:
    """The Core compiled once ahead of time; each call feeds the cache back (`xla`: donated, so
    XLA updates it in place; `xla_probe`: the issue's probe, `ProbeCache`, not donated)."""

    sync = None

    def __init__(self, graphdef, params, state, embedded, cache, case: Case, probe=False):
        # the probe as it was: start traced, so the whole cache slot is read
        from_zero = case.mode == "prefill" and not probe
        fn, weights = jit_core(
            graphdef, params, iterations=case.iterations, from_zero=from_zero, probe=probe
        )
        self.args = (weights, state, embedded)
        self.start = jnp.int32(case.start)
        self.cache = ProbeCache.from_cache(cache, case.iterations) if probe else cache
        self.compiled = fn.lower(*self.args, self.cache, self.start).compile()

    def compile_report(self):
        """Optimized HLO text and `memory_analysis()` of the executable that is timed."""
        return self.compiled.as_text(), self.compiled.memory_analysis()

    def __call__(self):
        out, self.cache = self.compiled(*self.args, self.cache, self.start)
        return out

    def release(self):
        self.cache = self.compiled = None


def to_numpy(out) -> np.ndarray:
    if hasattr(out, "detach"):
        return out.detach().float().cpu().numpy()
    return np.asarray(out, dtype=np.float32)


# ---------------------------------------------------------------- reports


def cost_of(cfg, case: Case, dtype_bytes: int) -> dict:
    """The cost model's bytes and FLOPs for ONE iteration of `case`."""
    one = costs.totals(
        costs.core_iteration_ops(
            cfg, batch=case.batch, context=case.context, mode=case.mode, dtype_bytes=dtype_bytes
        )
    )
    return {
        "weight_bytes": one.weight_bytes,
        "kv_read_bytes": one.kv_read_bytes,
        "hbm_read_bytes": one.hbm_read_bytes,
        "hbm_bytes": one.hbm_bytes,
        "flops": one.flops,
    }


def device_ceilings(device_kind: str) -> ceilings_lib.Ceilings | None:
    """The project's measured ceilings for this device (`--ceilings` or the device's results
    file); None where it has none, e.g. on a CPU."""
    try:
        return ceilings_lib.for_device(device_kind, FLAGS.ceilings or None)
    except ceilings_lib.CeilingsError as e:
        raise UserError(f"--ceilings: {e}") from None


def check_tolerance(dtype_name: str, iterations: int) -> float:
    """Largest relative (Frobenius) difference allowed between two implementations' output
    states: rounding grows with the number of chained layers, roughly as its square root."""
    base = 6e-3 if dtype_name == "bf16" else 3e-5
    return base * max(1.0, iterations) ** 0.5


def record(case: Case, impl: str, samples: timing.Samples, cost: dict, ceilings) -> dict:
    t = samples.median  # seconds per iteration
    rec = {
        **dataclasses.asdict(case),
        "impl": impl,
        "ms_per_iteration": t * 1e3,
        "samples": samples.to_dict(),
        "weights_gbps": cost["weight_bytes"] / t / 1e9,
        "weights_kv_gbps": (cost["weight_bytes"] + cost["kv_read_bytes"]) / t / 1e9,
        "tflops": cost["flops"] / t / 1e12,
        "cost_model": cost,
    }
    if ceilings:
        floor = (cost["weight_bytes"] + cost["kv_read_bytes"]) / ceilings.read_bytes_per_s
        rec["pct_hbm_floor"] = 100 * floor / t
        rec["pct_bf16_gemm"] = 100 * (cost["flops"] / t) / ceilings.bf16_flops_per_s
    return rec


TABLE_LEGEND = """\
vs best   the other framework's fastest ms/iter in the same case / this row's (> 1: ahead)
%floor    (weights + KV read) at the measured read-only streaming rate / ms/iter
%gemm     TFLOP/s / the measured sustained bf16 GEMM rate
HBM/pred  bytes read (ncu, --hbm) / the cost model's
-         not measured: no ceilings file for this device, no rival of the other framework,
          or no --hbm"""


def _optional(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(records: list[dict]) -> str:
    head = (
        f"{'mode':<8}{'B':>4}{'ctx':>6}{'r':>4} {'impl':<16}{'ms/iter':>9}{'p10-p90':>15}"
        f"{'vs best':>8}{'GB/s w+kv':>10}{'%floor':>7}{'TFLOP/s':>9}{'%gemm':>6}{'HBM/pred':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        s = r["samples"]
        it = r["iterations"]
        spread = f"{s['p10_us'] / 1e3:.3f}-{s['p90_us'] / 1e3:.3f}"
        hbm = r.get("hbm") or {}
        ratio = hbm.get("read_over_prediction")
        lines.append(
            f"{r['mode']:<8}{r['batch']:>4}{r['context']:>6}{it:>4} {r['impl']:<16}"
            f"{r['ms_per_iteration']:>9.3f}{spread:>15}"
            f"{compare.format_vs_best(r.get('vs_best')):>8}{r['weights_kv_gbps']:>10.0f}"
            f"{_optional(r.get('pct_hbm_floor'), '.1f'):>7}{r['tflops']:>9.1f}"
            f"{_optional(r.get('pct_bf16_gemm'), '.1f'):>6}"
            f"{_optional(ratio, '.3f'):>9}"
        )
    return "\n".join([*lines, TABLE_LEGEND])


# ---------------------------------------------------------------- one case


def make_runner(impl, cfg, graphdef, params, case, dtype_name):
    state, embedded, cache = case_inputs(cfg, case, jax_dtype(dtype_name), FLAGS.seed)
    if impl in ("xla", "xla_probe"):
        return XlaRunner(graphdef, params, state, embedded, cache, case, probe=impl == "xla_probe")
    if impl in XLA_VARIANTS:
        variant = dataclasses.replace(cfg, **XLA_VARIANTS[impl])
        return XlaRunner(
            core_graphdef(variant, jax_dtype(dtype_name)), params, state, embedded, cache, case
        )
    return TorchRunner(
        impl,
        nnx.to_pure_dict(params),
        cfg,
        state,
        embedded,
        cache,
        case,
        dtype_name,
        compile_mode=FLAGS.torch_compile_mode,
    )


def run_case(impl, cfg, graphdef, params, case, dtype_name, ceilings, hlo_dir) -> tuple[dict, Any]:
    runner = make_runner(impl, cfg, graphdef, params, case, dtype_name)
    extra = {}
    if impl in XLA_IMPLS:
        text, memory = runner.compile_report()
        report = hlo_lib.loop_report(
            text,
            memory,
            big_buffer_dims=tuple(runner.cache.k.shape),
            slice_dims=tuple(runner.cache.k.shape[-4:]),  # one slot, [B, S, H, K]
        )
        live = runner.cache.nbytes + sum(x.nbytes for x in jax.tree.leaves(params))
        report["temp_pct_of_weights_and_cache"] = 100 * report.get("temp_bytes", 0) / live
        extra["xla_report"] = report
        if hlo_dir:
            path = Path(hlo_dir) / f"core-{impl}-{case.spec().replace(':', '-')}.hlo.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    samples = timing.time_fn(
        runner,
        warmup=FLAGS.warmup,
        repeats=FLAGS.repeats,
        sync=getattr(runner, "sync", None),
        per_call=case.iterations,
    )
    out = to_numpy(runner())
    if getattr(runner, "sync", None):
        runner.sync()
    rec = record(
        case, impl, samples, cost_of(cfg, case, 2 if dtype_name == "bf16" else 4), ceilings
    )
    rec.update(extra)
    if getattr(runner, "compile_seconds", None) is not None:  # torch_compile: apart from timing
        rec["compile_seconds"] = runner.compile_seconds
        rec["torch_compile_mode"] = FLAGS.torch_compile_mode
    runner.release()
    return rec, out


@functools.cache
def torch_conformance(impl: str, device: str, compile_mode: str) -> dict:
    """`conformance.check_core_impl`, once per (impl, device, mode) in a process."""
    from experiments.torch_ref.conformance import check_core_impl

    return check_core_impl(impl, device, compile_mode)


def trace_all(records: list[dict], cfg, graphdef, params) -> None:
    """Per-kernel breakdowns, XLA first: once the torch profiler has run in a process, JAX's
    profiler can no longer subscribe to CUPTI there (seen on the H200: the next trace hung)."""
    order = sorted(records, key=lambda r: r["impl"] not in XLA_IMPLS)
    for rec in order:
        case = Case(rec["mode"], rec["batch"], rec["context"], rec["iterations"])
        runner = make_runner(rec["impl"], cfg, graphdef, params, case, FLAGS.dtype)
        for _ in range(2):
            timing.wait(runner(), runner.sync)
        rec["trace"], rec["trace_us_per_iteration"] = trace_case(runner, rec["impl"], case)
        runner.release()


def trace_case(runner, impl: str, case: Case) -> tuple[list[dict], dict]:
    """Per-kernel rows per Core iteration, and the traced span, busy time and gaps per
    iteration (µs)."""
    calls = 3
    label = f"{impl}-{case.spec().replace(':', '-')}"

    def run():
        for _ in range(calls):
            out = runner()
        timing.wait(out, runner.sync)

    per = calls * case.iterations  # rows are reported per Core iteration
    torch = impl not in XLA_IMPLS
    path = Path(FLAGS.trace_dir) / (f"{label}.json" if torch else label)
    rows, per_iteration = trace_lib.trace_run(run, path, torch=torch, units=per)
    return [dataclasses.asdict(r) for r in rows], per_iteration


# ---------------------------------------------------------------- ncu


def ncu_child(spec: str) -> None:
    """Warm up one (impl, case), then NCU_CALLS calls inside the profiler range."""
    impl, mode, batch, context, iterations = spec.split(":")
    case = Case(mode, int(batch), int(context), int(iterations))
    cfg = core_config(FLAGS.config)
    graphdef, params = core_weights(cfg, jax_dtype(FLAGS.dtype))
    runner = make_runner(impl, cfg, graphdef, params, case, FLAGS.dtype)
    for _ in range(2):
        out = runner()
    timing.wait(out, runner.sync)
    with ncu_lib.cuda_profiler_range():
        for _ in range(NCU_CALLS):
            out = runner()
        timing.wait(out, runner.sync)


def hbm_pass(impl: str, case: Case, ncu: str) -> dict:
    argv = [
        sys.executable,
        "-m",
        "experiments.core",
        f"--ncu_child={impl}:{case.spec()}",
        f"--config={FLAGS.config}",
        f"--dtype={FLAGS.dtype}",
        f"--seed={FLAGS.seed}",
        f"--weights={FLAGS.weights}",
        f"--gemm={FLAGS.gemm}",
        f"--torch_compile_mode={FLAGS.torch_compile_mode}",
    ]
    with tempfile.TemporaryDirectory(prefix="core-ncu-") as out:
        text = ncu_lib.run_ncu(
            argv, ncu=ncu, log_file=str(Path(out) / "ncu.csv"), timeout_s=FLAGS.ncu_timeout
        )
    summary = ncu_lib.summarize(ncu_lib.parse_ncu_csv(text), NCU_CALLS * case.iterations)
    return dataclasses.asdict(summary)


# ---------------------------------------------------------------- main


def release_torch_memory() -> None:
    """Returns torch's cached blocks to the driver (when torch is loaded), for the next case."""
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        torch_chain.release()


def run(cases: list[Case], impls: list[str]) -> dict:
    from tqdm import tqdm

    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    if not on_gpu:
        skipped = [i for i in impls if i in GPU_ONLY_IMPLS]
        impls = [i for i in impls if i not in skipped]
        if skipped:
            print(f"note: {', '.join(skipped)} need(s) CUDA; skipped on this device")
    if any(i in TORCH_IMPLS for i in impls):
        from experiments.torch_ref.chain import available

        if not available():
            print("note: PyTorch is not installed; torch impls skipped")
            impls = [i for i in impls if i not in TORCH_IMPLS]
    cfg = core_config(FLAGS.config)
    ceilings = device_ceilings(device.device_kind)
    graphdef, params = core_weights(cfg, jax_dtype(FLAGS.dtype))
    records, checks = [], []
    grid = [(c, i) for c in cases for i in impls]
    outputs: dict[tuple, np.ndarray] = {}
    failures = []
    conformance: dict[str, dict] = {}  # torch impl -> its Core's check against huginn_tiny_a
    for case, impl in tqdm(grid, desc="core", disable=len(grid) < 2, file=sys.stderr):
        try:
            rec, out = run_case(
                impl, cfg, graphdef, params, case, FLAGS.dtype, ceilings, FLAGS.hlo_dir
            )
        except Exception as e:  # out of memory in one case of a sweep: note it, go on
            if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
                raise
            first = str(e).strip().splitlines()[0][:200]
            print(f"note: {impl} {case.spec()} ran out of device memory: {first}")
            failures.append({**dataclasses.asdict(case), "impl": impl, "error": first})
            release_torch_memory()
            continue
        records.append(rec)
        outputs[(case, impl)] = out
        if impl in TORCH_IMPLS and impl not in conformance:
            check = torch_conformance(impl, torch_device(), FLAGS.torch_compile_mode)
            conformance[impl] = check
            print(
                f"conformance {impl} ({check['core']} Core) vs huginn_tiny_a: max abs err "
                f"{check['max_abs_err']:.2e} (tolerance {check['tolerance']:.0e})"
            )
            if not check["passed"]:
                raise UserError(
                    f"{impl}: its Core code misses the conformance logits (max abs err "
                    f"{check['max_abs_err']:.2e} > {check['tolerance']:.0e}); timings void"
                )
    if FLAGS.trace_dir:
        trace_all(records, cfg, graphdef, params)
    compare.add_vs_best(
        records, group_keys=("mode", "batch", "context", "iterations"), time_key="ms_per_iteration"
    )
    checks = agreement_checks(cases, impls, outputs, FLAGS.dtype)
    ncu = ncu_lib.find_ncu() if FLAGS.hbm else None
    if FLAGS.hbm and (not on_gpu or ncu is None):
        print(ncu_lib.SKIP_LINE)
    elif FLAGS.hbm:
        for rec in records:
            if rec["impl"] not in FLAGS.hbm_impls:
                continue
            case = Case(rec["mode"], rec["batch"], rec["context"], rec["iterations"])
            try:
                hbm = hbm_pass(rec["impl"], case, ncu)
            except (ncu_lib.NcuError, OSError, ValueError) as e:
                print(f"note: ncu for {rec['impl']} {case.spec()} failed: {e}")
                continue
            predicted = rec["cost_model"]["hbm_read_bytes"]
            hbm["read_over_prediction"] = hbm["bytes_read_per_chain"] / predicted
            hbm["read_over_weights_kv"] = hbm["bytes_read_per_chain"] / (
                rec["cost_model"]["weight_bytes"] + rec["cost_model"]["kv_read_bytes"]
            )
            rec["hbm"] = hbm
    return {
        "records": records,
        "checks": checks,
        "ceilings": ceilings.to_dict() if ceilings else None,
        "failures": failures,
        "conformance": list(conformance.values()),
    }


def agreement_checks(cases, impls, outputs: dict, dtype_name: str) -> list[dict]:
    """Every impl's output state against the case's reference impl (`xla` when it ran, else the
    first XLA impl): relative Frobenius difference and whether it is within tolerance."""
    checks = []
    for case in cases:
        ran = [impl for impl in impls if (case, impl) in outputs]
        reference = next((impl for impl in ran if impl in XLA_IMPLS), None)
        if reference is None:
            continue
        ref = outputs[(case, reference)]
        tolerance = check_tolerance(dtype_name, case.iterations)
        for impl in ran:
            if impl == reference:
                continue
            got = outputs[(case, impl)]
            rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            checks.append(
                {
                    **dataclasses.asdict(case),
                    "impl": impl,
                    "reference": reference,
                    "rel_err": rel,
                    "tolerance": tolerance,
                    "passed": bool(rel <= tolerance),  # NaN fails
                }
            )
    return checks


def scaling_lines(records: list[dict]) -> list[str]:
    """r iterations in one executable against r × one iteration, per case and impl."""
    lines = []
    by_key = {}
    for r in records:
        by_key[(r["mode"], r["batch"], r["context"], r["impl"], r["iterations"])] = r
    for (mode, b, ctx, impl, it), r in sorted(by_key.items()):
        one = by_key.get((mode, b, ctx, impl, 1))
        if it > 1 and one:
            ratio = r["ms_per_iteration"] / one["ms_per_iteration"]
            lines.append(f"{impl} {mode} B={b} ctx={ctx}: r={it} costs {ratio:.3f} x r x (r=1)")
    return lines


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise UserError(f"unexpected arguments: {' '.join(argv[1:])}")
    use_gemm(FLAGS.gemm)  # before anything starts the backend (ncu children inherit it)
    use_command_buffers(FLAGS.command_buffers)
    if FLAGS.ncu_child:
        ncu_child(FLAGS.ncu_child)
        return
    cases, impls = cases_from_flags(), impls_from_flags()
    core_config(FLAGS.config)  # a bad preset fails here, before any device work
    if FLAGS.weights == "trained" and not Path(FLAGS.config).is_dir():
        raise UserError("--weights=trained needs --config=DIR, a from_pretrained directory")
    if FLAGS.warmup < 0 or FLAGS.repeats < 1:
        raise UserError("--warmup must be >= 0 and --repeats >= 1")
    result = run(cases, impls)
    if FLAGS.json_out:
        path = results_lib.write_results(FLAGS.json_out, cli.flag_values(_OWN_FLAGS), result)
    for check in result["checks"]:
        print(
            f"check {check['impl']} vs {check['reference']}, {check['mode']} B={check['batch']} "
            f"ctx={check['context']} r={check['iterations']}: rel err {check['rel_err']:.2e} "
            f"(tolerance {check['tolerance']:.1e}){'' if check['passed'] else ' FAILED'}"
        )
    for rec in result["records"]:
        if "xla_report" in rec:
            rep = rec["xla_report"]
            print(
                f"{rec['impl']} {rec['mode']} r={rec['iterations']} B={rec['batch']} "
                f"ctx={rec['context']}: "
                f"kernels/iteration {list(rep['kernels_per_iteration'].values())}, "
                f"cache copies {len(rep['big_buffer_copies'])}, "
                f"slot copies/iteration {len(rep.get('slice_copies_per_iteration', []))}, "
                f"temp {rep.get('temp_bytes', 0) / 2**20:.1f} MiB "
                f"({rep['temp_pct_of_weights_and_cache']:.2f} % of weights+cache), "
                f"alias {rep.get('alias_bytes', 0) / 2**20:.1f} MiB"
            )
        if rec.get("trace"):
            print(f"trace {rec['impl']} {rec['mode']} r={rec['iterations']}:")
            print(
                trace_lib.side_by_side(
                    {rec["impl"]: [trace_lib.Row(**row) for row in rec["trace"]]},
                    top=12,
                    per="iter",
                )
            )
            print(trace_lib.per_unit_line(rec["trace_us_per_iteration"], "iteration (3 calls)"))
    for line in scaling_lines(result["records"]):
        print(line)
    if FLAGS.json_out:
        print(f"results: {path}")
    print(format_table(result["records"]))
    failed = [c for c in result["checks"] if not c["passed"]]
    if failed:
        names = ", ".join(sorted({c["impl"] for c in failed}))
        raise UserError(f"outputs disagree beyond tolerance ({names}): see the check lines above")


_OWN_FLAGS = (
    "mode iterations context batch impls config weights dtype gemm command_buffers warmup repeats "
    "seed ceilings json_out hbm hbm_impls ncu_timeout trace_dir hlo_dir torch_compile_mode"
).split()


run_main = cli.main_runner("core", main)


if __name__ == "__main__":
    define_flags()
    app.run(run_main, flags_parser=cli.flags_parser("core"))
