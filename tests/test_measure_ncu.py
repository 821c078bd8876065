"""Tests of experiments.measure.ncu: the ncu CSV parser on a made-up and two recorded samples,
the summary per chain, the ncu command line, and where ncu is found."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import DATA

from experiments.measure import ncu


def test_parse_ncu_csv_synthetic_sample():
    """2 chains x 3 kernels, ==PROF== lines, thousands separators, Mbyte/Kbyte units, n/a."""
    kernels = ncu.parse_ncu_csv((DATA / "ncu_sample.csv").read_text())
    assert [k.id for k in kernels] == list(range(6))
    assert kernels[0].name.startswith("void gemv2T_kernel_val<int, int, __nv_bfloat16")
    assert kernels[1].name == "loop_convert_fusion"
    assert kernels[0].metrics[ncu.DRAM_READ] == 75_497_472
    assert kernels[1].metrics[ncu.DRAM_READ] == pytest.approx(0.01e6)
    assert kernels[3].metrics[ncu.DRAM_WRITE] == pytest.approx(12.29e3)
    assert math.isnan(kernels[2].metrics[ncu.L2_HIT])

    s = ncu.summarize(kernels, chains=2)
    read = 75_497_472 + 0.01e6 + 0 + 75.52e6 + 10_000 + 2_048
    assert s.bytes_read_per_chain == pytest.approx(read / 2)
    assert s.bytes_write_per_chain == pytest.approx((12_288 + 4_096 + 12.29e3 + 4.10e3) / 2)
    # kernel 2 has no hit rate; the others are weighted by their sectors
    pairs = [(3.12, 2_359_552), (80.0, 1_024), (2.88, 2_359_552), (82.5, 1_024), (100, 64)]
    expected = sum(r * n for r, n in pairs) / sum(n for _, n in pairs)
    assert s.l2_hit_weighting == "sectors" and s.l2_hit_pct == pytest.approx(expected)
    assert s.results == 6 and s.chains == 2


def test_parse_ncu_csv_h200_range_sample():
    """Recorded on an H200: app-range replay, 4 ranges (shared/copies x xla/torch_graph).
    Expected values read off the file: each range's dram__bytes_read.sum, .._write.sum and
    hit rate, divided by its chains (10, 20, 10, 20)."""
    ranges = ncu.parse_ncu_csv((DATA / "ncu_h200_range.csv").read_text())
    assert [r.id for r in ranges] == [0, 1, 2, 3] and [r.name for r in ranges] == ["range"] * 4
    chains = (10, 20, 10, 20)
    read = (6_041_031_936, 12_080_898_560, 6_040_857_088, 12_080_893_184)
    write = (30_295_808, 2_258_688, 17_081_088, 2_322_432)
    hit = (1.77, 2.55, 1.77, 2.56)
    for r, n, rd, wr, h in zip(ranges, chains, read, write, hit, strict=True):
        s = ncu.summarize([r], n)
        assert s.bytes_read_per_chain == rd / n and s.bytes_write_per_chain == wr / n
        assert s.l2_hit_pct == pytest.approx(h) and s.l2_hit_weighting == "sectors"
    assert ranges[1].metrics[ncu.L2_SECTORS] == 582_015_822
    # 72 MiB > 60 MiB L2: every layout reads W (6144^2 bf16) about 8 times per chain of 8 steps
    w = 6144 * 6144 * 2
    assert [round(rd / n / w, 3) for rd, n in zip(read, chains, strict=True)] == [
        8.002,
        8.001,
        8.001,
        8.001,
    ]


def test_parse_ncu_csv_h200_kernel_sample():
    """Recorded on an H200: kernel replay, 2 chains x 16 kernels (XLA's multiply + reduce).
    Expected values counted in the file with awk, not with the parser: 32 IDs; names per chain
    loop_multiply_fusion_7 x1, _6 x7, input_reduce_fusion_1 x7, input_reduce_fusion x1; DRAM
    read 402,939,392 B and written 14,781,184 B in all; hit rates weighted by sectors 49.0573 %."""
    kernels = ncu.parse_ncu_csv((DATA / "ncu_h200_kernel.csv").read_text())
    assert [k.id for k in kernels] == list(range(32))
    names = [k.name for k in kernels]
    assert {n: names.count(n) for n in set(names)} == {
        "loop_multiply_fusion_7": 2,
        "loop_multiply_fusion_6": 14,
        "input_reduce_fusion_1": 14,
        "input_reduce_fusion": 2,
    }
    assert kernels[0].metrics == {
        ncu.DRAM_READ: 8_396_032,
        ncu.DRAM_WRITE: 904_704,
        ncu.L2_HIT: 69.56,
        ncu.L2_SECTORS: 1_219_006,
    }
    s = ncu.summarize(kernels, chains=2)
    assert s.results == 32 and s.chains == 2
    assert s.bytes_read_per_chain == 402_939_392 / 2
    assert s.bytes_write_per_chain == 14_781_184 / 2
    assert s.l2_hit_weighting == "sectors" and s.l2_hit_pct == pytest.approx(49.0573467, abs=1e-6)


def test_parse_ncu_csv_without_header_fails():
    with pytest.raises(ValueError, match="no ncu CSV header"):
        ncu.parse_ncu_csv("==PROF== Connected to process 1\n==ERROR== nothing profiled\n")


def test_summarize_plain_mean_without_sectors():
    ks = [
        ncu.KernelMetrics(0, "a", {ncu.DRAM_READ: 10.0, ncu.L2_HIT: 20.0}),
        ncu.KernelMetrics(1, "b", {ncu.DRAM_READ: 30.0, ncu.L2_HIT: 60.0}),
    ]
    s = ncu.summarize(ks, chains=4)
    assert s.bytes_read_per_chain == 10.0
    assert s.l2_hit_weighting == "mean" and s.l2_hit_pct == 40.0
    with pytest.raises(ncu.NcuError):
        ncu.summarize([], chains=1)


def test_ncu_command_profiles_only_the_ranges():
    cmd = ncu.ncu_command("ncu", ["python", "-m", "x"], log_file="/tmp/l.csv")
    joined = " ".join(cmd)
    assert "--clock-control none --cache-control none" in joined
    assert "--replay-mode app-range" in joined and "--profile-from-start" not in joined
    assert ",".join(ncu.METRICS) in joined and cmd[-3:] == ["python", "-m", "x"]
    kernel = " ".join(ncu.ncu_command("ncu", ["p"], log_file="l", replay_mode="kernel"))
    assert "--profile-from-start off" in kernel


def _executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_find_ncu_takes_path_first(tmp_path, monkeypatch):
    ncu_on_path = _executable(tmp_path / "bin" / "ncu")
    monkeypatch.setenv("PATH", str(ncu_on_path.parent))
    assert ncu.find_ncu() == str(ncu_on_path)


def test_find_ncu_then_the_newest_executable_install_else_none(tmp_path, monkeypatch):
    """Not on PATH, no /usr/local/cuda/bin/ncu: the newest /opt/nvidia/nsight-compute/*/ncu
    that is an executable file (a newer one that is not executable is passed over)."""
    import os
    import types

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    installs = tmp_path / "nsight-compute"
    _executable(installs / "2024.1.0" / "ncu")
    _executable(installs / "2025.3.1" / "ncu")
    (installs / "2026.1.0").mkdir()
    (installs / "2026.1.0" / "ncu").write_text("not executable")
    patterns = []

    def fake_glob(pattern):
        patterns.append(pattern)
        return [str(p) for p in installs.glob("*/ncu")]

    monkeypatch.setattr(ncu, "glob", types.SimpleNamespace(glob=fake_glob))
    no_cuda_bin = types.SimpleNamespace(
        path=types.SimpleNamespace(
            isfile=lambda p: p != "/usr/local/cuda/bin/ncu" and os.path.isfile(p)
        ),
        access=os.access,
        X_OK=os.X_OK,
    )
    monkeypatch.setattr(ncu, "os", no_cuda_bin)
    assert ncu.find_ncu() == str(installs / "2025.3.1" / "ncu")
    assert patterns == ["/opt/nvidia/nsight-compute/*/ncu"]
    (installs / "2025.3.1" / "ncu").chmod(0o644)
    (installs / "2024.1.0" / "ncu").unlink()
    assert ncu.find_ncu() is None
