"""Times the fused Core decode kernel at huginn-0125's shapes: per context, against the floor and
against its own weight stream, and where its time goes.

    python -m experiments.kernels.core_fused [--batch=1 --contexts=64,1024,4096 --profile]
        [--unit_cols=256 --schedules=3:3,4:2] [--jobs=2]

Random weights (`fused_step.random_step_weights`), `--iterations` Core iterations per call at one
position `context` (the cache slots hold `slot_positions(context)`), each row the device time of
a call (CUPTI, median of --reps, with its range) over the iterations: the kernel and the few
XLA operations around it (the embedded half of the adapter once per call, the tables, the new
rows). Columns: ms per iteration; the floor: the products' weights (as padded, 64 rows per
unit) and the cache bytes the attention must read (batch x layers x heads x context x 2 x
head_dim in bf16) at the measured read ceiling (results/<device>/ceilings.json), and % of it.
The "stream" row runs the same products alone (`weight_stream`, the same units, 128 KiB of
them in flight): what the fusion of the rest costs is the difference. The first row of each
batch is checked against `step_program.core_iteration` (float32). --profile: Mosaic GPU's
on-device profiler records each step, barrier (also by the step it follows: after_qkv, ...) and
part of the attention (its RoPE, its cached blocks, the combine of a head's splits), and with
one grid barrier per iteration the waits on counters (per kind of product: its owners' chunks,
`_own`, its first units' inputs, `_inputs`, the norms' scalars, `_wait_owned`; per attention
item, its head's tiles, `wait_head`), and with a second warpgroup each qkv's wait for its
partials (`wait_parts`) and, in that warpgroup's own table, its parts per layer (the item,
`ahead`; its wait for q, `wait_q`; `rope`, `blocks`, `partials_out`): SM cycles per iteration,
median over the workers, and their p10-p90, the first --batch, the last context, per schedule
(its records take shared memory, each warpgroup's: a schedule that leaves too little is refused
before any work; the default at batch 1 fits a profile of 3 iterations at most, --iterations=3).
--unit_cols: the weight units' width, which the ring counts (`fused_plan.Schedule`'s defaults
are for 256).
--skip_barriers=proj,attn,...: a timing bound, the kernel without its grid barriers after those
kinds of step, or with one grid barrier per iteration without its units' waits on those steps'
output tiles (wrong results, marked "bound").
A schedule RING:KV_STAGES[:L2_UNITS[...]] (`fused_plan.FORMAT`, in --schedules' help), in order:
weight units in flight per worker and cached blocks in flight in the attention (the shared
memory bounds the two together), the weight unit that many units further on prefetched into
L2, each attention item's first blocks prefetched into L2, the cached positions per attention
block, 64 or 128, the next product's units after the ring's prefetched into L2 at the barrier
after each product but a qkv, and after a qkv, and the units that a worker takes after a proj
(and after an MLP proj that a qkv follows) on tile counters before it waits for every worker
(0: a grid barrier there), 1 for a second warpgroup per worker that runs the attention's
cached blocks while the first streams the qkv's k and v columns, 1 for one
grid barrier per iteration, every other step on counters of the data it reads, 1 for
attention items of two heads each, whose cached values are read without the columns beyond
the heads' own, the wgmmas in flight behind a unit's before its ring slot takes the next
copy (1; 0: one more copy in flight), 1 to issue each unit's input copy ahead (and its wait
on a tile counter) after the unit's wgmma and its ring slot's release, and the output tiles
per counter of the products that another product reads (`fused_plan.Schedule`).
--jobs=N: each (batch, schedule) in a process of its own, N at a time, so that their
compilations overlap; the processes take turns on the GPU (a file lock around their work
there, shared with other programs given the same --gpu_lock; the compilations run outside
it), and the table is theirs together; each process's times are printed as it ends. Needs an
sm_90 GPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import flags  # noqa: E402

from experiments import cli, program  # noqa: E402
from experiments.cli import UserError  # noqa: E402
from experiments.kernels import scopes  # noqa: E402
from experiments.kernels.core_fused_report import format_table, row_times  # noqa: E402
from experiments.measure import ceilings as ceilings_lib  # noqa: E402
from experiments.measure.device_time import cupti_us  # noqa: E402
from experiments.measure.gpu_lock import held  # noqa: E402
from huginn_jax.config import huginn_0125  # noqa: E402

FLAGS = flags.FLAGS
PROGRAM = "core_fused"
SHAPE = (  # huginn-0125: n_embd, heads, MLP width, Core layers
    huginn_0125.n_embd,
    huginn_0125.n_heads,
    huginn_0125.intermediate_size,
    huginn_0125.n_layers_in_recurrent_block,
)
WORKERS = 132  # one per SM of an H100 / H200


def define_flags() -> None:
    from pallas_kernels.core_step.fused_plan import DEFAULT_UNIT_COLS, FORMAT, Schedule

    flags.DEFINE_list("batch", ["1"], "Sequences per call (1..8), a list.")
    flags.DEFINE_list("contexts", ["64", "1024", "4096"], "Cached positions, a list.")
    flags.DEFINE_integer("iterations", 8, "Core iterations per call.")
    flags.DEFINE_list(
        "schedules", [str(Schedule())],
        f"{FORMAT}, a list: weight units in flight per "
        "worker, cached blocks in flight, weight units prefetched into L2 beyond the ring, cached "
        "blocks per item prefetched into L2, cached positions per block (64 or 128), the next "
        "product's units prefetched into L2 at the barrier after a product (not a qkv), and "
        "after a qkv, units taken on tile counters after a proj and an MLP proj (0: a grid "
        "barrier), 1 to run the attention's cached blocks in a second warpgroup while the "
        "qkv's k and v columns stream, 1 for one grid barrier per iteration, the other steps on "
        "counters of the data they read, 1 for attention items of two heads each, the wgmmas "
        "in flight behind a unit's before its slot is refilled, 1 to issue a unit's input copy "
        "ahead after its wgmma and its slot's release, the output tiles per counter of the "
        "products that another product reads (default: the kernel's default).",
    )  # fmt: skip
    flags.DEFINE_integer(
        "unit_cols", DEFAULT_UNIT_COLS,
        "Output columns of a [64, unit_cols] weight unit: 64, 128 or 256.",
    )  # fmt: skip
    flags.DEFINE_list(
        "skip_barriers", [],
        "A timing bound: the kinds of step (adapter, qkv, attn, proj, fc, mlp_proj) after which "
        "the kernel leaves its grid barrier out (the last of an iteration stays), or with one "
        "grid barrier per iteration the units' waits on their output tiles. The results are "
        "wrong (the err column says 'bound'); the time says what those barriers or waits cost.",
    )  # fmt: skip
    flags.DEFINE_integer("reps", 10, "Timed calls per row (median).")
    flags.DEFINE_bool(
        "profile", False, "Record the steps' cycles (first batch, last context), per schedule."
    )
    flags.DEFINE_integer(
        "jobs", 1, "Processes at once, one per (batch, schedule), each with its weights on the GPU."
    )
    flags.DEFINE_bool("stream", True, "Time the bare weight stream per batch.")
    flags.DEFINE_string(
        "gpu_lock", "", "A file to lock around the GPU work (with --jobs, its processes share it)."
    )
    flags.DEFINE_string("json_out", "out/core_fused.json", "Results JSON.")


def fused_shape(batch: int):
    """The kernel's `FusedShape` of huginn-0125 at `batch` in --unit_cols units (ValueError for
    a width the kernel does not take)."""
    from huginn_jax.persistent import fused_shape as config_shape

    return config_shape(huginn_0125, batch, FLAGS.unit_cols)


def floor_bytes(batch: int, context: int) -> tuple[int, int]:
    """(weight bytes, cache bytes) one iteration must read."""
    from pallas_kernels.core_step.plan import stream_bytes

    d, _, _, layers = SHAPE
    return stream_bytes(fused_shape(batch).phases), batch * layers * 2 * context * d * 2


def decode_inputs(batch: int, slot_len: int):
    """(state, embedded [B, D], k, v caches [slots, B, slot_len, H, K] bf16, slots [r, L])."""
    d, heads, _, layers = SHAPE
    its = FLAGS.iterations
    keys = jax.random.split(jax.random.key(6), 4)
    state, embedded = (jax.random.normal(k, (batch, d)) for k in keys[:2])
    cache_shape = (its * layers, batch, slot_len, heads, d // heads)
    k, v = (jax.random.normal(key, cache_shape).astype(jnp.bfloat16) for key in keys[2:])
    slots = jnp.arange(its * layers, dtype=jnp.int32).reshape(its, layers)
    return state, embedded, k, v, slots


def slot_positions(context: int) -> int:
    """Cache positions per slot: room for the new position `context`, in whole blocks of every
    schedule."""
    from pallas_kernels.core_step.fused_plan import KV_BLOCKS

    return -(-(context + 1) // max(KV_BLOCKS)) * max(KV_BLOCKS)


def compiled_decode(w, batch: int, slot_len: int, schedule, profile_dir: str = ""):
    """(the kernel's call compiled for these shapes, its arguments but the position): the
    inputs are made under the GPU lock, the compilation outside it."""
    from pallas_kernels.core_step import Pending
    from pallas_kernels.core_step.fused_step import fused_core_decode, pack_weights

    d, heads, _, _ = SHAPE
    with held(FLAGS.gpu_lock):
        state, embedded, k, v, slots = decode_inputs(batch, slot_len)
        fw = pack_weights(w, heads=heads, batch=batch, rope_base=10000.0, unit_cols=FLAGS.unit_cols)
        args = jax.block_until_ready((fw, Pending(state), embedded, k, v, slots))
    decode = fused_core_decode.lower(
        *args, jnp.int32(0), iterations=FLAGS.iterations, workers=WORKERS,
        schedule=schedule, profile_dir=profile_dir, skip_barriers=tuple(FLAGS.skip_barriers),
    ).compile()  # fmt: skip
    return decode, args


def fused_rows(w, batch: int, contexts: list[int], schedule, ceiling) -> list[dict]:
    from pallas_kernels.core_step import core_iteration, rope_row

    d, heads, _, _ = SHAPE
    decode, args = compiled_decode(w, batch, slot_positions(max(contexts)), schedule)
    _, state, embedded, k, v, slots = args
    rows = []
    with held(FLAGS.gpu_lock):
        for context in contexts:
            pos = jnp.int32(context)
            row = dict(
                impl="fused",
                batch=batch,
                context=context,
                unit_cols=FLAGS.unit_cols,
                **dataclasses.asdict(schedule),
                skip_barriers=FLAGS.skip_barriers,
            )
            if not rows:  # the first row: the state against the specification
                got = decode(*args, pos)[0].value(w.eps)
                want, e_part = state, None
                cos, sin = rope_row(context, d // heads, 10000.0)
                for i in range(FLAGS.iterations):
                    kf, vf = (c[slots[i]].astype(jnp.float32) for c in (k, v))
                    want, _, _, e_part = jax.jit(core_iteration)(
                        w, want, embedded, kf, vf, context, cos, sin, e_part=e_part
                    )
                want = want.value(w.eps)
                row["rel_err"] = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
            rows.append(timed(row, decode, ceiling, *floor_bytes(batch, context), *args, pos))
    return rows


def timed(row: dict, fn, ceiling, weight_bytes: int, cache_bytes: int, *args) -> dict:
    us, kernels, note = cupti_us(fn, FLAGS.reps, *args)
    row.update(kernels=kernels, note=note, weight_bytes=weight_bytes, cache_bytes=cache_bytes)
    if us is not None:
        seconds = us * 1e-6 / FLAGS.iterations
        row["ms_per_iteration"] = seconds * 1e3
        if ceiling:
            row["floor_ms"] = (weight_bytes + cache_bytes) / ceiling * 1e3
            row["pct_floor"] = 100 * row["floor_ms"] / row["ms_per_iteration"]
    return row


def stream_row(batch: int, ceiling) -> dict:
    from pallas_kernels.core_step import core_phases, stream_bytes, weight_stream
    from pallas_kernels.core_step.stream import default_ring

    d, _, f, layers = SHAPE
    phases = core_phases(d, f, 3 * d, layers, unit_cols=FLAGS.unit_cols)
    with held(FLAGS.gpu_lock):
        weights = tuple(jnp.full((p.k, p.n), 0.01, jnp.bfloat16) for p in phases)
        x0 = jax.block_until_ready(jnp.ones((batch, phases[0].k), jnp.float32))

    def fn(x, w):  # the default ring: 128 KiB of units in flight
        return weight_stream(
            x, w, phases=phases, iterations=FLAGS.iterations, workers=WORKERS,
            unit_cols=FLAGS.unit_cols,
        )  # fmt: skip

    compiled = jax.jit(fn).lower(x0, weights).compile()
    ring = default_ring(FLAGS.unit_cols)
    row = dict(impl="stream", batch=batch, context=0, ring=ring, unit_cols=FLAGS.unit_cols)
    with held(FLAGS.gpu_lock):
        return timed(row, compiled, ceiling, stream_bytes(phases), 0, x0, weights)


def profile(w, batch: int, context: int, schedule) -> dict:
    """Cycles per iteration of each step kind and of the barriers, over the workers."""
    its = FLAGS.iterations
    directory = tempfile.mkdtemp(prefix="core_fused_profile_")
    decode, args = compiled_decode(w, batch, slot_positions(context), schedule, directory)
    with held(FLAGS.gpu_lock):
        jax.block_until_ready(decode(*args, jnp.int32(context)))
    trace = scopes.read_newest(directory)
    return dict(
        batch=batch, context=context, schedule=str(schedule), unit_cols=FLAGS.unit_cols,
        workers=scopes.recording_workers(trace),
        cycles_per_iteration=scopes.scope_cycles(trace, per=its),
        spread_per_iteration=scopes.spread(trace, per=its),
        second_warpgroup_workers=scopes.recording_workers(trace, warpgroup=1),
        second_warpgroup_cycles_per_iteration=scopes.scope_cycles(trace, per=its, warpgroup=1),
    )  # fmt: skip


def profile_hint(shape, schedule, iterations: int) -> str:
    """Where a profile of `iterations` does not fit beside `schedule`: the most iterations whose
    profile does, as a hint ('' where none does, or the schedule fails without a profile)."""
    from pallas_kernels.core_step.fused_fit import check_fused

    for n in range(iterations - 1, 0, -1):
        try:
            check_fused(shape, WORKERS, schedule, profiled_iterations=n)
        except ValueError:
            continue
        return f"; a profile of {n} iterations fits (--iterations={n})"
    return ""


def parse_schedule(text: str):
    """The `fused_plan.Schedule` of a --schedules entry; UserError for a bad one."""
    from pallas_kernels.core_step.fused_plan import Schedule

    try:
        return Schedule.parse(text)
    except ValueError as e:
        raise UserError(f"--schedules: {e}") from None


def measure(batches: list[int], contexts: list[int], schedules: list, ceiling):
    """(rows, profiles) of this process: per batch its stream row (--stream) and each
    schedule's rows, then with --profile each schedule's profile."""
    from pallas_kernels.core_step.fused_step import random_step_weights

    with held(FLAGS.gpu_lock):
        w = jax.block_until_ready(random_step_weights(*SHAPE))
    rows = []
    for batch in program.progress(batches, PROGRAM):
        if FLAGS.stream:
            rows.append(stream_row(batch, ceiling))
        for schedule in schedules:
            rows += fused_rows(w, batch, contexts, schedule, ceiling)
    if not FLAGS.profile:
        return rows, []
    return rows, [profile(w, batches[0], contexts[-1], sch) for sch in schedules]


def run_jobs(batches: list[int], schedules: list[str]) -> tuple[list[dict], list[dict]]:
    """`measure` over the (batch, schedule) cases in processes of their own, --jobs at once,
    taking turns on the GPU: the rows in the order one process would give them."""
    with tempfile.TemporaryDirectory(prefix="core_fused_jobs_") as tmp:
        return _run_jobs(batches, schedules, Path(tmp))


def _run_jobs(batches: list[int], schedules: list[str], work: Path):
    cases = [(b, sch) for b in batches for sch in schedules]
    # created by the first process that takes it; a given one is shared with other programs
    lock = Path(FLAGS.gpu_lock) if FLAGS.gpu_lock else work / "gpu.lock"

    def argv(n, batch, sch):  # the stream once per batch, each schedule's profile once
        first_of_batch, profiled = sch == schedules[0], batch == batches[0]
        return [
            sys.executable, "-m", "experiments.kernels.core_fused", f"--batch={batch}",
            f"--schedules={sch}", f"--contexts={','.join(FLAGS.contexts)}",
            f"--iterations={FLAGS.iterations}", f"--reps={FLAGS.reps}",
            f"--unit_cols={FLAGS.unit_cols}",
            f"--skip_barriers={','.join(FLAGS.skip_barriers)}",
            f"--stream={FLAGS.stream and first_of_batch}",
            f"--profile={FLAGS.profile and profiled}", f"--gpu_lock={lock}", "--jobs=1",
            f"--json_out={work / f'case_{n}.json'}",
        ]  # fmt: skip

    pending = list(enumerate(cases))
    running: dict[int, subprocess.Popen] = {}
    results: dict[int, dict] = {}
    while pending or running:
        while pending and len(running) < FLAGS.jobs:
            n, (batch, sch) = pending.pop(0)
            with open(work / f"case_{n}.log", "w") as log:
                running[n] = subprocess.Popen(
                    argv(n, batch, sch), stdout=log, stderr=subprocess.STDOUT
                )
        finished = [n for n, proc in running.items() if proc.poll() is not None]
        if not finished:
            time.sleep(1)
        for n in finished:
            rc = running.pop(n).returncode
            batch, sch = cases[n]
            if rc:
                for proc in running.values():
                    proc.kill()
                tail = (work / f"case_{n}.log").read_text().splitlines()[-15:]
                hint = ""
                if any("RESOURCE_EXHAUSTED" in line for line in tail):
                    hint = f"\nout of GPU memory with --jobs={FLAGS.jobs} processes at once: fewer"
                raise UserError(f"batch {batch} schedule {sch} failed:\n" + "\n".join(tail) + hint)
            results[n] = json.loads((work / f"case_{n}.json").read_text())
            print(
                f"[{len(results)}/{len(cases)}] batch {batch} schedule {sch}: "
                f"{row_times(results[n]['rows'])}",
                file=sys.stderr,
            )
    ordered = [results[n] for n in range(len(cases))]
    return [r for c in ordered for r in c["rows"]], [p for c in ordered for p in c["profiles"]]


def main(argv: list[str]) -> None:
    batches = cli.positive_ints("batch", FLAGS.batch)
    contexts = cli.positive_ints("contexts", FLAGS.contexts)
    if max(batches) > 8:
        raise UserError(f"--batch={max(batches)}: the kernel takes at most 8 sequences")
    if FLAGS.iterations < 1 or FLAGS.reps < 1 or FLAGS.jobs < 1:
        raise UserError("--iterations, --reps and --jobs must be >= 1")
    schedules = [parse_schedule(text) for text in FLAGS.schedules]
    from pallas_kernels.core_step.fused_fit import check_fused
    from pallas_kernels.core_step.fused_plan import STEP_KINDS

    if unknown := set(FLAGS.skip_barriers) - set(STEP_KINDS):
        raise UserError(f"--skip_barriers: {sorted(unknown)} not among {', '.join(STEP_KINDS)}")
    from pallas_kernels.core_step.plan import check_unit_cols

    try:
        check_unit_cols(FLAGS.unit_cols)
    except ValueError as e:
        raise UserError(f"--unit_cols: {e}") from None
    profiled = [(batches[0], FLAGS.iterations)] if FLAGS.profile else []  # the first batch
    for batch, profiled_iterations in [(b, 0) for b in batches] + profiled:
        for sch in schedules:
            try:
                check_fused(
                    fused_shape(batch), WORKERS, sch, profiled_iterations=profiled_iterations
                )
            except ValueError as e:
                what = " (--profile)" if profiled_iterations else ""
                hint = profile_hint(fused_shape(batch), sch, profiled_iterations)
                raise UserError(f"schedule {sch}, --batch={batch}{what}: {e}{hint}") from None
    program.check_outputs(FLAGS.json_out)
    device = jax.devices()[0]
    if device.platform != "gpu":
        raise UserError(f"needs an sm_90 GPU (Mosaic GPU); the backend here is {device.platform}")
    found = ceilings_lib.for_device(device.device_kind)
    ceiling = found.read_bytes_per_s if found else None
    if FLAGS.jobs > 1 and len(batches) * len(schedules) > 1:
        rows, profiles = run_jobs(batches, [str(sch) for sch in schedules])
    else:
        rows, profiles = measure(batches, contexts, schedules, ceiling)
    program.write_results(FLAGS.json_out, {"rows": rows, "profiles": profiles, "complete": True})
    print(format_table(rows, profiles))


if __name__ == "__main__":
    program.run(PROGRAM, define_flags, main)
