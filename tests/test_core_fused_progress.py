"""What `experiments.kernels.core_fused` prints as each of its processes ends."""

from experiments.kernels.core_fused import row_times


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
