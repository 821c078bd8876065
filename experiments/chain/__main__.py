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
  xla_no_cmdbuf  as xla, command buffers (CUDA graphs) off; run in a child process (GPU only)
  xla_loop_no_cmdbuf  as xla_loop, command buffers off (GPU only)
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
  pallas_splitk_no_cmdbuf  as pallas_splitk, command buffers off (GPU only)

N chains per call (--chains_per_call) spread a call's fixed cost over N chains: a JAX call
dispatches, copies its inputs and is waited for once; PyTorch's graph replay costs less.
--gemm=cublas turns XLA's Triton GEMMs off (every dot in cuBLAS), in this process and its
children. The floor columns use the read-only streaming rate the project measured on the device
(experiments.measure.ceilings); a device without one gets no floor. The plot goes next to the
JSON (same stem, .png) unless --plot_out names another path. A failed check makes the program
exit with status 1 after the results are written.
"""

from __future__ import annotations

import os
import sys

from absl import flags

from experiments import program
from experiments.chain import options as options_lib
from experiments.chain.report import failed_checks, format_table

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The chain's flags (`options.define_flags`)."""
    options_lib.define_flags()


def main(argv: list[str]) -> None:
    """The chain, or one of its children (--child)."""
    # Before the JAX backend starts: the parent, torch and child processes share the GPU.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    opts = options_lib.options_from_flags()
    # Traces go into folders under --trace_dir: a file there must be creatable.
    trace_probe = opts.trace_dir and os.path.join(opts.trace_dir, "probe")
    program.check_outputs(opts.json_out, opts.plot_out, trace_probe)
    from huginn_jax.xla_flags import use_gemm

    use_gemm(opts.gemm)  # XLA reads XLA_FLAGS once; children inherit them and get --gemm
    if FLAGS.child:
        from experiments.chain.children import child_main

        child_main(opts, FLAGS.child, FLAGS.child_out)
        return
    import jax

    from experiments.chain import sweep
    from experiments.measure import results as results_lib

    notes: list[str] = []
    note = sweep.note_fn(notes)
    if jax.devices()[0].platform == "cpu":
        opts = options_lib.cpu_options(opts, note)
    data = sweep.run(opts, notes, note)
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
    program.run("chain", define_flags, main)
