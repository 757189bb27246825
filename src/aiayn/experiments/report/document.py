"""``report.md``, its table as CSV, JSON and LaTeX, and the plots of the runs under the folders a user
names: what ``aiayn-report`` writes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from aiayn.errors import FieldError
from aiayn.experiments.report.exports import write_exports
from aiayn.experiments.report.plots import plot, plot_curves
from aiayn.experiments.report.runs import CONDITION_NAMES, failed_trials, find_runs
from aiayn.experiments.report.settings import group_settings, varying
from aiayn.experiments.report.significance import SIGNIFICANT, RunTexts, comet_values, significance
from aiayn.experiments.report.table import PARTIAL, CometColumn, Table, scored_on_final, table_of
from aiayn.files import TEST_TRANSLATIONS, atomic_write
from aiayn.scoring import BOOTSTRAP_SAMPLES, SIGNIFICANCE_LEVEL, bootstrap_seed

if TYPE_CHECKING:
    from aiayn.evaluation.comet import CometSettings


@dataclass(frozen=True)
class Report:
    """What :func:`write_report` wrote: ``report.md``'s text, the table it shows, the table's other formats
    (:mod:`.exports`) and the plot files."""

    markdown: str
    table: Table
    plots: list[Path]
    exports: list[Path]


def write_report(
    paths: Sequence[Path], output: Path, data_root: Path | None = None, comet: CometSettings | None = None
) -> Report:
    """Write ``report.md``, its table as ``report.csv``, ``report.json`` and ``report.tex``, and the plots
    into ``output`` (nothing else, nowhere else); returns what was written. The test references of the
    paired tests are read from ``data_root`` only; with ``comet``, each run's test translations are scored
    by that COMET model too (its sources and references from ``data_root``, which it then needs)."""
    if comet is not None and data_root is None:
        raise ValueError("--comet scores the test translations against their sources and references: give "
                         "--data-root, your copy of the runs' corpus")  # fmt: skip
    scorer = None
    if comet is not None:  # loaded before anything is written: a model it cannot score with is refused first
        from aiayn.evaluation.settings import resolved_device  # (the model's stack: only a COMET report needs it)

        try:
            comet_folder = comet.folder()
            scorer = (comet.load(resolved_device("auto"), comet_folder), comet.comet_batch_size)
        except FieldError as error:
            raise ValueError(f"--comet {comet.comet_model} {error.allowed}") from None
    found = find_runs(paths)
    if not found.runs:
        raise ValueError(f"no finished run (a folder with results.json) under {', '.join(map(str, paths))}")
    failed = failed_trials(found.sweeps, {run.folder for run in found.runs}, found.skipped)
    settings = group_settings(found.runs)
    if output.exists() and not output.is_dir():
        raise ValueError(f"{output}: not a folder; give --out <folder> for report.md and the plots")
    output.mkdir(parents=True, exist_ok=True)
    plots = plot(settings, output) + plot_curves(settings, output)
    texts = RunTexts(data_root, scorer)
    p_values = significance(settings, texts)
    column, left_out = None, []
    if comet is not None:
        values, left_out = comet_values(settings, texts)
        column = CometColumn(comet.comet_model, values, significance(settings, texts, "comet"))
    table = table_of(settings, p_values, column)
    seed = bootstrap_seed()
    best = (
        " BLEU (val, best): the best validation BLEU any validation of the run saw."
        if scored_on_final(settings)
        else ""
    )
    differ = varying(settings)
    same = [f"{CONDITION_NAMES[k]} {settings[0].conditions.described(k)}" for k in CONDITION_NAMES if k not in differ]
    text = [
        f"# Report: {', '.join(str(p) for p in paths)}",
        "",
        f"{len(found.runs)} finished run(s) in {len(settings)} setting(s). PPL and BLEU on the validation split "
        "(Table 3 uses newstest2013) from the checkpoint named in the checkpoint column (best: the best by "
        "validation; final: the last of training), BLEU on the test split from the run's answer, the checkpoint "
        "named in the answer column (best or final: that one; averaged: the mean of the newest step checkpoints' "
        "weights; ema: the exponential moving average of the weights), beam search; mean ± sample std over "
        f"seeds.{best} Blank: as the first row. Paper: Vaswani et al. (2017) Table 3 (WMT14 En-De, "
        "tokenized BLEU).",
        "",
        "A setting's runs differ only in their seed: runs of another corpus, direction, precision, checkpoint, "
        "answer or number of test sentences are other settings (in brackets after the setting where settings differ)."
        + (f" Every row: {'; '.join(same)}." if same else ""),
        "BLEU (val) at step S and at M min, where the runs logged their validations: each setting's validation "
        "BLEU at the last step every run reached and at the training minutes every run had trained (each run's "
        "last validation by then): recipes compared at matched steps and matched time, not only where each ended.",
        f"test sentences: how many the test BLEU is of (results.json's test_sentences; ?: not recorded). "
        f"first N and {PARTIAL}: only the first N sentences of the test split (data.eval_limit), not "
        "comparable with a score on the whole split.",
        "",
        f"p (test): sacreBLEU's paired bootstrap resampling ({BOOTSTRAP_SAMPLES} resamples, seed "
        f"{seed if seed is not None else 'unfixed'}) of the setting's test BLEU against the first row's. Runs are "
        "paired by seed (the seeds both settings have): each setting's test translations of those seeds, its "
        f"answer's ({TEST_TRANSLATIONS['evaluated']} of best or final, {TEST_TRANSLATIONS['averaged']}, "
        f"{TEST_TRANSLATIONS['ema']}), are concatenated in seed order and scored against the test references "
        "repeated as many times; the references are read from the corpus folder given with --data-root, never "
        f"from where a run's config says. {SIGNIFICANT}: p < {SIGNIFICANCE_LEVEL}, a difference chance alone "
        f"rarely makes; p ≥ {SIGNIFICANCE_LEVEL} means not significant: the difference may be chance. -: no "
        "test, for the reason below the table.",
        "",
        table.markdown(),
    ]
    if column is not None:
        text[-2:-2] = [
            "",
            f"COMET (test): the mean of the test segments' COMET ({comet.comet_model}, read from {comet_folder}; "
            "Rei et al., 2020, scored as unbabel-comet scores them) of each run's answer, mean ± sample std over "
            "seeds. p COMET (test): the same paired bootstrap on the seeds' segments (the resamples and statistic "
            "of sacreBLEU's test, the segments' mean for the corpus score).",
        ]
    unpaired = {label: why for label, why in p_values.items() if isinstance(why, str)}
    if unpaired:
        text += ["", *(f"p (test) of {label}: -, {why}." for label, why in unpaired.items())]
    unpaired_comet = {label: why for label, why in (column.p_values if column else {}).items() if isinstance(why, str)}
    if unpaired_comet or left_out:
        text += ["", *(f"p COMET (test) of {label}: -, {why}." for label, why in unpaired_comet.items()), *left_out]
    others = [folder for folder in found.unfinished if folder not in failed]
    if failed or others or found.skipped:
        text += ["", f"Not in the table: {len(failed)} unfinished trial(s) {', '.join(failed.values())}; "
                 f"{len(others)} other run folder(s) without results; {len(found.skipped)} malformed file(s)"
                 " skipped."]  # fmt: skip
        text += [f"- {line}" for line in found.skipped]
    text += ["", *(f"![{p.stem}]({p.name})" for p in plots)]
    markdown = "\n".join(text) + "\n"
    exports = write_exports(table, output)
    atomic_write(output / "report.md", markdown)
    return Report(markdown, table, plots, exports)
