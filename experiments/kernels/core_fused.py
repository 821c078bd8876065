"""Times the fused Core decode kernel at huginn-0125's shapes: per context, against the floor and
against its own weight stream, and where its time goes.

    python -m experiments.kernels.core_fused [--batch=1 --contexts=64,1024,4096 --profile]
        [--schedules=8:2,6:3]

Random weights (`fused_step.random_step_weights`), `--iterations` Core iterations per call at one
position `context` (the cache slots hold context + 64 positions), each row the device time of
a call (CUPTI, median of --reps, with its range) over the iterations: the kernel and the few
XLA operations around it (the embedded half of the adapter once per call, the tables, the new
rows). Columns: ms per iteration; the floor: the products' weights (as padded, 64 rows per
unit) and the cache bytes the attention must read (batch x layers x heads x context x 2 x
head_dim in bf16) at the measured read ceiling (results/<device>/ceilings.json), and % of it.
The "stream" row runs the same products alone (`weight_stream`, [64, 128] tiles, ring 8): what
the fusion of the rest costs is the difference. The first row of each batch is checked against
`step_program.core_iteration` (float32). --profile: Mosaic GPU's on-device profiler records
each step and barrier (SM cycles per iteration, median over the workers, and their p10-p90),
with the first schedule. A schedule RING:KV_STAGES: weight units in flight per worker and
cached blocks in flight in the attention (the shared memory bounds the two together).
Needs an sm_90 GPU.
"""

from __future__ import annotations

import collections
import json
import os
import re
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import flags  # noqa: E402

from experiments import cli, program  # noqa: E402
from experiments.cli import UserError  # noqa: E402
from experiments.measure import ceilings as ceilings_lib  # noqa: E402
from experiments.measure.device_time import cupti_us  # noqa: E402

FLAGS = flags.FLAGS
PROGRAM = "core_fused"
SHAPE = (5280, 55, 17920, 4)  # huginn-0125: n_embd, heads, MLP width, Core layers
WORKERS = 132  # one per SM of an H100 / H200
UNIT_COLS = 128


def define_flags() -> None:
    from pallas_kernels.core_step.fused_plan import KV_STAGES, RING

    flags.DEFINE_list("batch", ["1"], "Sequences per call (1..8), a list.")
    flags.DEFINE_list("contexts", ["64", "1024", "4096"], "Cached positions, a list.")
    flags.DEFINE_integer("iterations", 8, "Core iterations per call.")
    flags.DEFINE_list(
        "schedules", [f"{RING}:{KV_STAGES}"],
        "RING:KV_STAGES, a list: weight units in flight per worker, cached blocks in flight "
        "(default: the kernel's default schedule).",
    )  # fmt: skip
    flags.DEFINE_integer("reps", 10, "Timed calls per row (median).")
    flags.DEFINE_bool("profile", False, "Record the steps' cycles (batch 1, the last context).")
    flags.DEFINE_string("json_out", "out/core_fused.json", "Results JSON.")


def floor_bytes(batch: int, context: int) -> tuple[int, int]:
    """(weight bytes, cache bytes) one iteration must read."""
    from pallas_kernels.core_step.fused_plan import FusedShape
    from pallas_kernels.core_step.plan import stream_bytes

    d, heads, f, layers = SHAPE
    shape = FusedShape(d, heads, d // heads, f, layers, batch, UNIT_COLS)
    return stream_bytes(shape.phases), batch * layers * 2 * context * d * 2


def fused_rows(w, batch: int, contexts: list[int], schedule, ceiling) -> list[dict]:
    from pallas_kernels.core_step import Pending, core_iteration, rope_row
    from pallas_kernels.core_step.fused_step import fused_core_decode, pack_weights

    d, heads, _, layers = SHAPE
    its, (ring, kv_stages) = FLAGS.iterations, schedule
    keys = jax.random.split(jax.random.key(6), 4)
    state, embedded = (jax.random.normal(k, (batch, d)) for k in keys[:2])
    cache_shape = (its * layers, batch, max(contexts) + 64, heads, d // heads)
    k, v = (jax.random.normal(key, cache_shape).astype(jnp.bfloat16) for key in keys[2:])
    slots = jnp.arange(its * layers, dtype=jnp.int32).reshape(its, layers)
    fw = pack_weights(w, heads=heads, batch=batch, rope_base=10000.0, unit_cols=UNIT_COLS)

    def call(fw, state, embedded, k, v, slots, pos):
        return fused_core_decode(
            fw, Pending(state), embedded, k, v, slots, pos,
            iterations=its, workers=WORKERS, ring=ring, kv_stages=kv_stages,
        )  # fmt: skip

    fn = jax.jit(call)
    rows = []
    for context in contexts:
        pos = jnp.int32(context)
        row = dict(impl="fused", batch=batch, context=context, ring=ring, kv_stages=kv_stages)
        if not rows:  # the first row: the state against the specification
            got = fn(fw, state, embedded, k, v, slots, pos)[0].value(w.eps)
            want, e_part = Pending(state), None
            cos, sin = rope_row(context, d // heads, 10000.0)
            for i in range(its):
                kf, vf = (c[slots[i]].astype(jnp.float32) for c in (k, v))
                want, _, _, e_part = jax.jit(core_iteration)(
                    w, want, embedded, kf, vf, context, cos, sin, e_part=e_part
                )
            want = want.value(w.eps)
            row["rel_err"] = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
        rows.append(timed(row, fn, ceiling, *floor_bytes(batch, context), fw, state, embedded,
                          k, v, slots, pos))  # fmt: skip
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

    d, _, f, layers = SHAPE
    phases = core_phases(d, f, 3 * d, layers, unit_cols=UNIT_COLS)
    weights = tuple(jnp.full((p.k, p.n), 0.01, jnp.bfloat16) for p in phases)
    x0 = jnp.ones((batch, phases[0].k), jnp.float32)

    def fn(x, w):
        return weight_stream(
            x, w, phases=phases, iterations=FLAGS.iterations, workers=WORKERS,
            unit_cols=UNIT_COLS, ring=8,
        )  # fmt: skip

    row = dict(impl="stream", batch=batch, context=0, ring=8)
    return timed(row, fn, ceiling, stream_bytes(phases), 0, x0, weights)


def profile(w, context: int, schedule) -> dict:
    """Cycles per iteration of each step kind and of the barriers, over the workers."""
    from pallas_kernels.core_step import Pending
    from pallas_kernels.core_step.fused_step import fused_core_decode, pack_weights

    d, heads, _, layers = SHAPE
    its = FLAGS.iterations
    directory = tempfile.mkdtemp(prefix="core_fused_profile_")
    keys = jax.random.split(jax.random.key(6), 4)
    state, embedded = (jax.random.normal(k, (1, d)) for k in keys[:2])
    shape = (its * layers, 1, context + 64, heads, d // heads)
    k, v = (jax.random.normal(key, shape).astype(jnp.bfloat16) for key in keys[2:])
    slots = jnp.arange(its * layers, dtype=jnp.int32).reshape(its, layers)
    fw = pack_weights(w, heads=heads, batch=1, rope_base=10000.0, unit_cols=UNIT_COLS)
    out = fused_core_decode(
        fw, Pending(state), embedded, k, v, slots, jnp.int32(context), iterations=its,
        workers=WORKERS, ring=schedule[0], kv_stages=schedule[1], profile_dir=directory,
    )  # fmt: skip
    jax.block_until_ready(out)
    trace = json.loads(max(Path(directory).glob("*.json"), key=os.path.getmtime).read_text())
    per_worker: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    opened: dict[int, list] = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "B":
            opened[e["tid"]].append((e["name"], e["ts"]))
        elif e.get("ph") == "E":
            name, start = opened[e["tid"]].pop()
            kind = re.sub(r"\d+$", "", name.split("/")[-1])
            per_worker[e["tid"]][kind] += (e["ts"] - start) * 1e3 / its  # ns = cycles
    out = {}
    for kind in sorted({n for c in per_worker.values() for n in c}):
        vals = sorted(c.get(kind, 0.0) for c in per_worker.values())
        out[kind] = dict(
            median=statistics.median(vals),
            p10=vals[len(vals) // 10],
            p90=vals[9 * len(vals) // 10],
        )
    return dict(
        context=context, schedule=list(schedule), workers=len(per_worker),
        cycles_per_iteration=out,
    )  # fmt: skip


def parse_schedule(text: str) -> tuple[int, int]:
    """(ring, kv_stages) of a RING:KV_STAGES string such as 8:2."""
    ring, _, kv_stages = text.partition(":")
    if not (ring.isdigit() and kv_stages.isdigit()):
        raise UserError(f"--schedules: {text!r} is not RING:KV_STAGES (e.g. 8:2)")
    return int(ring), int(kv_stages)


def format_table(rows: list[dict], prof: dict | None) -> str:
    head = (
        f"{'batch':>5}  {'impl':<8}{'sched':>6}{'context':>8}{'ms/iter':>9}{'floor ms':>10}"
        f"{'% floor':>9}  err"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        ms, floor = r.get("ms_per_iteration"), r.get("floor_ms")
        cells = f"{ms:9.3f}" if ms else f"{'-':>9}"
        cells += f"{floor:10.3f}{r['pct_floor']:8.1f}%" if floor and ms else f"{'-':>10}{'-':>9}"
        err = f"{r['rel_err']:.1e}" if "rel_err" in r else "-"
        sched = f"{r['ring']}:{r['kv_stages']}" if "kv_stages" in r else f"{r['ring']}"
        lines.append(f"{r['batch']:>5}  {r['impl']:<8}{sched:>6}{r['context']:>8}{cells}  {err}")
    if prof:
        ring, kv_stages = prof["schedule"]
        lines.append(
            f"\ncycles per iteration (median over {prof['workers']} workers, p10-p90), "
            f"context {prof['context']}, batch 1, schedule {ring}:{kv_stages}:"
        )
        for kind, c in prof["cycles_per_iteration"].items():
            lines.append(f"  {kind:<10}{c['median']:>12.0f}   {c['p10']:.0f}-{c['p90']:.0f}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    batches = cli.positive_ints("batch", FLAGS.batch)
    contexts = cli.positive_ints("contexts", FLAGS.contexts)
    if max(batches) > 8:
        raise UserError(f"--batch={max(batches)}: the kernel takes at most 8 sequences")
    if FLAGS.iterations < 1 or FLAGS.reps < 1:
        raise UserError("--iterations and --reps must be >= 1")
    schedules = [parse_schedule(text) for text in FLAGS.schedules]
    from pallas_kernels.core_step.fused_plan import FusedShape, check_fused

    d, heads, f, layers = SHAPE
    for batch in batches:
        for ring, kv_stages in schedules:
            try:
                shape = FusedShape(d, heads, d // heads, f, layers, batch, UNIT_COLS)
                check_fused(shape, WORKERS, ring, x_stages=2, lag=1, kv_stages=kv_stages)
            except ValueError as e:
                raise UserError(f"schedule {ring}:{kv_stages}, --batch={batch}: {e}") from None
    program.check_outputs(FLAGS.json_out)
    device = jax.devices()[0]
    if device.platform != "gpu":
        raise UserError(f"needs an sm_90 GPU (Mosaic GPU); the backend here is {device.platform}")
    from pallas_kernels.core_step.fused_step import random_step_weights

    found = ceilings_lib.for_device(device.device_kind)
    ceiling = found.read_bytes_per_s if found else None
    w = random_step_weights(*SHAPE)
    rows = []
    for batch in program.progress(batches, PROGRAM):
        rows.append(stream_row(batch, ceiling))
        for schedule in schedules:
            rows += fused_rows(w, batch, contexts, schedule, ceiling)
    prof = profile(w, contexts[-1], schedules[0]) if FLAGS.profile else None
    program.write_results(FLAGS.json_out, {"rows": rows, "profile": prof, "complete": True})
    print(format_table(rows, prof))


if __name__ == "__main__":
    program.run(PROGRAM, define_flags, main)
