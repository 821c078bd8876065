"""Times the Core's weight stream as one persistent kernel against XLA's products and the floor.

    python -m experiments.kernels.core_stream [--batch=1,8 --iterations=8 --rings=16,24
        --unit_cols=64,128,256]

The products of `iterations` Core decode iterations of huginn-0125 (adapter, then per layer
qkv, proj, fc, mlp proj: 17 per iteration, weights padded to 64) run as one
`pallas_kernels.core_step.weight_stream` launch per weight tile width (--unit_cols) and ring
depth, and as XLA's chain of the same dots (`weight_stream_reference`). A ring depth counts
8 KiB ([64, 64] units): with [64, c] tiles the ring holds rings * 64 / c of them, the same bytes.
Wider tiles need n padded to c: their weights and input are the 64-padded ones zero-padded
(`pad_inputs`), so every row computes the same result, checked against the one reference. Each
row: kernel time per iteration (CUPTI device time of a call, median of --reps, divided by the
iterations), the weight bytes the row streams per iteration (its own padding) over that time,
% of the floor (the 64-padded bytes at the read-only streaming ceiling,
results/<device>/ceilings.json, over the row's time), the error against the reference, "vs xla"
(XLA's time / this row's). Needs an sm_90 GPU.
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import flags  # noqa: E402

from experiments import cli, program  # noqa: E402
from experiments.cli import UserError  # noqa: E402
from experiments.measure import ceilings as ceilings_lib  # noqa: E402
from experiments.measure.device_time import cupti_us  # noqa: E402

FLAGS = flags.FLAGS
PROGRAM = "core_stream"
# huginn-0125: n_embd, MLP intermediate size, fused qkv columns, Core layers
SHAPE = (5280, 17920, 3 * 5280, 4)
WORKERS = 132  # one per SM of an H100 / H200


def define_flags() -> None:
    flags.DEFINE_list("batch", ["1", "8"], "Rows of the activation (1..64).")
    flags.DEFINE_integer("iterations", 8, "Core iterations per kernel call.")
    flags.DEFINE_list(
        "rings",
        ["16", "24"],
        "Weight ring depths tried, in 8 KiB per SM: [64, c] tiles take rings * 64 / c slots.",
    )
    flags.DEFINE_list(
        "unit_cols",
        ["64", "128"],
        "Weight tile widths tried (output columns per unit: 64, 128, 256); 128 was the fastest "
        "on the H200 (docs/core_step.md), 64 the narrowest.",
    )
    flags.DEFINE_integer("x_stages", 4, "Input chunks in flight per worker.")
    flags.DEFINE_integer("reps", 10, "Timed calls per row (median).")
    flags.DEFINE_string("json_out", "out/core_stream.json", "Results JSON.")


def configs() -> list[tuple[int, int]]:
    """(unit_cols, ring slots) of every kernel row; UserError for a ring that does not divide."""
    from pallas_kernels.core_step.plan import UNIT, UNIT_COLS

    out = []
    for cols in cli.positive_ints("unit_cols", FLAGS.unit_cols):
        if cols not in UNIT_COLS:
            raise UserError(f"--unit_cols={cols}: must be one of {UNIT_COLS}")
        for ring in cli.positive_ints("rings", FLAGS.rings):
            if ring * UNIT % cols:
                raise UserError(f"--rings={ring}: not a whole number of [64, {cols}] tiles")
            out.append((cols, ring * UNIT // cols))
    return out


def check_configs(batches: list[int]) -> None:
    """UserError unless every row's schedule runs (ring shorter than a worker's units of any
    phase, shared memory), before the GPU is touched."""
    from pallas_kernels.core_step import core_phases
    from pallas_kernels.core_step.stream import check_schedule

    for cols, slots in configs():
        phases = core_phases(*SHAPE, unit_cols=cols)
        for batch in batches:
            try:
                check_schedule(phases, WORKERS, slots, FLAGS.x_stages, unit_cols=cols, m=batch)
            except ValueError as e:
                raise UserError(f"--unit_cols={cols} --batch={batch}: {e}") from None


def rows_of(batch: int, x0, weights, phases, ceiling) -> list[dict]:
    from pallas_kernels.core_step import (
        core_phases,
        pad_inputs,
        stream_bytes,
        weight_stream,
        weight_stream_reference,
    )

    iterations = FLAGS.iterations
    want = weight_stream_reference(x0, weights, phases=phases, iterations=iterations)
    scale = float(jnp.abs(want).max())
    n = phases[-1].n
    floor_bytes = stream_bytes(phases)  # the 64-padded weights
    rows = []

    def timed(name: str, fn, x, w, streamed: int, **extra):
        got = fn(x, w)  # [batch, >= n]: the padded columns must be zero
        err = max(
            float(jnp.abs(got[:, :n] - want).max()), float(jnp.abs(got[:, n:]).max(initial=0))
        )
        us, kernels, note = cupti_us(fn, FLAGS.reps, x, w)
        row = dict(impl=name, batch=batch, kernels=kernels, note=note, rel_err=err / scale, **extra)
        if us is not None:
            seconds = us * 1e-6 / iterations
            row.update(ms_per_iteration=seconds * 1e3, bytes_per_s=streamed / seconds)
            if ceiling:
                row["pct_floor"] = 100 * floor_bytes / ceiling / seconds
        rows.append(row)

    def xla(x, w):
        return weight_stream_reference(x, w, phases=phases, iterations=iterations)

    timed("xla", xla, x0, weights, floor_bytes)
    rings: dict[int, list[int]] = {}
    for cols, ring in configs():
        rings.setdefault(cols, []).append(ring)
    for cols, col_rings in rings.items():
        wide = core_phases(*SHAPE, unit_cols=cols)
        x_c, w_c = (x0, weights) if wide == phases else pad_inputs(x0, weights, phases, wide)
        for ring in col_rings:
            fn = functools.partial(  # weight_stream is jitted, its settings static
                weight_stream,
                phases=wide,
                iterations=iterations,
                workers=WORKERS,
                unit_cols=cols,
                ring=ring,
                x_stages=FLAGS.x_stages,
            )
            extra = dict(unit_cols=cols, ring=ring, ring_kib=ring * 64 * cols * 2 // 1024)
            timed(f"persistent ring={ring}", fn, x_c, w_c, stream_bytes(wide), **extra)
        del x_c, w_c  # the padded copy (3.3 GB) before the next width's
    xla_ms = rows[0].get("ms_per_iteration")
    for row in rows:
        if xla_ms and row.get("ms_per_iteration"):
            row["vs_xla"] = xla_ms / row["ms_per_iteration"]
    return rows


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'batch':>5}  {'impl':<22}{'cols':>5}{'ms/iter':>9}{'TB/s':>7}{'% floor':>9}"
        f"{'vs xla':>8}  err"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        ms = r.get("ms_per_iteration")
        cells = (
            f"{ms:9.3f}{r['bytes_per_s'] / 1e12:7.2f}" if ms else f"{'-':>9}{'-':>7}",
            f"{r['pct_floor']:8.1f}%" if r.get("pct_floor") else f"{'-':>9}",
            f"{r['vs_xla']:7.2f}x" if r.get("vs_xla") else f"{'-':>8}",
        )
        cols = f"{r.get('unit_cols', '-'):>5}"
        lines.append(f"{r['batch']:>5}  {r['impl']:<22}{cols}{''.join(cells)}  {r['rel_err']:.1e}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    batches = cli.positive_ints("batch", FLAGS.batch)
    if max(batches) > 64:
        raise UserError(f"--batch={max(batches)}: at most 64 rows")
    if FLAGS.iterations < 1 or FLAGS.reps < 1 or FLAGS.x_stages < 1:
        raise UserError("--iterations, --reps and --x_stages must be >= 1")
    check_configs(batches)
    program.check_outputs(FLAGS.json_out)
    device = jax.devices()[0]
    if device.platform != "gpu":
        raise UserError(f"needs an sm_90 GPU (Mosaic GPU); the backend here is {device.platform}")
    from pallas_kernels.core_step import core_phases

    phases = core_phases(*SHAPE)
    found = ceilings_lib.for_device(device.device_kind)
    ceiling = found.read_bytes_per_s if found else None
    key = jax.random.key(0)
    weights = tuple(
        (jax.random.normal(jax.random.fold_in(key, i), (p.k, p.n)) / p.k**0.5).astype(jnp.bfloat16)
        for i, p in enumerate(phases)
    )
    rows = []
    for batch in program.progress(batches, "core_stream"):
        x0 = jax.random.normal(jax.random.fold_in(key, 99), (batch, phases[0].k))
        rows += rows_of(batch, x0, weights, phases, ceiling)
    program.write_results(FLAGS.json_out, {"rows": rows, "complete": True})
    print(format_table(rows))


if __name__ == "__main__":
    program.run(PROGRAM, define_flags, main)
