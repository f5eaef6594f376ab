"""Plots where a curve says more than a table (matplotlib, written to PNG files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def splice_curve(rows: list[dict[str, Any]], path: str | Path, title: str = "splice: speed vs fidelity") -> Path:
    """Speed, token agreement and KL against the recomputed share, one line per strategy.

    ``rows`` are splice benchmark rows with ``strategy`` (a selection criterion such as
    "attention+deviation" or "kv-deviation", "first-k", or "both" for the R = 0 and R = 1
    runs every criterion shares), ``recomputed_share`` (0..1), ``speedup``,
    ``ttft_speedup``, ``agreement`` and ``kl``, and optionally ``exact_agreement`` and
    ``exact_kl`` (against an exact recomputation of the same ids). Older rows whose
    strategy is "R" are one criterion of their own.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    floor = 1e-7  # KL below this (R = 1 is exact, ~1e-11) is drawn at it, so the curve between stays readable
    shared = [r for r in rows if r["strategy"] == "both"]
    strategies = list(dict.fromkeys(r["strategy"] for r in rows if r["strategy"] != "both"))
    fig, (speed, fidelity, divergence) = plt.subplots(1, 3, figsize=(16, 4.6), constrained_layout=True)
    markers = iter("os^Dvx")
    for number, strategy in enumerate(strategies):
        marker = next(markers, "o")
        own = [r for r in rows if r["strategy"] == strategy]
        points = sorted(own + (shared if strategy != "first-k" else []), key=lambda r: r["recomputed_share"])
        share = [100 * r["recomputed_share"] for r in points]
        line = speed.plot(share, [r["ttft_speedup"] for r in points], marker=marker, label=f"TTFT, {strategy}")
        color = line[0].get_color()
        speed.plot(share, [r["speedup"] for r in points], marker=marker, linestyle="--", color=color,
                   label=f"end-to-end, {strategy}")
        fidelity.plot(share, [100 * r["agreement"] for r in points], marker=marker, color=color, linestyle=":",
                      label=f"vs text, {strategy}")
        if all(r.get("exact_agreement") is not None for r in points):
            fidelity.plot(share, [100 * r["exact_agreement"] for r in points], marker=marker, color=color,
                          label=f"vs exact recompute, {strategy}")
        if all(r.get("kl") is not None for r in points):
            divergence.plot(share, [max(r["kl"], floor) for r in points], marker=marker, color=color, linestyle=":",
                            label=f"vs text, {strategy}")
        if all(r.get("exact_kl") is not None for r in points):
            divergence.plot(share, [max(r["exact_kl"], floor) for r in points], marker=marker, color=color,
                            label=f"vs exact recompute, {strategy}")
            if strategy != "first-k":
                for r, x in zip(own, (100 * r["recomputed_share"] for r in own)):
                    divergence.annotate(f"R={r['fraction']:g}", (x, max(r["exact_kl"], floor)),
                                        textcoords="offset points", xytext=(4, 4 - 12 * number), fontsize=7,
                                        color=color)
    speed.axhline(1.0, color="grey", linewidth=0.8)
    speed.set_xlabel("spliced tokens recomputed (%)")
    speed.set_ylabel("speedup vs text (x)")
    speed.set_title("speed (agents 2..N)")
    speed.legend(fontsize=7)
    fidelity.axhline(90, color="grey", linewidth=0.8, linestyle=":")
    fidelity.set_xlabel("spliced tokens recomputed (%)")
    fidelity.set_ylabel("greedy token agreement (%)")
    fidelity.set_ylim(0, 102)
    fidelity.set_title("agreement (agents 2..N)")
    fidelity.legend(fontsize=7)
    divergence.set_yscale("log")
    divergence.set_xlabel("spliced tokens recomputed (%)")
    divergence.set_ylabel(f"mean next-token KL (nats; < {floor:g} drawn at {floor:g})")
    divergence.set_title("KL, teacher forced (agents 2..N)")
    divergence.legend(fontsize=7)
    fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
