"""What a training run shows: the plot (accuracy against test-time iterations, overall and per
difficulty, and the training loss) and the table, both drawn from the results JSON alone, so
that either can be redrawn from a saved file."""

from __future__ import annotations

from pathlib import Path


def plot_results(json_path: str | Path, out_path: str | Path) -> Path:
    """Accuracy against test-time iterations (overall and per difficulty) and the training loss,
    drawn from the results JSON alone; saved atomically."""
    import matplotlib

    matplotlib.use("Agg")  # no display on GPU machines or CI
    import matplotlib.pyplot as plt

    from experiments.measure import results as results_lib
    from huginn_jax.files import write_atomic

    data = results_lib.read_json(json_path)
    ev = data["eval"]
    its = ev["iterations"]
    fig, (ax, ax_loss) = plt.subplots(1, 2, figsize=(12, 4.5))
    cmap = plt.get_cmap("viridis")
    diffs = sorted(ev["by_difficulty"], key=int)
    for i, d in enumerate(diffs):
        color = cmap(i / max(1, len(diffs) - 1))
        label = data["config"].get("difficulty_labels", {}).get(d, f"difficulty {d}")
        ax.plot(its, ev["by_difficulty"][d]["accuracy"], "-", lw=1, color=color, alpha=0.8,
                label=label)  # fmt: skip
    ax.plot(its, ev["accuracy"], "k-o", lw=2.2, label="all answers")
    if ev.get("sequence_accuracy"):
        ax.plot(its, ev["sequence_accuracy"], "k--s", lw=1.4, ms=4, label="whole sequence")
    random_acc = data.get("compare_random", {}).get("random", {}).get("accuracy")
    if random_acc:
        ax.plot(its, random_acc, "k:", lw=1.2, label="random weights")
    ax.set_xscale("log", base=2)
    ax.set_xticks(its, [str(r) for r in its])
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("Core iterations at test time")
    ax.set_ylabel("answer-token accuracy")
    cfg = data["config"]
    train_cfg = cfg["train"]
    model = cfg["model"]
    layers = "+".join(
        str(model[f"n_layers_in_{part}"]) for part in ("prelude", "recurrent_block", "coda")
    )
    ax.set_title(
        f"{cfg['preset']} ({layers} layers) on {cfg['task']['name']}, trained at mean r="
        f"{train_cfg['mean_recurrence']:g}, k={train_cfg['backprop_depth']}",
        fontsize=10,
    )
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    hist = data["train"]["history"]
    ax_loss.plot([h["step"] for h in hist], [h["loss"] for h in hist], lw=1)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss (answer tokens)")
    ax_loss.set_yscale("log")
    ax_loss.grid(alpha=0.3)
    fig.tight_layout()
    try:
        return write_atomic(out_path, lambda tmp: fig.savefig(tmp, dpi=130))
    finally:
        plt.close(fig)


def format_table(data: dict) -> str:
    """Accuracy per test-time iteration count (overall, whole sequence, per difficulty), the KL
    exit's line and, with --compare_random, the trained-vs-random line."""
    ev = data["eval"]
    diffs = sorted(ev["by_difficulty"], key=int)
    labels = data["config"].get("difficulty_labels", {})  # the task's words, e.g. "depth 0"
    header = ["iterations", "accuracy", "seq acc", *[labels.get(d, f"d={d}") for d in diffs]]
    rows = []
    for i, r in enumerate(ev["iterations"]):
        per = [f"{ev['by_difficulty'][d]['accuracy'][i]:.3f}" for d in diffs]
        rows.append([str(r), f"{ev['accuracy'][i]:.3f}", f"{ev['sequence_accuracy'][i]:.3f}", *per])
    widths = [max(len(x[c]) for x in [header, *rows]) for c in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
             for row in [header, *rows]]  # fmt: skip
    ax = ev["adaptive_exit"]
    lines.append(
        f"KL exit (< {ax['threshold']:g}): mean {ax['mean_exit']:.2f} iterations, median "
        f"{ax['median_exit']:.0f}, accuracy at exit {ax['accuracy_at_exit']:.3f} vs "
        f"{ax['accuracy_at_max']:.3f} at {ax['max_iterations']}"
    )
    cmp_ = data.get("compare_random")
    if cmp_:
        t, r = cmp_["trained"]["decode"], cmp_["random"]["decode"]
        lines.append(
            f"decode r={t['num_steps']}: trained {t['median_us']:.0f} us, random "
            f"{r['median_us']:.0f} us (ratio {t['median_us'] / r['median_us']:.3f}); mean KL exit "
            f"trained {cmp_['summary']['mean_exit_trained']:.2f}, random "
            f"{cmp_['summary']['mean_exit_random']:.2f}"
        )
    return "\n".join(lines)
