"""How fast one worker of the weight stream takes a weight unit from L2 and from HBM.

    python -m experiments.kernels.stream_units [--sizes=4096,16384 --rings=3,4 --lags=0,1]

Each size s is one [s, s] bf16 product chained to itself (`weight_stream`, 132 workers, a grid
barrier after every iteration), --iterations per call: at 4096 its 32 MiB of weights stay in
the H200's 60 MiB L2 from one iteration to the next, at 16384 (512 MiB) every unit comes from
HBM. Per size, ring and wgmma lag (a unit's slot takes its next copy once the wgmma `lag` units
later is issued; 0: at once, one more copy in flight while a worker waits for a unit): the
device time per iteration (CUPTI, median of --reps) and its rate, then from Mosaic GPU's
on-device profiler (one more call) the cycles a worker spends per unit in the product's loop
(its units' scope over the units it owns, median over the workers) and in the barrier per
iteration. What the L2 row's cycles per unit measure is the worker's own work on a unit (its
input chunk's wait and conversion, the wgmma, the copies' issue) with the weight a short wait
away: the rate at which units prefetched into L2 could be consumed. Needs an sm_90 GPU.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import flags  # noqa: E402

from experiments import cli, program  # noqa: E402
from experiments.cli import UserError  # noqa: E402
from experiments.kernels import scopes  # noqa: E402
from experiments.measure.device_time import cupti_us  # noqa: E402

FLAGS = flags.FLAGS
PROGRAM = "stream_units"
WORKERS = 132  # one per SM of an H100 / H200
NAME = "square"  # the product's scope in the profile


def define_flags() -> None:
    flags.DEFINE_list(
        "sizes", ["4096", "16384"], "k = n of the product, a list (32 MiB in L2, 512 MiB not)."
    )
    flags.DEFINE_integer("unit_cols", 256, "Output columns of a [64, unit_cols] weight unit.")
    flags.DEFINE_list("rings", ["3"], "Ring slots of weight units per worker, a list.")
    flags.DEFINE_list(
        "lags", ["1"], "wgmmas in flight behind a unit's before its slot is refilled, a list."
    )
    flags.DEFINE_integer("x_stages", 2, "Input chunks in flight per worker.")
    flags.DEFINE_integer("iterations", 16, "Iterations (products) per call.")
    flags.DEFINE_integer("reps", 20, "Timed calls per row (median).")
    flags.DEFINE_string("json_out", "out/stream_units.json", "Results JSON.")


def phases_of(size: int):
    from pallas_kernels.core_step.plan import Phase

    return (Phase(NAME, size, size),)


def check_flags(cases: list[tuple[int, int, int]]) -> None:
    """UserError unless every (size, ring, lag) runs, before the GPU is touched."""
    from pallas_kernels.core_step.stream import check_schedule

    if FLAGS.iterations < 1 or FLAGS.reps < 1:
        raise UserError("--iterations and --reps must be >= 1")
    for size, ring, lag in cases:
        try:
            check_schedule(
                phases_of(size), WORKERS, ring, FLAGS.x_stages, unit_cols=FLAGS.unit_cols, lag=lag
            )
        except ValueError as e:
            raise UserError(f"--sizes={size}, ring {ring}, lag {lag}: {e}") from None


def row_of(size: int, ring: int, lag: int) -> dict:
    from pallas_kernels.core_step import weight_stream

    phases = phases_of(size)
    key = jax.random.key(size)
    w = (jax.random.normal(key, (size, size)) / size**0.5).astype(jnp.bfloat16)
    x0 = jax.random.normal(jax.random.fold_in(key, 1), (1, size))
    settings = dict(
        phases=phases, iterations=FLAGS.iterations, workers=WORKERS, unit_cols=FLAGS.unit_cols,
        ring=ring, x_stages=FLAGS.x_stages, lag=lag,
    )  # fmt: skip

    def call(x, weights):
        return weight_stream(x, weights, **settings)

    us, _, note = cupti_us(call, FLAGS.reps, x0, (w,))
    directory = tempfile.mkdtemp(prefix="stream_units_")
    jax.block_until_ready(weight_stream(x0, (w,), profile_dir=directory, **settings))
    cycles = scopes.scope_cycles(scopes.read_newest(directory), per=FLAGS.iterations)
    units = phases[0].units(FLAGS.unit_cols) / WORKERS
    row = dict(
        size=size, weight_bytes=phases[0].weight_bytes, unit_cols=FLAGS.unit_cols,
        ring=ring, lag=lag, x_stages=FLAGS.x_stages, units_per_worker=units, note=note,
        cycles_per_unit=cycles[NAME]["median"] / units,
        barrier_cycles=cycles.get("barrier", {}).get("median"), cycles=cycles,
    )  # fmt: skip
    if us is not None:
        seconds = us * 1e-6 / FLAGS.iterations
        row.update(us_per_iteration=seconds * 1e6, bytes_per_s=phases[0].weight_bytes / seconds)
    return row


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'size':>6}{'MiB':>6}{'ring':>5}{'lag':>4}{'us/iter':>9}{'TB/s':>7}{'cycles/unit':>13}"
        f"{'barrier':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        us = r.get("us_per_iteration")
        rate = f"{us:9.2f}{r['bytes_per_s'] / 1e12:7.2f}" if us else f"{'-':>9}{'-':>7}"
        barrier = f"{r['barrier_cycles']:9.0f}" if r["barrier_cycles"] is not None else f"{'-':>9}"
        mib = r["weight_bytes"] / 2**20
        lines.append(
            f"{r['size']:>6}{mib:6.0f}{r['ring']:>5}{r['lag']:>4}{rate}"
            f"{r['cycles_per_unit']:13.0f}{barrier}"
        )
    if rows:
        lines.append(
            f"[64, {rows[0]['unit_cols']}] units, {WORKERS} workers; cycles per unit: the "
            "product's scope / the units a worker owns (median)"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    sizes = cli.positive_ints("sizes", FLAGS.sizes)
    rings = cli.positive_ints("rings", FLAGS.rings)
    lags = cli.positive_ints("lags", FLAGS.lags, least=0)
    cases = [(s, r, lag) for s in sizes for r in rings for lag in lags]
    check_flags(cases)
    program.check_outputs(FLAGS.json_out)
    device = jax.devices()[0]
    if device.platform != "gpu":
        raise UserError(f"needs an sm_90 GPU (Mosaic GPU); the backend here is {device.platform}")
    rows = [row_of(*case) for case in program.progress(cases, PROGRAM)]
    program.write_results(FLAGS.json_out, {"rows": rows, "complete": True})
    print(format_table(rows))


if __name__ == "__main__":
    program.run(PROGRAM, define_flags, main)
