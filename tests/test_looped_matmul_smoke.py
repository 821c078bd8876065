"""Tests of experiments.kernels.looped_matmul_smoke's plumbing (CPU): every case has a valid
config or is the one without a plan, and both tables of looped_matmul_smoke_report print."""

from __future__ import annotations

from pallas_kernels.looped_matmul.barrier import POLLS


def test_smoke_cases_have_configs_and_table_prints(capsys):
    from experiments.kernels import looped_matmul_smoke as smoke
    from experiments.kernels.looped_matmul_smoke_report import print_table

    cases = {n: c for suite in smoke.SUITES.values() for n, c in suite.items()}
    for name, spec in cases.items():
        if spec.get("variant") == "barrier":
            continue
        try:
            cfg = smoke._config_for(spec)
            cfg.validate(spec["m"], spec["d"], spec["steps"], stacked=spec.get("stacked", False))
        except ValueError as e:  # only the split-K kernel at M=64 has no plan
            assert spec.get("variant") == "splitk" and spec["m"] == 64, (name, e)
    rows = [
        dict(case="resident_d6144_m1", steps=8, kernel_us=240.0, xla_us=190.0, status="OK"),
        dict(case="splitk_d6144_m1", steps=8, kernel_us=70.0, xla_us=190.0, status="OK"),
        dict(case="splitk_d6144_m1_lag2", steps=8, kernel_wall_us=80.0, status="OK", rel=1e-3),
        dict(case="splitk_d6144_m64", steps=8, status="n/a"),
        dict(case="splitk_d2048_m8", steps=8, status="TIMEOUT"),
    ]
    print_table(rows)
    out = capsys.readouterr().out
    assert "    70.0" in out and "0.37" in out and "splitk_d6144_m1_lag2" in out


def test_smoke_barrier_suite_table(capsys):
    from experiments.kernels import looped_matmul_smoke as smoke
    from experiments.kernels.looped_matmul_cases import BARRIER_EPOCHS
    from experiments.kernels.looped_matmul_smoke_report import print_barrier_table

    e = BARRIER_EPOCHS
    rows = [
        dict(case="barrier_one_thread_wg1_e1", kernel_us=3.0),
        dict(case=f"barrier_one_thread_wg1_e{e}", kernel_us=3.0 + (e - 1) * 1.5),
        dict(case="splitk_d2048_m1_s8_one_thread", kernel_us=30.0),
        dict(case="splitk_d2048_m1_s32_one_thread", kernel_us=30.0 + 24 * 2.5),
    ]
    print_barrier_table(rows)
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("one_thread"))
    assert line.split() == ["one_thread", "1.5", "-", "2.5", "-"]
    for spec in smoke.SUITES["barrier"].values():
        assert smoke._poll_of(spec) in POLLS


def test_suite_runs_each_case_in_a_process_and_skips_a_hung_poll(monkeypatch, capsys):
    """`run_suite`'s plumbing, with the case processes faked: a row per case from its RESULT
    line, a timed-out barrier case skips the later ones with its poll (not the others)."""
    import json
    import subprocess

    from experiments.kernels import looped_matmul_smoke as smoke

    cases = {
        "hangs": dict(variant="barrier", poll="one_thread", steps=4),
        "same_poll": dict(variant="barrier", poll="one_thread", steps=8),
        "other_poll": dict(variant="barrier", poll="all_threads", steps=4),
        "resident": dict(d=2048, m=1, steps=8),
    }
    commands = []

    def fake_run(cmd, **kwargs):
        commands.append(cmd)
        name = next(a for a in cmd if a.startswith("--case=")).split("=", 1)[1]
        if name == "hangs":
            raise subprocess.TimeoutExpired(cmd, kwargs["timeout"], output=b"started\n")
        row = json.dumps(dict(case=name, steps=cases[name]["steps"], status="OK"))
        return subprocess.CompletedProcess(cmd, 0, stdout=f"[{name}] ran\nRESULT {row}\n")

    monkeypatch.setattr(smoke.subprocess, "run", fake_run)
    rows = smoke.run_suite(list(cases), cases, reps=3, timeout=5.0, budget=100.0)
    assert [(r["case"], r["status"]) for r in rows] == [
        ("hangs", "TIMEOUT"),
        ("same_poll", "SKIP"),
        ("other_poll", "OK"),
        ("resident", "OK"),
    ]
    assert len(commands) == 3 and all("--json_out=" in c and "--reps=3" in c for c in commands)
    out = capsys.readouterr().out
    assert "[hangs] TIMEOUT after 5 s" in out and "RESULT" not in out


def test_suite_stops_launching_past_its_budget(monkeypatch):
    from experiments.kernels import looped_matmul_smoke as smoke

    def fail_run(cmd, **kwargs):
        raise AssertionError("no case fits the budget: none should start")

    monkeypatch.setattr(smoke.subprocess, "run", fail_run)
    cases = {"resident": dict(d=2048, m=1, steps=8)}
    rows = smoke.run_suite(list(cases), cases, reps=3, timeout=60.0, budget=30.0)
    assert rows == [dict(case="resident", steps=8, status="BUDGET")]
