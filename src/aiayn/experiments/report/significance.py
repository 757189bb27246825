"""Whether a setting's test BLEU (and, with a COMET model, its test COMET) differs significantly from the
first row's: sacreBLEU's paired bootstrap on the seeds' test translations, against test references (and
sources) read only from the corpus folder the user gives."""

from __future__ import annotations

import json
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiayn.data.corpus import read_lines
from aiayn.data.stored import instantiated_from_checkpoint, stored_targets
from aiayn.errors import DataError
from aiayn.experiments.report.records import HYPOTHESES_BYTES, inside_folder, shown
from aiayn.experiments.report.runs import CONDITION_NAMES, CONFIG, TESTED_ON, Run
from aiayn.experiments.report.settings import Setting, ordered
from aiayn.experiments.results import RESULTS_FILE
from aiayn.scoring import SIGNIFICANCE_LEVEL, paired_bootstrap, paired_bootstrap_segments

if TYPE_CHECKING:
    from aiayn.evaluation.comet import Comet

SIGNIFICANT = "*"  # after a p-value below SIGNIFICANCE_LEVEL


class Unpaired(Exception):
    """Why a setting's test translations cannot be compared with the first row's (said under the table)."""


class RunTexts:
    """The runs' test hypotheses and references, each corpus read once, from ``data_root`` only: the
    folder the user gave; without it, no references are read."""

    def __init__(self, data_root: Path | None = None, comet: tuple[Comet, int] | None = None) -> None:
        """``comet``: a loaded COMET model and its batch size, to score each run's test translations with."""
        self.data_root, self.scorer = data_root, comet
        self._split: dict[str, tuple[list[str], list[str]] | str] = {}  # by data section: the split, or why none
        self._comet: dict[Path, list[float] | str] = {}  # by run folder: its test COMET's segments, or why none

    @staticmethod
    def hypotheses(run: Run) -> list[str]:
        """The test translations of ``run``'s answer (the checkpoint its test BLEU is of)."""
        path = run.folder / run.hypotheses
        try:
            status = path.lstat()
        except FileNotFoundError:
            raise Unpaired(f"{path} does not exist") from None
        if not stat.S_ISREG(status.st_mode):  # a link may lead anywhere, a pipe never end
            raise Unpaired(f"{path} is not a plain file")
        if status.st_size > HYPOTHESES_BYTES:
            raise Unpaired(f"{path} has {status.st_size} bytes, more than test translations have")
        try:
            return read_lines(path)
        except DataError as error:
            raise Unpaired(" ".join(str(error).split())) from None

    def split(self, run: Run) -> tuple[list[str], list[str]]:
        """The test sources and references ``run`` was scored on."""
        if self.data_root is None:
            raise Unpaired("the test references are read only from the corpus folder given with --data-root")
        key = json.dumps([run.data, run.eval_limit, run.conditions.test_sentences], sort_keys=True, default=str)
        if key not in self._split:
            try:
                self._split[key] = tested_split(run, self.data_root)
            # Any failure (no such file, a config of another aiayn, a library missing) leaves the report
            # without this p-value, never without the report.
            except Exception as error:
                message = " ".join(str(error).split()) or type(error).__name__
                self._split[key] = f"the test references of {run.folder} cannot be read ({message})"
        found = self._split[key]
        if isinstance(found, str):
            raise Unpaired(found)
        return found

    def references(self, run: Run) -> list[str]:
        return self.split(run)[1]

    def comet(self, run: Run) -> list[float]:
        """Each test segment's COMET of ``run``'s answer, scored once per report."""
        if self.scorer is None:
            raise Unpaired("no COMET model was given (--comet)")
        if run.folder not in self._comet:
            try:
                sources, references = self.split(run)
                hypotheses = self.hypotheses(run)
                if len(hypotheses) != len(references):
                    raise Unpaired(f"{run.folder / run.hypotheses} has {len(hypotheses)} lines for "
                                   f"{len(references)} test references")  # fmt: skip
                model, batch = self.scorer
                self._comet[run.folder] = model.score(sources, hypotheses, references, batch).segments
            except Unpaired as why:
                self._comet[run.folder] = str(why)
        found = self._comet[run.folder]
        if isinstance(found, str):
            raise Unpaired(found)
        return found


def reading_classes() -> dict[str, type]:
    """The data modules whose test split the report reads, by the names a stored ``_target_`` gives them."""
    from aiayn.data.sources import Multi30kDataModule, TextDataModule, WMT14DataModule

    classes = (Multi30kDataModule, TextDataModule, WMT14DataModule)
    return {n: c for c in classes for n in (f"{c.__module__}.{c.__name__}", f"aiayn.data.{c.__name__}")}


def readable_section(run: Run, data_root: Path) -> dict[str, Any]:
    """``run``'s data section with its corpus at ``data_root`` (the user's folder) in place of the stored
    one: a stored root, Hub dataset or download is never used, and a stored file name must lie inside
    ``data_root``. :class:`Unpaired` says why a section cannot be read so."""
    where = run.folder / CONFIG
    target = run.data.get("_target_")
    classes = reading_classes()
    if not isinstance(target, str) or target not in classes:
        raise Unpaired(f"{where}: data._target_={shown(target)} is not a corpus the report reads")
    nested = [key for key, _ in stored_targets(run.data, "data") if key != "data._target_"]
    if nested:
        raise Unpaired(f"{where}: {nested[0]} is set; the report reads only aiayn's corpora as configured")
    kind = classes[target].__name__
    if kind == "TextDataModule":
        for role in ("train", "val", "test"):
            pair = run.data.get(role)
            if pair is None:
                continue
            if not (isinstance(pair, list) and len(pair) == 2 and all(map(inside_folder, pair))):
                raise Unpaired(f"{where}: data.{role}={shown(pair)} does not name two files inside --data-root")
            for file in pair:
                if not (data_root / file).resolve().is_relative_to(data_root.resolve()):
                    raise Unpaired(f"{where}: data.{role} names {file}, which leads out of --data-root {data_root}")
    if kind == "WMT14DataModule" and not (data_root / "dataset_dict.json").is_file():
        # any other layout is loaded through datasets.load_dataset, which writes a cache of its own
        raise Unpaired(f"--data-root {data_root} is not a save_to_disk copy of {run.data.get('hub', 'WMT14')}")
    return {**run.data, "root": str(data_root), "cache_dir": None}


def tested_split(run: Run, data_root: Path) -> tuple[list[str], list[str]]:
    """The sources and references of ``run``'s test translations: the test split of its corpus, read
    from ``data_root`` (:func:`readable_section`), built only from aiayn's own classes (as aiayn-eval
    builds a checkpoint's), cut to the run's ``eval_limit`` as its training cut it."""
    if "_target_" not in run.data:
        raise Unpaired(f"{run.folder / CONFIG} has no data section")
    section = readable_section(run, data_root)
    datamodule = instantiated_from_checkpoint(section, "data", run.folder / CONFIG, root=data_root)
    sources, references = datamodule.split_texts("test")
    if datamodule.eval_limit:
        sources, references = sources[: datamodule.eval_limit], references[: datamodule.eval_limit]
    tested = run.conditions.test_sentences
    if tested is not None and tested != len(references):
        raise Unpaired(f"{len(references)} test references in {data_root}, {run.folder / RESULTS_FILE} scored {tested}")
    return list(sources), list(references)


def paired_p_value(base: Setting, setting: Setting, texts: RunTexts, metric: str = "bleu") -> float | str:
    """The p-value of sacreBLEU's paired bootstrap of ``setting``'s test BLEU (``metric="comet"``: its test
    COMET, :func:`~aiayn.scoring.paired_bootstrap_segments`) against ``base``'s, or why there is none. Runs
    are paired by seed (the seeds both settings have); each setting's test hypotheses of those seeds
    (their answer's, which its test BLEU is of) are concatenated in seed order and scored against the test
    references, repeated once per seed, so every seed's translations count and each sentence is paired
    with the same seed's translation of it. Settings tested on another corpus, direction or number of
    test sentences are not compared."""
    for key in TESTED_ON:
        ours, theirs = base.conditions.described(key), setting.conditions.described(key)
        if ours != theirs:
            return f"tested with {CONDITION_NAMES[key]} {theirs}, the first row with {CONDITION_NAMES[key]} {ours}"
    firsts = {run.seed: run for run in base.runs if run.seed is not None}
    pairs = sorted(((r.seed, firsts[r.seed], r) for r in setting.runs if r.seed in firsts), key=lambda p: p[0])
    if not pairs:
        return "no seed in common with the first row"
    baseline: list[Any] = []
    system: list[Any] = []
    references: list[str] = []
    try:
        for seed, first, run in pairs:
            first_refs, refs = texts.references(first), texts.references(run)
            if first_refs != refs:
                raise Unpaired(f"seed {seed}: {first.folder} and {run.folder} were tested on different references")
            if metric == "comet":
                baseline += texts.comet(first)
                system += texts.comet(run)
                continue
            hypotheses = [texts.hypotheses(first), texts.hypotheses(run)]
            for tested, lines in zip((first, run), hypotheses, strict=True):
                if len(lines) != len(refs):
                    raise Unpaired(
                        f"{tested.folder / tested.hypotheses} has {len(lines)} lines for {len(refs)} test references"
                    )
            baseline += hypotheses[0]
            system += hypotheses[1]
            references += refs
    except Unpaired as why:
        return str(why)
    if metric == "comet":
        return paired_bootstrap_segments([(base.label, baseline), (setting.label, system)], "COMET").systems[1].p_value
    return paired_bootstrap([(base.label, baseline), (setting.label, system)], references).systems[1].p_value


def significance(settings: Sequence[Setting], texts: RunTexts, metric: str = "bleu") -> dict[str, float | str]:
    """For each setting after the first (:func:`ordered`), by label: :func:`paired_p_value` of ``metric``
    (``bleu`` or ``comet``) against the first, with the runs' texts read by ``texts``."""
    base, *others = ordered(settings)
    return {setting.label: paired_p_value(base, setting, texts, metric) for setting in others}


def comet_values(settings: Sequence[Setting], texts: RunTexts) -> tuple[dict[str, list[float]], list[str]]:
    """Each setting's runs' test COMET (the mean of their segments'), by label; and why a run has none
    (it is left out of its setting's mean)."""
    values: dict[str, list[float]] = {}
    missing = []
    for setting in settings:
        values[setting.label] = []
        for run in setting.runs:
            try:
                segments = texts.comet(run)
            except Unpaired as why:
                missing.append(f"COMET (test) of {setting.label} leaves out {run.folder}: {why}.")
                continue
            values[setting.label].append(sum(segments) / len(segments))
    return values, missing


def p_cell(value: float | str | None) -> str:
    """A ``p (test)`` cell: blank for the first row, ``-`` without a test, else the p-value (marked when
    significant)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return "-"
    return f"{value:.4f}{SIGNIFICANT if value < SIGNIFICANCE_LEVEL else ''}"
