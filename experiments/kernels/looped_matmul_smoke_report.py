"""The tables `experiments.kernels.looped_matmul_smoke` prints last, from the RESULT rows of its
cases: resident vs split-K vs XLA per (d, M) with the other cases below it, and for the barrier
suite the cost of one grid barrier and of one split-K step, by poll."""

from __future__ import annotations

from typing import Any

from experiments.kernels.looped_matmul_cases import (
    BARRIER_BLOCKS,
    BARRIER_EPOCHS,
    TABLE_D,
    TABLE_M,
)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _time(row: dict[str, Any], what: str) -> float | None:
    """CUPTI time, else the back-to-back wall time (when CUPTI saw nothing)."""
    return row.get(f"{what}_us") or row.get(f"{what}_wall_us")


def print_table(rows: list[dict[str, Any]]) -> None:
    """Resident vs split-K vs XLA per (d, M), then the split-K variants."""
    by = {r["case"]: r for r in rows}
    print("\n=== looped matmul, 8 steps, device time per chain (us; CUPTI, else wall) ===")
    print(
        f"{'d':>6} {'W MiB':>6} {'M':>3} | {'resident':>9} {'splitk':>9} {'XLA':>8} "
        f"{'split/XLA':>9} | status res/split"
    )
    for d in TABLE_D:
        for m in TABLE_M:
            res, spl = by.get(f"resident_d{d}_m{m}", {}), by.get(f"splitk_d{d}_m{m}", {})
            xla = _time(spl, "xla") or _time(res, "xla")
            k = _time(spl, "kernel")
            ratio = f"{k / xla:.2f}" if k and xla else "-"
            print(
                f"{d:>6} {d * d * 2 / 2**20:>6.0f} {m:>3} | {_fmt(_time(res, 'kernel')):>9} "
                f"{_fmt(k):>9} {_fmt(xla):>8} {ratio:>9} | "
                f"{res.get('status', '?')}/{spl.get('status', '?')}"
            )
    extra = [r for r in rows if r["case"] not in {f"{v}_d{d}_m{m}" for v in ("resident", "splitk")
             for d in TABLE_D for m in TABLE_M}]  # fmt: skip
    if extra:
        print("--- other cases ---")
        for r in extra:
            print(
                f"{r['case']:<34} steps={r['steps']:<3} kernel {_fmt(_time(r, 'kernel')):>8} us"
                f"  XLA {_fmt(_time(r, 'xla')):>8} us  rel={r.get('rel', float('nan')):.1e}"
                f"  {r.get('status', '?')}"
            )


def print_barrier_table(rows: list[dict[str, Any]]) -> None:
    """Per-barrier cost from the probe, per-step cost of the split-K kernel, by poll."""
    from pallas_kernels.looped_matmul.barrier import POLLS

    by = {r["case"]: r for r in rows}
    print(f"\n=== grid barrier: us per barrier (probe, {BARRIER_BLOCKS} blocks) and per split-K "
          "step (8 -> 32 steps) ===")  # fmt: skip
    print(f"{'poll':<12} {'wg1':>7} {'wg2':>7} {'d2048/step':>11} {'d3520/step':>11}")
    for poll in POLLS:
        cells = []
        for warpgroups in (1, 2):
            one = by.get(f"barrier_{poll}_wg{warpgroups}_e1", {}).get("kernel_us")
            many = by.get(f"barrier_{poll}_wg{warpgroups}_e{BARRIER_EPOCHS}", {}).get("kernel_us")
            cells.append((many - one) / (BARRIER_EPOCHS - 1) if one and many else None)
        for d in (2048, 3520):
            s8 = by.get(f"splitk_d{d}_m1_s8_{poll}", {}).get("kernel_us")
            s32 = by.get(f"splitk_d{d}_m1_s32_{poll}", {}).get("kernel_us")
            cells.append((s32 - s8) / 24 if s8 and s32 else None)
        widths = (7, 7, 11, 11)
        row = " ".join(f"{_fmt(c):>{w}}" for c, w in zip(cells, widths, strict=True))
        print(f"{poll:<12} {row}")
