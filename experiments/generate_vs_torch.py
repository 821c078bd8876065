"""Per-token decode latency of the JAX generation loop and of PyTorch loops over the same weights,
in the same run, each framework at its strongest.

    python -m experiments.generate_vs_torch --config=huginn_0125 --prompt_len=1024 \
        --max_new_tokens=32 --num_steps=32 --json_out=out/generate_vs_torch.json

JAX: `huginn_jax.generate.make_plan` + `run_plan`, what `python -m huginn_jax.generate` runs, with
a fixed `num_steps`, a zero initial state (init_scale 0), greedy tokens and the `full` cache; each
token's compiled step is dispatched before the token before it is read, and the latency of a
token is the time from the token before it being ready to it being ready.
`--core_decode=persistent`: its decode steps' Core in the persistent kernel (the row
`jax_persistent`; `xla` with a line saying why where it cannot run), with the kernel's schedule
`--persistent_schedule` (unless given, the case's: `persistent.default_schedule`). PyTorch
(`--torch_impls`, `experiments.torch_ref.huginn.run_loop`), the same weights (DLPack on CUDA):
- torch_compile: gpt-fast style, the position a tensor; prelude, one Core iteration and coda
  compiled once each (`--torch_compile_mode`: by default every mode, one after another, the
  fastest kept; a mode that torch.compile fails to build is left out with a note and its error
  in `compile_failures`), the whole token in one CUDA graph replayed at every position
  (Inductor's own graphs with reduce-overhead);
- torch_graph: FastCore's eager Core, a CUDA graph of the whole token captured per position;
- torch_reference: the same loop with the reference-faithful Core.
A torch_compile token is one replay, made before the token before it is read and timed as JAX's
(a CUDA event marks it ready); torch_graph and torch_reference capture each position's graph
before its replay, so theirs is one replay timed until `torch.cuda.synchronize` returns. Every
prefill runs once (JAX) or `--graph_warmup` times (torch) untimed before it is timed;
compilation, captures and warm-ups are reported apart (compile s). Every loop feeds back its own
greedy tokens; the table gives per loop the median ms/token (p10-p90), tokens/s, prefill,
compile time, whether its tokens equal JAX's (else where they part; the JSON has the logit
difference and JAX's top-1/top-2 gap there, as random weights make near-ties likely in bf16)
and "vs best" (the other framework's fastest median ÷ this row's). With `--torch_conformance`
each torch loop first reproduces the conformance checkpoint's greedy tokens in float32
(`torch_ref.conformance.check_generation_impl`); a failure exits 1 after the JSON is written.
Without torch the JAX half runs alone (one note line); without CUDA torch runs on the CPU
without CUDA graphs. `--trace_dir`: after its timed tokens, torch_compile's decode step replays
TRACE_TOKENS tokens under torch.profiler (a Chrome trace there, one per mode) and the kept
mode's kernels per token are printed and kept in the JSON: where PyTorch's token goes beside
its Core iterations. Ctrl-C or SIGTERM writes what was measured, marked "complete": false: JAX's
loop and each torch loop or torch.compile mode that had ended (`modes_so_far`: an autotuning
mode can take minutes).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from pathlib import Path

# PyTorch runs in the same process: JAX must not grab 75 % of the GPU up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags, logging  # noqa: E402
from flax import nnx  # noqa: E402

from experiments import cli, program  # noqa: E402
from experiments.cli import UserError  # noqa: E402
from experiments.generate_vs_torch_report import (  # noqa: E402
    compare,
    make_records,
    print_table,
    print_traces,
)
from experiments.measure import trace as trace_lib  # noqa: E402
from experiments.torch_ref import chain as torch_chain  # noqa: E402 (imports no torch)
from experiments.torch_ref.core import (  # noqa: E402 (imports no torch)
    COMPILE_MODES,
    compile_modes_for,
    run_each_mode,
)
from experiments.torch_ref.huginn import LOOPS as TORCH_LOOPS  # noqa: E402 (imports no torch)
from huginn_jax.checkpoint import from_pretrained  # noqa: E402
from huginn_jax.config import (  # noqa: E402
    CORE_DECODE_IMPLS,
    DECODE_ATTENTION_IMPLS,
    DECODE_GEMV_IMPLS,
    HuginnConfig,
)
from huginn_jax.generate import Generation, Plan, make_plan, run_plan  # noqa: E402
from huginn_jax.generate.options import PERSISTENT_SCHEDULE_HELP, check_memory  # noqa: E402
from huginn_jax.model import Huginn, random_init, with_config  # noqa: E402
from huginn_jax.xla_flags import GEMM_CHOICES, use_gemm  # noqa: E402

FLAGS = flags.FLAGS
_DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
TRACE_TOKENS = 4  # decode tokens torch_compile replays under the profiler (--trace_dir)


def loop_text(impl: str, cuda: bool, mode: str) -> str:
    """What the loop `impl` runs, in a few words (the table's footnote)."""
    if impl == "torch_compile":
        graphs = (
            "Inductor's CUDA graphs of the r + 2 calls"
            if mode == "reduce-overhead"
            else "one CUDA graph of the token"
        )
        where = f"{graphs}, replayed at every position" if cuda else "no CUDA graph (CPU)"
        tuning = ", coordinate descent tuning" if FLAGS.torch_coordinate_descent else ""
        return f"compiled units (mode {mode}{tuning}), {where}"
    core = "fast eager Core" if impl == "torch_graph" else "reference-faithful Core"
    return f"{core}, " + ("a CUDA graph captured per position" if cuda else "eager (CPU)")


def define_flags() -> None:
    """Defines the flags; called only when this module runs as the program."""
    flags.DEFINE_string("config", "huginn_0125", "Model preset (random weights, reference init).")
    flags.DEFINE_string("checkpoint", None, "Hugging Face checkpoint directory instead.")
    flags.DEFINE_enum("dtype", "bf16", list(_DTYPES), "Weights, activations and cache dtype.")
    flags.DEFINE_enum(
        "gemm", "cublas", list(GEMM_CHOICES), "JAX's dots: cublas (Triton GEMMs off) or xla."
    )
    flags.DEFINE_integer("prompt_len", 1024, "Random prompt ids (drawn from --seed): the context.")
    flags.DEFINE_integer("batch", 1, "Sequences: copies of the prompt.")
    flags.DEFINE_integer("max_new_tokens", 32, "Tokens to generate (token 0 from the prefill).")
    flags.DEFINE_integer("num_steps", 32, "Core iterations per token (fixed, no exit).")
    flags.DEFINE_integer("seed", 0, "Seed of the weights and the prompt.")
    flags.DEFINE_enum(
        "decode_attention",
        "xla",
        list(DECODE_ATTENTION_IMPLS),
        "JAX's decode attention (HuginnConfig.decode_attention_impl); pallas: the kernel in "
        "pallas_kernels.decode_attention.",
    )
    flags.DEFINE_enum(
        "decode_gemv",
        "xla",
        list(DECODE_GEMV_IMPLS),
        "JAX's decode GEMVs at batch 1 (HuginnConfig.decode_gemv); pallas: the row GEMVs of "
        "huginn_jax.decode_row with pallas_kernels.fused_gemv.",
    )
    flags.DEFINE_enum(
        "core_decode", "xla", list(CORE_DECODE_IMPLS),
        "JAX's Core decode steps: xla (run_core) or persistent (huginn_jax.persistent: one "
        "persistent kernel; xla, with a line saying why, where it cannot run).",
    )  # fmt: skip
    flags.DEFINE_string("persistent_schedule", "", PERSISTENT_SCHEDULE_HELP)
    flags.DEFINE_list(
        "torch_impls", list(TORCH_LOOPS), f"PyTorch loops to run, of {', '.join(TORCH_LOOPS)}."
    )
    flags.DEFINE_enum(
        "torch_compile_mode",
        "fastest",
        ["fastest", *COMPILE_MODES],
        "torch.compile's mode for torch_compile (fastest: every mode compiled and run in this "
        "process, one after another, the fastest kept for the row, each mode's median in the "
        "JSON's compile_modes; reduce-overhead: Inductor's CUDA graphs, otherwise one CUDA "
        "graph captured around the compiled token).",
    )
    flags.DEFINE_bool(
        "torch_coordinate_descent",
        False,
        "Inductor's coordinate_descent_tuning for torch_compile, as gpt-fast sets it: Inductor "
        "then writes every matrix-vector product as a Triton reduction with the norms fused in, "
        "slower than cuBLAS's GEMVs at huginn-0125's shapes on the H200 (docs/peers.md).",
    )
    flags.DEFINE_bool(
        "torch_conformance",
        True,
        "Check each torch loop against the conformance checkpoint's greedy tokens first.",
    )
    flags.DEFINE_integer(
        "graph_warmup", 2, "Untimed torch prefills, and runs of a token's step before capture."
    )
    flags.DEFINE_bool(
        "progress", True, "Progress on stderr: each phase, JAX's tokens, torch's loops."
    )
    flags.DEFINE_string(
        "trace_dir",
        None,
        f"Trace {TRACE_TOKENS} decode tokens of torch_compile here after its timed ones "
        "(torch.profiler) and print its kernels per token.",
    )
    flags.DEFINE_string("json_out", "out/generate_vs_torch.json", "Results JSON ('' to skip).")


def _config() -> HuginnConfig:
    if FLAGS.checkpoint:
        path = Path(FLAGS.checkpoint) / "config.json"
        if not path.exists():
            raise UserError(f"--checkpoint: {path} does not exist")
        config = HuginnConfig.from_hf_json(path)
    else:
        config = HuginnConfig.from_name(FLAGS.config)
    return dataclasses.replace(
        config, decode_attention_impl=FLAGS.decode_attention, decode_gemv=FLAGS.decode_gemv
    )


def _plan(config: HuginnConfig) -> Plan:
    """The request, checked before any weights exist; the prompt as the generate CLI draws it."""
    if FLAGS.prompt_len < 1 or FLAGS.batch < 1:
        raise UserError("--prompt_len and --batch must be at least 1")
    if FLAGS.prompt_len > config.block_size:  # refused before drawing that many ids
        raise UserError(
            f"--prompt_len={FLAGS.prompt_len}: exceeds the model's block_size={config.block_size}"
        )
    ids = np.random.default_rng(FLAGS.seed).integers(0, config.vocab_size, FLAGS.prompt_len)
    plan = make_plan(  # checked for one sequence; --batch copies once they are known to fit
        config,
        ids.reshape(1, -1),
        FLAGS.max_new_tokens,
        FLAGS.num_steps,
        init_scale=0.0,
        strategy="full",
        seed=FLAGS.seed,
        core_decode=FLAGS.core_decode,
        persistent_schedule=FLAGS.persistent_schedule,
    )
    check_memory(config, plan, FLAGS.batch, _DTYPES[FLAGS.dtype])
    return dataclasses.replace(plan, ids=np.tile(plan.ids, (FLAGS.batch, 1)))


def _model(config: HuginnConfig) -> Huginn:
    dtype = _DTYPES[FLAGS.dtype]
    if FLAGS.checkpoint:
        return with_config(from_pretrained(FLAGS.checkpoint, dtype=dtype), config)
    return random_init(config, jax.random.key(FLAGS.seed), dtype=dtype)


def _torch_impls() -> list[str]:
    unknown = [name for name in FLAGS.torch_impls if name not in TORCH_LOOPS]
    if unknown:
        raise UserError(
            f"--torch_impls: unknown {', '.join(unknown)}; known: {', '.join(TORCH_LOOPS)}"
        )
    return list(dict.fromkeys(FLAGS.torch_impls))


def say(line: str) -> None:
    """A progress line on stderr (with --progress): where a long run is."""
    if FLAGS.progress:
        print(f"generate_vs_torch: {line}", file=sys.stderr, flush=True)


def run_jax(model: Huginn, plan: Plan) -> Generation:
    """The JAX loop. Its prefill runs once untimed first (a plan of one token, same cache
    shape, so the same executable), then the timed run; the stats' compile seconds are the
    prefill's (first run) and the decode's, `prefill_first_call_s` the untimed prefill."""
    warm = run_plan(model, dataclasses.replace(plan, max_new_tokens=1))
    compile_prefill, first_call_s = warm.stats["compile_s"]["prefill"], warm.stats["prefill_s"]
    del warm  # its cache
    say(f"JAX: {plan.max_new_tokens} tokens, {plan.spec.num_steps} Core iterations each")
    gen = run_plan(model, plan, return_logits=True, progress=FLAGS.progress)
    gen.stats["compile_s"] = {**gen.stats["compile_s"], "prefill": compile_prefill}
    gen.stats["prefill_first_call_s"] = first_call_s
    return gen


def run_torch(model: Huginn, plan: Plan, impls: list[str], notes: list[str], details: dict):
    """Each PyTorch loop of `impls` over `model`'s weights, after its conformance check (with
    --torch_conformance): ({impl: TorchGeneration}, {impl: check}), each loop's JSON details
    added to `details` as it ends; empty (with a note) when torch is missing. torch_compile runs
    in each mode of --torch_compile_mode (`compile_modes_for`: every mode with "fastest"), one
    after another, and keeps the fastest (by median latency; every mode's in its details)."""
    if not impls:
        return {}, {}
    if not torch_chain.available():
        notes.append(f"PyTorch is not installed ({torch_chain.INSTALL}): its loops are skipped")
        return {}, {}
    import torch

    from experiments.torch_ref.core import FastCore, to_torch_fn

    cuda = jax.default_backend() == "gpu" and torch.cuda.is_available()
    if not cuda:
        notes.append("no CUDA for torch: its loops run on the CPU, without CUDA graphs")
        # One intra-op thread: an OpenMP team beside JAX's thread pool waits on descheduled
        # threads at every compiled kernel's barrier.
        torch.set_num_threads(1)
    torch._inductor.config.coordinate_descent_tuning = FLAGS.torch_coordinate_descent
    dtype = torch_chain.torch_dtype(str(jnp.dtype(model.dtype)))
    params = nnx.to_pure_dict(nnx.state(model))
    to_torch = to_torch_fn("cuda" if cuda else "cpu", dtype)
    shared = {"torch_compile", "torch_graph"} & set(impls)
    fast_core = FastCore(params, model.config, to_torch) if shared else None
    runs, checks = {}, {}
    for impl in program.progress(impls, "generate_vs_torch: torch loops"):
        # the loops other than torch_compile compile nothing: they run once, "default" unused
        modes = ("default",)
        if impl == "torch_compile":
            modes = compile_modes_for(FLAGS.torch_compile_mode)
        loop = (impl, params, model, plan, to_torch, fast_core, cuda, modes)
        run_mode = functools.partial(run_torch_loop, *loop)
        tried, failed = run_modes(impl, modes, run_mode, details, say)
        gen, detail, check = min(tried, key=lambda t: t[0].latency_median_s)
        if len(modes) > 1:
            detail["compile_modes"] = {d["compile_mode"]: g.latency_median_s for g, d, _ in tried}
            each = ", ".join(f"{m} {1e3 * s:.2f}" for m, s in detail["compile_modes"].items())
            print(f"{impl}: {each} ms per token; kept {detail['compile_mode']}")
        if failed:
            detail["compile_failures"] = failed
            notes.extend(
                f"{impl}: mode {m} left out, torch.compile failed: {w}" for m, w in failed.items()
            )
        missed = [c for _, _, c in tried if c is not None and not c["passed"]]
        if check is not None:
            checks[impl] = missed[0] if missed else check  # any mode's miss voids the timings
        runs[impl], details[impl] = gen, detail
        del tried
    return runs, checks


def run_modes(impl: str, modes, run_mode, details: dict, say) -> tuple[list, dict[str, str]]:
    """`run_each_mode` for one loop, its lines said with the loop's name: (what each mode
    returned, in order; {mode: why} for each that torch.compile failed to build). Each mode's
    JSON details (the second of what it returned) go into `details[impl]["modes_so_far"]` as
    it ends: what an interrupted run writes."""
    so_far = {}

    def ended(mode, returned):
        so_far[mode] = returned[1]
        details[impl] = {"modes_so_far": dict(so_far)}

    done, failed = run_each_mode(modes, run_mode, lambda line: say(f"{impl}: {line}"), ended)
    return list(done.values()), failed


def run_torch_loop(impl, params, model, plan, to_torch, fast_core, cuda, modes, mode):
    """One PyTorch loop (torch_compile in `mode`, one of the `modes` timed), after its
    conformance check (with --torch_conformance), torch_compile's decode tokens traced under
    --trace_dir (each mode's apart): (TorchGeneration, its JSON details, the check or None)."""
    import torch

    from experiments.torch_ref.conformance import check_generation_impl
    from experiments.torch_ref.huginn import run_loop

    device = "cuda" if cuda else "cpu"
    check = None
    if FLAGS.torch_conformance:
        check = check_generation_impl(impl, device, mode, FLAGS.graph_warmup)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    traced: dict = {}
    trace = None
    if FLAGS.trace_dir and impl == "torch_compile":
        name = f"{impl}.trace.json" if len(modes) == 1 else f"{impl}.{mode}.trace.json"
        trace = token_tracer(Path(FLAGS.trace_dir) / name, plan, traced)
    gen = run_loop(
        impl,
        params,
        model.config,
        to_torch,
        plan.ids,
        plan.max_new_tokens,
        plan.spec.num_steps,
        compile_mode=mode,
        warmup=FLAGS.graph_warmup,
        fast_core=fast_core,
        trace=trace,
    )
    detail = {
        "loop": loop_text(impl, cuda, mode),
        "graph": gen.graph,
        "compile_mode": mode if impl == "torch_compile" else None,
        "coordinate_descent_tuning": (
            FLAGS.torch_coordinate_descent if impl == "torch_compile" else None
        ),
        "graphs_compiled": gen.graphs_compiled,
        "prefill_s": gen.prefill_s,
        "setup_s": gen.setup_s,
        "capture_s": gen.capture_s,
        "decode_latency_s": gen.latencies_s,
        "latency_median_s": gen.latency_median_s,
        "tokens": gen.tokens.tolist(),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "peak_bytes_allocated": torch.cuda.max_memory_allocated() if cuda else None,
        **traced,
    }
    return gen, detail, check


def token_tracer(path: Path, plan: Plan, into: dict):
    """The `trace` hook of a torch loop (`run_loop`): replays min(TRACE_TOKENS, the plan's
    decode tokens) tokens of its decode step under torch.profiler, writes the Chrome trace to
    `path` and puts the kernels per token into `into` (`trace_tokens`, `trace`,
    `trace_us_per_token`, `trace_file`)."""
    tokens = min(TRACE_TOKENS, plan.max_new_tokens - 1)

    def trace(step) -> None:
        import torch

        def replay() -> None:
            for _ in range(tokens):
                step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()

        rows, spent = trace_lib.trace_run(replay, path, torch=True, units=tokens)
        into.update(
            trace_tokens=tokens,
            trace=[dataclasses.asdict(row) for row in rows],
            trace_us_per_token=spent,
            trace_file=str(path),
        )

    return trace


def main(argv: list[str]) -> None:
    logging.set_verbosity(logging.WARNING)  # no backend-probing chatter around the output
    if FLAGS.graph_warmup < 1:
        raise UserError("--graph_warmup must be at least 1 (cuBLAS and friends initialise there)")
    impls = _torch_impls()
    program.check_outputs(FLAGS.json_out)
    use_gemm(FLAGS.gemm)  # before anything starts the backend
    try:  # every bad setting fails here (presets, make_plan, checkpoints), before compilation
        config = _config()
        plan = _plan(config)
        model = _model(config)
    except ValueError as e:
        raise UserError(str(e)) from None
    measured: dict = {}  # what an interrupted run writes
    with program.keep_partial(FLAGS.json_out, lambda: measured):
        say(f"JAX: prefill of {plan.ids.shape[1]} positions, compiled and run once untimed")
        jax_gen = run_jax(model, plan)
        measured["jax"] = {**jax_gen.stats, "tokens": jax_gen.tokens.tolist()}
        notes: list[str] = []
        measured["torch"] = details = {}  # filled loop by loop
        runs, checks = run_torch(model, plan, impls, notes, details)
    comparisons = {impl: compare(jax_gen, g.tokens, g.logits) for impl, g in runs.items()}
    for impl, comparison in comparisons.items():
        details[impl]["comparison"] = comparison
    records = make_records(jax_gen, runs, comparisons, checks, FLAGS.batch)
    for line in notes:
        print(f"note: {line}")
    if FLAGS.json_out:
        result = {
            "jax": measured["jax"],
            "torch": details,
            "records": records,
            "conformance": checks,
            "notes": notes,
        }
        print(f"results: {program.write_results(FLAGS.json_out, result)}")
    print_table(records, comparisons, checks, details)
    print_traces(details)
    failed = [impl for impl, check in checks.items() if not check["passed"]]
    if failed:
        cli.fail(
            "generate_vs_torch",
            f"{', '.join(failed)} missed the conformance greedy tokens; their timings are void",
            code=1,
        )


if __name__ == "__main__":
    program.run("generate_vs_torch", define_flags, main)
