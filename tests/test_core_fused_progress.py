"""What `experiments.kernels.core_fused` prints as each of its processes ends, and its table."""

from experiments.kernels.core_fused_report import format_table, row_times


def test_a_finished_case_prints_each_timed_row():
    rows = [
        dict(impl="stream", context=0, ms_per_iteration=0.8114),
        dict(impl="fused", context=1024, ms_per_iteration=0.9102),
        dict(impl="fused", context=4096, note="no kernel timed"),
    ]
    assert row_times(rows) == (
        "stream context 0 0.811 ms/iteration; fused context 1024 0.910 ms/iteration"
    )
    assert row_times(rows[2:]) == "no row timed"


def test_the_table_writes_each_rows_schedule_floor_and_error():
    schedule = dict(ring=3, kv_stages=2, l2_units=0, l2_blocks=0, kv_block=64, l2_barrier=0)
    schedule |= dict(l2_attention=0, handover=8, overlap=1)
    row = dict(batch=1, impl="fused", unit_cols=256, context=1024, **schedule)
    timed = dict(row, ms_per_iteration=0.903, floor_ms=0.787, pct_floor=87.2, rel_err=0.042)
    bound = dict(timed, skip_barriers=["proj", "attn"])
    lines = format_table([timed, bound], []).splitlines()
    assert lines[2].split() == ["1", "fused", "256", "3:2:0:0:64:0:0:8:1", "1024", "0.903",
                                "0.787", "87.2%", "4.2e-02"]  # fmt: skip
    assert lines[3].split()[-1] == "bound"
    lag0 = dict(timed, dataflow=1, head_pairs=0, lag=0)  # 12 fields: wider than the column
    wide = format_table([lag0], []).splitlines()[2].split()
    assert wide[2:4] == ["256", "3:2:0:0:64:0:0:8:1:1:0:0"]
    assert lines[4].startswith("bound: no grid barrier after proj, attn")
    waits = dict(bound, dataflow=1)  # one grid barrier per iteration: the counters' waits
    assert (
        format_table([waits], [])
        .splitlines()[-1]
        .startswith("bound: no unit waits on the output tiles of proj, attn")
    )


def test_a_profile_of_two_warpgroups_lists_the_second_apart():
    """A profile's batch, cycles and spread, then the second warpgroup's parts in a table of
    their own; a profile of one warpgroup (or an older run's, without the key) has no such
    table."""

    def cycles(median):
        return dict(median=median, p10=median - 10, p90=median + 10)

    profile = dict(
        workers=132, batch=8, context=1024, unit_cols=256, schedule="3:2:0:0:64:0:0:8:1:1",
        cycles_per_iteration={"qkv": cycles(300_000), "wait_parts": cycles(4_000)},
        spread_per_iteration={"qkv": dict(late=9_000.0, waited=2_000.0, repeat=0.8)},
        second_warpgroup_workers=110,
        second_warpgroup_cycles_per_iteration={"blocks": cycles(80_000), "wait_q": cycles(900)},
    )  # fmt: skip
    lines = format_table([], [profile]).splitlines()
    assert any("context 1024, batch 8, [64, 256] units" in line for line in lines)
    at = lines.index("  the second warpgroup (median over the 110 workers with an attention item, "
                     "p10-p90):")  # fmt: skip
    assert lines[at + 1].split() == ["blocks", "80000", "79990-80010"]
    assert lines[at + 2].split() == ["wait_q", "900", "890-910"]
    assert any(line.split()[:2] == ["wait_parts", "4000"] for line in lines[:at])
    one = {k: v for k, v in profile.items() if not k.startswith("second")}
    assert "second warpgroup" not in format_table([], [one])
    none = dict(profile, second_warpgroup_workers=0, second_warpgroup_cycles_per_iteration={})
    assert "second warpgroup" not in format_table([], [none])
