"""experiments.headline: several processes' results combined into median and range."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from program_runs import run_forked

from experiments import headline
from experiments.cli import UserError

REPO = Path(__file__).resolve().parent.parent


def core_run(times: dict[str, float], back_to_back: dict[str, float] | None = None) -> dict:
    """A core results JSON: each impl's ms_per_iteration, and its back-to-back time where
    `back_to_back` gives one."""
    case = {"mode": "decode", "batch": 1, "context": 1024, "iterations": 8}
    records = [{**case, "impl": impl, "ms_per_iteration": t} for impl, t in times.items()]
    for rec in records:
        if rec["impl"] in (back_to_back or {}):
            rec["back_to_back_ms_per_iteration"] = back_to_back[rec["impl"]]
    return {"environment": {"argv": ["/x/experiments/core.py"]}, "records": records}


def test_median_range_and_vs_best_from_the_processes():
    runs = [
        core_run({"xla": 1.0, "torch_compile": 1.2, "only_here": 5.0}),
        core_run({"xla": 1.4, "torch_compile": 0.9}),
        core_run({"xla": 1.1, "torch_compile": 1.0}),
    ]
    records = {r["impl"]: r for r in headline.combine(runs, headline.PROGRAMS["core"])}
    assert set(records) == {"xla", "torch_compile"}  # only_here ran in one process
    xla, torch = records["xla"], records["torch_compile"]
    assert xla["ms_per_iteration"] == 1.1 and (xla["min"], xla["max"]) == (1.0, 1.4)
    assert torch["ms_per_iteration"] == 1.0 and torch["per_process"] == [1.2, 0.9, 1.0]
    assert xla["vs_best"] == pytest.approx(1.0 / 1.1)
    assert torch["vs_best"] == pytest.approx(1.1 / 1.0)


def b2b_runs() -> list[dict]:
    """Three processes with back-to-back times; torch_eager has none in one of them."""
    waited = {"xla": 1.0, "torch_graph": 1.5, "torch_eager": 3.0}
    return [
        core_run(waited, {"xla": 0.8, "torch_graph": 1.4, "torch_eager": 2.0}),
        core_run(waited, {"xla": 0.9, "torch_graph": 1.3}),
        core_run(waited, {"xla": 0.7, "torch_graph": 1.2, "torch_eager": 2.0}),
    ]


def test_back_to_back_metric_combines_its_own_key():
    program = headline.PROGRAMS["core"].measured_by("back_to_back")
    assert program.time_key == "back_to_back_ms_per_iteration"
    records = {r["impl"]: r for r in headline.combine(b2b_runs(), program)}
    assert set(records) == {"xla", "torch_graph"}  # torch_eager lacks it in one process
    xla = records["xla"]
    assert xla["back_to_back_ms_per_iteration"] == 0.8 and xla["per_process"] == [0.8, 0.9, 0.7]
    assert "ms_per_iteration" not in xla
    assert xla["vs_best"] == pytest.approx(1.3 / 0.8)  # from the back-to-back medians
    table = headline.format_table(list(records.values()), program, 3, "back_to_back")
    assert "measure: back_to_back (back_to_back_ms_per_iteration)" in table
    primary = headline.PROGRAMS["core"].measured_by("")
    assert primary == headline.PROGRAMS["core"]
    waited = headline.combine(b2b_runs(), primary)
    assert "measure:" not in headline.format_table(waited, primary, 3)


def test_unknown_metric_names_the_known_ones():
    with pytest.raises(UserError, match="--metric=device: .* known: back_to_back"):
        headline.PROGRAMS["core"].measured_by("device")
    with pytest.raises(UserError, match="known: none"):
        headline.PROGRAMS["chain"].measured_by("back_to_back")


def test_generation_runs_combine_per_loop():
    """generate_vs_torch's records have no case keys (a run is one case): one figure per loop."""

    def run(jax_ms, torch_ms):
        records = [
            {"impl": "jax_persistent", "ms_per_token": jax_ms},
            {"impl": "torch_compile", "ms_per_token": torch_ms},
        ]
        argv = ["/x/experiments/generate_vs_torch.py"]
        return {"environment": {"argv": argv}, "records": records}

    runs = [run(30.0, 36.0), run(32.0, 35.0), run(31.0, 37.0)]
    assert headline.program_of(runs[0], "f") == "generate_vs_torch"
    records = {r["impl"]: r for r in headline.combine(runs, headline.PROGRAMS["generate_vs_torch"])}
    assert records["jax_persistent"]["ms_per_token"] == 31.0
    assert records["jax_persistent"]["vs_best"] == pytest.approx(36.0 / 31.0)


def test_program_name_from_argv_of_a_module_and_a_package():
    assert headline.program_of({"environment": {"argv": ["/a/experiments/core.py"]}}, "f") == "core"
    package = {"environment": {"argv": ["/a/experiments/chain/__main__.py"]}}
    assert headline.program_of(package, "f") == "chain"


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "experiments.headline", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )


def test_cli_writes_json_and_table(tmp_path):
    paths = []
    for i, t in enumerate((1.0, 1.3, 1.2)):
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps(core_run({"xla": t, "torch_graph": 1.5})))
        paths.append(str(path))
    out = tmp_path / "headline.json"
    proc = run_cli(*paths, f"--json_out={out}", f"--txt_out={tmp_path / 'h.txt'}")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    xla = next(r for r in data["records"] if r["impl"] == "xla")
    assert xla["ms_per_iteration"] == 1.2 and xla["vs_best"] == pytest.approx(1.5 / 1.2)
    assert "1.000-1.300" in proc.stdout and (tmp_path / "h.txt").read_text() in proc.stdout + "\n"


def run_cli_forked(*args):
    """`run_cli` forked from a process that has imported JAX (tests/program_runs.py): for runs
    that end at their input."""
    return run_forked("experiments.headline", *args, cwd=REPO)


def test_cli_metric_back_to_back(tmp_path):
    paths = []
    for i, run in enumerate(b2b_runs()):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run))
    out = tmp_path / "headline.json"
    proc = run_cli_forked(*map(str, paths), "--metric=back_to_back", f"--json_out={out}")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["time_key"] == "back_to_back_ms_per_iteration"
    assert [r["impl"] for r in data["records"]] == ["xla", "torch_graph"]
    assert "0.700-0.900" in proc.stdout and "measure: back_to_back" in proc.stdout
    unknown = run_cli_forked(*map(str, paths), "--metric=device")
    assert unknown.returncode == 2 and "known: back_to_back" in unknown.stderr


def test_cli_errors_are_one_line(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(core_run({"xla": 1.0})))
    few = run_cli_forked(str(path), str(path))
    assert few.returncode == 2 and "at least 3" in few.stderr and "Traceback" not in few.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    broken = run_cli_forked(str(path), str(path), str(bad))
    assert broken.returncode == 2 and len(broken.stderr.strip().splitlines()) == 1
    unwritable = run_cli_forked(str(path), str(path), str(path), f"--json_out={path}/x.json")
    assert unwritable.returncode == 2 and "cannot write" in unwritable.stderr
