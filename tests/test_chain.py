"""Tests of experiments.chain's options and report: size parsing, the d rule, the plot's path,
impl lists, bit comparison, the results table, "vs best", failed checks, the plot's styles."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.chain import options, report
from experiments.measure import plot

MIB = 2**20


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


# ---------------------------------------------------------------- impls and the report


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


# ---------------------------------------------------------------- plot


def test_plot_gives_each_impl_a_colour_and_each_layout_a_style():
    impls = list(options.KNOWN_IMPLS)
    colours = plot.impl_colours(impls)
    assert len(set(colours.values())) == len(impls) > 10
    shared, copies = plot.LAYOUT_STYLES["shared"], plot.LAYOUT_STYLES["copies"]
    assert shared["ls"] != copies["ls"] and shared["marker"] != copies["marker"]
