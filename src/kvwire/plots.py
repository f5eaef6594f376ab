"""Plots where a curve says more than a table (matplotlib, written to PNG files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def splice_curve(rows: list[dict[str, Any]], path: str | Path, title: str = "splice: speed vs fidelity") -> Path:
    """Speedup and token agreement against the recomputed share, one line per strategy.

    ``rows`` are splice benchmark rows with ``strategy`` ("R" or "first-k"),
    ``recomputed_share`` (0..1), ``speedup``, ``ttft_speedup`` and ``agreement``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, fidelity, divergence) = plt.subplots(1, 3, figsize=(15, 4.2), constrained_layout=True)
    for strategy, marker in (("R", "o"), ("first-k", "s")):
        points = sorted((r for r in rows if r["strategy"] == strategy), key=lambda r: r["recomputed_share"])
        if not points:
            continue
        share = [100 * r["recomputed_share"] for r in points]
        speed.plot(share, [r["ttft_speedup"] for r in points], marker=marker, label=f"TTFT, {strategy}")
        speed.plot(share, [r["speedup"] for r in points], marker=marker, linestyle="--",
                   label=f"end-to-end, {strategy}")
        fidelity.plot(share, [100 * r["agreement"] for r in points], marker=marker, label=f"vs text, {strategy}")
        if all(r.get("exact_agreement") is not None for r in points):
            fidelity.plot(share, [100 * r["exact_agreement"] for r in points], marker=marker, linestyle="--",
                          label=f"vs exact recompute, {strategy}")
        if any(r.get("kl") for r in points):
            divergence.plot(share, [max(r["kl"], 1e-12) for r in points], marker=marker, label=f"vs text, {strategy}")
        if all(r.get("exact_kl") is not None for r in points):
            divergence.plot(share, [max(r["exact_kl"], 1e-12) for r in points], marker=marker, linestyle="--",
                            label=f"vs exact recompute, {strategy}")
        if strategy == "R":
            for r, x in zip(points, share):
                fidelity.annotate(r["setting"], (x, 100 * r["agreement"]), textcoords="offset points",
                                  xytext=(4, -10), fontsize=7)
    speed.axhline(1.0, color="grey", linewidth=0.8)
    speed.set_xlabel("spliced tokens recomputed (%)")
    speed.set_ylabel("speedup vs text (x)")
    speed.set_title("speed (agents 2..N)")
    speed.legend(fontsize=8)
    fidelity.axhline(90, color="grey", linewidth=0.8, linestyle=":")
    fidelity.set_xlabel("spliced tokens recomputed (%)")
    fidelity.set_ylabel("greedy token agreement with text (%)")
    fidelity.set_ylim(0, 102)
    fidelity.set_title("fidelity (agents 2..N)")
    fidelity.legend(fontsize=8)
    divergence.set_yscale("log")
    divergence.set_xlabel("spliced tokens recomputed (%)")
    divergence.set_ylabel("mean next-token KL (nats)")
    divergence.set_title("divergence, teacher forced (agents 2..N)")
    divergence.legend(fontsize=8)
    fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def training_curve(steps: list[dict[str, Any]], evals: list[dict[str, Any]], path: str | Path,
                   title: str = "training") -> Path:
    """Training loss per step (raw and a moving average) and held-out loss / accuracy per evaluation.

    ``steps`` rows have ``step`` and ``loss``; ``evals`` rows have ``step``, ``loss``,
    ``accuracy`` and the receiver alone's ``baseline_loss`` / ``baseline_accuracy``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(12, 4.2), constrained_layout=True)
    xs = [r["step"] for r in steps]
    ys = [r["loss"] for r in steps]
    loss_ax.plot(xs, ys, color="tab:blue", alpha=0.25, linewidth=0.8, label="train (per step)")
    window = max(1, len(ys) // 30)
    if window > 1:
        smooth = [sum(ys[max(0, i - window + 1): i + 1]) / len(ys[max(0, i - window + 1): i + 1])
                  for i in range(len(ys))]
        loss_ax.plot(xs, smooth, color="tab:blue", label=f"train (mean of {window})")
    if evals:
        loss_ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], "o-", color="tab:orange",
                     label="held-out")
        loss_ax.axhline(evals[-1]["baseline_loss"], color="grey", linestyle="--", label="held-out, receiver alone")
        accs = [e for e in evals if e.get("accuracy") is not None]
        if accs:
            acc_ax.plot([e["step"] for e in accs], [100 * e["accuracy"] for e in accs], "o-", color="tab:orange",
                        label="held-out accuracy")
            acc_ax.axhline(100 * accs[-1]["baseline_accuracy"], color="grey", linestyle="--",
                           label="receiver alone")
            if accs[-1].get("sharer_accuracy") is not None:
                acc_ax.axhline(100 * accs[-1]["sharer_accuracy"], color="tab:green", linestyle="--",
                               label="sharer alone")
            agree = [e for e in accs if e.get("agreement") is not None]
            if agree:
                acc_ax.plot([e["step"] for e in agree], [100 * e["agreement"] for e in agree], "s:",
                            color="tab:purple", label="picks the sharer's letter")
    loss_ax.set_yscale("log")
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("answer cross-entropy (nats/token)")
    loss_ax.set_title("loss")
    loss_ax.legend(fontsize=8)
    acc_ax.set_xlabel("step")
    acc_ax.set_ylabel("held-out multiple-choice questions (%)")
    acc_ax.set_title("held-out accuracy (first answer token among the letters)")
    if acc_ax.lines:
        acc_ax.legend(fontsize=8)
    fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
