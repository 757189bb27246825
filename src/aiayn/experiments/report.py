"""A Table-3-style report of finished runs: one row per setting (the runs that differ only in their seed),
with the paper's numbers beside ours where the setting is one of its rows, whether each setting's test BLEU
differs significantly from the first row's (sacreBLEU's paired bootstrap on the seeds' test translations),
and plots of BLEU and perplexity against what the settings vary (heads, d_k, positional encoding, model
size)."""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from aiayn.config.build import instantiated_from_checkpoint
from aiayn.config.naming import defining_overrides
from aiayn.data.corpus import read_lines
from aiayn.errors import DataError
from aiayn.experiments.table3 import COLUMNS, FAMILIES, PAPER, columns_of, family_rows
from aiayn.files import atomic_write
from aiayn.scoring import BOOTSTRAP_SAMPLES, SIGNIFICANCE_LEVEL, bootstrap_seed, paired_bootstrap

log = logging.getLogger(__name__)

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
ROW_ORDER = {row: index for index, row in enumerate(PAPER)}
SIGNIFICANT = "*"  # after a p-value below SIGNIFICANCE_LEVEL
TEST_HYPOTHESES = "test.hyp.txt"  # a run's test translations, in corpus order (results.json's "evaluated")


@dataclass
class Run:
    """A finished run: its folder, Table 3's columns of its config, its results."""

    folder: Path
    overrides: tuple[str, ...]  # what defines it, sorted, without the seed
    seed: int | None
    columns: dict[str, Any]
    family: str | None
    results: dict[str, Any]
    data: dict[str, Any] = field(default_factory=dict)  # the config's data section: where the corpus is

    @property
    def evaluated(self) -> str:
        """Which checkpoint val_*, test_* and test.hyp.txt come from: ``best`` or ``final`` (results.json's
        ``evaluated``; runs from before it was recorded were scored on their best checkpoint)."""
        return str(self.results.get("evaluated", "best"))


@dataclass
class Setting:
    """The runs of one setting (they differ only in their seed) and the paper's row it is, if any."""

    label: str
    columns: dict[str, Any]
    runs: list[Run] = field(default_factory=list)
    paper_row: str | None = None

    def values(self, key: str) -> list[float]:
        """The runs' finite values of ``key`` (a diverged run's perplexity is inf or NaN: left out)."""
        values = [run.results.get(key) for run in self.runs]
        return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]

    def mean(self, key: str) -> float | None:
        values = self.values(key)
        return statistics.fmean(values) if values else None

    def spread(self, key: str) -> str:
        """``mean ± std`` over seeds (the sample standard deviation), ``mean`` for one run, ``-`` for none."""
        values = self.values(key)
        if not values:
            return "-"
        if len(values) == 1:
            return f"{values[0]:.2f}"
        return f"{statistics.fmean(values):.2f} ± {statistics.stdev(values):.2f}"

    def evaluated(self) -> str:
        """The checkpoint the runs' numbers come from: ``best``, ``final``, or ``mixed`` when seeds differ."""
        kinds = {run.evaluated for run in self.runs}
        return kinds.pop() if len(kinds) == 1 else "mixed"


def find_runs(paths: Iterable[Path]) -> tuple[list[Run], list[Path]]:
    """Every finished run (a folder with ``results.json`` and ``config.yaml``) under ``paths``, once
    each, and the run folders without results (failed or unfinished)."""
    finished: dict[Path, Run] = {}
    unfinished: set[Path] = set()
    for path in paths:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such run or sweep folder")
        for results in sorted(path.rglob("results.json")):
            folder = results.parent.resolve()
            if (folder / "config.yaml").is_file() and folder not in finished:
                finished[folder] = read_run(folder)
        # Hydra writes .hydra/ into every run folder when it starts; results.json comes at the end.
        unfinished |= {h.parent.resolve() for h in path.rglob(".hydra") if not (h.parent / "results.json").exists()}
    return list(finished.values()), sorted(unfinished)


def read_run(folder: Path) -> Run:
    config = yaml.safe_load((folder / "config.yaml").read_text())
    results = json.loads((folder / "results.json").read_text())
    overrides = [o.lstrip("+") for o in defining_overrides(results.get("overrides", []))]
    try:
        columns = columns_of(config)
    except (KeyError, TypeError) as error:
        raise ValueError(f"{folder / 'config.yaml'}: no {error} key; not a run of aiayn-train") from None
    return Run(
        folder=folder,
        overrides=tuple(sorted(o for o in overrides if o.split("=", 1)[0] != "seed")),
        seed=config.get("seed"),
        columns=dict(zip([heading for heading, _ in COLUMNS], columns, strict=True)),
        family=family_of(folder, config),
        results=results,
        data=config.get("data") or {},
    )


def family_of(folder: Path, config: dict[str, Any]) -> str | None:
    """``table3`` or ``mini`` when the run's experiment is one of their rows (Hydra's record of the
    experiment chosen, else the run's name), else None."""
    hydra_record = folder / ".hydra" / "hydra.yaml"
    experiment = None
    if hydra_record.is_file():
        choices = (yaml.safe_load(hydra_record.read_text()) or {}).get("hydra", {}).get("runtime", {}).get("choices")
        experiment = (choices or {}).get("experiment")
    family = str(experiment).split("/", 1)[0] if experiment else str(config.get("name", "")).split("_", 1)[0]
    return family if family in FAMILIES else None


def group_settings(runs: Sequence[Run]) -> list[Setting]:
    """Runs grouped by their overrides without the seed; a setting's label leaves out the overrides all
    runs share (a sweep's fixed arguments). Settings that are Table 3 rows get the row's name."""
    shared = set.intersection(*(set(run.overrides) for run in runs)) if runs else set()
    settings: dict[tuple[str, ...], Setting] = {}
    for run in runs:  # in the order found: the table's order after the paper's rows
        own = tuple(o for o in run.overrides if o not in shared)
        setting = settings.setdefault(own, Setting(" ".join(own) or "(as configured)", run.columns))
        same = next((other for other in setting.runs if run.seed is not None and other.seed == run.seed), None)
        if same is None:
            setting.runs.append(run)
            continue
        # one run per seed (two sweeps may both hold base; a seed may be proposed twice): the newest
        newer, older = sorted((run, same), key=lambda r: (r.folder / "results.json").stat().st_mtime, reverse=True)
        setting.runs[setting.runs.index(same)] = newer
        log.info("%s repeats seed %s of %s; %s counts", older.folder, run.seed, setting.label, newer.folder)
    rows_by_family = {family: family_rows(family) for family in {run.family for run in runs} if family}
    for setting in settings.values():
        family = setting.runs[0].family
        if family:
            setting.paper_row = rows_by_family[family].get(tuple(setting.columns.values()))
    return list(settings.values())


def ordered(settings: Sequence[Setting]) -> list[Setting]:
    """The reference setting first (the one that is Table 3's base row, else the first found), then
    Table 3's rows in the paper's order, then the rest as found."""
    base = next((s for s in settings if s.paper_row == "base"), settings[0])
    rows = sorted(
        (s for s in settings if s is not base), key=lambda s: ROW_ORDER.get(s.paper_row or "", len(ROW_ORDER))
    )
    return [base, *rows]


class Unpaired(Exception):
    """Why a setting's test translations cannot be compared with the first row's (said under the table)."""


class RunTexts:
    """The runs' test hypotheses and references, each corpus read once."""

    def __init__(self) -> None:
        self._references: dict[str, list[str] | str] = {}  # by data section: the references, or why none

    @staticmethod
    def hypotheses(run: Run) -> list[str]:
        path = run.folder / TEST_HYPOTHESES
        if not path.is_file():
            raise Unpaired(f"{path} does not exist")
        try:
            return read_lines(path)
        except DataError as error:
            raise Unpaired(str(error)) from None

    def references(self, run: Run) -> list[str]:
        key = json.dumps(run.data, sort_keys=True, default=str)
        if key not in self._references:
            try:
                self._references[key] = tested_references(run)
            # Any failure (no such folder, no network for a download, a config of another aiayn, a library
            # missing) leaves the report without this p-value, never without the report.
            except Exception as error:
                message = " ".join(str(error).split()) or type(error).__name__
                self._references[key] = f"the test references of {run.folder} cannot be read ({message})"
        found = self._references[key]
        if isinstance(found, str):
            raise Unpaired(found)
        return found


def tested_references(run: Run) -> list[str]:
    """The references ``run``'s ``test.hyp.txt`` was scored against: the test split of the corpus its
    ``config.yaml``'s ``data`` section names, built only from aiayn's own classes (as aiayn-eval builds a
    checkpoint's, and with aiayn-eval's default cache: where files go is the reader's to say, not a shared
    config's), cut to the run's ``eval_limit`` as its training cut it."""
    if "_target_" not in run.data:
        raise Unpaired(f"{run.folder / 'config.yaml'} has no data section")
    datamodule = instantiated_from_checkpoint({**run.data, "cache_dir": None}, "data", run.folder / "config.yaml")
    references = datamodule.split_texts("test")[1]
    return references[: datamodule.eval_limit] if datamodule.eval_limit else references


def paired_p_value(base: Setting, setting: Setting, texts: RunTexts) -> float | str:
    """The p-value of sacreBLEU's paired bootstrap of ``setting``'s test BLEU against ``base``'s, or why
    there is none. Runs are paired by seed (the seeds both settings have); each setting's test
    hypotheses of those seeds are concatenated in seed order and scored against the test references,
    repeated once per seed, so every seed's translations count and each sentence is paired with the
    same seed's translation of it."""
    firsts = {run.seed: run for run in base.runs if run.seed is not None}
    pairs = sorted((run.seed, firsts[run.seed], run) for run in setting.runs if run.seed in firsts)
    if not pairs:
        return "no seed in common with the first row"
    baseline: list[str] = []
    system: list[str] = []
    references: list[str] = []
    try:
        for seed, first, run in pairs:
            hypotheses = [texts.hypotheses(first), texts.hypotheses(run)]
            first_refs, refs = texts.references(first), texts.references(run)
            if first_refs != refs:
                raise Unpaired(f"seed {seed}: {first.folder} and {run.folder} were tested on different references")
            for tested, lines in zip((first, run), hypotheses, strict=True):
                if len(lines) != len(refs):
                    raise Unpaired(
                        f"{tested.folder / TEST_HYPOTHESES} has {len(lines)} lines for {len(refs)} test references"
                    )
            baseline += hypotheses[0]
            system += hypotheses[1]
            references += refs
    except Unpaired as why:
        return str(why)
    return paired_bootstrap([(base.label, baseline), (setting.label, system)], references).systems[1].p_value


def significance(settings: Sequence[Setting]) -> dict[str, float | str]:
    """For each setting after the first (:func:`ordered`), by label: :func:`paired_p_value` against the first."""
    base, *others = ordered(settings)
    texts = RunTexts()
    return {setting.label: paired_p_value(base, setting, texts) for setting in others}


def p_cell(value: float | str | None) -> str:
    """A ``p (test)`` cell: blank for the first row, ``-`` without a test, else the p-value (marked when
    significant)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return "-"
    return f"{value:.4f}{SIGNIFICANT if value < SIGNIFICANCE_LEVEL else ''}"


def scored_on_final(settings: Sequence[Setting]) -> bool:
    """Whether any run's numbers come from its final checkpoint (then the best validation BLEU is shown too)."""
    return any(run.evaluated == "final" for setting in settings for run in setting.runs)


def markdown_table(settings: Sequence[Setting], p_values: Mapping[str, float | str] | None = None) -> str:
    """Table 3's layout (rows :func:`ordered`): the changed values (blank where as the first row), params,
    the checkpoint scored, PPL and BLEU (mean ± std over seeds; with the best validation BLEU when a run is
    scored on its final checkpoint), the p-value of the test BLEU against the first row's
    (:func:`significance`), steps and wall time; the paper's PPL and BLEU where the setting is its row."""
    base, *_ = settings = ordered(settings)
    p_values = p_values or {}
    best = scored_on_final(settings)
    headings = [
        "setting", *(h for h, _ in COLUMNS), "params ×10⁶", "seeds", "steps", "checkpoint", "PPL (val)",
        "BLEU (val)", *(["BLEU (val, best)"] if best else []), "BLEU (test)", "p (test)", "minutes", "paper row",
        "paper PPL", "paper BLEU", "paper params ×10⁶",
    ]  # fmt: skip
    lines = ["| " + " | ".join(headings) + " |", "|" + "---|" * len(headings)]
    for setting in settings:
        changed = [
            "" if setting is not base and value == base.columns[heading] else str(value)
            for heading, value in setting.columns.items()
        ]
        params = setting.mean("params")
        steps = setting.mean("steps")
        wall = setting.mean("wall_s")
        paper = PAPER.get(setting.paper_row or "")
        cells = [
            setting.label,
            *changed,
            f"{params / 1e6:.1f}" if params is not None else "-",
            str(len(setting.runs)),
            f"{steps:.0f}" if steps is not None else "-",
            setting.evaluated(),
            setting.spread("val_ppl"),
            setting.spread("val_bleu"),
            *([setting.spread("best_val_bleu")] if best else []),
            setting.spread("test_bleu"),
            p_cell(None if setting is base else p_values.get(setting.label, "not tested")),
            f"{wall / 60:.1f}" if wall is not None else "-",
            setting.paper_row or "",
            f"{paper.ppl:.2f}" if paper else "",
            f"{paper.bleu:.1f}" if paper else "",
            f"{paper.params_millions or PAPER['base'].params_millions:g}" if paper else "",  # blank: as base
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_axes(settings: Sequence[Setting]) -> list[tuple[str, str, str, list[Setting]]]:
    """The axes along which settings vary from the first (:func:`ordered`), each with its points: the
    first setting and those that differ from it only in the axis's columns (rows A change h with d_k and
    d_v; big changes the size and P_drop), in at least one of its key columns. An axis needs 2 points."""
    base, *others = ordered(settings)
    chosen = []
    for name, label, column in AXES:
        allowed, keys = AXIS_COLUMNS[name]
        points = [base]
        for setting in others:
            changed = {h for h in setting.columns if setting.columns[h] != base.columns[h]}
            if changed and changed <= allowed and changed & keys:
                points.append(setting)
        if len(points) > 1:
            chosen.append((name, label, column, points))
    return chosen


def plot(settings: Sequence[Setting], folder: Path) -> list[Path]:
    """``bleu_ppl_vs_<axis>.png`` for every axis the settings vary along: validation BLEU and perplexity,
    mean with the standard deviation over seeds as error bars."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster or in CI
    import matplotlib.pyplot as plt

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
        figure.savefig(path, dpi=110)
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


def failed_trials(paths: Iterable[Path], finished: set[Path]) -> dict[Path, str]:
    """The trials of the sweeps under ``paths`` (their ``sweep.json``) without a finished run: run folder
    -> ``trial-0003 (exit code 1...)``, or ``(running)``."""
    failed = {}
    for path in paths:
        for state in Path(path).rglob("sweep.json"):
            for trial in json.loads(state.read_text()).get("trials", []):
                where = (state.parent / (trial.get("run_dir") or f"trial-{trial['number']}")).resolve()
                if trial.get("state") != "finished" and where not in finished:
                    why = "running" if trial.get("state") == "running" else trial.get("error")
                    failed[where] = f"trial-{trial['number']:04d} ({why})"
    return failed


def write_report(paths: Sequence[Path], output: Path) -> tuple[str, list[Path]]:
    """Write ``report.md`` and the plots into ``output``; returns the markdown and the plot files."""
    runs, unfinished = find_runs(paths)
    if not runs:
        raise ValueError(f"no finished run (a folder with results.json) under {', '.join(map(str, paths))}")
    settings = group_settings(runs)
    output.mkdir(parents=True, exist_ok=True)
    plots = plot(settings, output)
    p_values = significance(settings)
    seed = bootstrap_seed()
    best = (
        " BLEU (val, best): the best validation BLEU any validation of the run saw."
        if scored_on_final(settings)
        else ""
    )
    text = [
        f"# Report: {', '.join(str(p) for p in paths)}",
        "",
        f"{len(runs)} finished run(s) in {len(settings)} setting(s). PPL and BLEU on the validation split "
        "(Table 3 uses newstest2013) and BLEU on the test split, from the checkpoint named in the checkpoint column "
        "(best: the best by validation; final: the last of training; mixed: it differs between seeds), beam "
        f"search, no averaging; mean ± sample std over seeds.{best} Blank: as the first row. Paper: Vaswani et al. "
        "(2017) Table 3 (WMT14 En-De, tokenized BLEU).",
        "",
        f"p (test): sacreBLEU's paired bootstrap resampling ({BOOTSTRAP_SAMPLES} resamples, seed "
        f"{seed if seed is not None else 'unfixed'}) of the setting's test BLEU against the first row's. Runs are "
        f"paired by seed (the seeds both settings have): each setting's {TEST_HYPOTHESES} of those seeds are "
        "concatenated in seed order and scored against the test references repeated as many times. "
        f"{SIGNIFICANT}: p < {SIGNIFICANCE_LEVEL}, a difference chance alone rarely makes; p ≥ {SIGNIFICANCE_LEVEL} "
        "means not significant: the difference may be chance. -: no test, for the reason below the table.",
        "",
        markdown_table(settings, p_values),
    ]
    unpaired = {label: why for label, why in p_values.items() if isinstance(why, str)}
    if unpaired:
        text += ["", *(f"p (test) of {label}: -, {why}." for label, why in unpaired.items())]
    failed = failed_trials(paths, {run.folder for run in runs})
    others = [folder for folder in unfinished if folder not in failed]
    if failed or others:
        text += ["", f"Not in the table: {len(failed)} unfinished trial(s) {', '.join(failed.values())}; "
                 f"{len(others)} other run folder(s) without results."]  # fmt: skip
    text += ["", *(f"![{p.stem}]({p.name})" for p in plots)]
    markdown = "\n".join(text) + "\n"
    atomic_write(output / "report.md", markdown)
    return markdown, plots
