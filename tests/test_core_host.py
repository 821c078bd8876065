"""The host-time program's parts that run on a CPU: its traced host events and its table."""

import jax
import jax.numpy as jnp

from experiments.kernels import core_host


def test_host_events_lists_the_dispatch_of_each_call():
    f = jax.jit(lambda x: (x @ x).sum())
    x = jnp.ones((64, 64))
    f(x).block_until_ready()
    events = core_host.host_events(lambda: f(x), reps=4, top=50)
    assert events == sorted(events, key=lambda e: -e["us_per_call"])
    by_name = {e["name"]: e for e in events}
    dispatch = [e for name, e in by_name.items() if name.startswith("PjitFunction")]
    assert dispatch and all(e["per_call"] >= 1 and e["us_per_call"] > 0 for e in dispatch)


def test_measure_and_table():
    f = jax.jit(lambda x: x + 1)
    x = jnp.ones(8)
    rows = {name: core_host.measure(lambda: f(x), reps=5, iterations=4) for name in ("a", "b")}
    for r in rows.values():
        assert 0 < r["host_us"]["median_us"] <= r["wall_us"]["max_us"]
        assert r["host_us_per_iteration"] == r["host_us"]["median_us"] / 4
    events = [dict(name="launch", us_per_call=12.5, per_call=2.0)]
    table = core_host.format_table(rows, events, 4, True).splitlines()
    assert [line.split()[0] for line in table[1:3]] == ["a", "b"]
    assert table[-1].split() == ["launch", "12.5", "2.0"]
