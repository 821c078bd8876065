"""Tests of the experiments.chain package (options, runners, children, sweep, report): size
parsing, d rule, layouts, the XLA and torch forms of the chain, checks, "vs best", the CLI and bad
input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from experiments.chain import children, options, report, runners, sweep
from experiments.measure import plot
from huginn_jax.xla_flags import COMMAND_BUFFERS_OFF, TRITON_GEMM_OFF

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20


def small_config(d: int = 128, steps: int = 4, dtype: str = "bfloat16") -> options.ChainConfig:
    return options.ChainConfig(d=d, steps=steps, batch=1, dtype=dtype, seed=0, size_bytes=0)


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
    assert options.parse_size(text) == expected


@pytest.mark.parametrize("text", ["banana", "", "0", "0MiB", "-8MiB", "8 XiB", "MiB", "8M", "1e3"])
def test_parse_size_bad(text):
    with pytest.raises(ValueError, match="invalid size"):
        options.parse_size(text)


def test_parse_sizes_list():
    assert options.parse_sizes("8MiB,72MiB, 288MiB") == [8 * MIB, 72 * MIB, 288 * MIB]
    with pytest.raises(ValueError):
        options.parse_sizes("8MiB,,72MiB")


@pytest.mark.parametrize("size, d", [(8 * MIB, 2048), (72 * MIB, 6144), (288 * MIB, 12288)])
def test_dim_for_size_standard_sizes(size, d):
    assert options.dim_for_size(size) == d
    assert d * d * 2 == size


def test_dim_for_size_rounds_to_multiple_of_64():
    assert options.dim_for_size(32 * 2**10) == 128
    assert options.dim_for_size(100 * MIB) % 64 == 0
    assert options.dim_for_size(4 * 2048 * 2048, dtype_bytes=4) == 2048
    with pytest.raises(ValueError, match="too small"):
        options.dim_for_size(100)


def test_size_label():
    assert report.size_label(72 * MIB) == "72MiB"
    assert report.size_label(32 * 2**10) == "32KiB"
    assert report.size_label(2**30) == "1GiB"


def test_plot_goes_next_to_the_json_unless_named():
    assert options.plot_path("out/chain.json", None) == "out/chain.png"
    assert options.plot_path("/tmp/r/run1.json", None) == "/tmp/r/run1.png"
    assert options.plot_path("/tmp/r/run1", None) == "/tmp/r/run1.png"
    assert options.plot_path("/tmp/r/odd.png", None) == "/tmp/r/odd.png.png"  # never the JSON
    assert options.plot_path("", None) == ""  # no JSON, no plot
    assert options.plot_path("/tmp/r/run1.json", "/tmp/p.png") == "/tmp/p.png"
    assert options.plot_path("/tmp/r/run1.json", "") == ""


# ---------------------------------------------------------------- weights


def test_copies_are_distinct_buffers_and_shared_is_one():
    cfg = small_config()
    _, w = runners.host_values(cfg)
    shared = runners.make_weights(w, cfg.steps, "shared")
    copies = runners.make_weights(w, cfg.steps, "copies")
    assert len(set(runners.buffer_pointers(shared))) == 1
    assert all(s is shared[0] for s in shared)
    assert len(set(runners.buffer_pointers(copies))) == cfg.steps
    for c in copies:
        assert np.array_equal(np.asarray(c).view(np.uint16), w.view(np.uint16))


def test_host_values_are_deterministic_and_not_zero():
    cfg = small_config(d=64)
    x1, w1 = runners.host_values(cfg)
    x2, w2 = runners.host_values(cfg)
    assert x1.shape == (1, 64) and w1.shape == (64, 64) and w1.dtype == cfg.np_dtype
    assert np.array_equal(w1.view(np.uint16), w2.view(np.uint16))
    assert np.array_equal(x1.view(np.uint16), x2.view(np.uint16))
    assert np.std(w1.astype(np.float32)) == pytest.approx(1 / 8, rel=0.1)  # N(0, 1/d)


# ---------------------------------------------------------------- outputs


def _outputs(cfg, impl, n=3):
    x, w = runners.host_values(cfg)
    out = {}
    for layout in options.LAYOUTS:
        ws = runners.make_weights(w, cfg.steps, layout)
        out[layout] = runners.xla_runner(impl, jax.device_put(x), ws, n=n).output()
    return x, w, out


@pytest.mark.parametrize("impl", ["xla", "xla_loop"])
def test_layouts_give_bit_identical_outputs(impl):
    _, _, out = _outputs(small_config(), impl)
    assert report.same_bits(out["shared"], out["copies"])
    assert np.all(np.isfinite(out["shared"])) and np.any(out["shared"] != 0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("impl, chains", [("xla", 1), ("xla_loop", 3)])
def test_xla_matches_numpy_reference(dtype, impl, chains):
    cfg = small_config(d=192, steps=8, dtype=dtype)
    x, w, out = _outputs(cfg, impl, n=3)
    ref = report.reference_chain(x, w, cfg.steps * chains)
    rel = np.max(np.abs(out["shared"] - ref)) / np.max(np.abs(ref))
    assert rel <= report.tolerance(dtype, cfg.steps * chains)
    # the state stays O(1): scaled weights neither vanish nor blow up
    assert 0.05 < np.max(np.abs(ref)) < 100


def test_same_bits_tells_signed_zeros_apart():
    a = np.array([0.0, 1.0], np.float32)
    assert report.same_bits(a, a.copy())
    assert not report.same_bits(a, np.array([-0.0, 1.0], np.float32))


def test_expand_impls():
    assert options.expand_impls(["xla"]) == (
        "xla",
        "xla_loop",
        "xla_no_cmdbuf",
        "xla_loop_no_cmdbuf",
    )
    assert options.expand_impls(["xla"], families=False) == ("xla",)
    assert options.expand_impls(["torch", "xla_loop"]) == (
        "torch_eager",
        "torch_graph",
        "torch_compile",
        "xla_loop",
    )
    # the named variants run only when named
    named = ("xla_f32dot", "xla_loop_f32dot", "xla_loop_unrolled")
    assert options.expand_impls(["xla", *named])[-3:] == named
    with pytest.raises(ValueError, match="unknown impl"):
        options.expand_impls(["cuda_fortran"])


def _run(w, layout, impl, median_us):
    return {
        "weight_bytes": w, "d": 2048, "layout": layout, "impl": impl, "median_us": median_us,
        "p10_us": median_us - 1, "p90_us": median_us + 1, "gbps": 3355.4, "pct_floor_once": 10.0,
        "pct_floor_steps": 80.0, "hbm": None,
    }  # fmt: skip


def _check(w, layout, impl, rel_err, tol=0.01, chains=1):
    return {
        "weight_bytes": w, "layout": layout, "impl": impl, "chains": chains, "rel_err": rel_err,
        "tol": tol, "ok": rel_err <= tol,
    }  # fmt: skip


def test_format_table_from_results():
    w = 8 * MIB
    data = {
        "config": {"steps": 8, "repeats": 50},
        "env": {"ceilings": {"read_bytes_per_s": 4.25e12, "source": "results/h200/ceilings.json"}},
        "runs": [
            {**_run(w, "shared", "xla", 20.0), "hbm": {"read_x_w": 0.1, "l2_hit_pct": 99.0}},
            _run(w, "copies", "xla", 30.0),
        ],
        "checks": {
            "layouts": [{"weight_bytes": w, "impl": "xla", "identical": True}],
            "agreement": [_check(w, "shared", "xla", 0.001)],
            "one_chain": [_check(w, "shared", "xla", 0.005)],
        },
    }
    table = report.format_table(data)
    shared = next(line for line in table.splitlines() if line.split()[2:3] == ["shared"])
    assert "8MiB" in shared and "1.50" in shared and "0.10" in shared and "99.0" in shared
    assert "yes" in shared
    assert shared.split()[-1] == "0.50"  # err/tol: the worse of one chain and one call
    assert "4.25 TB/s" in table and "results/h200/ceilings.json" in table
    del data["env"]["ceilings"]
    assert "no ceilings measured" in report.format_table(data)


def test_vs_best_is_per_size_and_layout_and_in_the_table():
    small, big = 8 * MIB, 72 * MIB
    runs = [
        _run(small, "shared", "xla", 100.0),
        _run(small, "shared", "xla_loop", 80.0),
        _run(small, "shared", "torch_graph", 40.0),
        _run(small, "copies", "xla_loop", 50.0),
        _run(small, "copies", "torch_graph", 100.0),
        _run(small, "copies", "torch_eager", 200.0),
        _run(big, "shared", "xla_loop", 200.0),
        _run(big, "shared", "torch_graph", 180.0),
        _run(big, "copies", "xla_loop", 210.0),  # no torch row: no rival
    ]
    report.add_vs_best(runs)
    vs = {(r["weight_bytes"], r["layout"], r["impl"]): r["vs_best"] for r in runs}
    assert vs[(small, "shared", "xla")] == pytest.approx(0.4)  # torch_graph 40 / 100
    assert vs[(small, "shared", "torch_graph")] == pytest.approx(2.0)  # xla_loop 80 / 40
    assert vs[(small, "copies", "xla_loop")] == pytest.approx(2.0)  # torch_graph 100 / 50
    assert vs[(small, "copies", "torch_eager")] == pytest.approx(0.25)  # xla_loop 50 / 200
    assert vs[(big, "shared", "xla_loop")] == pytest.approx(0.9)
    assert vs[(big, "copies", "xla_loop")] is None
    assert runs[0]["best_rival"] == "torch_graph"
    data = {
        "config": {"steps": 8, "repeats": 5},
        "env": {},
        "runs": runs,
        "checks": {"layouts": [], "agreement": [], "one_chain": []},
    }
    lines = report.format_table(data).splitlines()
    assert "vs best" in lines[0]
    row = next(line for line in lines if " torch_eager " in line)
    assert "0.25x" in row.split()
    row = next(line for line in lines if "72MiB" in line and " copies " in line)
    assert row.split()[8] == "-"  # W d layout impl time unit p10-p90 unit vs-best


def test_failed_checks_name_every_failure():
    w = 8 * MIB
    data = {
        "checks": {
            "layouts": [
                {"weight_bytes": w, "impl": "xla", "identical": False},
                {"weight_bytes": w, "impl": "pallas_splitk", "identical": None},
            ],
            "agreement": [_check(w, "shared", "xla_loop", 0.5, chains=100)],
            "one_chain": [_check(w, "copies", "xla", 0.001), _check(w, "copies", "xla_loop", 0.02)],
        }
    }
    lines = report.failed_checks(data)
    assert len(lines) == 3
    assert "xla W=8MiB: shared and copies outputs differ" in lines[0]
    assert "xla_loop copies" in lines[1] and "after 1 chain" in lines[1]
    assert "xla_loop shared" in lines[2] and "after 100 chain" in lines[2]
    for c in data["checks"]["agreement"] + data["checks"]["one_chain"]:
        c["ok"] = True
    data["checks"]["layouts"] = data["checks"]["layouts"][1:]
    assert report.failed_checks(data) == []


# ---------------------------------------------------------------- XLA forms


def _xla(impl, cfg, layout="shared", n=3):
    x, w = runners.host_values(cfg)
    ws = runners.make_weights(w, cfg.steps, layout)
    return x, w, runners.xla_runner(impl, jax.device_put(x), ws, n=n)


def test_plain_form_is_a_bf16_dot_and_f32dot_casts():
    cfg = small_config(d=128, steps=4)
    x, w = runners.host_values(cfg)
    args = (x, *[w] * cfg.steps)
    plain = jax.jit(runners.chain_fn).lower(*args).as_text()
    f32dot = jax.jit(runners.chain_f32dot_fn).lower(*args).as_text()
    assert plain.count("stablehlo.dot_general") == f32dot.count("stablehlo.dot_general") == 4
    assert "stablehlo.convert" not in plain and "-> tensor<1x128xf32>" not in plain
    assert f32dot.count("stablehlo.convert") == 4


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("impls", [("xla", "xla_f32dot"), ("xla_loop", "xla_loop_f32dot")])
def test_plain_form_equals_f32dot_form_within_tolerance(dtype, impls):
    cfg = small_config(d=256, steps=8, dtype=dtype)
    outs = [_xla(impl, cfg)[2] for impl in impls]
    chains = outs[0].chains_in_output
    assert chains == outs[1].chains_in_output == (1 if impls[0] == "xla" else 3)
    a, b = (r.output() for r in outs)
    tol = report.tolerance(dtype, cfg.steps * chains)
    assert np.max(np.abs(a - b)) / np.max(np.abs(b)) <= tol
    assert np.any(a != 0) and np.all(np.isfinite(a))


def test_xla_loop_unrolled_matches_xla_loop():
    cfg, n = small_config(d=192, steps=8), 5
    x, w, loop = _xla("xla_loop", cfg, n=n)
    unrolled = _xla("xla_loop_unrolled", cfg, n=n)[2]
    assert loop.per_call == unrolled.per_call == unrolled.chains_in_output == n
    a, b = loop.output(), unrolled.output()
    ref = report.reference_chain(x, w, cfg.steps * n)
    tol = report.tolerance(cfg.dtype, cfg.steps * n)
    assert np.max(np.abs(a - b)) / np.max(np.abs(ref)) <= tol
    assert np.max(np.abs(b - ref)) / np.max(np.abs(ref)) <= tol
    # one straight-line program: no while loop, n x steps dots
    ws = runners.make_weights(w, cfg.steps, "shared")
    lowered = jax.jit(runners._unrolled_fn, static_argnames="n").lower(x, *ws, n=n).as_text()
    assert "stablehlo.while" not in lowered
    assert lowered.count("stablehlo.dot_general") == n * cfg.steps
    looped = jax.jit(runners._loop_fn, static_argnames="n").lower(x, *ws, n=n).as_text()
    assert "stablehlo.while" in looped


def test_xla_loop_unrolled_caps_its_chains_per_call(monkeypatch):
    assert runners.unrolled_chains(100, 8) == 100
    assert runners.unrolled_chains(1000, 8) == runners.UNROLLED_MAX_PRODUCTS // 8
    assert runners.unrolled_chains(10, 10_000) == 1
    monkeypatch.setattr(runners, "UNROLLED_MAX_PRODUCTS", 12)
    runner = _xla("xla_loop_unrolled", small_config(d=64, steps=4), n=10)[2]
    assert runner.per_call == runner.chains_in_output == 3


@pytest.mark.parametrize("impl", ["xla", "xla_loop", "xla_loop_f32dot", "xla_loop_unrolled"])
def test_one_chain_output_is_one_chain(impl):
    cfg, n = small_config(d=192, steps=8), 3
    x, w, runner = _xla(impl, cfg, n=n)
    one = runner.one_chain()
    ref1 = report.reference_chain(x, w, cfg.steps)
    assert report.agreement(one, ref1, cfg.dtype, cfg.steps)["ok"]
    if runner.chains_in_output > 1:  # not the output of the whole call
        ref_n = report.reference_chain(x, w, cfg.steps * n)
        assert not report.agreement(one, ref_n, cfg.dtype, cfg.steps * n)["ok"]


def test_compile_seconds_only_when_it_compiled():
    cfg = small_config(d=320, steps=3)
    first = _xla("xla_loop_f32dot", cfg, n=7)[2]
    again = _xla("xla_loop_f32dot", cfg, layout="copies", n=7)[2]  # same shapes: cached
    assert first.compile_seconds is not None and first.compile_seconds > 0
    assert again.compile_seconds is None


def test_gemm_and_torch_compile_mode_reach_the_children():
    cfg = small_config()
    opts = options.Options(
        configs=(cfg,), layouts=("shared",), impls=("xla_no_cmdbuf",), warmup=1, repeats=1,
        chains_per_call=1, ncu_chains=1, json_out="", plot_out="", hbm=False, trace_dir=None,
        gemm="cublas", torch_compile_mode="max-autotune-no-cudagraphs",
    )  # fmt: skip
    argv = children.child_argv(cfg, opts, "timing", ["shared"], ["xla_no_cmdbuf"], "/tmp/x")
    assert "--gemm=cublas" in argv and "--torch_compile_mode=max-autotune-no-cudagraphs" in argv


def test_plot_gives_each_impl_a_colour_and_each_layout_a_style():
    impls = list(options.KNOWN_IMPLS)
    colours = plot.impl_colours(impls)
    assert len(set(colours.values())) == len(impls) > 10
    shared, copies = plot.LAYOUT_STYLES["shared"], plot.LAYOUT_STYLES["copies"]
    assert shared["ls"] != copies["ls"] and shared["marker"] != copies["marker"]


# ---------------------------------------------------------------- the CLI


CLI_DEVICE_KIND = "cpu"  # what the program run by run_cli sees, on any machine


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
        (["--size=8MiB", "--gemm=tensor_cores"], "--gemm"),
        (["--size=8MiB", "--torch_compile_mode=fast"], "--torch_compile_mode"),
        (["--size=64KiB", "--ceilings=/nonexistent/ceilings.json"], "--ceilings"),
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
    assert "xla_no_cmdbuf" in out and "skipped" in out  # command buffers: GPU only
    assert "torch" in out  # torch missing or no CUDA: one note
    # the table is last, then the two paths
    tail = out.strip().splitlines()
    assert tail[-2] == f"json: {json_out}" and tail[-1] == f"plot: {plot_out}"
    assert any(line.lstrip().startswith("W ") and "time/chain" in line for line in tail)
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
    assert all(c["ok"] for c in data["checks"]["agreement"] + data["checks"]["one_chain"])
    assert {t["impl"] for t in data["traces"]} == {"xla", "xla_loop"}
    for t in data["traces"]:  # the timeline per chain: span = kernels + idle between them
        span, busy, gaps = (t["per_chain"][k] for k in ("span", "busy", "gaps"))
        assert 0 < busy <= span and span == pytest.approx(busy + gaps)
    assert "xla: GPU span" in out and "idle between them" in out
    assert list((tmp_path / "trace").glob("*/plugins/profile/*/*.xplane.pb"))


def test_json_out_alone_puts_the_plot_beside_it_and_records_the_cpu_timing(tmp_path):
    json_out = tmp_path / "run7.json"
    proc = run_cli("--size=64KiB", "--impls=xla", "--layouts=shared", f"--json_out={json_out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    plot_out = tmp_path / "run7.png"
    assert proc.stdout.strip().splitlines()[-1] == f"plot: {plot_out}"
    assert plot_out.read_bytes()[:4] == b"\x89PNG"
    data = json.loads(json_out.read_text())
    used = {k: data["config"][k] for k in options.CPU_DEFAULTS}
    assert used == options.CPU_DEFAULTS  # scaled down on CPU: the flags were not given
    flags = data["env"]["flags"]
    assert {k: flags[k] for k in options.CPU_DEFAULTS} == used  # the values used, not defaults
    assert flags["plot_out"] == str(plot_out) and "child" not in flags


def test_pallas_impl_is_known_and_skipped_without_a_gpu(tmp_path):
    assert options.expand_impls(["pallas"]) == ("pallas",)
    proc = run_cli("--size=64KiB", "--impls=xla,pallas", "--json_out=", "--plot_out=")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "the Pallas kernels need a GPU" in proc.stdout + proc.stderr


def test_pallas_splitk_nocb_runs_in_the_command_buffer_free_child():
    assert options.expand_impls(["pallas_splitk_no_cmdbuf"]) == ("pallas_splitk_no_cmdbuf",)
    assert "pallas_splitk_no_cmdbuf" in runners.LAYOUTS_NOT_COMPARABLE
    assert COMMAND_BUFFERS_OFF in children.child_env(["pallas_splitk_no_cmdbuf"])["XLA_FLAGS"]
    notes: list[str] = []
    opts = options.Options(
        configs=(), layouts=("shared",), impls=("xla", "pallas_splitk_no_cmdbuf"), warmup=1,
        repeats=1, chains_per_call=1, ncu_chains=1, json_out="", plot_out="", hbm=False,
        trace_dir=None,
    )  # fmt: skip
    assert sweep.select_impls(opts, on_gpu=False, note=notes.append) == ("xla",)
    assert "pallas_splitk_no_cmdbuf skipped" in notes[0]


def test_timing_child_reports_the_chains_its_output_went_through():
    # The parent checks a child's output against the reference after that many chains; it
    # used to guess 1 for every impl without "loop" in its name (pallas_splitk_no_cmdbuf runs N).
    cfg, n = small_config(d=64, steps=3), 3
    opts = options.Options(
        configs=(cfg,), layouts=("shared",), impls=("xla", "xla_loop"), warmup=0, repeats=1,
        chains_per_call=n, ncu_chains=1, json_out="", plot_out="", hbm=False, trace_dir=None,
    )  # fmt: skip
    child = children.run_timing_child(cfg, opts, ["xla", "xla_loop"])
    x_host, w_host = runners.host_values(cfg)
    for impl, chains in (("xla", 1), ("xla_loop", n)):
        _, out, compile_seconds = child[("shared", impl)]
        assert out.chains == chains and compile_seconds > 0
        ref = report.reference_chain(x_host, w_host, cfg.steps * chains)
        other = report.reference_chain(x_host, w_host, cfg.steps * (n + 1 - chains))
        tol = report.tolerance(cfg.dtype, cfg.steps * chains)
        assert np.max(np.abs(out.y - ref)) / np.max(np.abs(ref)) <= tol
        assert np.max(np.abs(out.y - other)) / np.max(np.abs(other)) > tol
        ref1 = report.reference_chain(x_host, w_host, cfg.steps)  # the child's one chain
        assert report.agreement(out.one_chain, ref1, cfg.dtype, cfg.steps)["ok"]


def _ceilings_file(path: Path, device_kind: str, read_bytes_per_s: float) -> Path:
    path.write_text(
        json.dumps(
            {
                "environment": {"device_kind": device_kind},
                "ceilings": {"read_bytes_per_s": read_bytes_per_s, "bf16_flops_per_s": 1e12},
            }
        )
    )
    return path


def test_variants_end_to_end_with_one_chain_checks_ceilings_and_gemm(tmp_path):
    impls = ("xla", "xla_loop", "xla_f32dot", "xla_loop_unrolled")
    json_out = tmp_path / "chain.json"
    bw = 2.0e11
    ceilings = _ceilings_file(tmp_path / "ceilings.json", CLI_DEVICE_KIND, bw)
    proc = run_cli(
        f"--impls={','.join(impls)}", "--size=1MiB", f"--json_out={json_out}", "--plot_out=",
        f"--ceilings={ceilings}", "--gemm=cublas",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(json_out.read_text())
    keys = {(layout, impl) for layout in ("shared", "copies") for impl in impls}
    assert {(r["layout"], r["impl"]) for r in data["runs"]} == keys
    steps, n = data["config"]["steps"], data["config"]["chains_per_call"]
    one = data["checks"]["one_chain"]
    assert {(c["layout"], c["impl"]) for c in one} == keys
    for c in one:
        assert c["chains"] == 1 and c["ok"]
        assert c["tol"] == pytest.approx(report.tolerance("bfloat16", steps))
    chains = {c["impl"]: c["chains"] for c in data["checks"]["agreement"]}
    assert chains == {"xla": 1, "xla_loop": n, "xla_f32dot": 1, "xla_loop_unrolled": n}
    assert all(c["ok"] for c in data["checks"]["agreement"])
    assert all(c["identical"] for c in data["checks"]["layouts"])
    # the floor comes from the ceilings file; no torch rows here, so no rival
    assert data["env"]["ceilings"]["read_bytes_per_s"] == bw
    assert data["env"]["ceilings_source"] == str(ceilings)
    for r in data["runs"]:
        t = r["median_us"] * 1e-6
        assert r["pct_floor_once"] == pytest.approx(100 * r["weight_bytes"] / bw / t, rel=1e-3)
        assert r["vs_best"] is None
    compiled = {r["impl"] for r in data["runs"] if r["compile_seconds"]}
    assert compiled == set(impls)  # compiled for the first layout, cached for the second
    assert data["config"]["gemm"] == "cublas" and TRITON_GEMM_OFF in data["env"]["xla_flags"]
    assert "0.20 TB/s" in proc.stdout and "vs best" in proc.stdout


def test_ceilings_of_another_device_are_refused(tmp_path):
    ceilings = _ceilings_file(tmp_path / "c.json", "Another GPU", 4e12)
    proc = run_cli("--size=64KiB", f"--ceilings={ceilings}", "--json_out=", "--plot_out=")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"chain: --ceilings: {ceilings}: measured on 'Another GPU', this run is on "
        f"{CLI_DEVICE_KIND!r}"
    ]


def test_a_failed_check_exits_1_after_writing_the_json(tmp_path):
    # Every check fails when the tolerance is negative; the program must still write the JSON.
    json_out = tmp_path / "chain.json"
    script = (
        "import sys; from experiments import program; from experiments.chain import report; "
        "from experiments.chain.__main__ import define_flags, main; "
        "report.tolerance = lambda dtype, steps: -1.0; "
        "sys.argv = ['chain'] + sys.argv[1:]; "
        "program.run('chain', define_flags, main)"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", script, "--size=64KiB", "--impls=xla_f32dot", "--layouts=shared",
         f"--json_out={json_out}", "--plot_out="],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    data = json.loads(json_out.read_text())
    assert data["complete"] and not any(c["ok"] for c in data["checks"]["one_chain"])
    errors = proc.stderr.strip().splitlines()
    assert "chain: check failed: xla_f32dot shared W=" in errors[0]
    assert "after 1 chain" in errors[0]
    assert errors[-1].startswith("chain: 2 check(s) failed")


# ---------------------------------------------------------------- torch


def test_torch_compile_is_one_graph_equal_to_eager():
    torch = pytest.importorskip("torch", reason='needs PyTorch: pip install -e ".[torch]"')
    from experiments.torch_ref import chain as torch_chain

    assert torch_chain.IMPLS == ("torch_eager", "torch_graph", "torch_compile")
    x = torch.randn(1, 128, dtype=torch.bfloat16)
    w = torch.randn(128, 128, dtype=torch.bfloat16) / 11.3
    copies = [w] + [w.clone() for _ in range(3)]
    compiled = torch_chain.compile_chain("default", backend="aot_eager")  # Inductor: GPU test
    for ws in ([w] * 4, copies):
        assert torch.equal(compiled(x, *ws), torch_chain.chain(x, ws))
    with pytest.raises(ValueError, match="mode"):
        torch_chain.compile_chain("fastest")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune-no-cudagraphs"])
def test_torch_compile_runner_matches_the_reference(mode):
    from experiments.torch_ref import chain as torch_chain

    if not torch_chain.cuda_available():
        pytest.skip("torch without CUDA")
    cfg, n = small_config(d=256, steps=8), 3
    x, w = runners.host_values(cfg)
    ref = report.reference_chain(x, w, cfg.steps)
    outputs = {}
    for layout in options.LAYOUTS:
        ws = torch_chain.make_weights(w, cfg.steps, layout, cfg.dtype)
        runner = torch_chain.runner(
            "torch_compile", x, ws, dtype_name=cfg.dtype, n=n, compile_mode=mode
        )
        assert runner.per_call == n and runner.compile_seconds > 0
        runner.fn()
        runner.sync()
        outputs[layout] = runner.output()
        assert report.agreement(runner.one_chain(), ref, cfg.dtype, cfg.steps)["ok"]
    assert report.same_bits(outputs["shared"], outputs["copies"])


@pytest.mark.gpu
def test_torch_graph_runner_keeps_what_its_graph_reads():
    """A captured graph holds raw pointers: the runner must keep x alive, or the allocator hands
    its memory to the next tensor and later replays read that tensor instead."""
    from experiments.torch_ref import chain as torch_chain

    if not torch_chain.cuda_available():
        pytest.skip("torch without CUDA")
    import torch

    cfg = small_config(d=256, steps=8)
    x, w = runners.host_values(cfg)
    ref = report.reference_chain(x, w, cfg.steps)
    ws = torch_chain.make_weights(w, cfg.steps, "shared", cfg.dtype)
    runner = torch_chain.runner("torch_graph", x, ws, dtype_name=cfg.dtype, n=2)
    clobber = [torch.full((1, 256), 7.0, device="cuda") for _ in range(64)]  # reuse freed blocks
    for _ in range(2):
        assert report.agreement(runner.output(), ref, cfg.dtype, cfg.steps)["ok"]
    del clobber
