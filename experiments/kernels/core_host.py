"""Where the host time of a persistent Core call goes, part by part.

    python -m experiments.kernels.core_host [--batch=1 --context=1024 --iterations=8 --reps=50]

Random weights packed for the fused Core decode kernel at huginn-0125's shapes, and four jitted
calls on the same arguments, each holding more of what the model's call runs than the one
before:

  arguments  takes every argument and returns the position + 1: the dispatch and argument
             handling alone
  kernel     the fused kernel alone, on its arguments made once before (`kernel_arguments`)
  decode     `fused_step.fused_core_decode`: the kernel and the XLA operations around it
  model      decode with the new rows written into the caches, donated and passed back: what
             `huginn_jax.persistent.run_core_persistent` runs

Each row: the time until a waited call returned (the host's part: argument handling, the
executable's launches), then the call's whole wall time, median and p10-p90 over --reps calls
after 3 warm-up calls, and the host part per Core iteration. --top > 0 also traces --reps
calls of the last row under the JAX profiler's host tracer and lists the host events that took
the most time per call (each name's summed durations: nested events count in their parents
too). --nocommand_buffers runs every call without XLA's command buffers (CUDA graphs), each
kernel launched by itself rather than inside a graph. --calls picks the rows.
Needs an sm_90 GPU.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import flags  # noqa: E402

from experiments import program  # noqa: E402
from experiments.cli import UserError  # noqa: E402
from experiments.kernels.core_fused import SHAPE, WORKERS, slot_positions  # noqa: E402
from experiments.measure import timing  # noqa: E402
from experiments.measure import trace as trace_lib  # noqa: E402
from huginn_jax.xla_flags import use_command_buffers  # noqa: E402

FLAGS = flags.FLAGS
PROGRAM = "core_host"
CALLS = ("arguments", "kernel", "decode", "model")
WARMUP = 3


def define_flags() -> None:
    flags.DEFINE_integer("batch", 1, "Sequences per call (1..8).")
    flags.DEFINE_integer("context", 1024, "Cached positions before the new one.")
    flags.DEFINE_integer("iterations", 8, "Core iterations per call.")
    flags.DEFINE_integer("reps", 50, "Timed calls per row (median).")
    flags.DEFINE_integer("top", 20, "Host events listed from a traced run (0: no trace).")
    flags.DEFINE_list("calls", list(CALLS), f"Rows to measure, of {', '.join(CALLS)}.")
    flags.DEFINE_bool(
        "command_buffers", True,
        "XLA's command buffers (its default); --nocommand_buffers launches each kernel by itself.",
    )  # fmt: skip
    flags.DEFINE_string("json_out", "out/core_host.json", "Results JSON.")


def make_calls(batch: int, context: int, iterations: int) -> dict:
    """name -> a function that compiles that call and returns it: a function of no arguments
    that makes one call and returns what to wait for."""
    from pallas_kernels.core_step import Pending
    from pallas_kernels.core_step.fused import build_fused_core
    from pallas_kernels.core_step.fused_step import (
        fused_core_decode,
        kernel_arguments,
        pack_weights,
        random_step_weights,
        write_new_rows,
    )

    d, heads, f, layers = SHAPE
    w = random_step_weights(d, heads, f, layers)
    fw = pack_weights(w, heads=heads, batch=batch, rope_base=10000.0)
    del w
    keys = jax.random.split(jax.random.key(6), 4)
    state, embedded = (jax.random.normal(k, (batch, d)) for k in keys[:2])
    cache_shape = (iterations * layers, batch, slot_positions(context), heads, d // heads)
    k, v = (jax.random.normal(key, cache_shape).astype(jnp.bfloat16) for key in keys[2:])
    slots = jnp.arange(iterations * layers, dtype=jnp.int32).reshape(iterations, layers)
    pos = jnp.int32(context)
    args = jax.block_until_ready((fw, Pending(state), embedded, k, v, slots, pos))

    def decode(*a):
        return fused_core_decode(*a, iterations=iterations, workers=WORKERS)

    def model(fw, state, embedded, k, v, slots, pos):
        out, k_new, v_new = decode(fw, state, embedded, k, v, slots, pos)
        return out.z, *write_new_rows(k, v, slots, pos, k_new, v_new)

    kernel = build_fused_core(fw.shape, iterations, workers=WORKERS, eps=fw.eps)
    kernel_args = jax.block_until_ready(jax.jit(kernel_arguments)(*args))
    caches = [k, v]

    def arguments_call():
        compiled = jax.jit(lambda *a: a[-1] + 1).lower(*args).compile()
        return lambda: compiled(*args)

    def kernel_call():
        compiled = jax.jit(kernel).lower(*kernel_args).compile()
        return lambda: compiled(*kernel_args)

    def decode_call():
        compiled = jax.jit(decode).lower(*args).compile()
        return lambda: compiled(*args)

    def model_call():
        compiled = jax.jit(model, donate_argnums=(3, 4)).lower(*args).compile()

        def call():
            z, caches[0], caches[1] = compiled(*args[:3], *caches, *args[5:])
            return z

        return call

    return dict(
        arguments=arguments_call,
        kernel=kernel_call,
        decode=decode_call,
        model=model_call,
    )


def host_events(call, reps: int, top: int) -> list[dict]:
    """The `top` host event names by summed µs per call over `reps` traced calls of `call`."""
    options = jax.profiler.ProfileOptions()
    options.host_tracer_level, options.python_tracer_level = 3, 0
    directory = tempfile.mkdtemp(prefix="core_host_")
    with jax.profiler.trace(directory, create_perfetto_trace=True, profiler_options=options):
        for _ in range(reps):
            timing.wait(call())
    trace = trace_lib.load_trace(trace_lib.latest_trace_file(directory))
    hosts = {
        e["pid"]
        for e in trace["traceEvents"]
        if e.get("name") == "process_name" and e["args"]["name"].startswith("/host")
    }
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["pid"] in hosts]
    return [
        dict(name=r.name, us_per_call=r.us_per_chain, per_call=r.launches / reps)
        for r in trace_lib.breakdown(events, chains=reps)[:top]
    ]


def measure(call, reps: int, iterations: int) -> dict:
    samples = timing.time_fn(call, warmup=WARMUP, repeats=reps)
    host = timing.Samples(seconds=samples.returned, warmup=WARMUP)
    return dict(
        host_us=host.summary_us(), wall_us=samples.summary_us(),
        host_us_per_iteration=host.median * 1e6 / iterations,
    )  # fmt: skip


def format_table(rows: dict, events: list[dict], iterations: int, command_buffers: bool) -> str:
    lines = [
        f"{'call':<10}{'host us':>10}{'p10-p90':>16}{'wall us':>10}{'p10-p90':>16}"
        f"{'host us/iter':>14}"
    ]
    for name, r in rows.items():
        h, w = r["host_us"], r["wall_us"]
        lines.append(
            f"{name:<10}{h['median_us']:>10.1f}{h['p10_us']:>8.1f}-{h['p90_us']:<7.1f}"
            f"{w['median_us']:>10.1f}{w['p10_us']:>8.1f}-{w['p90_us']:<7.1f}"
            f"{r['host_us_per_iteration']:>14.2f}"
        )
    lines.append(
        f"host: until a waited call returned; wall: until its wait ended; r = {iterations}; "
        f"XLA's command buffers {'on' if command_buffers else 'off'}"
    )
    if events:
        traced = f"host event ({list(rows)[-1]} call)"
        lines += ["", f"{traced:<64}{'us/call':>9}{'per call':>9}"]
        lines += [
            f"{e['name'][:63]:<64}{e['us_per_call']:>9.1f}{e['per_call']:>9.1f}" for e in events
        ]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if not 1 <= FLAGS.batch <= 8:
        raise UserError(f"--batch={FLAGS.batch}: the kernel takes 1 to 8 sequences")
    if min(FLAGS.context, FLAGS.iterations, FLAGS.reps) < 1 or FLAGS.top < 0:
        raise UserError("--context, --iterations and --reps must be >= 1, --top >= 0")
    unknown = sorted(set(FLAGS.calls) - set(CALLS))
    if unknown or not FLAGS.calls:
        raise UserError(f"--calls={','.join(FLAGS.calls)}: give some of {', '.join(CALLS)}")
    program.check_outputs(FLAGS.json_out)
    use_command_buffers(FLAGS.command_buffers)  # before the backend starts
    device = jax.devices()[0]
    if device.platform != "gpu":
        raise UserError(f"needs an sm_90 GPU (Mosaic GPU); the backend here is {device.platform}")
    print(f"packing and compiling: batch {FLAGS.batch}, context {FLAGS.context}", file=sys.stderr)
    t = time.perf_counter()
    compilers = make_calls(FLAGS.batch, FLAGS.context, FLAGS.iterations)
    rows, call = {}, None
    # each row printed as it is measured: the compilations take minutes
    for name in (c for c in CALLS if c in FLAGS.calls):
        call = compilers[name]()
        rows[name] = measure(call, FLAGS.reps, FLAGS.iterations)
        print(
            f"[{time.perf_counter() - t:.0f} s] {name}: host "
            f"{rows[name]['host_us']['median_us']:.1f} us, wall "
            f"{rows[name]['wall_us']['median_us']:.1f} us per call",
            file=sys.stderr,
        )
    events = host_events(call, FLAGS.reps, FLAGS.top) if FLAGS.top else []  # the last row's
    program.write_results(
        FLAGS.json_out,
        dict(batch=FLAGS.batch, context=FLAGS.context, iterations=FLAGS.iterations,
             command_buffers=FLAGS.command_buffers, rows=rows,
             traced_call=list(rows)[-1] if events else None, host_events=events),
    )  # fmt: skip
    print(format_table(rows, events, FLAGS.iterations, FLAGS.command_buffers))


if __name__ == "__main__":
    program.run(PROGRAM, define_flags, main)
