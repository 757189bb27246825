"""Plots of validation BLEU and perplexity against what the settings vary (heads, d_k, positional encoding,
model size), mean and standard deviation over seeds; and each setting's learning curves: validation BLEU
and loss against optimizer steps, training minutes and training FLOPs, a line per seed."""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiayn.experiments.report.runs import validations
from aiayn.experiments.report.settings import Setting, ordered
from aiayn.extras import require
from aiayn.files import atomic_write

# What a plot can put on its x axis: (file name part, axis label, Table 3 column or "params").
AXES = (
    ("heads", "attention heads h", "h"),
    ("d_k", "key size d_k", "d_k"),
    ("positional", "positional encoding", "positional"),
    ("size", "parameters (millions)", "params"),
)
# Per axis: the columns its settings may change, and those of which they must change one.
AXIS_COLUMNS = {
    "heads": ({"h", "d_k", "d_v"}, {"h"}),
    "d_k": ({"d_k"}, {"d_k"}),
    "positional": ({"positional"}, {"positional"}),
    "size": ({"N", "d_model", "d_ff", "h", "d_k", "d_v", "P_drop"}, {"N", "d_model", "d_ff"}),
}


def plot_axes(settings: Sequence[Setting]) -> list[tuple[str, str, str, list[Setting]]]:
    """The axes along which settings vary from the first (:func:`ordered`), each with its points: the
    first setting and those that differ from it only in the axis's columns (rows A change h with d_k and
    d_v; big changes the size and P_drop), in at least one of its key columns, under the same
    :class:`Conditions` (a point of another corpus or precision is not on the first row's curve). An
    axis needs 2 points."""
    base, *others = ordered(settings)
    chosen = []
    for name, label, column in AXES:
        allowed, keys = AXIS_COLUMNS[name]
        points = [base]
        for setting in others:
            changed = {h for h in setting.columns if setting.columns[h] != base.columns[h]}
            if changed and changed <= allowed and changed & keys and setting.conditions == base.conditions:
                points.append(setting)
        if len(points) > 1:
            chosen.append((name, label, column, points))
    return chosen


# A learning curve's x axes: (title, how a validation's row of metrics.csv and the run's results give it).
CURVE_AXES = (
    ("step", lambda row, run: row.get("step")),
    ("training minutes", lambda row, run: row.get("minutes")),
    # ≈ 6 FLOPs per parameter per token trained on (forward 2, backward 4), as scaling studies count them
    ("training FLOPs (≈ 6 · params · tokens)", lambda row, run: 6 * run.results["params"] * row["train/tokens"]
     if "train/tokens" in row else None),
)  # fmt: skip
CURVE_METRICS = (("val/bleu", "BLEU (val)"), ("val/loss", "loss (val)"))


def pyplot() -> Any:
    """matplotlib's pyplot for files only (no display on a cluster or in CI), or the extra's one-line error."""
    matplotlib = require("matplotlib", "report", "matplotlib (aiayn-report's plots)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(settings: Sequence[Setting], folder: Path) -> list[Path]:
    """``curves_<n>_<setting>.png`` for each setting whose runs logged validations: validation BLEU and loss
    against optimizer steps, training minutes and training FLOPs (runs from before ``train/seconds`` and
    ``train/tokens`` were logged have the steps only), a line per seed. Written atomically."""
    plt = None
    written = []
    for number, setting in enumerate(ordered(settings), start=1):
        curves = [(run, validations(run)) for run in setting.runs]
        if not any(rows for _, rows in curves):
            continue
        plt = plt or pyplot()
        figure, panels = plt.subplots(len(CURVE_METRICS), len(CURVE_AXES), figsize=(12, 6), squeeze=False)
        for (key, heading), row_panels in zip(CURVE_METRICS, panels, strict=True):
            for (axis, x_of), panel in zip(CURVE_AXES, row_panels, strict=True):
                for run, rows in curves:
                    points = [(x_of(row, run), row[key]) for row in rows if key in row]
                    points = [(x, y) for x, y in points if x is not None]
                    if points:
                        xs, ys = [x for x, _ in points], [y for _, y in points]
                        panel.plot(xs, ys, marker="o", markersize=3, label=f"seed {run.seed}")
                panel.set_xlabel(axis)
                panel.set_ylabel(heading)
                panel.grid(alpha=0.3)
        panels[0][0].legend(fontsize=8)
        figure.suptitle(f"{setting.label}: learning curves")
        figure.tight_layout()
        slug = re.sub(r"[^A-Za-z0-9.=_-]+", "_", setting.label).strip("_")[:60] or "setting"
        path = folder / f"curves_{number}_{slug}.png"
        atomic_write(path, lambda file, figure=figure: figure.savefig(file, format="png", dpi=100))
        plt.close(figure)
        written.append(path)
    return written


def plot(settings: Sequence[Setting], folder: Path) -> list[Path]:
    """``bleu_ppl_vs_<axis>.png`` for every axis the settings vary along: validation BLEU and perplexity,
    mean with the standard deviation over seeds as error bars. Written atomically; a link of that name
    in a shared folder is refused, neither followed nor replaced (:func:`~aiayn.files.atomic_write`)."""
    plt = pyplot()
    written = []
    for name, label, column, on_axis in plot_axes(settings):
        figure, panels = plt.subplots(1, 2, figsize=(9, 3.6))
        categorical = column == "positional"
        points = on_axis if categorical else sorted(on_axis, key=lambda s: axis_value(s, column))
        for panel, key, heading in ((panels[0], "val_bleu", "BLEU (val)"), (panels[1], "val_ppl", "perplexity (val)")):
            xs, means, errors = panel_series(points, key, column, categorical)
            if categorical:
                panel.bar(xs, means, yerr=errors, capsize=4, color="#4c72b0")
            else:
                panel.errorbar(xs, means, yerr=errors, fmt="o-", capsize=4, color="#4c72b0")
                if column in ("h", "d_k"):
                    panel.set_xscale("log", base=2)
                    panel.set_xticks(xs, [f"{x:g}" for x in xs])
            panel.set_xlabel(label)
            panel.set_ylabel(heading)
            panel.grid(alpha=0.3)
        seeds = max(len(s.runs) for s in on_axis)
        figure.suptitle(f"{label}: mean ± std over up to {seeds} seed(s)")
        figure.tight_layout()
        path = folder / f"bleu_ppl_vs_{name}.png"
        atomic_write(path, lambda file, figure=figure: figure.savefig(file, format="png", dpi=110))
        plt.close(figure)
        written.append(path)
    return written


def panel_series(
    points: Sequence[Setting], key: str, column: str, categorical: bool
) -> tuple[list[Any], list[float], list[float]]:
    """A panel's points: x, the mean of ``key`` over seeds and its error bar, the sample standard
    deviation (0 for one seed), for every setting with a value; every point gets its error bar."""
    present = [s for s in points if s.values(key)]
    xs = [str(s.columns[column]) if categorical else axis_value(s, column) for s in present]
    means = [statistics.fmean(s.values(key)) for s in present]
    errors = [statistics.stdev(s.values(key)) if len(s.values(key)) > 1 else 0.0 for s in present]
    return xs, means, errors


def axis_value(setting: Setting, column: str) -> float:
    if column == "params":
        params = setting.mean("params")
        return params / 1e6 if params is not None else math.nan
    return float(setting.columns[column])
