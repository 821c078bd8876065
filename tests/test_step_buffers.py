"""tools/step_buffers.py on CPU: both steps compile against abstract weights and their largest
temp values are listed from XLA's buffer assignment."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_lists_each_steps_temp_and_its_largest_values():
    proc = subprocess.run(
        [sys.executable, "tools/step_buffers.py", "--config=tiny", "--prompt_len=16",
         "--cache_len=32", "--num_steps=4", "--top=2"],
        cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    for step in ("prefill", "decode"):
        block = out.split(f"{step}: temp")[1].split("\n", 1)[1]
        values = re.findall(r"^\s+([\d.]+) MB  \S+: \w+\[", block, flags=re.M)
        assert len(values) >= 1, out  # at most --top per dumped module, largest first
    assert len(re.findall(r"^head .*: temp [\d.]+ MB$", out, flags=re.M)) == 3
