"""Tests of experiments.chain: size parsing, d rule, layouts, outputs, the CLI and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from experiments import chain
from huginn_jax.xla_flags import COMMAND_BUFFERS_OFF

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20


def small_config(d: int = 128, steps: int = 4, dtype: str = "bfloat16") -> chain.ChainConfig:
    return chain.ChainConfig(d=d, steps=steps, batch=1, dtype=dtype, seed=0, size_bytes=0)


# ---------------------------------------------------------------- size string -> d


@pytest.mark.parametrize(
    "text, expected",
    [
        ("72MiB", 72 * MIB),
        ("8 MiB", 8 * MIB),
        ("1GiB", 2**30),
        ("512KiB", 512 * 2**10),
        ("1048576", 2**20),
        ("1048576B", 2**20),
        ("72mib", 72 * MIB),
        ("1.5KiB", 1536),
        ("2MB", 2_000_000),
        ("3kb", 3_000),
        ("1GB", 10**9),
    ],
)
def test_parse_size_good(text, expected):
    assert chain.parse_size(text) == expected


@pytest.mark.parametrize("text", ["banana", "", "0", "0MiB", "-8MiB", "8 XiB", "MiB", "8M", "1e3"])
def test_parse_size_bad(text):
    with pytest.raises(ValueError, match="invalid size"):
        chain.parse_size(text)


def test_parse_sizes_list():
    assert chain.parse_sizes("8MiB,72MiB, 288MiB") == [8 * MIB, 72 * MIB, 288 * MIB]
    with pytest.raises(ValueError):
        chain.parse_sizes("8MiB,,72MiB")


@pytest.mark.parametrize("size, d", [(8 * MIB, 2048), (72 * MIB, 6144), (288 * MIB, 12288)])
def test_dim_for_size_seeds_sizes(size, d):
    assert chain.dim_for_size(size) == d
    assert d * d * 2 == size


def test_dim_for_size_rounds_to_multiple_of_64():
    assert chain.dim_for_size(32 * 2**10) == 128
    assert chain.dim_for_size(100 * MIB) % 64 == 0
    assert chain.dim_for_size(4 * 2048 * 2048, dtype_bytes=4) == 2048
    with pytest.raises(ValueError, match="too small"):
        chain.dim_for_size(100)


def test_size_label():
    assert chain.size_label(72 * MIB) == "72MiB"
    assert chain.size_label(32 * 2**10) == "32KiB"
    assert chain.size_label(2**30) == "1GiB"


# ---------------------------------------------------------------- weights


def test_copies_are_distinct_buffers_and_shared_is_one():
    cfg = small_config()
    _, w = chain.host_values(cfg)
    shared = chain.make_weights(w, cfg.steps, "shared")
    copies = chain.make_weights(w, cfg.steps, "copies")
    assert len(set(chain.buffer_pointers(shared))) == 1
    assert all(s is shared[0] for s in shared)
    assert len(set(chain.buffer_pointers(copies))) == cfg.steps
    for c in copies:
        assert np.array_equal(np.asarray(c).view(np.uint16), w.view(np.uint16))


def test_host_values_are_deterministic_and_not_zero():
    cfg = small_config(d=64)
    x1, w1 = chain.host_values(cfg)
    x2, w2 = chain.host_values(cfg)
    assert x1.shape == (1, 64) and w1.shape == (64, 64) and w1.dtype == cfg.np_dtype
    assert np.array_equal(w1.view(np.uint16), w2.view(np.uint16))
    assert np.array_equal(x1.view(np.uint16), x2.view(np.uint16))
    assert np.std(w1.astype(np.float32)) == pytest.approx(1 / 8, rel=0.1)  # N(0, 1/d)


# ---------------------------------------------------------------- outputs


def _outputs(cfg, impl, n=3):
    x, w = chain.host_values(cfg)
    out = {}
    for layout in chain.LAYOUTS:
        ws = chain.make_weights(w, cfg.steps, layout)
        out[layout] = chain.xla_runner(impl, jax.device_put(x), ws, n=n).output()
    return x, w, out


@pytest.mark.parametrize("impl", ["xla", "xla_loop"])
def test_layouts_give_bit_identical_outputs(impl):
    _, _, out = _outputs(small_config(), impl)
    assert chain.same_bits(out["shared"], out["copies"])
    assert np.all(np.isfinite(out["shared"])) and np.any(out["shared"] != 0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("impl, chains", [("xla", 1), ("xla_loop", 3)])
def test_xla_matches_numpy_reference(dtype, impl, chains):
    cfg = small_config(d=192, steps=8, dtype=dtype)
    x, w, out = _outputs(cfg, impl, n=3)
    ref = chain.reference_chain(x, w, cfg.steps * chains)
    rel = np.max(np.abs(out["shared"] - ref)) / np.max(np.abs(ref))
    assert rel <= chain.tolerance(dtype, cfg.steps * chains)
    # the state stays O(1): scaled weights neither vanish nor blow up
    assert 0.05 < np.max(np.abs(ref)) < 100


def test_same_bits_tells_signed_zeros_apart():
    a = np.array([0.0, 1.0], np.float32)
    assert chain.same_bits(a, a.copy())
    assert not chain.same_bits(a, np.array([-0.0, 1.0], np.float32))


def test_expand_impls():
    assert chain.expand_impls(["xla"]) == chain.XLA_IMPLS
    assert chain.expand_impls(["xla"], families=False) == ("xla",)
    assert chain.expand_impls(["torch", "xla_loop"]) == ("torch_eager", "torch_graph", "xla_loop")
    with pytest.raises(ValueError, match="unknown impl"):
        chain.expand_impls(["cuda_fortran"])


def test_format_table_from_results():
    run = {
        "weight_bytes": 8 * MIB,
        "d": 2048,
        "impl": "xla",
        "median_us": 20.0,
        "p10_us": 19.0,
        "p90_us": 21.0,
        "gbps": 3355.4,
        "pct_floor_once": 10.0,
        "pct_floor_steps": 80.0,
    }
    data = {
        "config": {"steps": 8, "repeats": 50},
        "env": {"hbm_bandwidth": 4.25e12},
        "runs": [
            {**run, "layout": "shared", "hbm": {"read_x_w": 0.1, "l2_hit_pct": 99.0}},
            {**run, "layout": "copies", "median_us": 30.0, "hbm": None},
        ],
        "checks": {
            "layouts": [{"weight_bytes": 8 * MIB, "impl": "xla", "identical": True}],
            "agreement": [
                {"weight_bytes": 8 * MIB, "layout": "shared", "impl": "xla", "rel_err": 0.001,
                 "tol": 0.01}
            ],
        },
    }  # fmt: skip
    lines = chain.format_table(data).splitlines()
    shared = next(line for line in lines if line.split()[2:3] == ["shared"])
    assert "8MiB" in shared and "1.50" in shared and "0.10" in shared and "99.0" in shared
    assert "yes" in shared and "0.10" in shared
    assert "4.25 TB/s" in chain.format_table(data)


# ---------------------------------------------------------------- the CLI


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", "experiments.chain", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--size=banana"], "invalid size 'banana'"),
        (["--size=0"], "must be positive"),
        (["--size=-8MiB"], "must be positive"),
        (["--size=8MiB,banana"], "invalid size 'banana'"),
        (["--size=10B"], "too small"),
        (["--size=64GiB", "--steps=64"], "memory"),
        (["--size=8MiB", "--steps=0"], "--steps must be >= 1"),
        (["--size=8MiB", "--dtype=int8"], "unknown --dtype"),
        (["--size=8MiB", "--layouts=shared,mirrored"], "--layouts"),
        (["--size=8MiB", "--impls=cuda_fortran"], "unknown impl"),
        (["--d=0"], "--d must be >= 1"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, args, message):
    json_out, plot_out = tmp_path / "r.json", tmp_path / "r.png"
    proc = run_cli(*args, f"--json_out={json_out}", f"--plot_out={plot_out}")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert message in lines[0] and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_end_to_end_on_cpu(tmp_path):
    json_out, plot_out = tmp_path / "out" / "chain.json", tmp_path / "out" / "chain.png"
    proc = run_cli(
        "--size=32KiB,128KiB", "--steps=4", "--repeats=3", "--warmup=1", "--impls=xla,torch",
        f"--json_out={json_out}", f"--plot_out={plot_out}", "--hbm",
        f"--trace_dir={tmp_path / 'trace'}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "HBM counters need a GPU and Nsight Compute (ncu); skipped" in out
    assert "xla_nocb" in out and "skipped" in out  # command buffers: GPU only
    assert "torch" in out  # torch missing or no CUDA: one note
    # the table is last, then the two paths
    tail = out.strip().splitlines()
    assert tail[-2] == f"json: {json_out}" and tail[-1] == f"plot: {plot_out}"
    assert any(line.lstrip().startswith("W ") and "µs/chain" in line for line in tail)
    assert "kernels per chain" in out and "dot" in out  # CPU trace breakdown

    data = json.loads(json_out.read_text())
    assert plot_out.read_bytes()[:4] == b"\x89PNG"
    assert data["env"]["platform"] == "cpu" and data["env"]["versions"]["jax"]
    assert data["config"]["repeats"] == 3 and data["config"]["chains_per_call"] == 4
    assert {(r["weight_bytes"], r["layout"], r["impl"]) for r in data["runs"]} == {
        (w, layout, impl)
        for w in (32 * 2**10, 128 * 2**10)
        for layout in ("shared", "copies")
        for impl in ("xla", "xla_loop")
    }
    for r in data["runs"]:
        assert len(r["samples"]["seconds"]) == 3 and r["median_us"] > 0 and r["hbm"] is None
    assert all(c["identical"] for c in data["checks"]["layouts"])
    assert all(c["ok"] for c in data["checks"]["agreement"])
    assert {t["impl"] for t in data["traces"]} == {"xla"}
    for t in data["traces"]:  # the timeline per chain: span = kernels + idle between them
        span, busy, gaps = (t["per_chain"][k] for k in ("span", "busy", "gaps"))
        assert 0 < busy <= span and span == pytest.approx(busy + gaps)
    assert "xla: GPU span" in out and "idle between them" in out
    assert list((tmp_path / "trace").glob("*/plugins/profile/*/*.xplane.pb"))


def test_pallas_impl_is_known_and_skipped_without_a_gpu(tmp_path):
    assert chain.expand_impls(["pallas"]) == ("pallas",)
    proc = run_cli("--size=64KiB", "--impls=xla,pallas", "--json_out=", "--plot_out=")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "the Pallas kernels need a GPU" in proc.stdout + proc.stderr


def test_pallas_splitk_nocb_runs_in_the_command_buffer_free_child():
    assert chain.expand_impls(["pallas_splitk_nocb"]) == ("pallas_splitk_nocb",)
    assert "pallas_splitk_nocb" in chain.LAYOUTS_NOT_COMPARABLE
    assert COMMAND_BUFFERS_OFF in chain.child_env(["pallas_splitk_nocb"])["XLA_FLAGS"]
    notes: list[str] = []
    opts = chain.Options(
        configs=(), layouts=("shared",), impls=("xla", "pallas_splitk_nocb"), warmup=1,
        repeats=1, chains_per_call=1, ncu_chains=1, json_out="", plot_out="", hbm=False,
        trace_dir=None,
    )  # fmt: skip
    assert chain.select_impls(opts, on_gpu=False, note=notes.append) == ("xla",)
    assert "pallas_splitk_nocb skipped" in notes[0]


def test_timing_child_reports_the_chains_its_output_went_through():
    # The parent checks a child's output against the reference after that many chains; it
    # used to guess 1 for every impl without "loop" in its name (pallas_splitk_nocb runs N).
    cfg, n = small_config(d=64, steps=3), 3
    opts = chain.Options(
        configs=(cfg,), layouts=("shared",), impls=("xla", "xla_loop"), warmup=0, repeats=1,
        chains_per_call=n, ncu_chains=1, json_out="", plot_out="", hbm=False, trace_dir=None,
    )  # fmt: skip
    child = chain.run_timing_child(cfg, opts, ["xla", "xla_loop"])
    x_host, w_host = chain.host_values(cfg)
    for impl, chains in (("xla", 1), ("xla_loop", n)):
        _, y, reported = child[("shared", impl)]
        assert reported == chains
        ref = chain.reference_chain(x_host, w_host, cfg.steps * chains)
        other = chain.reference_chain(x_host, w_host, cfg.steps * (n + 1 - chains))
        tol = chain.tolerance(cfg.dtype, cfg.steps * chains)
        assert np.max(np.abs(y - ref)) / np.max(np.abs(ref)) <= tol
        assert np.max(np.abs(y - other)) / np.max(np.abs(other)) > tol
