"""experiments.generate_vs_torch's JAX half, which runs without PyTorch (the program with torch
is tested in test_torch_ref.py): the decode attention and decode GEMV flags reach the model."""

import json
import subprocess
import sys
from pathlib import Path


def run(tmp_path, decode_attention, *flags):
    out = tmp_path / f"{decode_attention}{len(flags)}.json"
    proc = subprocess.run(
        [
            sys.executable, "-m", "experiments.generate_vs_torch", "--config=micro",
            "--dtype=f32", "--prompt_len=8", "--max_new_tokens=4", "--num_steps=3",
            f"--decode_attention={decode_attention}", f"--json_out={out}", *flags,
        ],
        capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


def test_pallas_decode_attention_generates_the_same_tokens(tmp_path):
    """The Pallas kernel (interpret mode on CPU) in every decode step: the greedy tokens of the
    XLA attention, float32."""
    xla, pallas = run(tmp_path, "xla"), run(tmp_path, "pallas")
    assert pallas["environment"]["flags"]["decode_attention"] == "pallas"
    assert len(pallas["jax"]["tokens"][0]) == 4
    assert pallas["jax"]["tokens"] == xla["jax"]["tokens"]


def test_row_gemvs_generate_the_same_tokens(tmp_path):
    """--decode_gemv=pallas at batch 1: every Core step of every decode step through the row
    GEMV kernels (interpret mode on CPU); the greedy tokens of the plain path, float32."""
    xla, rows = run(tmp_path, "xla"), run(tmp_path, "xla", "--decode_gemv=pallas")
    assert rows["environment"]["flags"]["decode_gemv"] == "pallas"
    assert rows["jax"]["tokens"] == xla["jax"]["tokens"]
