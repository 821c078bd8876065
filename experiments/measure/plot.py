"""Plot of the chain experiment, drawn from its results JSON only (never from in-memory state).

Left: µs per chain (median, p10-p90 band) against weight size W. Right, when `--hbm` ran: HBM
bytes read per chain in units of W. Each implementation has its own colour and each layout its
own marker and line style (shared: circles, solid; copies: squares, dashed), so that the two
layouts of one implementation stay apart; log axes. A vertical line marks the device's L2 size
(as the run measured it, else the datasheet's, labelled nominal); with the device's ceilings,
two grey lines mark the floors: reading W once, and steps x W, at the measured streaming rate.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on GPU machines or CI

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from experiments.measure import results as results_lib  # noqa: E402
from huginn_jax.files import write_atomic  # noqa: E402

MIB = 1024**2
# Layout -> how its lines look; a layout not listed here gets the last style.
LAYOUT_STYLES = {
    "shared": {"ls": "-", "marker": "o"},
    "copies": {"ls": "--", "marker": "s", "markerfacecolor": "none"},
}
_OTHER_LAYOUT = {"ls": ":", "marker": "^"}


def impl_colours(impls: list[str]) -> dict[str, object]:
    """One distinct colour per implementation: tab10 up to 10 of them, tab20 up to 20."""
    cmap = plt.get_cmap("tab10" if len(impls) <= 10 else "tab20")
    return {impl: cmap(i % cmap.N) for i, impl in enumerate(sorted(impls))}


def l2_marker(env: dict) -> tuple[int, str] | None:
    """(bytes, legend label) of the L2 line: the size the run read from the device, else the
    datasheet value of a device kind `huginn_jax.costs` knows (labelled nominal); else None."""
    if env.get("l2_bytes"):
        return env["l2_bytes"], f"L2 {env['l2_bytes'] / MIB:.0f} MiB"
    from huginn_jax.costs import DEVICES

    kind = str(env.get("device_kind", "")).lower()
    for name, spec in DEVICES.items():
        if name.isalnum() and name in kind.split():
            return spec.l2_bytes, f"L2 {spec.l2_bytes / MIB:.0f} MiB (nominal, {name})"
    return None


def plot_chain(json_path: str | os.PathLike, out_path: str | os.PathLike) -> Path:
    """Reads the chain results JSON at `json_path` and saves the figure atomically to `out_path`."""
    data = results_lib.read_json(json_path)
    runs = data["runs"]
    series: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
    for run in runs:
        series[(run["impl"], run["layout"])].append(run)
    has_hbm = any(run.get("hbm") for run in runs)

    fig, axes = plt.subplots(1, 2 if has_hbm else 1, figsize=(14 if has_hbm else 8, 5))
    axes = list(axes) if has_hbm else [axes]
    colour = impl_colours(sorted({impl for impl, _ in series}))
    order = list(LAYOUT_STYLES)
    layouts = sorted({lo for _, lo in series}, key=lambda lo: (order + [lo]).index(lo))
    for (impl, layout), rows in sorted(series.items()):
        rows = sorted(rows, key=lambda r: r["weight_bytes"])
        x = [r["weight_bytes"] / MIB for r in rows]
        style = {**LAYOUT_STYLES.get(layout, _OTHER_LAYOUT), "color": colour[impl], "lw": 1.4}
        axes[0].plot(x, [r["median_us"] for r in rows], **style)
        axes[0].fill_between(
            x,
            [r["p10_us"] for r in rows],
            [r["p90_us"] for r in rows],
            color=colour[impl],
            alpha=0.10,
            lw=0,
        )
        hbm = [(xi, r["hbm"]["read_x_w"]) for xi, r in zip(x, rows, strict=True) if r.get("hbm")]
        if has_hbm and hbm:
            axes[1].plot(*zip(*hbm, strict=True), **style)

    env = data.get("env", {})
    l2_mark = l2_marker(env)
    l2 = l2_mark[0] if l2_mark else None
    steps = data.get("config", {}).get("steps")
    bw = (env.get("ceilings") or {}).get("read_bytes_per_s")
    floors = [(1, ":", "W once"), (steps, "--", f"{steps} x W")] if bw and steps else []
    sizes = sorted({r["weight_bytes"] for r in runs})
    for times, ls, _ in floors:
        axes[0].plot(
            [w / MIB for w in sizes], [times * w / bw * 1e6 for w in sizes], color="grey",
            ls=ls, lw=1.2,
        )  # fmt: skip
    axes[0].set_ylabel("time per chain (µs, median; band p10-p90)")
    axes[0].set_yscale("log")
    if has_hbm:
        axes[1].set_ylabel("HBM bytes read per chain (multiples of W)")
        if steps:
            axes[1].axhline(steps, color="grey", lw=0.8, ls=":")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("weight size W (MiB)")
        if l2:
            ax.axvline(l2 / MIB, color="black", lw=1, ls="-.")
            ax.text(l2 / MIB, 0.98, " L2", transform=ax.get_xaxis_transform(), va="top", size=8)
        ax.grid(True, which="both", alpha=0.3)
    # One legend: a colour per implementation, a marker and line style per layout, the L2 line.
    handles = [Line2D([], [], color=c, lw=2, label=impl) for impl, c in colour.items()]
    handles += [
        Line2D([], [], color="dimgrey", **LAYOUT_STYLES.get(layout, _OTHER_LAYOUT), label=layout)
        for layout in layouts
    ]
    if l2_mark:
        handles.append(Line2D([], [], color="black", lw=1, ls="-.", label=l2_mark[1]))
    handles += [
        Line2D([], [], color="grey", lw=1.2, ls=ls, label=f"floor: read {label} at "
               f"{bw / 1e12:.2f} TB/s")
        for _, ls, label in floors
    ]  # fmt: skip
    if has_hbm and steps:
        handles.append(Line2D([], [], color="grey", lw=0.8, ls=":", label=f"{steps} x W"))
    axes[-1].legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    no_floor = "" if floors else " (no ceilings measured for this device: no floor)"
    fig.suptitle(f"chain of {steps} dependent x @ W on {env.get('device_kind', '?')}{no_floor}")
    fig.tight_layout()

    try:
        return write_atomic(out_path, lambda tmp: fig.savefig(tmp, dpi=120, bbox_inches="tight"))
    finally:
        plt.close(fig)
