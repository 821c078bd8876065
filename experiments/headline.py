"""Headline figures: one program's results from several separate processes, combined.

    python -m experiments.headline out/core_1.json out/core_2.json out/core_3.json \
        --json_out=results/h200/core_headline.json

Each input is the results JSON of one process of the same program with the same flags. For each
case and implementation the headline time is the median over processes of each process's median,
with the range (min-max) of those medians; "vs best" is recomputed from the headline medians
(the other framework's fastest ÷ this row's). A figure from one process can be a lucky or an
unlucky process (clocks, cuBLAS's algorithm choice); the range shows how far they spread.
`--metric` combines another of the program's measures instead of its primary time (core:
`--metric=back_to_back`).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from absl import flags

from experiments import program
from experiments.cli import UserError
from experiments.measure import compare
from experiments.measure import results as results_lib

FLAGS = flags.FLAGS


@dataclasses.dataclass(frozen=True)
class Program:
    """Where a program's records keep their case and their time (`metrics`: the keys of its
    other measures in the same unit, by the name `--metric` gives them)."""

    group_keys: tuple[str, ...]
    time_key: str
    unit: str
    metrics: dict[str, str] = dataclasses.field(default_factory=dict)

    def measured_by(self, metric: str) -> Program:
        """This program with `metric`'s key as its time key ('' = its own); UserError for a
        metric it does not record."""
        if not metric:
            return self
        if metric not in self.metrics:
            known = ", ".join(self.metrics) or "none"
            raise UserError(f"--metric={metric}: not a measure of this program; known: {known}")
        return dataclasses.replace(self, time_key=self.metrics[metric])


PROGRAMS = {
    "core": Program(
        ("mode", "batch", "context", "iterations"),
        "ms_per_iteration",
        "ms",
        {"back_to_back": "back_to_back_ms_per_iteration"},
    ),
    "chain": Program(("size_bytes", "layout"), "median_us", "us"),
    "adapter": Program(("m", "variant"), "us", "us"),
    "decode_attention": Program(("batch", "context"), "us", "us"),
    "prefill_attention": Program(("batch", "tokens"), "us", "us"),
    "generate_vs_torch": Program((), "ms_per_token", "ms"),  # one case per run: its flags
}


def define_flags() -> None:
    flags.DEFINE_string("json_out", "", "Write the combined figures here ('' to skip).")
    flags.DEFINE_string("txt_out", "", "Write the printed table here too ('' to skip).")
    flags.DEFINE_string(
        "metric",
        "",
        "The measure to combine: '' = the program's primary time; core: back_to_back (calls "
        "dispatched without a wait, back_to_back_ms_per_iteration).",
    )


def environment_of(run: dict[str, Any]) -> dict[str, Any]:
    """The environment block of a results JSON (the chain names it "env")."""
    return run.get("environment") or run.get("env") or {}


def records_of(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The measured rows of a results JSON (the chain names them "runs")."""
    return run.get("records") or run.get("runs") or []


def program_of(run: dict[str, Any], path: str) -> str:
    """The program that wrote a results JSON, from the argv it recorded."""
    argv = environment_of(run).get("argv") or [""]
    name = Path(argv[0]).stem
    if name == "__main__":  # a package run with -m: the package's folder names it
        name = Path(argv[0]).parent.name
    if name not in PROGRAMS:
        raise UserError(f"{path}: written by {name!r}; known programs: {', '.join(PROGRAMS)}")
    return name


def combine(runs: Sequence[dict[str, Any]], program: Program) -> list[dict[str, Any]]:
    """One record per (case, impl) found in every run: median and range of the runs' times."""
    per_key: dict[tuple, list[dict[str, Any]]] = {}
    for run in runs:
        for rec in records_of(run):
            if rec.get(program.time_key) is None:
                continue
            key = (*(rec.get(k) for k in program.group_keys), rec["impl"])
            per_key.setdefault(key, []).append(rec)
    combined = []
    for key, recs in per_key.items():
        if len(recs) != len(runs):
            continue  # not measured in every process: no headline figure
        times = [r[program.time_key] for r in recs]
        combined.append(
            {
                **dict(zip(program.group_keys, key[:-1], strict=True)),
                "impl": key[-1],
                program.time_key: statistics.median(times),
                "min": min(times),
                "max": max(times),
                "per_process": times,
            }
        )
    compare.add_vs_best(combined, group_keys=program.group_keys, time_key=program.time_key)
    return combined


def format_table(
    records: list[dict[str, Any]], program: Program, processes: int, metric: str = ""
) -> str:
    """One row per (case, impl), then what the figures are (`metric`: the measure's name when
    it is not the program's primary time)."""
    unit = program.unit
    cases = [" ".join(f"{k}={r[k]}" for k in program.group_keys) for r in records]
    width = max(len("case"), *(len(c) for c in cases)) + 2
    head = (
        f"{'case':<{width}}{'impl':<22}{'median ' + unit:>12}{'range (' + unit + ')':>22}"
        f"{'vs best':>9}"
    )
    lines = [head, "-" * len(head)]
    for case, r in zip(cases, records, strict=True):
        spread = f"{r['min']:.3f}-{r['max']:.3f}"
        lines.append(
            f"{case:<{width}}{r['impl']:<22}{r[program.time_key]:>12.3f}{spread:>22}"
            f"{compare.format_vs_best(r['vs_best']):>9}"
        )
    if metric:
        lines.append(f"measure: {metric} ({program.time_key})")
    lines.append(
        f"median over {processes} processes of each process's median; range: min-max of those; "
        "vs best: the other framework's fastest median / this row's"
    )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    paths = argv[1:]
    if len(paths) < 3:
        raise UserError(f"give at least 3 results JSONs of separate processes (got {len(paths)})")
    program.check_outputs(FLAGS.json_out, FLAGS.txt_out)
    runs = []
    for path in paths:
        try:
            runs.append(results_lib.read_json(path))
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: cannot read a results JSON ({e})") from None
    for run, path in zip(runs, paths, strict=True):
        if not isinstance(run, dict):
            raise UserError(f"{path}: not a results JSON (expected an object)")
        if run.get("complete") is False:
            raise UserError(f'{path}: an interrupted run ("complete": false); rerun it')
    names = {program_of(run, path) for run, path in zip(runs, paths, strict=True)}
    if len(names) != 1:
        raise UserError(f"the files come from different programs: {', '.join(sorted(names))}")
    name = names.pop()
    layout = PROGRAMS[name].measured_by(FLAGS.metric)
    records = combine(runs, layout)
    if not records:
        raise UserError(f"no (case, impl) has {layout.time_key} in every file")
    table = format_table(records, layout, len(runs), FLAGS.metric)
    if FLAGS.json_out:  # the environments are the measuring processes': this one measured nothing
        results_lib.write_json_atomic(
            FLAGS.json_out,
            {
                "program": name,
                "time_key": layout.time_key,
                "sources": [str(p) for p in paths],
                "environments": [environment_of(run) for run in runs],
                "records": records,
            },
        )
    if FLAGS.txt_out:
        results_lib.write_text_atomic(FLAGS.txt_out, table + "\n")
    print(table)


if __name__ == "__main__":
    program.run("headline", define_flags, main, arguments=True)
