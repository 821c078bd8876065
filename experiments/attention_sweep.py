"""What the two attention programs (`decode_attention`, `prefill_attention`) share beyond
`attention_bench`: their common flags and checks, the sweep over (batch, size) cases with each
program's rates, and the table layout (each program gives its case and rate columns)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from absl import flags

from experiments import attention_bench as bench
from experiments import cli
from experiments.cli import UserError
from experiments.measure import compare, timing

FLAGS = flags.FLAGS


def define_flags(name: str, impls: Sequence[str]) -> None:
    """The flags of both attention programs; each adds its case sizes and attentions per call."""
    flags.DEFINE_list("impls", list(impls), f"Any of {', '.join(impls)}.")
    flags.DEFINE_list(
        "sdpa_backends",
        list(bench.DEFAULT_SDPA_BACKENDS),
        f"SDPA backends of the torch rows, one row each (any of {', '.join(bench.SDPA_BACKENDS)}).",
    )
    flags.DEFINE_enum(
        "torch_compile_mode", "default", bench.COMPILE_MODES, bench.TORCH_COMPILE_MODE_HELP
    )
    flags.DEFINE_integer("heads", 55, "Heads H (huginn-0125: 55).")
    flags.DEFINE_integer("head_dim", 96, "Head dimension K (huginn-0125: 96).")
    flags.DEFINE_integer("warmup", 3, "Untimed calls (CPU: 1).")
    flags.DEFINE_integer(
        "repeats", 20, "Timed calls; the median time per attention is reported (CPU: 3)."
    )
    flags.DEFINE_integer("seed", 0, "Seed of the inputs.")
    flags.DEFINE_string("json_out", f"out/{name}.json", "Results JSON ('' to skip).")
    flags.DEFINE_string(
        "ceilings", "", "Ceilings JSON of the % of floor ('': the device's default file)."
    )


def check_flags(known: Sequence[str], per_call: str) -> tuple[list[str], list[str]]:
    """The impls and SDPA backends of `define_flags`' flags; UserError for a bad value (--heads,
    --head_dim, --`per_call`, --repeats below 1, --warmup below 0)."""
    impls = bench.known_impls(FLAGS.impls, known)
    for name in ("heads", "head_dim", per_call, "repeats"):
        if FLAGS[name].value < 1:
            raise UserError(f"--{name} must be >= 1, got {FLAGS[name].value}")
    if FLAGS.warmup < 0:
        raise UserError(f"--warmup must be >= 0, got {FLAGS.warmup}")
    return impls, cli.names_in("sdpa_backends", FLAGS.sdpa_backends, bench.SDPA_BACKENDS)


def sweep_attention(
    name: str,
    cases: Sequence[tuple[int, int]],
    impls: Sequence[str],
    records: list[dict[str, Any]] | None,
    *,
    case_keys: Sequence[str],
    per_call: str,
    inputs: Callable[..., tuple],
    reference: Callable[..., np.ndarray],
    checked: Callable[[Any], np.ndarray],
    make_runner: Callable[..., Any],
    add_rates: Callable[..., None],
) -> list[dict[str, Any]]:
    """An attention program's `bench.sweep` over (batch, size) `cases` named by `case_keys`:
    each impl's `bench.time_one` over `inputs(FLAGS[per_call], *case, heads, head_dim, seed)`,
    checked against their `reference`, then `add_rates(record, q, k, v)` where it ran;
    `bench.add_vs_best`."""
    count = FLAGS[per_call].value

    def prepare(case: tuple[int, int]) -> tuple:
        q, k, v = inputs(count, *case, FLAGS.heads, FLAGS.head_dim, FLAGS.seed)
        return q, k, v, reference(q, k, v)

    def measure(case: tuple[int, int], impl: str, prepared: tuple) -> dict[str, Any]:
        q, k, v, ref = prepared
        record = bench.time_one(
            {"impl": impl, **dict(zip(case_keys, case, strict=True))},
            functools.partial(make_runner, impl, q, k, v, FLAGS.torch_compile_mode),
            checked,
            ref,
            per_call=count,
            warmup=FLAGS.warmup,
            repeats=FLAGS.repeats,
        )
        if "error" not in record:
            add_rates(record, q, k, v)
        return record

    records = bench.sweep(name, cases, impls, prepare, measure, records)
    bench.add_vs_best(records, case_keys)
    return records


@dataclasses.dataclass(frozen=True)
class Column:
    """A right-aligned column of an attention program's table: title, width, a record's cell."""

    title: str
    width: int
    cell: Callable[[dict[str, Any]], str]


def field(title: str, width: int, key: str, spec: str = "") -> Column:
    """The column of a record's `key`, formatted by `spec`; "-" where the record has none."""
    return Column(title, width, lambda r: "-" if r.get(key) is None else format(r[key], spec))


TIME_COLUMNS = (
    Column("time", 9, lambda r: timing.format_us(r["us"])),
    Column("p10-p90", 17, lambda r: timing.format_us_range(r["us_p10"], r["us_p90"])),
)
CHECK_COLUMNS = (
    Column("vs best", 7, lambda r: compare.format_vs_best(r.get("vs_best"))),
    Column("compile s", 9, bench.compile_cell),
    field("rel err", 8, "rel_err_vs_f64", ".1e"),
)


def format_table(
    records: list[dict[str, Any]], *, case: Sequence[Column], rates: Sequence[Column], note: str
) -> str:
    """One row per record: impl, `case`, time, p10-p90, `rates`, vs best, compile s, rel err (a
    failed row: impl, `case`, "failed (see notes)"); `note` under the rows."""
    width = max([len("impl"), *(len(r["impl"]) for r in records)])
    columns = (*case, *TIME_COLUMNS, *rates, *CHECK_COLUMNS)
    head = " ".join([f"{'impl':<{width}}", *(f"{c.title:>{c.width}}" for c in columns)])
    lines = [head, "-" * len(head)]
    for r in records:
        shown = case if "error" in r else columns
        row = " ".join([f"{r['impl']:<{width}}", *(f"{c.cell(r):>{c.width}}" for c in shown)])
        lines.append(f"{row} failed (see notes)" if "error" in r else row)
    lines.append(note)
    return "\n".join(lines)
