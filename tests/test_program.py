"""experiments.program: the skeleton every experiment program runs in."""

import json
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


def run_toy(tmp_path, *args):
    script = tmp_path / "toy.py"
    script.write_text(TOY)
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
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
