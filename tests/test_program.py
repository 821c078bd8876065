"""experiments.program: the skeleton every experiment program runs in."""

import contextlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import program

REPO = Path(__file__).resolve().parent.parent

TOY = """
from absl import flags
from experiments import program
FLAGS = flags.FLAGS

def define_flags():
    flags.DEFINE_integer("count", 3, "Items.")
    flags.DEFINE_string("json_out", "", "Results JSON.")

def main(argv):
    if FLAGS.count < 1:
        raise program.UserError(f"--count={FLAGS.count}: must be >= 1")
    program.check_outputs(FLAGS.json_out)
    total = sum(program.progress(range(FLAGS.count), "toy"))
    if FLAGS.json_out:
        program.write_results(FLAGS.json_out, {"total": total})
    print(f"total {total}")

if __name__ == "__main__":
    program.run("toy", define_flags, main)
"""


# A long loop: its GPU-sized --count shrinks on a CPU; an interrupt keeps the rows done so far.
LONG_TOY = """
import time
from absl import flags
from experiments import program
FLAGS = flags.FLAGS

def define_flags():
    flags.DEFINE_integer("count", 100000, "Rows.")
    flags.DEFINE_string("json_out", "", "Results JSON.")

def main(argv):
    program.check_outputs(FLAGS.json_out)
    print(program.cpu_defaults({"count": 20}), flush=True)
    rows = []
    with program.keep_partial(FLAGS.json_out, lambda: {"rows": rows}):
        for i in range(FLAGS.count):
            rows.append(i)
            if i == 2:
                print("three rows", flush=True)
            time.sleep(0.01)
    program.write_results(FLAGS.json_out, {"rows": rows, "complete": True})

if __name__ == "__main__":
    program.run("toy", define_flags, main)
"""
ENV = {"PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}


def run_toy(tmp_path, *args, source=TOY):
    script = tmp_path / "toy.py"
    script.write_text(source)
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ENV,
        timeout=120,
    )


def test_a_run_writes_its_own_flags_and_prints_the_table_last(tmp_path):
    out = tmp_path / "r.json"
    proc = run_toy(tmp_path, "--count=4", f"--json_out={out}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "total 6"
    data = json.loads(out.read_text())
    assert data["total"] == 6
    assert data["environment"]["flags"] == {"count": 4, "json_out": str(out)}  # own flags only


@pytest.mark.parametrize(
    "args, message",
    [
        (["--count=0"], "toy: --count=0: must be >= 1"),
        (["--count=x"], "toy: flag --count=x"),
        (["--json_out=/dev/null/r.json"], "cannot write there"),
        (["extra"], "toy: unexpected arguments: extra"),  # before main runs
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    proc = run_toy(tmp_path, *args)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_check_outputs_accepts_new_folders_and_refuses_a_directory(tmp_path):
    program.check_outputs(str(tmp_path / "new" / "dir" / "r.json"), "", None)
    with pytest.raises(program.UserError, match="is a directory"):
        program.check_outputs(str(tmp_path))


def test_cpu_defaults_shrink_the_flags_not_given_and_the_json_records_them(tmp_path):
    out = tmp_path / "r.json"
    proc = run_toy(tmp_path, f"--json_out={out}", source=LONG_TOY)
    assert proc.returncode == 0, proc.stderr
    assert (
        proc.stdout.splitlines()[0]
        == "CPU: a short run with --count=20 (give a flag to override it)"
    )
    data = json.loads(out.read_text())
    assert (
        data["complete"] and len(data["rows"]) == 20 and data["environment"]["flags"]["count"] == 20
    )
    given = run_toy(tmp_path, "--count=3", f"--json_out={out}", source=LONG_TOY)
    assert given.stdout.splitlines()[0] == "None"  # a flag the user gave is kept
    assert json.loads(out.read_text())["rows"] == [0, 1, 2]


@contextlib.contextmanager
def ctrl_c_reaches_children():
    """The processes started inside get Ctrl-C (SIGINT) as a program started from a terminal
    does, also where this one ignores it (a shell's background job, e.g. a CI runner's, starts
    with SIGINT ignored, and a child process inherits that)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupted_run_writes_what_it_measured_marked_incomplete(tmp_path, signum, code):
    script, out = tmp_path / "toy.py", tmp_path / "r.json"
    script.write_text(LONG_TOY)
    with ctrl_c_reaches_children():
        proc = subprocess.Popen(
            [sys.executable, str(script), "--count=100000", f"--json_out={out}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=ENV,
        )  # fmt: skip
    try:
        while proc.stdout.readline().strip() != "three rows":
            assert proc.poll() is None, proc.stderr.read()
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code
    assert err.strip().splitlines() == [
        f'toy: interrupted; what was measured is in {out} ("complete": false)'
    ]
    data = json.loads(out.read_text())
    assert data["complete"] is False and data["rows"][:3] == [0, 1, 2]
    assert data["environment"]["flags"]["count"] == 100000
