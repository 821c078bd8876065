"""Times the fused row GEMV against XLA on huginn-0125's five decode GEMVs (H200 tuning).

    python -m experiments.kernels.fused_gemv_tune [--configs=64:64:4:1,...] [--json_out=F]

For each GEMV of a decode iteration (with its output: split-K partial sums for the three
[., D] products, the SiLU gate for fc) and each config block_n:block_k:warps:stages[:dot]
(split-K from pick_config for the partial sums), the summed device time of all kernels of one
product (CUPTI, median of --reps), next to XLA's (`row_gemv_xla` under jit: cuBLAS's GEMV, its
split-K reduction, the SiLU fusion, as `experiments.core --gemm=cublas` runs them; where CUPTI
sees no kernel, the wall time of --reps calls issued back to back, "kernels": null). Each timed
call multiplies by `copies` different weights in turn, together > 2 x the 60 MiB L2, so every
product reads its weight from HBM, as in the Core. GB/s counts the weight bytes only. Needs a
CUDA GPU (the kernel is Triton's); every flag is checked before anything is allocated.
"""

from __future__ import annotations

import functools
import json
import math
import time

import jax
import jax.numpy as jnp
from absl import flags

from experiments import cli, program
from experiments.cli import UserError
from experiments.measure.device_time import cupti_us, wall_us
from huginn_jax.decode_row import row_gemv_xla
from huginn_jax.xla_flags import use_gemm
from pallas_kernels.fused_gemv import GemvConfig, fused_gemv, pick_config

FLAGS = flags.FLAGS
PROGRAM = "fused_gemv_tune"


def define_flags() -> None:
    flags.DEFINE_list(
        "configs",
        [
            "128:64:4:3:dot",
            "64:128:4:4:dot",
            "64:64:4:3:dot",
            "32:128:4:4:dot",
            "128:128:4:3:dot",
            "64:256:4:3:dot",
            "128:64:8:3:dot",
            "128:32:4:1",
            "64:64:4:1",
        ],
        "block_n:block_k:num_warps:num_stages[:dot] of each config tried.",
    )
    flags.DEFINE_list("programs_per_sm", ["4", "8"], "Split-K targets tried for partial sums.")
    flags.DEFINE_list("shapes", ["qkv", "proj", "fc", "mlp_proj", "adapter"], "GEMVs to time.")
    flags.DEFINE_integer("reps", 20, "Timed calls per case (median).")
    flags.DEFINE_float("budget", 400.0, "Stop starting cases after this many seconds.")
    flags.DEFINE_string("json_out", "out/fused_gemv_tune.json", "Results JSON ('' to skip).")


D, F = 5280, 17920
# name: (rows, columns, kwargs)
SHAPES = {
    "qkv": (D, 3 * D, {}),
    "proj": (D, D, {"as_partials": True}),
    "fc": (D, 2 * F, {"silu": True}),
    "mlp_proj": (F, D, {"as_partials": True}),
    "adapter": (2 * D, D, {"as_partials": True}),
}
L2_BYTES = 60 * 2**20


def inputs(rows, columns, copies, key):
    keys = jax.random.split(key, copies + 1)
    ws = [
        (jax.random.normal(k, (rows, columns), jnp.float32) / math.sqrt(rows)).astype(jnp.bfloat16)
        for k in keys[:copies]
    ]
    return ws, jax.random.normal(keys[-1], (rows,)).astype(jnp.bfloat16)


def time_case(ws, x, gemv, kw):
    fn = jax.jit(lambda ws, x: [gemv(w, x, **kw) for w in ws])
    jax.block_until_ready(fn(ws, x))
    us, kernels, _ = cupti_us(fn, FLAGS.reps, ws, x)
    if us is None:  # CUPTI saw no kernel (or is unavailable): wall time, "kernels": null
        us = wall_us(lambda: fn(ws, x), FLAGS.reps)
    return us / len(ws), kernels and kernels // len(ws)


def parse_config(spec: str) -> dict:
    """block_n:block_k:num_warps:num_stages[:dot] as GemvConfig's keyword arguments; UserError
    naming --configs otherwise."""
    fields = spec.split(":")
    try:
        if len(fields) not in (4, 5) or fields[4:] not in ([], ["dot"]):
            raise ValueError
        bn, bk, warps, stages = (int(v) for v in fields[:4])
    except ValueError:
        raise UserError(
            f"--configs: {spec!r} is not block_n:block_k:num_warps:num_stages[:dot]"
        ) from None
    if min(bn, bk, warps, stages) < 1:
        raise UserError(f"--configs: {spec!r}: every size must be >= 1")
    return {
        "block_n": bn,
        "block_k": bk,
        "num_warps": warps,
        "num_stages": stages,
        "use_dot": fields[4:] == ["dot"],
    }


def configs_for(rows, columns, kw):
    for spec in FLAGS.configs:
        tuning = parse_config(spec)
        if not kw.get("as_partials"):
            yield spec, GemvConfig(**tuning)
            continue
        for pps in FLAGS.programs_per_sm:
            config = pick_config(
                rows,
                columns // (2 if kw.get("silu") else 1),
                as_partials=True,
                programs_per_sm=int(pps),
                **tuning,
            )
            yield f"{spec}/split{config.split_k}", config


def check_flags() -> list[str]:
    """The --shapes to time; UserError for the first bad flag, an unwritable --json_out or a
    backend other than a GPU."""
    shapes = cli.names_in("shapes", FLAGS.shapes, list(SHAPES), "shape")
    if not FLAGS.configs:
        raise UserError("--configs is empty: give at least one config")
    for spec in FLAGS.configs:
        parse_config(spec)
    cli.positive_ints("programs_per_sm", FLAGS.programs_per_sm)
    if FLAGS.reps < 1:
        raise UserError(f"--reps={FLAGS.reps}: must be >= 1")
    if not (math.isfinite(FLAGS.budget) and FLAGS.budget > 0):
        raise UserError(f"--budget={FLAGS.budget}: must be a number of seconds > 0")
    program.check_outputs(FLAGS.json_out)
    use_gemm("cublas")  # XLA's dots in cuBLAS, as experiments.core runs them; before the backend
    platform = jax.devices()[0].platform
    if platform != "gpu":
        raise UserError(f"needs a CUDA GPU (Triton's kernel); the backend here is {platform}")
    return shapes


def main(argv: list[str]) -> None:
    shapes = check_flags()
    t0 = time.perf_counter()
    results = []
    for name in shapes:
        rows, columns, kw = SHAPES[name]
        nbytes = rows * columns * 2
        copies = max(2, math.ceil(2.2 * L2_BYTES / nbytes))
        ws, x = inputs(rows, columns, copies, jax.random.key(rows + columns))
        cases = [("xla", row_gemv_xla)] + [
            (spec, functools.partial(fused_gemv, config=config))
            for spec, config in configs_for(rows, columns, kw)
        ]
        for spec, gemv in cases:
            if time.perf_counter() - t0 > FLAGS.budget:
                print(f"budget spent: {name} {spec} not run", flush=True)
                continue
            try:
                us, kernels = time_case(ws, x, gemv, kw)
                rec = {
                    "shape": name,
                    "config": spec,
                    "us": us,
                    "kernels": kernels,
                    "gbps": nbytes / us / 1e3,
                }
            except Exception as e:  # a config Triton cannot compile is reported, not fatal
                rec = {"shape": name, "config": spec, "error": f"{type(e).__name__}: {e}"[:300]}
            results.append(rec)
            print("RESULT " + json.dumps(rec), flush=True)
        del ws
    if FLAGS.json_out:
        program.write_results(FLAGS.json_out, {"cases": results})
    print(f"\n{'shape':<9} {'xla us':>8} {'best config':<22} {'us':>8} {'GB/s':>7} {'xla/best':>8}")
    for name in shapes:
        rows = [r for r in results if r["shape"] == name and "us" in r]
        xla = next((r for r in rows if r["config"] == "xla"), None)
        mine = [r for r in rows if r["config"] != "xla"]
        if not xla or not mine:
            continue
        best = min(mine, key=lambda r: r["us"])
        print(
            f"{name:<9} {xla['us']:8.1f} {best['config']:<22} {best['us']:8.1f} "
            f"{best['gbps']:7.0f} {xla['us'] / best['us']:8.2f}"
        )


if __name__ == "__main__":
    program.run(PROGRAM, define_flags, main)
