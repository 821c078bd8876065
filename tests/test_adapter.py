"""experiments.adapter on CPU: the byte estimate, and the program end to end."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import adapter
from huginn_jax.config import HuginnConfig

REPO = Path(__file__).resolve().parent.parent


def test_estimate_matches_the_seeds_and_counts_the_concat():
    cfg = HuginnConfig.from_name("huginn_0125")
    alone = adapter.estimate(cfg, 1, "matmul")
    assert alone.weight_bytes == 10560 * 5280 * 2
    assert alone.hbm_read_bytes == alone.weight_bytes + 10560 * 2
    concat = adapter.estimate(cfg, 1, "concat")
    # s and e read once more, x [1, 2h] written: 2·h·2 B read and 2·h·2 B written more.
    assert concat.hbm_read_bytes - alone.hbm_read_bytes == 2 * 5280 * 2
    assert concat.hbm_write_bytes - alone.hbm_write_bytes == 2 * 5280 * 2


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "experiments.adapter", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
    )


def test_cli_on_cpu(tmp_path):
    out = tmp_path / "adapter.json"
    proc = run_cli(
        "--config=tiny", "--m=1,8", "--repeats=2", "--calls=2", f"--json_out={out}", "--hbm"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "HBM counters need a GPU" in proc.stdout
    records = json.loads(out.read_text())["records"]
    assert {(r["m"], r["variant"]) for r in records} == {
        (1, "matmul"),
        (1, "concat"),
        (8, "matmul"),
        (8, "concat"),
    }
    assert all(r["us_per_call"] > 0 for r in records)


@pytest.mark.parametrize(
    "flag", ["--m=0", "--m=x", "--variants=transpose", "--impls=cuda", "--calls=z"]
)
def test_bad_flags_exit_2_with_one_line(tmp_path, flag):
    proc = run_cli(flag, f"--json_out={tmp_path / 'a.json'}")
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if "tpu" not in line.lower()]
    assert len(lines) == 1 and lines[0].startswith("adapter:")
    assert not (tmp_path / "a.json").exists()
