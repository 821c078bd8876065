"""Measures the ceilings every "% of floor" figure is stated against, on the device it runs on.

    python -m experiments.ceilings [--gib=2 --reps=20 --gemm_counts=10,400 --gemm=cublas]

Writes `results/<device>/ceilings.json` (e.g. results/h200/ceilings.json, the file
`experiments.measure.ceilings.for_device` loads; elsewhere than on a GPU, out/ceilings.json and
smaller sizes, so that the program runs in seconds):
  read_bytes_per_s   read-only streaming: a bf16 GEMV x [1, K] @ W [K, N], XLA's reduction
                     of W over K and, on a Hopper GPU, W's bytes copied by TMA into every SM's
                     shared memory, [64, 256] units, 4 in flight per SM, nothing else done
                     (`experiments.measure.probes.tma_probe`); W `gib` GiB (far larger than
                     L2, so every call reads HBM); device time per call by CUPTI, or wall time
                     where CUPTI is unavailable; the ceiling is the fastest, and the file
                     names which;
  bf16_flops_per_s   sustained dense bf16 GEMM: N 8192^3 matmuls dispatched back to back, then
                     one wait, median over repeats with an idle pause before each; the ceiling
                     is the largest N (long enough for the clock to settle as in a long
                     prefill), a short burst is reported beside it;
  copy_bytes_per_s   W + 1 into a new array (read + write), for context only.
The JSON also holds every case with its samples ("records"); the table is printed last.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
from absl import flags  # noqa: E402

from experiments import cli, program  # noqa: E402
from experiments.cli import UserError  # noqa: E402
from experiments.measure import ceilings as ceilings_lib  # noqa: E402
from experiments.measure import memory, probes, timing  # noqa: E402
from huginn_jax import xla_flags  # noqa: E402

FLAGS = flags.FLAGS
PROGRAM = "ceilings"
K = 8192
# On a GPU: a weight far larger than L2 and the GEMM size of the ceiling. Elsewhere (a CPU run
# checks the program, it measures no ceiling anyone uses): sizes that take seconds.
GPU_SIZES = {"gib": 2.0, "gemm_size": 8192, "idle_s": 1.0}
SMALL_SIZES = {"gib": 1 / 128, "gemm_size": 256, "idle_s": 0.05}


def define_flags() -> None:
    """Defines the flags; called only when this module runs as the program, so that tests
    and other programs can import it without clashing flag names."""
    flags.DEFINE_float(
        "gib",
        None,
        "GiB of the streamed weight W [8192, N] (default: 2 on a GPU, 1/128 elsewhere).",
    )
    flags.DEFINE_integer("reps", 20, "Samples per streaming case (median reported).")
    flags.DEFINE_list("gemm_counts", ["10", "400"], "Matmuls per run; the largest is sustained.")
    flags.DEFINE_integer(
        "gemm_size", None, "M = N = K of each matmul (default: 8192 on a GPU, 256 elsewhere)."
    )
    flags.DEFINE_integer("gemm_repeats", 5, "Runs per matmul count (median reported).")
    flags.DEFINE_float(
        "idle_s", None, "Idle seconds before each matmul run (default: 1 on a GPU, 0.05 elsewhere)."
    )
    flags.DEFINE_string(
        "json_out",
        None,
        "Results JSON (default: results/<device>/ceilings.json on a GPU, out/ceilings.json "
        "elsewhere).",
    )
    flags.DEFINE_enum(
        "gemm", "cublas", list(xla_flags.GEMM_CHOICES), "How XLA compiles dots (cublas: no Triton)."
    )
    flags.DEFINE_integer("seed", 0, "Seed of the random weight and matmul operands.")


def check_flags() -> list[int]:
    """The matmul counts; UserError for any flag value that cannot be measured. Runs before the
    backend starts, so that a bad flag costs nothing."""
    counts = cli.positive_ints("gemm_counts", FLAGS.gemm_counts)
    if FLAGS.gib is not None and not FLAGS.gib * 2**30 >= 2 * K:
        raise UserError(f"--gib={FLAGS.gib}: the weight must hold at least one column of {K}")
    if FLAGS.gemm_size is not None and FLAGS.gemm_size < 1:
        raise UserError(f"--gemm_size={FLAGS.gemm_size}: must be >= 1")
    if FLAGS.idle_s is not None and not FLAGS.idle_s >= 0:
        raise UserError(f"--idle_s={FLAGS.idle_s}: must be >= 0")
    if FLAGS.reps < 1 or FLAGS.gemm_repeats < 1:
        raise UserError("--reps and --gemm_repeats must be >= 1")
    return sorted(set(counts))


def sizes(on_gpu: bool) -> dict:
    """gib, gemm_size and idle_s: the flags' values, or the device's defaults where unset."""
    defaults = GPU_SIZES if on_gpu else SMALL_SIZES
    return {
        name: default if FLAGS[name].value is None else FLAGS[name].value
        for name, default in defaults.items()
    }


def json_path(device_kind: str, on_gpu: bool) -> Path:
    if FLAGS.json_out:
        return Path(FLAGS.json_out)
    return ceilings_lib.default_path(device_kind) if on_gpu else Path("out") / "ceilings.json"


def samples_of(seconds: list[float], warmup: int) -> dict:
    return timing.Samples(seconds=list(seconds), warmup=warmup).to_dict()


def read_records(gib: float, reps: int, seed: int) -> list[dict]:
    """The streaming cases over one weight of `gib` GiB: one record each, with its rate."""
    w = probes.stream_weight(int(gib * 2**30), K, jax.random.key(seed))
    records = []
    for probe in program.progress(probes.read_probes(w), "ceilings: reads"):
        measured = probes.probe_time(probe, reps)
        if measured is None:
            continue
        seconds = [us * 1e-6 for us in measured.samples_us]
        median_s = statistics.median(seconds)
        records.append(
            {
                "case": probe.name,
                "kind": "read" if probe.read_only else "copy",
                "what": probe.what,
                "shape": list(w.shape),
                "bytes": probe.nbytes,
                "timing": measured.method,
                "method": measured.describe(),
                "kernels": measured.kernels,
                "note": measured.note,
                "samples": samples_of(seconds, warmup=1),
                "bytes_per_s": probe.nbytes / median_s,
            }
        )
    return records


def gemm_records(size: int, counts: list[int], repeats: int, idle_s: float, seed: int):
    times = probes.gemm_times(
        size, counts, repeats=repeats, idle_s=idle_s, key=jax.random.key(seed + 1)
    )
    records = []
    for count, seconds in times.items():
        flops = probes.gemm_flops(size, count)
        records.append(
            {
                "case": f"gemm x{count}",
                "kind": "gemm",
                "what": f"{count} back-to-back [{size}, {size}] @ [{size}, {size}] bf16 "
                f"matmuls, one wait",
                "size": size,
                "count": count,
                "flops": flops,
                "timing": probes.WALL,
                "idle_s": idle_s,
                "samples": samples_of(seconds, warmup=1),
                "flops_per_s": flops / statistics.median(seconds),
            }
        )
    return records


def ceilings_of(records: list[dict], repeats: int) -> dict:
    """The ceilings from the records: the fastest read-only case, the largest matmul count."""
    reads = [r for r in records if r["kind"] == "read"]
    best = max(reads, key=lambda r: r["bytes_per_s"])
    sustained = max((r for r in records if r["kind"] == "gemm"), key=lambda r: r["count"])
    copy = next(r for r in records if r["kind"] == "copy")
    return {
        "read_bytes_per_s": best["bytes_per_s"],
        "read_method": f"{best['case']}: {best['what']}; {best['method']}",
        "bf16_flops_per_s": sustained["flops_per_s"],
        "gemm_method": f"{sustained['what']}; wall time of the run, median of {repeats}",
        "copy_bytes_per_s": copy["bytes_per_s"],
    }


def format_table(records: list[dict]) -> str:
    head = f"{'case':<12}{'timing':>7}{'time':>13}{'rate':>16}  what"
    lines = [head, "-" * len(head)]
    for r in records:
        median_s = r["samples"]["median_us"] * 1e-6
        if r["kind"] == "gemm":
            rate = f"{r['flops_per_s'] / 1e12:.4g} TFLOP/s"
        else:
            rate = f"{r['bytes_per_s'] / 1e12:.4g} TB/s"
        time_text = timing.format_us(median_s * 1e6)
        lines.append(f"{r['case']:<12}{r['timing']:>7}{time_text:>13}{rate:>16}  {r['what']}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    counts = check_flags()
    try:
        xla_flags.use_gemm(FLAGS.gemm)  # before the backend starts
    except RuntimeError as e:
        raise UserError(str(e)) from None
    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    values = sizes(on_gpu)
    path = json_path(device.device_kind, on_gpu)
    program.check_outputs(str(path))
    stream, gemm = 2 * int(values["gib"] * 2**30), 4 * 2 * values["gemm_size"] ** 2
    memory.check_fits(
        f"--gib={values['gib']:g}" if stream >= gemm else f"--gemm_size={values['gemm_size']}",
        f"the streamed W and its copy, and the [{values['gemm_size']}]^2 bf16 matmul operands",
        stream + gemm,
        device=device,
        hint="use a smaller --gib or --gemm_size",
    )
    # The device's defaults and the path become the flags' values: the JSON's environment then
    # holds every value this run used.
    for name, value in {**values, "json_out": str(path)}.items():
        setattr(FLAGS, name, value)
    records = read_records(values["gib"], FLAGS.reps, FLAGS.seed)
    records += gemm_records(
        values["gemm_size"], counts, FLAGS.gemm_repeats, values["idle_s"], FLAGS.seed
    )
    ceilings = ceilings_of(records, FLAGS.gemm_repeats)
    written = program.write_results(str(path), {"ceilings": ceilings, "records": records})
    print(f"results: {written}")
    print(
        f"device {device.device_kind}: read {ceilings['read_bytes_per_s'] / 1e12:.4g} TB/s "
        f"({ceilings['read_method'].split(':')[0]}), "
        f"bf16 {ceilings['bf16_flops_per_s'] / 1e12:.4g} TFLOP/s, "
        f"copy {ceilings['copy_bytes_per_s'] / 1e12:.4g} TB/s"
    )
    print(format_table(records))


if __name__ == "__main__":
    program.run(PROGRAM, define_flags, main)
