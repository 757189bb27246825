"""``aiayn-eval tune=...``: decoding settings chosen on the validation split. Every combination of the
listed values is translated (once per distinct translation) and scored with sacreBLEU, the length ratio
and the brevity penalty beside it; the best by sacreBLEU is reported with the overrides that select it.
The test split is never read: settings chosen on the set a paper reports would flatter it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import sacrebleu

from aiayn.evaluation.evaluate import loaded_system, output_digest, system_identity
from aiayn.evaluation.settings import EvalSettings
from aiayn.files import atomic_write
from aiayn.model import DecodingOptions
from aiayn.scoring import BLEU_SETTINGS

# The decoding settings tune= may vary (decoding=sample, or not, is chosen once for the whole grid).
TUNABLE = (
    "beam_size", "alpha", "length_penalty", "max_len_offset", "min_len", "no_repeat_ngram",
    "temperature", "top_k", "top_p",
)  # fmt: skip


@dataclass(frozen=True)
class TuneGrid:
    """``tune=``: the values of each tuned decoding setting (in :data:`TUNABLE`'s order) and every
    combination of them, as the decoding options it makes from ``base`` (``decoding=``)."""

    base: DecodingOptions
    values: dict[str, list[Any]]
    settings: list[DecodingOptions]

    def changes(self, options: DecodingOptions) -> dict[str, Any]:
        """The tuned settings of one combination: ``{"alpha": 1.0, "beam_size": 8}``."""
        return {key: getattr(options, key) for key in self.values}


@dataclass(frozen=True)
class Tuning:
    """A tuning's results: the JSON report (also written to ``report_file``), with its ``grid`` (a row per
    combination, in order) and the ``best`` row by sacreBLEU."""

    report: dict[str, Any]
    report_file: Path


def same_translations(options: DecodingOptions) -> DecodingOptions:
    """``options`` with the settings that cannot change the translations' texts at their defaults: two
    settings equal here translate alike, and :func:`tune` translates only the first. The length penalty
    does not steer one beam (greedy), nor an α of 0, nor sampling (it only scores the samples); the
    sampling settings do not steer beam search."""
    changes: dict[str, Any] = {}
    if options.sample or options.beam_size == 1 or options.alpha == 0:
        changes |= {"alpha": 0.0, "length_penalty": "gnmt"}
    if not options.sample:
        changes |= {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    return replace(options, **changes)


def tune(settings: EvalSettings) -> Tuning:
    """Scores every setting of ``settings.tune`` on the validation split (or the user's own ``source`` and
    ``reference``, a development set: never another split, the test split least of all; see
    :class:`~aiayn.evaluation.settings.EvalSettings`) with the model of the checkpoint (or an ensemble),
    decoded as :func:`evaluate` decodes; writes ``<stem>.tune.json`` (each setting's sacreBLEU, length
    ratio and brevity penalty, and the best by sacreBLEU: the first of equal ones) to ``output_dir``
    (:func:`output_folder`). Each setting that translates differently (:func:`same_translations`) is
    translated once."""
    grid = settings.tune
    assert grid is not None, "tune() is for settings with a grid (EvalSettings.tune)"
    system = loaded_system(settings)  # its decoding is decoding=, the grid's base
    identity = {"checkpoint": system_identity(system.paths), "texts": system.digest, "settings": system.decoded}
    stem = f"{system.stem}.{output_digest(identity | {'tune': grid.values})}"
    base = system.translator

    def translated(options: DecodingOptions) -> list[str]:
        return base.varied(options).translate(system.source)

    bleu = sacrebleu.BLEU(**BLEU_SETTINGS)
    start = time.perf_counter()
    rows = scored_rows(grid, translated, system.reference, bleu)
    best = max(range(len(rows)), key=lambda i: rows[i]["sacrebleu"])  # the first of equal scores
    chosen = grid.settings[best]
    report = {
        **system.described(),
        "sentences": len(system.source),
        "settings": system.decoded,  # its decoding is decoding=, which each row changes
        "tuned": grid.values,
        "sacrebleu_signature": str(bleu.get_signature()),
        "grid": rows,
        "best": {
            "index": best,
            **rows[best],
            "decoding": chosen.to_dict(),
            "overrides": " ".join(f"decoding.{key}={value}" for key, value in grid.changes(chosen).items()),
        },
        "seconds": time.perf_counter() - start,
    }
    system.folder.mkdir(parents=True, exist_ok=True)
    report_file = system.folder / f"{stem}.tune.json"
    atomic_write(report_file, json.dumps(report, indent=2) + "\n")
    return Tuning(report, report_file)


def scored_rows(
    grid: TuneGrid, translated: Callable[[DecodingOptions], list[str]], reference: list[str], bleu: sacrebleu.BLEU
) -> list[dict[str, Any]]:
    """A row per setting of ``grid``, in order: the tuned values, sacreBLEU, the length ratio sys/ref, the
    brevity penalty, the lengths and the seconds it took. A setting that translates as an earlier one
    (:func:`same_translations`) is not translated again: its row names that one (``same_as``)."""
    scores = ("sacrebleu", "length_ratio", "brevity_penalty", "sys_len", "ref_len")
    rows: list[dict[str, Any]] = []
    translated_by: dict[DecodingOptions, int] = {}  # same_translations(options) -> the row that translated it
    for index, options in enumerate(grid.settings):
        key = same_translations(options)
        row = {"decoding": grid.changes(options), "same_as": translated_by.get(key)}
        if row["same_as"] is not None:
            rows.append(row | {name: rows[row["same_as"]][name] for name in scores} | {"seconds": 0.0})
            continue
        began = time.perf_counter()
        score = bleu.corpus_score(translated(options), [reference])
        ratio = score.sys_len / score.ref_len if score.ref_len else None
        values = (score.score, ratio, score.bp, score.sys_len, score.ref_len)
        rows.append(row | dict(zip(scores, values, strict=True)) | {"seconds": time.perf_counter() - began})
        translated_by[key] = index
    return rows


def tune_lines(tuning: Tuning) -> list[str]:
    """What ``aiayn-eval tune=...`` prints: a row per setting (sacreBLEU, length ratio sys/ref, brevity
    penalty; a setting that translates as an earlier one says which), the best and where the report is."""
    report = tuning.report
    rows = report["grid"]
    named = [" ".join(f"{key}={value}" for key, value in row["decoding"].items()) for row in rows]
    width = max(len("setting"), *(len(name) for name in named))
    lines = [
        f"tune: {len(rows)} settings on {report['evaluated']} ({report['sentences']} sentences), "
        f"{sum(row['same_as'] is None for row in rows)} translated; {report['sacrebleu_signature']}",
        f"{'setting':<{width}}  sacreBLEU  ratio   BP",
    ]
    for index, (name, row) in enumerate(zip(named, rows, strict=True)):
        ratio = f"{row['length_ratio']:.3f}" if row["length_ratio"] is not None else "  -  "
        same = f"  (translates as {named[row['same_as']]})" if row["same_as"] is not None else ""
        best = "  *" if index == report["best"]["index"] else ""
        lines.append(f"{name:<{width}}  {row['sacrebleu']:9.2f}  {ratio}  {row['brevity_penalty']:.3f}{best}{same}")
    chosen = report["best"]
    lines.append(f"best: {named[chosen['index']]}  sacreBLEU {chosen['sacrebleu']:.2f}  ({chosen['overrides']})")
    lines.append(f"{report['seconds']:.1f} s; report: {tuning.report_file}")
    return lines
