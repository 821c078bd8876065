"""The study's "From One Matrix to a Recurrent Core": the Core alone, r iterations per call.

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
  xla_row_gemv    as xla_pallas, and at batch 1 each GEMV one Pallas kernel that returns
                  split-K partial sums unreduced or applies the SiLU gate, XLA adding the
                  partials up where it builds the next row (huginn_jax.decode_row with
                  pallas_kernels.fused_gemv)
  xla_rows8       as xla_pallas, and at batch 1 each GEMV the first row of an 8-row XLA
                  product (a GEMM, not XLA's one-row reduction; huginn_jax.decode_row)
  xla_mgpu        as xla_pallas, prefill attention by jax's Mosaic GPU flash attention on
                  float16 copies (the model's attention_impl="mgpu"; GPU only)
  persistent      decode only: the r iterations in one persistent kernel
                  (huginn_jax.persistent: the weights packed once per case, before timing;
                  the cache's positions padded to whole blocks of 64); skipped with a note
                  where `why_not_persistent` refuses the case (prefill, an fp32 cache, batch
                  above 8, a GPU other than sm_90); Pallas' GPU interpreter on a CPU (slow)
  torch_compile   the same Core in PyTorch, the fast Core's iteration through torch.compile
                  (--torch_compile_mode; by default every mode, each timed, the fastest kept),
                  compiled once, r iterations replayed from one CUDA graph (reduce-overhead:
                  Inductor's own CUDA graphs); compile time reported apart (compile_seconds)
  torch_graph     the fast Core written by hand (fused RMSNorm, cached RoPE tables, SDPA, views,
                  static cache written in place), r iterations replayed from one CUDA graph
  torch_eager     the same, eager
  torch_reference the reference-faithful Core (float32 RMSNorm by hand, RoPE recomputed with
                  torch.stack), r iterations replayed from one CUDA graph
  torch_teaching  the study's teaching cache: history re-concatenated with torch.cat (eager)
(`--impls=torch` means all five; experiments.torch_ref.core_runner; torch_compile, torch_graph
and torch_reference need CUDA.) Each torch impl's Core code is also checked once per process
against the conformance checkpoint (experiments.torch_ref.conformance); a failure ends the run.
Timing: `measure.timing.time_fn`, each call waited for (with the time until it returned, the
host's part: host/iter), and `time_back_to_back`, calls dispatched without a wait
(--back_to_back), caches not flushed; each call restarts from the same
state and history, as in the study. Implementations whose output states disagree beyond the
tolerance (report.check_tolerance) end the run with exit status 2 after the results are written.
On a CPU the flags not given take the smaller values of CPU_DEFAULTS (one line says which, and
the JSON records them); a problem that cannot fit in memory is refused before anything is
allocated; Ctrl-C or SIGTERM writes the rows measured so far, marked "complete": false (with
the torch.compile modes already timed in the case it stopped in: `torch_compile_modes_so_far`).
"""

from __future__ import annotations

from pathlib import Path

from absl import flags

from experiments import cli, program
from experiments.cli import UserError
from experiments.core import cases as cases_lib
from experiments.core import mesh as core_mesh
from experiments.core import profiling, report, sweep
from experiments.torch_ref.core_runner import COMPILE_MODES  # imports no torch
from huginn_jax.config import HuginnConfig
from huginn_jax.xla_flags import GEMM_CHOICES, use_command_buffers, use_gemm
from pallas_kernels.core_step.fused_plan import FORMAT

FLAGS = flags.FLAGS
# On a CPU, for the flags not given: the small preset and a few short cases (a check that the
# program runs; the huginn-0125 Core's CPU times say nothing about a GPU's).
CPU_DEFAULTS = {
    "config": "small",
    "context": ["64"],
    "iterations": ["2"],
    "warmup": 1,
    "repeats": 3,
    "back_to_back": 2,
}


def define_flags() -> None:
    """The program's flags; defined here, in the main module, so that --help lists them."""
    flags.DEFINE_list("mode", ["decode", "prefill"], "decode and/or prefill.")
    flags.DEFINE_list("iterations", ["1", "8"], "Core iterations r per call, a list (CPU: 2).")
    flags.DEFINE_list(
        "context",
        ["1024"],
        "Positions, a list: cached ones (decode) or new ones (prefill); at most 1048576 (CPU: 64).",
    )
    flags.DEFINE_list("batch", ["1"], "Sequences B, a list.")
    core_mesh.define_flag()
    flags.DEFINE_list(
        "impls",
        ["xla", "torch"],
        "xla, torch (= the five torch_* impls) or the impl names above (xla_split, xla_pallas, "
        "..., persistent).",
    )
    flags.DEFINE_enum(
        "torch_compile_mode",
        "fastest",
        ["fastest", *COMPILE_MODES],
        "torch.compile's mode for torch_compile (fastest: every mode compiled and timed in "
        "this process, one after another, the fastest kept for the row, each mode's times in "
        "the JSON's torch_compile_modes, a mode that torch.compile fails to build left out "
        "with a note, its error in torch_compile_failures; reduce-overhead: Inductor's CUDA "
        "graphs, otherwise one CUDA graph captured around the r compiled iterations).",
    )
    flags.DEFINE_string(
        "config",
        "huginn_0125",
        "Model preset whose Core is measured (huginn_0125, tiny, micro, small; CPU: small), or a "
        "from_pretrained directory (its config.json).",
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
    flags.DEFINE_string(
        "persistent_schedule",
        "",
        f"The persistent impl's kernel schedule {FORMAT} (pallas_kernels."
        "core_step.fused_plan.Schedule; '' = each case's default, "
        "huginn_jax.persistent.default_schedule).",
    )
    flags.DEFINE_bool(
        "command_buffers",
        True,
        "XLA's command buffers (CUDA graphs; XLA's default). --nocommand_buffers launches each "
        "kernel on its own (slower for the Core decode on the H200: docs/xla_flags.md).",
    )
    flags.DEFINE_string(
        "ceilings",
        "",
        "Measured ceilings JSON (experiments.ceilings); '' = results/<device>/ceilings.json "
        "when it exists.",
    )
    flags.DEFINE_integer("warmup", 3, "Untimed calls (CPU: 1).")
    flags.DEFINE_integer("repeats", 20, "Timed calls; the median time per iteration (CPU: 3).")
    flags.DEFINE_integer(
        "back_to_back",
        10,
        "Calls per back-to-back sample: --repeats samples of this many calls dispatched without "
        "a wait, then one wait (back_to_back_ms_per_iteration); 0 = not measured (CPU: 2).",
    )
    flags.DEFINE_integer("seed", 0, "Seed of weights, state and history.")
    flags.DEFINE_string("json_out", "out/core.json", "Results JSON ('' to skip).")
    flags.DEFINE_bool("hbm", False, "HBM bytes per iteration from Nsight Compute (GPU + ncu).")
    flags.DEFINE_list("hbm_impls", ["xla", "torch_graph"], "Impl names that --hbm profiles.")
    flags.DEFINE_integer("ncu_timeout", 300, "Seconds an --hbm child may run under ncu.")
    flags.DEFINE_string("trace_dir", None, "Write profiler traces; print per-kernel breakdowns.")
    flags.DEFINE_string("hlo_dir", None, "Write each XLA executable's optimized HLO here.")
    flags.DEFINE_string(
        "ncu_child", None, "Internal: impl:mode:batch:context:iterations under ncu."
    )


def check_flags() -> tuple[list[cases_lib.Case], list[str], HuginnConfig]:
    """The cases, impls and Core config of the flags; UserError for a bad value (no backend
    started, no file read but a --config directory's config.json)."""
    cases, impls = cases_lib.cases_from_flags(), cases_lib.impls_from_flags()
    cfg = cases_lib.core_config(FLAGS.config)
    if FLAGS.weights == "trained" and not Path(FLAGS.config).is_dir():
        raise UserError("--weights=trained needs --config=DIR, a from_pretrained directory")
    for name, least in (("warmup", 0), ("repeats", 1), ("ncu_timeout", 1)):
        if FLAGS[name].value < least:
            raise UserError(f"--{name}={FLAGS[name].value}: must be >= {least}")
    if FLAGS.back_to_back < 0 or FLAGS.back_to_back == 1:
        raise UserError(f"--back_to_back={FLAGS.back_to_back}: must be 0 (off) or >= 2")
    cli.names_in("hbm_impls", FLAGS.hbm_impls, cases_lib.IMPLS)
    core_mesh.shards_from_flag()
    profiling.persistent_schedule()
    return cases, impls, cfg


def main(argv: list[str]) -> None:
    use_gemm(FLAGS.gemm)  # before anything starts the backend (ncu children inherit it)
    use_command_buffers(FLAGS.command_buffers)
    if FLAGS.ncu_child:
        profiling.ncu_child(FLAGS.ncu_child)
        return
    check_flags()  # the user's values, before the backend starts
    # Traces and HLO files go under their folders: a file there must be creatable.
    folders = [str(Path(d) / "probe") for d in (FLAGS.trace_dir, FLAGS.hlo_dir) if d]
    program.check_outputs(FLAGS.json_out, *folders)
    cpu_line = program.cpu_defaults(CPU_DEFAULTS)  # the backend starts here
    cases, impls, cfg = check_flags()  # with the CPU's values
    cases_lib.check_cases(cfg, cases, impls, 2 if FLAGS.dtype == "bf16" else 4)
    if cpu_line:
        print(cpu_line)
    result: dict = {}
    with program.keep_partial(FLAGS.json_out, lambda: result):
        sweep.run(cases, impls, result)
    result["complete"] = True
    path = program.write_results(FLAGS.json_out, result) if FLAGS.json_out else None
    for line in report.report_lines(result):
        print(line)
    if path:
        print(f"results: {path}")
    print(report.format_table(result["records"]))
    failed = [c for c in result["checks"] if not c["passed"]]
    if failed:
        names = ", ".join(sorted({c["impl"] for c in failed}))
        raise UserError(f"outputs disagree beyond tolerance ({names}): see the check lines above")


if __name__ == "__main__":
    program.run("core", define_flags, main)
