"""The report's table in Table 3's layout, built once as rows (a header and a row of cells per setting)
and rendered from them: to Markdown for ``report.md``, and as they are to a W&B table; beside the cells,
each row as numbers (:meth:`Table.records`) for ``report.csv``, ``report.json`` and ``report.tex``
(:mod:`.exports`)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiayn.experiments.report.runs import validations
from aiayn.experiments.report.settings import Setting, ordered, spread_of
from aiayn.experiments.report.significance import p_cell
from aiayn.experiments.table3 import COLUMNS, PAPER
from aiayn.scoring import SIGNIFICANCE_LEVEL

PARTIAL = "‡"  # after a test BLEU of part of the test split (data.eval_limit)


def scored_on_final(settings: Sequence[Setting]) -> bool:
    """Whether any run's numbers come from its final checkpoint (then the best validation BLEU is shown too)."""
    return any(run.evaluated == "final" for setting in settings for run in setting.runs)


def cell(value: str) -> str:
    """A markdown table cell: ``|`` escaped (an override may hold one)."""
    return value.replace("|", "\\|")


@dataclass(frozen=True)
class Table:
    """The report's table: its header and a row of cells per setting, as a reader sees them. ``report.md``
    shows :meth:`markdown`; the W&B table holds the same cells."""

    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    records: tuple[dict[str, Any], ...] = ()  # the same rows as numbers (:func:`row_record`)

    def markdown(self) -> str:
        lines = ["| " + " | ".join(self.header) + " |", "|" + "---|" * len(self.header)]
        lines += ["| " + " | ".join(map(cell, row)) + " |" for row in self.rows]
        return "\n".join(lines)


@dataclass(frozen=True)
class CometColumn:
    """The report's COMET, when a COMET model was given: each setting's runs' test COMET and the p-value of
    its paired test against the first row's (or why there is none), by label."""

    model: str
    values: Mapping[str, list[float]]
    p_values: Mapping[str, float | str]

    def cells(self, label: str, first: bool) -> list[str]:
        shown = spread_of(self.values.get(label, []), digits=4)
        return [shown, p_cell(None if first else self.p_values.get(label, "not tested"))]

    def record(self, label: str, first: bool) -> dict[str, Any]:
        p_value = None if first else self.p_values.get(label, "not tested")
        return {
            "model": self.model,
            "test": values_statistic(self.values.get(label, [])),
            "p_test": p_value if isinstance(p_value, float) else None,
            "p_note": p_value if isinstance(p_value, str) else None,
            "significant": p_value < SIGNIFICANCE_LEVEL if isinstance(p_value, float) else None,
        }


@dataclass(frozen=True)
class MatchedPoint:
    """A point where the settings are compared alike (:func:`matched_points`): on the ``axis`` of
    ``step`` or training ``minutes``, ``at`` where, each setting's runs' validation BLEU there (each run's
    last validation at or before it)."""

    axis: str
    at: float
    bleu: dict[str, list[float]]

    @property
    def heading(self) -> str:
        return f"BLEU (val) at step {self.at:.0f}" if self.axis == "step" else f"BLEU (val) at {self.at:.1f} min"

    def record(self, label: str) -> dict[str, Any]:
        return {"axis": self.axis, "at": self.at, **values_statistic(self.bleu[label])}


def matched_points(settings: Sequence[Setting]) -> list[MatchedPoint]:
    """Where recipes compare alike, from the runs' validations while training (``metrics.csv``): the last
    step every run reached, and the training minutes every run had trained by its last validation (runs
    that log ``train/seconds``). None where a run has no validations (a folder copied without ``csv/``)."""
    curves = {setting.label: [validations(run) for run in setting.runs] for setting in settings}
    every = [rows for runs in curves.values() for rows in runs]
    if not every or not all(every):
        return []
    points = [("step", min(rows[-1]["step"] for rows in every))]
    if all(any("minutes" in row for row in rows) for rows in every):
        points.append(("minutes", min([row for row in rows if "minutes" in row][-1]["minutes"] for rows in every)))

    def bleu_at(rows: list[dict[str, float]], axis: str, at: float) -> list[float]:
        reached = [row["val/bleu"] for row in rows if axis in row and row[axis] <= at]
        return reached[-1:]  # none for a run whose first validation came later

    return [
        MatchedPoint(
            axis, at, {label: [b for rows in runs for b in bleu_at(rows, axis, at)] for label, runs in curves.items()}
        )
        for axis, at in points
    ]


def values_statistic(values: Sequence[float]) -> dict[str, float | int | None]:
    """The mean, the sample standard deviation (None for one value) and the count of ``values``."""
    return {
        "mean": statistics.fmean(values) if values else None,
        "std": statistics.stdev(values) if len(values) > 1 else None,
        "n": len(values),
    }


def table_of(
    settings: Sequence[Setting], p_values: Mapping[str, float | str] | None = None, comet: CometColumn | None = None
) -> Table:
    """Table 3's layout (rows :func:`ordered`): the changed values (blank where as the first row), params,
    the checkpoint validated and the one tested (the runs' answer), PPL and BLEU (mean ± std over seeds;
    with the best validation BLEU when a run is scored on its final checkpoint), the test sentences the
    test BLEU is of (:data:`PARTIAL` after a test BLEU of part of the split), the p-value of the test BLEU
    against the first row's (:func:`significance`), with ``comet`` the test COMET and its p-value, steps and
    wall time; the validation BLEU at a matched step and at matched training minutes (:func:`matched`),
    where the runs logged their validations; the paper's PPL and BLEU where the setting is its row."""
    base, *_ = settings = ordered(settings)
    p_values = p_values or {}
    best = scored_on_final(settings)
    alike = matched_points(settings)
    headings = [
        "setting", *(h for h, _ in COLUMNS), "params ×10⁶", "seeds", "steps", "checkpoint", "answer", "PPL (val)",
        "BLEU (val)", *(["BLEU (val, best)"] if best else []), "BLEU (test)", "test sentences", "p (test)",
        *(["COMET (test)", "p COMET (test)"] if comet else []), "minutes", *(point.heading for point in alike),
        "paper row", "paper PPL", "paper BLEU", "paper params ×10⁶",
    ]  # fmt: skip
    rows = []
    for setting in settings:
        changed = [
            "" if setting is not base and value == base.columns[heading] else str(value)
            for heading, value in setting.columns.items()
        ]
        params = setting.mean("params")
        steps = setting.mean("steps")
        wall = setting.mean("wall_s")
        paper = PAPER.get(setting.paper_row or "")
        test_bleu = setting.spread("answer_test_bleu")
        cells = [
            setting.label,
            *changed,
            f"{params / 1e6:.1f}" if params is not None else "-",
            str(len(setting.runs)),
            f"{steps:.0f}" if steps is not None else "-",
            setting.evaluated(),
            setting.answer(),
            setting.spread("val_ppl"),
            setting.spread("val_bleu"),
            *([setting.spread("best_val_bleu")] if best else []),
            f"{test_bleu} {PARTIAL}" if setting.partial_test and test_bleu != "-" else test_bleu,
            setting.test_sentences(),
            p_cell(None if setting is base else p_values.get(setting.label, "not tested")),
            *(comet.cells(setting.label, setting is base) if comet else []),
            f"{wall / 60:.1f}" if wall is not None else "-",
            *(spread_of(point.bleu[setting.label]) for point in alike),
            setting.paper_row or "",
            f"{paper.ppl:.2f}" if paper else "",
            f"{paper.bleu:.1f}" if paper else "",
            f"{paper.params_millions or PAPER['base'].params_millions:g}" if paper else "",  # blank: as base
        ]
        rows.append(tuple(cells))
    records = tuple(row_record(setting, base, p_values, alike, comet) for setting in settings)
    return Table(tuple(headings), tuple(rows), records)


def statistic(setting: Setting, key: str) -> dict[str, float | int | None]:
    """``key`` over the setting's seeds (:func:`values_statistic`)."""
    return values_statistic(setting.values(key))


def row_record(
    setting: Setting,
    base: Setting,
    p_values: Mapping[str, float | str],
    alike: Sequence[MatchedPoint] = (),
    comet: CometColumn | None = None,
) -> dict[str, Any]:
    """A row of the table as numbers: what a paper's build reads (the cells of :func:`table_of` are
    rounded text). ``p_test`` is None for the first row and where no test was made (``p_note`` says why);
    ``comet`` is None without a COMET model; ``paper`` is the paper's row where the setting is one."""
    p_value = None if setting is base else p_values.get(setting.label, "not tested")
    paper = PAPER.get(setting.paper_row or "")
    wall = setting.mean("wall_s")
    return {
        "setting": setting.label,
        "columns": dict(setting.columns),
        "params": setting.mean("params"),
        "seeds": len(setting.runs),
        "steps": setting.mean("steps"),
        "checkpoint": setting.evaluated(),
        "answer": setting.answer(),
        "val_ppl": statistic(setting, "val_ppl"),
        "val_bleu": statistic(setting, "val_bleu"),
        "best_val_bleu": statistic(setting, "best_val_bleu"),
        "test_bleu": statistic(setting, "answer_test_bleu"),
        "test_sentences": setting.conditions.test_sentences,
        "partial_test": setting.partial_test,
        "p_test": p_value if isinstance(p_value, float) else None,
        "p_note": p_value if isinstance(p_value, str) else None,
        "significant": p_value < SIGNIFICANCE_LEVEL if isinstance(p_value, float) else None,
        "comet": comet.record(setting.label, setting is base) if comet else None,
        "minutes": wall / 60 if wall is not None else None,
        "val_bleu_matched": [point.record(setting.label) for point in alike],
        "paper": (
            {
                "row": setting.paper_row,
                "ppl": paper.ppl,
                "bleu": paper.bleu,
                "params_millions": paper.params_millions or PAPER["base"].params_millions,
            }
            if paper
            else None
        ),
    }
