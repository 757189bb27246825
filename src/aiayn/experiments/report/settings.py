"""Runs grouped into settings, a row of the report each: the runs that differ only in their seed, labelled
so that settings tell apart, ordered as Table 3 orders its rows."""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aiayn.experiments.report.runs import CONDITION_NAMES, Conditions, Run
from aiayn.experiments.results import RESULTS_FILE
from aiayn.experiments.table3 import PAPER, family_rows

log = logging.getLogger(__name__)

ROW_ORDER = {row: index for index, row in enumerate(PAPER)}


def spread_of(values: Sequence[float], digits: int = 2) -> str:
    """``mean ± std`` of ``values`` (the sample standard deviation), the value for one, ``-`` for none;
    ``digits`` after the point (COMET's scores, near 1, take 4)."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


@dataclass
class Setting:
    """The runs of one setting (they differ only in their seed) and the paper's row it is, if any."""

    label: str
    columns: dict[str, Any]
    conditions: Conditions
    runs: list[Run] = field(default_factory=list)
    paper_row: str | None = None

    def values(self, key: str) -> list[float]:
        """The runs' finite values of ``key`` (a diverged run's perplexity is inf or NaN: left out)."""
        values = [run.results.get(key) for run in self.runs]
        return [float(v) for v in values if isinstance(v, int | float) and math.isfinite(v)]

    def mean(self, key: str) -> float | None:
        values = self.values(key)
        return statistics.fmean(values) if values else None

    def spread(self, key: str) -> str:
        """``key`` over seeds as :func:`spread_of` shows it."""
        return spread_of(self.values(key))

    def evaluated(self) -> str:
        """The checkpoint the runs' validation numbers come from: ``best`` or ``final`` (all runs of a
        setting share it)."""
        return self.conditions.checkpoint

    def answer(self) -> str:
        """The checkpoint the runs' test BLEU comes from, their answer: ``best``, ``final``, ``averaged`` or
        ``ema`` (all runs of a setting share it)."""
        return self.conditions.described("answer")

    @property
    def partial_test(self) -> bool:
        return any(run.partial_test for run in self.runs)

    def test_sentences(self) -> str:
        """How many test sentences the test BLEU is of: ``100``, ``first 16`` (cut by data.eval_limit),
        ``first ≤16`` (cut, the number not recorded) or ``?`` (not recorded)."""
        tested = self.conditions.test_sentences
        if not self.partial_test:
            return "?" if tested is None else str(tested)
        limit = min(run.eval_limit for run in self.runs if run.eval_limit is not None)
        return f"first {tested}" if tested is not None else f"first ≤{limit}"


def group_settings(runs: Sequence[Run]) -> list[Setting]:
    """Runs grouped by their overrides without the seed, by their :class:`Conditions` and by Table 3's
    columns of their configs: runs that differ in any are never merged (the same overrides train another
    model once the defaults change). A setting's label leaves out the overrides all runs share (a sweep's fixed
    arguments) and adds the conditions that differ between settings. Settings that are Table 3 rows get
    the row's name."""
    shared = set.intersection(*(set(run.overrides) for run in runs)) if runs else set()
    settings: dict[tuple[tuple[str, ...], Conditions, tuple[Any, ...]], Setting] = {}
    for run in runs:  # in the order found: the table's order after the paper's rows
        own = tuple(o for o in run.overrides if o not in shared)
        key = (own, run.conditions, tuple(map(repr, run.columns.values())))
        setting = settings.setdefault(key, Setting(" ".join(own) or "(as configured)", run.columns, run.conditions))
        same = next((other for other in setting.runs if run.seed is not None and other.seed == run.seed), None)
        if same is None:
            setting.runs.append(run)
            continue
        # one run per seed (two sweeps may both hold base; a seed may be proposed twice): the newest
        newer, older = sorted((run, same), key=lambda r: (r.folder / RESULTS_FILE).stat().st_mtime, reverse=True)
        setting.runs[setting.runs.index(same)] = newer
        log.info("%s repeats seed %s of %s; %s counts", older.folder, run.seed, setting.label, newer.folder)
    labelled(list(settings.values()))
    rows_by_family = {family: family_rows(family) for family in {run.family for run in runs} if family}
    for setting in settings.values():
        family = setting.runs[0].family
        if family:
            setting.paper_row = rows_by_family[family].get(tuple(setting.columns.values()))
    return list(settings.values())


def varying(settings: Sequence[Setting]) -> list[str]:
    """The conditions whose value differs between settings."""
    return [key for key in CONDITION_NAMES if len({getattr(s.conditions, key) for s in settings}) > 1]


def labelled(settings: Sequence[Setting]) -> None:
    """Labels that tell settings apart: the corpus, direction and precision where they vary (no column
    shows them); the checkpoint, answer and test sentences (columns show them) where two labels would be
    alike; a number where they still are."""
    differ = varying(settings)
    always = [key for key in differ if key not in ("checkpoint", "answer", "test_sentences")]
    alike: dict[str, int] = {}
    for setting in settings:
        alike[setting.label] = alike.get(setting.label, 0) + 1
    for setting in settings:
        keys = always + [key for key in differ if key not in always and alike[setting.label] > 1]
        if keys:
            shown_keys = ", ".join(f"{CONDITION_NAMES[k]}={setting.conditions.described(k)}" for k in keys)
            setting.label = f"{setting.label} [{shown_keys}]"
    seen: dict[str, int] = {}
    for setting in settings:
        seen[setting.label] = seen.get(setting.label, 0) + 1
        if seen[setting.label] > 1:
            setting.label = f"{setting.label} #{seen[setting.label]}"


def ordered(settings: Sequence[Setting]) -> list[Setting]:
    """The reference setting first (the one that is Table 3's base row, else one chosen as a family's
    base row, ``experiment=mini2025/base``, else the first found), then Table 3's rows in the paper's
    order, then the rest as found."""
    named_base = (
        s for s in settings if any(o.startswith("experiment=") and o.endswith("/base") for o in s.runs[0].overrides)
    )
    base = next((s for s in settings if s.paper_row == "base"), None) or next(named_base, settings[0])
    rows = sorted(
        (s for s in settings if s is not base), key=lambda s: ROW_ORDER.get(s.paper_row or "", len(ROW_ORDER))
    )
    return [base, *rows]
