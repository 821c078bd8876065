"""Prints the Chapter 2 cost tables of the study for one Core iteration and the headline numbers.

  python -m experiments.roofline --device=b200 [--context=1024 --batch=1 --iterations=32]
      [--json_out=results/roofline_b200.json] [--per_layer]

No GPU needed: everything comes from `huginn_jax.costs` (analytic counts over peak limits).
Tables: parameter storage per op, matmul FLOPs per op, and the roofline per op for decode and
prefill; the headline numbers (the study's Chapter 2 and Appendix A) are printed last.
Units: MB = 1e6 B, GB = 1e9 B, us = microseconds. A problem whose Core weights and KV cache
(`--iterations` Core iterations of slots at `--context` + 1 positions) exceed the device's memory
is refused: its roofline would be no device's.
"""

from __future__ import annotations

import dataclasses

from absl import flags

from experiments import program
from experiments.cli import UserError
from huginn_jax import costs
from huginn_jax.config import PRESETS, HuginnConfig

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_enum(
        "device", "b200", list(costs.DEVICES), "Peak limits and memory to use (huginn_jax.costs)."
    )
    flags.DEFINE_enum("config", "huginn_0125", list(PRESETS), "Model preset.")
    flags.DEFINE_integer(
        "context", 1024, "Prefill positions / decode cached positions (tokens).", lower_bound=1
    )
    flags.DEFINE_integer("batch", 1, "Sequences processed together.", lower_bound=1)
    flags.DEFINE_integer("iterations", 32, "Core iterations per token.", lower_bound=1)
    flags.DEFINE_bool("per_layer", False, "One row per layer op instead of per kind.")
    flags.DEFINE_string("json_out", None, "Write tables and headline numbers as JSON (unset: no).")


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Plain-text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    rule = "-" * len(line(header))
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def _kind(name: str) -> str:
    """'core.2.attn.Wqkv' -> 'attn.Wqkv'; all norms -> 'norms'."""
    kind = name.split(".", 2)[2] if name.startswith("core.") else name
    return "norms" if kind.startswith("norm_") else kind


def group(ops: list[costs.OpCost], per_layer: bool) -> list[list[costs.OpCost]]:
    """Rows to print: each op alone, or ops of the same kind across Core layers together."""
    if per_layer:
        return [[op] for op in ops]
    groups: dict[str, list[costs.OpCost]] = {}
    for op in ops:
        groups.setdefault(_kind(op.name), []).append(op)
    return list(groups.values())


def _label(members: list[costs.OpCost]) -> str:
    if len(members) == 1:
        return members[0].name
    kind = _kind(members[0].name)
    layers = len({op.name.split(".")[1] for op in members})
    return f"{kind} (x{layers})"


def op_record(op: costs.OpCost, device: costs.DeviceSpec) -> dict:
    """One op as JSON: its counts plus compute, memory and ideal seconds and the bound."""
    compute, memory = op.times(device)
    ideal, bound = op.roofline(device)
    mem_w = op.times(device, weights_only=True)[1]
    return {
        **dataclasses.asdict(op),
        "compute_s": compute,
        "memory_s": memory,
        "memory_weights_only_s": mem_w,
        "ideal_s": ideal,
        "bound": bound,
    }


def param_table(ops: list[costs.OpCost], per_layer: bool) -> str:
    total = costs.totals(ops).param_bytes
    rows = []
    for members in group(ops, per_layer):
        nbytes = sum(op.param_bytes for op in members)
        if nbytes:
            rows.append(
                [
                    _label(members),
                    f"{nbytes // 2:,}",
                    f"{nbytes / 1e6:,.1f}",
                    f"{100 * nbytes / total:.1f}",
                ]
            )
    rows.append(["total", f"{total // 2:,}", f"{total / 1e6:,.1f}", "100.0"])
    return format_table(["op", "params", "MB (bf16)", "%"], rows)


def flops_table(prefill: list[costs.OpCost], decode: list[costs.OpCost], per_layer: bool) -> str:
    tot_p, tot_d = costs.totals(prefill).flops, costs.totals(decode).flops
    rows = []
    for gp, gd in zip(group(prefill, per_layer), group(decode, per_layer), strict=True):
        fp, fd = sum(op.flops for op in gp), sum(op.flops for op in gd)
        if fp or fd:
            rows.append(
                [
                    _label(gp),
                    f"{fp / 1e9:,.1f}",
                    f"{100 * fp / tot_p:.1f}",
                    f"{fd / 1e6:,.1f}",
                    f"{100 * fd / tot_d:.1f}",
                ]
            )
    rows.append(["total", f"{tot_p / 1e9:,.1f}", "100.0", f"{tot_d / 1e6:,.1f}", "100.0"])
    return format_table(["op", "prefill GFLOP", "%", "decode MFLOP", "%"], rows)


def roofline_table(ops: list[costs.OpCost], device: costs.DeviceSpec, per_layer: bool) -> str:
    header = ["op", "GFLOP", "weights MB", "HBM MB", "compute us", "memory us", "ideal us", "bound"]
    rows = []

    def row(label: str, op: costs.OpCost, ideal: float) -> list[str]:
        compute, memory = op.times(device)
        bound = "compute" if compute > memory else "memory"
        return [
            label,
            f"{op.flops / 1e9:,.3f}",
            f"{op.weight_bytes / 1e6:,.1f}",
            f"{op.hbm_bytes / 1e6:,.1f}",
            f"{compute * 1e6:,.2f}",
            f"{memory * 1e6:,.2f}",
            f"{ideal * 1e6:,.2f}",
            bound,
        ]

    for members in group(ops, per_layer):
        rows.append(row(_label(members), costs.totals(members), costs.serial_time(members, device)))
    rows.append(row("total (ops in series)", costs.totals(ops), costs.serial_time(ops, device)))
    return format_table(header, rows)


def headline_lines(h: dict) -> list[str]:
    return [
        f"Core + adapter parameters: {h['core_adapter_param_gb']:.3f} GB",
        f"{h['iterations']} iterations re-read: {h['reread_gb']:.1f} GB"
        f" -> >= {h['min_ms_per_token']:.1f} ms per token",
        f"adapter M={h['adapter_decode_m']}: {h['adapter_decode_us']:.1f} us"
        f" ({h['adapter_decode_bound']}-bound)",
        f"adapter M={h['adapter_prefill_m']}: {h['adapter_prefill_us']:.1f} us"
        f" ({h['adapter_prefill_bound']}-bound)",
    ]


def _decimal(n: float) -> str:
    """Bytes in the largest decimal unit below them, 3 significant digits: '279 PB'."""
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale or unit == "MB":
            break
    value = n / scale
    return f"{value:.3g} {unit}" if value < 1000 else f"{value:,.0f} {unit}"


def check_fits(
    config: HuginnConfig, device: costs.DeviceSpec, batch: int, context: int, iterations: int
) -> None:
    """UserError when the adapter and Core weights and the KV cache of one decode step (a slot
    per prelude and coda layer and per Core layer and iteration, `context` + 1 positions, bf16)
    exceed the device's memory."""
    weights = costs.totals(
        costs.core_iteration_ops(config, batch=batch, context=1, mode="decode")
    ).param_bytes
    slots = config.n_layers_in_prelude + iterations * config.n_core + config.n_layers_in_coda
    per_position = 2 * slots * batch * config.n_heads * config.head_dim * 2  # K and V, bf16
    need = weights + per_position * (context + 1)
    if need > device.memory_bytes:
        raise UserError(
            f"--context={context}: the KV cache of {iterations} iterations at batch {batch} "
            f"({per_position / 1e6:,.2f} MB per position) and the weights need "
            f"{_decimal(need)}; a {device.name} holds {_decimal(device.memory_bytes)}: "
            "use a smaller --context, --batch or --iterations"
        )


def main(argv: list[str]) -> None:
    program.check_outputs(FLAGS.json_out)
    try:
        device = costs.get_device(FLAGS.device)
        config = HuginnConfig.from_name(FLAGS.config)
        batch, context, iterations = FLAGS.batch, FLAGS.context, FLAGS.iterations
        check_fits(config, device, batch, context, iterations)
        kw = dict(batch=batch, context=context)
        decode = costs.core_iteration_ops(config, mode="decode", **kw)
        prefill = costs.core_iteration_ops(config, mode="prefill", **kw)
        head = costs.headline(config, device, iterations=iterations, **kw)
        it_dec = costs.iterations_cost(
            config, mode="decode", iterations=iterations, device=device, **kw
        )
    except ValueError as e:
        raise UserError(str(e)) from None
    per_layer = FLAGS.per_layer

    if FLAGS.json_out:
        payload = {
            "config": {"name": FLAGS.config, **dataclasses.asdict(config)},
            "device": dataclasses.asdict(device),
            "tables": {
                "decode": [op_record(op, device) for op in decode],
                "prefill": [op_record(op, device) for op in prefill],
            },
            "iterations_decode": dataclasses.asdict(it_dec),
            "headline": head,
            "headline_lines": headline_lines(head),
        }
        print(f"results: {program.write_results(FLAGS.json_out, payload)}\n")
    print(
        f"device {device.name}: {device.peak_bf16_flops / 1e12:,.1f} TFLOP/s dense bf16, "
        f"{device.hbm_bandwidth / 1e12:.2f} TB/s HBM, L2 {device.l2_bytes / 2**20:.1f} MiB, "
        f"{device.num_sms} SMs ({device.source})"
    )
    print(
        f"model {FLAGS.config}, batch {batch}; prefill {context} positions; "
        f"decode 1 new position + {context} cached; bf16; one Core iteration\n"
    )
    print("Parameter storage (adapter + Core layers)")
    print(param_table(decode, per_layer) + "\n")
    print("Matmul FLOPs (causal pairs only; softmax and elementwise excluded)")
    print(flops_table(prefill, decode, per_layer) + "\n")
    for mode, ops in (("decode", decode), ("prefill", prefill)):
        print(f"Roofline, {mode}: ideal = max(FLOPs / peak, HBM bytes / bandwidth)")
        print(roofline_table(ops, device, per_layer) + "\n")
    print(
        f"{iterations} decode iterations, all traffic in series: "
        f"{it_dec.roofline_seconds * 1e3:.2f} ms per token "
        f"({it_dec.hbm_bytes / 1e9:.1f} GB moved)\n"
    )
    print(f"Headline numbers ({device.name}, weights-only traffic for the re-read bound):")
    for line in headline_lines(head):
        print(f"  {line}")


if __name__ == "__main__":
    program.run("roofline", define_flags, main)
