"""Plots where a curve says more than a table (matplotlib, written to PNG files)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

FORMATS = (".png", ".svg", ".pdf")  # what a plot is written as (matplotlib's pick by the file's suffix)
SPLICE_FIELDS = ("strategy", "setting", "recomputed_share", "speedup", "ttft_speedup", "agreement")
_SPLICE_NUMBERS = ("recomputed_share", "speedup", "ttft_speedup", "agreement")
_SPLICE_OPTIONAL = ("kl", "exact_agreement", "exact_kl", "fraction")  # numbers where given (null: not measured)


def written_path(path: str | Path) -> Path:
    """The file a plot asked for at ``path`` is written to: matplotlib adds ``.png`` to a name without a
    suffix (``--out splice`` writes ``splice.png``), so the name said and the file written are the same."""
    path = Path(path)
    return path if path.suffix else path.with_name(path.name + ".png")


def check_splice_rows(rows: Any) -> list[dict[str, Any]]:
    """``rows`` if they are what :func:`splice_curve` draws, else ValueError naming the row and field.

    Each row is an object with :data:`SPLICE_FIELDS`; its measures are finite numbers (a string would be
    drawn as a category, a NaN or null left out of the line, both silently); ``kl``, ``exact_agreement``,
    ``exact_kl`` and ``fraction`` are numbers or null; a row with ``exact_kl`` names its ``fraction``
    (the R written beside its point). At least one row has a strategy other than "both" (the R = 0 and
    R = 1 runs every strategy's line shares, drawn only with one).
    """
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"'rows' must be a non-empty list of objects with {', '.join(SPLICE_FIELDS)}")
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise ValueError(f"row {number} of 'rows' is {_json_kind(row)}, not an object")
        missing = [key for key in SPLICE_FIELDS if key not in row]
        if missing:
            raise ValueError(f"row {number} of 'rows' has no {', '.join(map(repr, missing))} "
                             f"(each row needs {', '.join(SPLICE_FIELDS)})")
        if not isinstance(row["strategy"], str):
            raise ValueError(f"row {number}: 'strategy' is {_json_kind(row['strategy'])}, not a string")
        named = f"row {number} ({row['strategy']}, {row['setting']})"
        for key in (*_SPLICE_NUMBERS, *(k for k in _SPLICE_OPTIONAL if row.get(k) is not None)):
            value = row[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{named}: {key!r} is {json.dumps(value)}, not a finite number")
        if row.get("exact_kl") is not None and row["strategy"] != "first-k" and row.get("fraction") is None:
            raise ValueError(f"{named} has 'exact_kl' but no 'fraction' (the R written beside its point)")
    if all(row["strategy"] == "both" for row in rows):
        raise ValueError("every row's strategy is 'both' (the R = 0 and R = 1 runs each strategy's line shares): "
                         "there is no strategy to draw")
    return rows


def _json_kind(value: Any) -> str:
    """What a JSON value is, in JSON's words: ``a string``, ``null``, ``a list``..."""
    kinds = {str: "a string", bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def partial_curve(splits: list[dict[str, Any]], chosen: list[dict[str, Any]], sensitivity: list[float],
                  path: str | Path, title: str = "partial-layer transfer: base -> fine-tuned variant") -> Path:
    """Fidelity and receiver time against the split k, the chosen recompute sets beside them, and the
    per-layer sensitivity (KL when only that layer's K/V come from the other weights).

    ``splits`` rows have ``k``, ``agreement``, ``kl``, ``time_ratio``; ``chosen`` rows have
    ``set``, ``recomputed_layers`` and the same measures.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (fid, kl_ax, speed, sens) = plt.subplots(1, 4, figsize=(20, 4.2), constrained_layout=True)
    layers = len(sensitivity)
    recomputed = [layers - r["k"] for r in splits]
    fid.plot(recomputed, [100 * r["agreement"] for r in splits], marker="o", label="split at k (recompute k..L-1)")
    kl_ax.plot(recomputed, [r["kl"] for r in splits], marker="o", label="split at k")
    speed.plot(recomputed, [r["time_ratio"] for r in splits], marker="o", label="split at k")
    if chosen:
        xs = [r["recomputed_layers"] for r in chosen]
        fid.plot(xs, [100 * r["agreement"] for r in chosen], marker="s", linestyle="--", label="most sensitive layers")
        kl_ax.plot(xs, [r["kl"] for r in chosen], marker="s", linestyle="--", label="most sensitive layers")
        speed.plot(xs, [r["time_ratio"] for r in chosen], marker="s", linestyle="--", label="most sensitive layers")
    _panel(fid, "layers recomputed by the receiver (split at k = L - x)",
           "greedy agreement with the variant's own output (%)", "fidelity", ylim=(0, 102))
    _panel(kl_ax, "layers recomputed by the receiver", "mean next-token KL (nats), teacher forced", "divergence")
    speed.axhline(1.0, color="grey", linewidth=0.8)
    _panel(speed, "layers recomputed by the receiver", "receiver time / full prefill", "receiver-side time")
    sens.bar(range(layers), [max(v, 1e-12) for v in sensitivity])
    sens.set_yscale("log")
    sens.set_xlabel("layer")
    sens.set_ylabel("KL with only this layer's K/V from the base")
    sens.set_title("per-layer sensitivity")
    fig.suptitle(title)
    return _save(fig, path)


def splice_curve(rows: list[dict[str, Any]], path: str | Path, title: str = "splice: speed vs fidelity") -> Path:
    """Speed, token agreement and KL against the recomputed share, one line per strategy.

    ``rows`` are splice benchmark rows with ``strategy`` (a selection criterion such as
    "attention+start" or "kv-deviation", "first-k", or "both" for the R = 0 and R = 1
    runs every criterion shares), ``recomputed_share`` (0..1), ``speedup``,
    ``ttft_speedup``, ``agreement`` and ``kl``, and optionally ``exact_agreement`` and
    ``exact_kl`` (against an exact recomputation of the same ids). Older rows whose
    strategy is "R" are one criterion of their own. Rows are checked first (:func:`check_splice_rows`).
    """
    check_splice_rows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    floor = 1e-7  # KL below this (R = 1 is exact, ~1e-11) is drawn at it, so the curve between stays readable
    shared = [r for r in rows if r["strategy"] == "both"]
    strategies = list(dict.fromkeys(r["strategy"] for r in rows if r["strategy"] != "both"))
    fig, (speed, fidelity, divergence) = plt.subplots(1, 3, figsize=(16, 4.6), constrained_layout=True)
    markers = iter("os^Dvx")
    for number, strategy in enumerate(strategies):
        own = [r for r in rows if r["strategy"] == strategy]
        points = sorted(own + (shared if strategy != "first-k" else []), key=lambda r: r["recomputed_share"])
        _splice_lines((speed, fidelity, divergence), strategy, own, points, next(markers, "o"), number, floor)
    speed.axhline(1.0, color="grey", linewidth=0.8)
    _panel(speed, "spliced tokens recomputed (%)", "speedup vs text (x)", "speed (agents 2..N)", legend=7)
    fidelity.axhline(90, color="grey", linewidth=0.8, linestyle=":")
    _panel(fidelity, "spliced tokens recomputed (%)", "greedy token agreement (%)", "agreement (agents 2..N)",
           legend=7, ylim=(0, 102))
    _panel(divergence, "spliced tokens recomputed (%)", f"mean next-token KL (nats; < {floor:g} drawn at {floor:g})",
           "KL, teacher forced (agents 2..N)", legend=7, log=True)
    fig.suptitle(title)
    return _save(fig, path)


def _splice_lines(axes: tuple[Any, Any, Any], strategy: str, own: list[dict[str, Any]], points: list[dict[str, Any]],
                  marker: str, number: int, floor: float) -> None:
    """One strategy's lines on :func:`splice_curve`'s three panels (speed, agreement, KL), in one colour;
    its own R values are written next to its KL points (offset by ``number`` so strategies do not overlap)."""
    speed, fidelity, divergence = axes
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
            for r in own:
                divergence.annotate(f"R={r['fraction']:g}", (100 * r["recomputed_share"], max(r["exact_kl"], floor)),
                                    textcoords="offset points", xytext=(4, 4 - 12 * number), fontsize=7, color=color)


def merge_curve(rows: list[dict[str, Any]], path: str | Path, title: str = "graph merge: fidelity vs R",
                prefilled_ttft: float | None = None) -> Path:
    """A merging agent's fidelity and TTFT speedup against the recompute share R (graph benchmark).

    ``rows`` have ``fraction`` (R), ``exact_agreement`` / ``exact_kl`` (vs an exact recomputation of
    the merge's own ids), ``agreement`` / ``kl`` (vs text mode) and ``ttft_speedup`` (text / graph),
    and optionally ``exact_forced_agreement`` (teacher forced, drawn when every row has it).
    ``prefilled_ttft``: the same agent's TTFT speedup with its later branches prefilled instead
    (exact), drawn as a level line.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: r["fraction"])
    share = [100 * r["fraction"] for r in rows]
    fig, (fidelity, divergence, speed) = plt.subplots(1, 3, figsize=(15, 4.2), constrained_layout=True)
    fidelity.plot(share, [100 * r["exact_agreement"] for r in rows], marker="o", label="vs exact recomputation")
    fidelity.plot(share, [100 * r["agreement"] for r in rows], marker="s", linestyle="--", label="vs text mode")
    if all(r.get("exact_forced_agreement") is not None for r in rows):
        fidelity.plot(share, [100 * r["exact_forced_agreement"] for r in rows], marker="^", linestyle="-.",
                      label="vs exact, teacher forced")
    fidelity.axhline(95, color="grey", linewidth=0.8, linestyle=":")
    _panel(fidelity, "R: spliced tokens recomputed (%)", "greedy token agreement (%)", "merging agent: agreement",
           ylim=(0, 102))
    divergence.plot(share, [max(r["exact_kl"], 1e-12) for r in rows], marker="o", label="vs exact recomputation")
    if all(r.get("kl") is not None for r in rows):
        divergence.plot(share, [max(r["kl"], 1e-12) for r in rows], marker="s", linestyle="--", label="vs text mode")
    _panel(divergence, "R: spliced tokens recomputed (%)", "mean next-token KL (nats)",
           "merging agent: divergence, teacher forced", log=True)
    speed.plot(share, [r["ttft_speedup"] for r in rows], marker="o", label="TTFT, merge vs text")
    speed.axhline(3.0, color="grey", linewidth=0.8, linestyle=":")
    if prefilled_ttft is not None:
        speed.axhline(prefilled_ttft, color="tab:green", linestyle="--",
                      label=f"branches prefilled instead (exact): {prefilled_ttft:.1f}x")
    _panel(speed, "R: spliced tokens recomputed (%)", "speedup vs text (x)", "merging agent: time to first token")
    fig.suptitle(title)
    return _save(fig, path)


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
    mcs: list[dict[str, Any]] = []
    if evals:
        loss_ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], "o-", color="tab:orange",
                     label="held-out")
        loss_ax.axhline(evals[-1]["baseline_loss"], color="grey", linestyle="--", label="held-out, receiver alone")
        controls = [e for e in evals if e.get("control_loss") is not None]
        if controls:
            loss_ax.plot([e["step"] for e in controls], [e["control_loss"] for e in controls], "x:", color="tab:red",
                         label="held-out, fed another text's sharer K/V")
        mcs = _accuracy_panel(acc_ax, evals)
    _panel(loss_ax, "step", "answer cross-entropy (nats/token)", "loss", log=True)
    acc_ax.set_xlabel("step")
    acc_ax.set_ylabel("multiple-choice questions right (%)")
    acc_ax.set_title("bundled questions (option log-likelihood)" if mcs else
                     "held-out accuracy (first answer token among the letters)")
    if acc_ax.lines:
        acc_ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path, dpi=110)


def _accuracy_panel(acc_ax: Any, evals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The right panel of :func:`training_curve`: the bundled questions (fused, alone, control) if
    measured, else held-out letter accuracy; returns the evaluations that scored the questions."""
    mcs = [e for e in evals if e.get("mc_accuracy") is not None]
    accs = [e for e in evals if e.get("accuracy") is not None]
    if mcs:  # the bundled questions, each option scored by its mean log-likelihood
        _percent_line(acc_ax, mcs, "mc_accuracy", "o-", "tab:orange", "bundled questions, fused")
        acc_ax.axhline(100 * mcs[-1]["mc_baseline_accuracy"], color="grey", linestyle="--",
                       label="receiver alone")
        _percent_line(acc_ax, mcs, "mc_control_accuracy", "x:", "tab:red", "fed another question's sharer K/V")
    elif accs:
        _percent_line(acc_ax, accs, "accuracy", "o-", "tab:orange", "held-out accuracy")
        acc_ax.axhline(100 * accs[-1]["baseline_accuracy"], color="grey", linestyle="--",
                       label="receiver alone")
        if accs[-1].get("sharer_accuracy") is not None:
            acc_ax.axhline(100 * accs[-1]["sharer_accuracy"], color="tab:green", linestyle="--",
                           label="sharer alone")
        _percent_line(acc_ax, accs, "agreement", "s:", "tab:purple", "picks the sharer's letter")
    return mcs


# -- where the time went: one bar per phase of each agent's turn -------------------------------------

PHASES = (("receive", "#4c72b0"), ("prefill", "#dd8452"), ("decode", "#55a868"), ("publish", "#c44e52"))


def _percent_line(ax: Any, evals: list[dict[str, Any]], key: str, style: str, color: str, label: str) -> None:
    """``100 * e[key]`` against ``e["step"]`` over the evaluations that have ``key`` (nothing if none do)."""
    points = [e for e in evals if e.get(key) is not None]
    if points:
        ax.plot([e["step"] for e in points], [100 * e[key] for e in points], style, color=color, label=label)


def turn_phases(agent: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """(start, length) of each phase of one turn, in seconds from the turn's start.

    ``agent`` is an :meth:`kvwire.pipeline.results.AgentResult.to_json` dict: receive runs first
    (``receive_s``), the prefill ends at the first token (``ttft_s``), decoding follows,
    and publishing ends the turn (``publish_s`` before ``total_s``). Example: receive_s
    0.2, prefill_s 0.1, ttft_s 0.35, decode_s 1.0, publish_s 0.05, total_s 1.45 ->
    receive (0, 0.2), prefill (0.25, 0.1), decode (0.35, 1.0), publish (1.4, 0.05).
    """
    return {"receive": (0.0, agent["receive_s"]),
            "prefill": (agent["ttft_s"] - agent["prefill_s"], agent["prefill_s"]),
            "decode": (agent["ttft_s"], agent["decode_s"]),
            "publish": (agent["total_s"] - agent["publish_s"], agent["publish_s"])}


def timeline(runs: list[tuple[str, list[dict[str, Any]]]], path: str | Path,
             title: str = "where the time went") -> Path:
    """Each agent's receive, prefill, decode and publish as bars on one time axis, one group of rows
    per run, the first run on top (text mode above the cache mode).

    ``runs`` are (label, agents) with agents as :meth:`AgentResult.to_json` dicts. Turns are placed at
    their ``started_at`` relative to the run's first turn (agents in separate processes keep their
    waits); without it, one after another. Each run's end-to-end time is written at its last bar.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sum(len(agents) for _, agents in runs) + len(runs) - 1
    fig, ax = plt.subplots(figsize=(12, 0.9 + 0.42 * rows), constrained_layout=True)
    labels, y = [], rows - 1
    for label, agents in runs:
        origin = min((a.get("started_at") or 0.0) for a in agents) if agents else 0.0
        clock, end = 0.0, 0.0
        for agent in agents:
            begin = agent["started_at"] - origin if agent.get("started_at") else clock
            ax.barh(y, agent["total_s"], left=begin, height=0.8, color="#eeeeee", edgecolor="#bbbbbb", linewidth=0.5)
            for phase, color in PHASES:
                offset, length = turn_phases(agent)[phase]
                if length > 0:
                    ax.barh(y, length, left=begin + offset, height=0.6, color=color)
            clock = end = max(end, begin + agent["total_s"])
            labels.append((y, f"{label}: {agent['agent']}"))
            y -= 1
        ax.text(end, y + 1, f"  {end:.1f} s", va="center", fontsize=9)
        y -= 1  # a blank row between runs
    ax.set_yticks([t for t, _ in labels], [text for _, text in labels], fontsize=8)
    ax.set_xlabel("seconds from the run's first turn")
    handles = [plt.Rectangle((0, 0), 1, 1, color=color) for _, color in PHASES]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="#eeeeee", edgecolor="#bbbbbb"))
    ax.legend(handles, [p for p, _ in PHASES] + ["rest of the turn (tokenize, template check)"], fontsize=8,
              loc="upper right", ncol=5)
    ax.set_title(title)
    return _save(fig, path)


# -- where each choice wins: fp32 cache, int8 cache or token ids --------------------------------------

CHOICE_COLORS = {"ids": "#8c8c8c", "fp32": "#4c72b0", "int8": "#55a868"}


def break_even_map(panels: list[tuple[str, list[dict[str, Any]]]], path: str | Path,
                   measured: list[dict[str, Any]] | None = None, title: str = "") -> Path:
    """One panel per (title, grid points): link rate across, prefill rate up, colored by the cheapest choice.

    Grid points are :meth:`kvwire.pipeline.breakeven.Point.to_json` dicts. ``measured`` points
    (``link_bits``, ``prefill_rate``, ``winner``, optional ``label`` and ``panel``, the index of the
    panel to draw on, default 0) are drawn as markers in their winner's color.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap

    choices = list(CHOICE_COLORS)
    columns = min(2, len(panels))
    fig, axes = plt.subplots(-(-len(panels) // columns), columns, figsize=(6.2 * columns, 4.8 * -(-len(panels) //
                             columns)), constrained_layout=True, squeeze=False)
    for index, (name, points) in enumerate(panels):
        ax = axes[index // columns][index % columns]
        links = sorted({p["link_bits"] for p in points})
        rates = sorted({p["prefill_rate"] for p in points})
        grid = np.zeros((len(rates), len(links)))
        for p in points:
            grid[rates.index(p["prefill_rate"]), links.index(p["link_bits"])] = choices.index(p["winner"])
        ax.pcolormesh(_edges(links), _edges(rates), grid, cmap=ListedColormap(list(CHOICE_COLORS.values())),
                      vmin=-0.5, vmax=len(choices) - 0.5, shading="flat")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link rate (bit/s)")
        ax.set_ylabel("receiver's prefill rate (tokens/s)")
        ax.set_title(name, fontsize=10)
        for point in measured or []:
            if point.get("panel", 0) == index:
                ax.scatter(point["link_bits"], point["prefill_rate"], s=70, marker="o",
                           color=CHOICE_COLORS[point["winner"]], edgecolors="black", linewidths=1.2, zorder=3)
                if point.get("label"):
                    ax.annotate(point["label"], (point["link_bits"], point["prefill_rate"]), textcoords="offset points",
                                xytext=(5, 6), fontsize=7, zorder=4)
    for index in range(len(panels), axes.size):
        axes[index // columns][index % columns].axis("off")
    handles = [plt.Rectangle((0, 0), 1, 1, color=color) for color in CHOICE_COLORS.values()]
    names = ["token ids (re-prefill)", "fp32 cache", "int8 cache"]
    if measured:
        handles.append(plt.Line2D([], [], marker="o", linestyle="", color="white", markeredgecolor="black"))
        names.append("measured here (fill: what won)")
    fig.legend(handles, names, loc="outside lower center", ncol=len(names), fontsize=9)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def eval_points(modes: list[dict[str, Any]], path: str | Path, title: str = "kvwire eval") -> Path:
    """pass@1 (with its 95 % interval) and consistency with text mode against the reuse share, one point per mode
    (or per R, for summaries of several runs labelled by their ``mode``). ``modes`` are
    :class:`kvwire.evals.report.ModeSummary` objects as JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (passing, consistent) = plt.subplots(1, 2, figsize=(11, 4.4), constrained_layout=True)
    for number, mode in enumerate(modes):
        x, p = 100 * mode["reuse"], 100 * mode["pass_at_1"]
        low, high = 100 * mode["ci95"][0], 100 * mode["ci95"][1]
        color = f"C{number % 10}"
        passing.errorbar([x], [p], yerr=[[p - low], [high - p]], fmt="o", color=color, capsize=4, label=mode["mode"])
        if mode.get("consistency") is not None:
            consistent.plot([x], [100 * mode["consistency"]], "o", color=color, label=mode["mode"])
        elif mode["mode"] == "text":
            consistent.plot([x], [100.0], "o", color=color, label="text (reference)")
    _panel(passing, "context of agents 2..N served from received caches (%)", "pass@1 (%, 95% Wilson interval)",
           "pass@1", ylim=(0, 100))
    _panel(consistent, "context of agents 2..N served from received caches (%)",
           "final answers identical to text mode's (%)", "consistency with text", ylim=(0, 102))
    fig.suptitle(title)
    return _save(fig, path)


def _panel(ax: Any, xlabel: str, ylabel: str, title: str, *, legend: int = 8, ylim: tuple[float, float] | None = None,
           log: bool = False) -> None:
    """Label one panel: axes, title, a log y scale or a y range if asked, a legend in ``legend``-point type."""
    if log:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_title(title)
    if ax.get_legend_handles_labels()[0]:  # nothing labeled: no legend (matplotlib would warn on the terminal)
        ax.legend(fontsize=legend)


def _edges(centers: list[float]) -> list[float]:
    """Cell edges for log-spaced cell centers (geometric midpoints, extended at both ends)."""
    if len(centers) == 1:
        return [centers[0] / 1.5, centers[0] * 1.5]
    mids = [(a * b) ** 0.5 for a, b in zip(centers, centers[1:])]
    return [centers[0] ** 2 / mids[0], *mids, centers[-1] ** 2 / mids[-1]]


def _save(fig: Any, path: str | Path, dpi: int = 120) -> Path:
    import matplotlib.pyplot as plt

    path = written_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
    return path
