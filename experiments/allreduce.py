"""Measures all-reduce latency and bandwidth over a mesh, at the Core's activation sizes.

    python -m experiments.allreduce [--devices=2,4 --batch=1 --context=1024 --dtype=bf16]

Under tensor parallelism (huginn_jax.parallel) every Core layer ends its attention and its MLP
in an all-reduce of the residual stream: B x n_embd values at decode, B x T x n_embd at prefill
(huginn_jax.comm_costs.allreduce_bytes). For each device count N (a mesh of the first N devices)
and each size, one executable runs `--chain` all-reduces back to back (`jax.lax.psum` in
`shard_map`, each one's input the previous one's output, so none overlaps the next); a sample is
one call's wall time over `--chain` (experiments.measure.timing: warm-up calls, then the median
of `--repeats`). Sizes: every decode and prefill size of the flags, and `--sweep` sizes spaced
evenly in log between them, so that latency + bytes / bandwidth (comm_costs.AllReduceModel) is
fitted over the whole range; the JSON holds every sample and the fit per N, which the cost model
reads (`AllReduceModel.from_results`).

Bandwidths are stated as nccl-tests does: algbw = bytes / time, busbw = algbw x 2 (N - 1) / N
(the bytes each link carries in a ring). On a CPU (XLA_FLAGS=
--xla_force_host_platform_device_count=N) the program runs as a check; its numbers describe
host memory copies, not a GPU interconnect.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from jax.sharding import PartitionSpec as P

from experiments import cli, program
from experiments.cli import UserError
from experiments.measure import timing
from huginn_jax import comm_costs, parallel
from huginn_jax.config import HuginnConfig

FLAGS = flags.FLAGS
PROGRAM = "allreduce"
_DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}


def define_flags() -> None:
    flags.DEFINE_list("devices", [], "Device counts (>= 2) to measure; default 2, 4, 8 as present.")
    flags.DEFINE_string("config", "huginn_0125", "Model preset whose n_embd sets the sizes.")
    flags.DEFINE_list("batch", ["1"], "Sequences: decode all-reduces B x n_embd values.")
    flags.DEFINE_list("context", ["1024"], "Prefill positions T: B x T x n_embd values.")
    flags.DEFINE_integer("sweep", 6, "Extra sizes between the smallest and largest, for the fit.")
    flags.DEFINE_enum("dtype", "bf16", list(_DTYPES), "Activation dtype.")
    flags.DEFINE_integer("chain", 50, "All-reduces per timed call.")
    flags.DEFINE_integer("warmup", 3, "Untimed calls per size.")
    flags.DEFINE_integer("repeats", 20, "Timed calls per size (median reported).")
    flags.DEFINE_string("json_out", "out/allreduce.json", "Results JSON ('' to skip).")


def sizes_from_flags(config: HuginnConfig, dtype_bytes: int) -> list[tuple[str, int]]:
    """(case, bytes) of every decode and prefill size, then the sweep between them."""
    batches = cli.positive_ints("batch", FLAGS.batch)
    contexts = cli.positive_ints("context", FLAGS.context)
    cases = {}
    for b in batches:
        size = comm_costs.allreduce_bytes(
            config, batch=b, context=1, mode="decode", dtype_bytes=dtype_bytes
        )
        cases.setdefault(size, f"decode B={b}")
        for t in contexts:
            size = comm_costs.allreduce_bytes(
                config, batch=b, context=t, mode="prefill", dtype_bytes=dtype_bytes
            )
            cases.setdefault(size, f"prefill B={b} T={t}")
    lo, hi = min(cases), max(cases)
    for size in np.geomspace(lo, hi, FLAGS.sweep + 2)[1:-1] if hi > lo else []:
        aligned = int(size) // (2 * dtype_bytes) * (2 * dtype_bytes)
        cases.setdefault(aligned, "sweep")
    return [(case, size) for size, case in sorted(cases.items())]


def device_counts() -> list[int]:
    """--devices, or 2, 4 and 8 where present (`counts_of`)."""
    return counts_of(FLAGS.devices, len(jax.devices()))


def counts_of(requested: list[str], present: int) -> list[int]:
    """The device counts to measure: `requested` (each in [2, present]), or 2, 4 and 8 where
    present; UserError when fewer than two devices exist or a count is out of range."""
    if present < 2:
        raise UserError(
            f"an all-reduce needs >= 2 devices; {present} present (on a CPU set XLA_FLAGS="
            "--xla_force_host_platform_device_count=N before the program starts)"
        )
    if not requested:
        return [n for n in (2, 4, 8) if n <= present]
    counts = cli.positive_ints("devices", requested)
    for n in counts:
        if not 2 <= n <= present:
            raise UserError(f"--devices={n}: must be in [2, {present}] (devices present)")
    return sorted(set(counts))


def chained_allreduce(mesh, chain: int):
    """fn(x [N, L]) -> [N, L]: `chain` psums over the mesh's "model" axis, each of one device's
    row of L values (scaled by 1/N, so that values stay bounded), one after another."""
    n = mesh.shape[parallel.MODEL_AXIS]

    # check_vma off: the psum's result is the same on every device, and the loop carries it on
    # as the next all-reduce's per-device input.
    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=P(parallel.MODEL_AXIS),
        out_specs=P(parallel.MODEL_AXIS),
        check_vma=False,
    )
    def body(row):
        def one(_, x):
            return jax.lax.psum(x, parallel.MODEL_AXIS) * jnp.asarray(1.0 / n, x.dtype)

        return jax.lax.fori_loop(0, chain, one, row)

    return jax.jit(body)


def measure(counts: list[int], sizes: list[tuple[str, int]], dtype) -> tuple[list, list]:
    """One record per (device count, size) and the latency + bandwidth fit per device count."""
    itemsize = jnp.dtype(dtype).itemsize
    records, fits = [], []
    grid = [(n, case, size) for n in counts for case, size in sizes]
    compiled = {}
    for n, case, size in program.progress(grid, PROGRAM):
        if n not in compiled:
            mesh = parallel.make_mesh({parallel.MODEL_AXIS: n})
            compiled[n] = (mesh, chained_allreduce(mesh, FLAGS.chain))
        mesh, fn = compiled[n]
        x = jax.device_put(
            jnp.ones((n, size // itemsize), dtype),
            jax.sharding.NamedSharding(mesh, P(parallel.MODEL_AXIS)),
        )
        samples = timing.time_fn(
            lambda fn=fn, x=x: fn(x),
            warmup=FLAGS.warmup,
            repeats=FLAGS.repeats,
            per_call=FLAGS.chain,
        )
        algbw = size / samples.median
        records.append(
            {
                "devices": n,
                "case": case,
                "bytes": size,
                "us": samples.median * 1e6,
                "algbw_bytes_per_s": algbw,
                "busbw_bytes_per_s": algbw * 2 * (n - 1) / n,
                "samples": samples.to_dict(),
            }
        )
    for n in counts:
        mine = [r for r in records if r["devices"] == n]
        source = f"experiments.allreduce on {jax.devices()[0].device_kind}, {len(mine)} sizes"
        try:
            fit = comm_costs.AllReduceModel.fit(
                n, [r["bytes"] for r in mine], [r["us"] * 1e-6 for r in mine], source
            )
        except ValueError as e:
            print(f"note: {n} devices: no fit ({e})")
            continue
        fits.append(
            {
                "devices": n,
                "latency_s": fit.latency_s,
                "bytes_per_s": fit.bytes_per_s,
                "source": source,
            }
        )
    return records, fits


def format_table(records: list[dict], fits: list[dict]) -> str:
    head = (
        f"{'devices':>7}  {'case':<22}{'bytes':>12}{'time':>11}{'algbw GB/s':>12}{'busbw GB/s':>12}"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        lines.append(
            f"{r['devices']:>7}  {r['case']:<22}{r['bytes']:>12,}{timing.format_us(r['us']):>11}"
            f"{r['algbw_bytes_per_s'] / 1e9:>12.3g}{r['busbw_bytes_per_s'] / 1e9:>12.3g}"
        )
    for f in fits:
        lines.append(
            f"fit {f['devices']} devices: latency {timing.format_us(f['latency_s'] * 1e6)}, "
            f"bandwidth {f['bytes_per_s'] / 1e9:.3g} GB/s (algbw)"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if FLAGS.chain < 1 or FLAGS.repeats < 1 or FLAGS.warmup < 0 or FLAGS.sweep < 0:
        raise UserError("--chain and --repeats must be >= 1, --warmup and --sweep >= 0")
    try:
        config = HuginnConfig.from_name(FLAGS.config)
    except ValueError as e:
        raise UserError(str(e)) from None
    dtype = _DTYPES[FLAGS.dtype]
    sizes = sizes_from_flags(config, jnp.dtype(dtype).itemsize)
    program.check_outputs(FLAGS.json_out)
    counts = device_counts()
    records, fits = measure(counts, sizes, dtype)
    if FLAGS.json_out:
        path = program.write_results(
            FLAGS.json_out, {"n_embd": config.n_embd, "records": records, "fits": fits}
        )
        print(f"results: {path}")
    print(format_table(records, fits))


if __name__ == "__main__":
    program.run(PROGRAM, define_flags, main)
