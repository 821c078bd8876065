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
    assert lines[4].startswith("bound: no grid barrier after proj, attn")
