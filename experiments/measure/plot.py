"""Plot of the chain experiment, drawn from its results JSON only (never from in-memory state).

Left: µs per chain (median, p10-p90 band) against weight size W. Right, when `--hbm` ran: HBM
bytes read per chain in units of W. One line per implementation x layout; a vertical line at
the device's L2 size; log x axis.
"""

from __future__ import annotations

import collections
import os
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on GPU machines or CI

import matplotlib.pyplot as plt  # noqa: E402

from experiments.measure import results as results_lib  # noqa: E402

MIB = 1024**2


def plot_chain(json_path: str | os.PathLike, out_path: str | os.PathLike) -> Path:
    """Reads the chain results JSON at `json_path` and saves the figure atomically to `out_path`."""
    data = results_lib.read_json(json_path)
    runs = data["runs"]
    series: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
    for run in runs:
        series[(run["impl"], run["layout"])].append(run)
    has_hbm = any(run.get("hbm") for run in runs)

    fig, axes = plt.subplots(1, 2 if has_hbm else 1, figsize=(13 if has_hbm else 7, 4.5))
    axes = list(axes) if has_hbm else [axes]
    # One colour per implementation; solid = shared, dashed = copies.
    impls = sorted({impl for impl, _ in series})
    colour = {impl: f"C{i % 10}" for i, impl in enumerate(impls)}
    for (impl, layout), rows in sorted(series.items()):
        rows = sorted(rows, key=lambda r: r["weight_bytes"])
        x = [r["weight_bytes"] / MIB for r in rows]
        style = dict(ls="-" if layout == "shared" else "--", marker="o", color=colour[impl])
        axes[0].plot(x, [r["median_us"] for r in rows], label=f"{impl} {layout}", **style)
        axes[0].fill_between(
            x,
            [r["p10_us"] for r in rows],
            [r["p90_us"] for r in rows],
            color=colour[impl],
            alpha=0.12,
        )
        hbm = [(xi, r["hbm"]["read_x_w"]) for xi, r in zip(x, rows, strict=True) if r.get("hbm")]
        if has_hbm and hbm:
            axes[1].plot(*zip(*hbm, strict=True), label=f"{impl} {layout}", **style)

    env = data.get("env", {})
    l2 = env.get("l2_bytes")
    steps = data.get("config", {}).get("steps")
    axes[0].set_ylabel("µs per chain (median, p10-p90)")
    axes[0].set_yscale("log")
    if has_hbm:
        axes[1].set_ylabel("HBM bytes read per chain / W")
        if steps:
            axes[1].axhline(steps, color="grey", lw=0.8, ls=":", label=f"{steps} x W")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("weight size W (MiB)")
        if l2:
            ax.axvline(l2 / MIB, color="black", lw=1, ls="-.", label=f"L2 {l2 / MIB:.0f} MiB")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"chain of {steps} dependent x @ W on {env.get('device_kind', '?')}")
    fig.tight_layout()

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(
        prefix=f".{out_path.stem}.", suffix=out_path.suffix, dir=out_path.parent
    )
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, out_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
    return out_path
