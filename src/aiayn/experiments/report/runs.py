"""Finding finished runs under the folders a user names (walked without following links), reading each
run's checked fields and the conditions that define it beside its overrides (:class:`Conditions`), and
the sweeps' trials that left no finished run."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiayn.config.naming import defining_overrides
from aiayn.errors import DataError, whole
from aiayn.experiments.report.records import (
    MISSING,
    brief,
    field_of,
    is_name,
    is_overrides,
    is_spec,
    is_text,
    malformed,
    number_in,
    optional,
    read_record,
    whole_in,
)
from aiayn.experiments.results import ANSWERS, RESULTS_FILE
from aiayn.experiments.sweeps.state import FINISHED, RUNNING, STATE_BYTES, STATE_FILE, SweepError, read_trials
from aiayn.experiments.table3 import COLUMNS, FAMILIES
from aiayn.files import TEST_TRANSLATIONS
from aiayn.model.components import describe
from aiayn.training.metrics import EVALUATED_CHECKPOINTS, METRICS_CSV, metric_rows

log = logging.getLogger(__name__)

CONFIG = "config.yaml"
HYDRA_RECORD = Path(".hydra") / "hydra.yaml"
RUN_SUBFOLDERS = {".hydra", "checkpoints", "csv", "wandb"}  # hold no runs: not walked
BLEU = (number_in(0, 100), "must be a BLEU score from 0 to 100")
# The fields of results.json the report reads: (key, check, what it must be, default; none: required).
RESULT_FIELDS: tuple[tuple[str, Callable[[Any], bool], str, Any], ...] = (
    ("params", whole_in(0, 10**13), "must be a whole number of parameters", MISSING),
    ("steps", whole_in(0, 10**12), "must be a whole number of steps", MISSING),
    ("val_bleu", *BLEU, MISSING),
    ("val_ppl", number_in(1, 1e30, diverged=True), "must be a perplexity (Infinity or NaN: diverged)", MISSING),
    ("test_bleu", *BLEU, None),
    ("answer", lambda v: v in ANSWERS, f"must be one of {', '.join(ANSWERS)}", None),
    ("answer_test_bleu", optional(BLEU[0]), BLEU[1] + " or null", None),
    ("best_val_bleu", optional(BLEU[0]), BLEU[1] + " or null", None),
    ("wall_s", number_in(0, 1e10), "must be seconds (a number of at least 0)", None),
    ("evaluated", lambda v: v in EVALUATED_CHECKPOINTS, f"must be one of {', '.join(EVALUATED_CHECKPOINTS)}", "best"),
    ("test_sentences", whole_in(1, 10**9), "must be the whole number of test sentences scored", None),
    ("data_cache", is_name, "must be the name of a data cache entry", None),
    ("overrides", is_overrides, "must be a list of key=value overrides", MISSING),
)
MODEL_SIZE = (whole_in(1, 10**7), "must be a whole number of at least 1")
# The fields of config.yaml the report reads, Table 3's columns among them.
COLUMN_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model.n_layers": MODEL_SIZE,
    "model.d_model": MODEL_SIZE,
    "model.d_ff": MODEL_SIZE,
    "model.n_heads": MODEL_SIZE,
    "model.d_k": MODEL_SIZE,
    "model.d_v": MODEL_SIZE,
    "model.dropout": (number_in(0, 1), "must be a probability from 0 to 1"),
    "optim.label_smoothing": (number_in(0, 1), "must be a probability from 0 to 1"),
    "model.positional": (lambda v: is_name(v) or is_spec(v), "must be the name of a positional encoding or a spec"),
}
ANY_COLUMN = (lambda v: is_name(v) or number_in(-1e12, 1e12)(v), "must be a number or a name")  # one added later
CONFIG_FIELDS: tuple[tuple[str, Callable[[Any], bool], str, Any], ...] = (
    ("seed", optional(lambda v: whole(v, -(2**63)) and v < 2**64), "must be a whole number or null", None),
    ("name", lambda v: is_text(v, 200), "must be a run's name", ""),
    ("data", lambda v: isinstance(v, dict), "must be a mapping", {}),
    ("data._target_", is_name, "must be the name of a data module", None),
    ("data.src_lang", is_name, "must be a language code", None),
    ("data.tgt_lang", is_name, "must be a language code", None),
    ("data.eval_limit", optional(whole_in(1, 10**12)), "must be a whole number of at least 1 or null", None),
    ("trainer.precision", optional(lambda v: is_name(v) or whole_in(1, 128)(v)), "must be a precision", None),
    ("checkpoint.answer", optional(is_name), "must be the name of an answer rule", None),  # by_validation, ...
)
# A data section's keys that say which corpus and which of its splits is tested (its fingerprint does
# not say which split is the test split).
CORPUS_KEYS = ("_target_", "root", "hub", "config", "splits", "train", "val", "test", "val_split", "test_split")


@dataclass(frozen=True)
class Conditions:
    """What defines a run beside its overrides, which runs of one setting share: runs that differ in any of
    these are never averaged together. None: not recorded (an older run), never equal to a known value."""

    corpus: str  # results.json's data_cache (the corpus digest and vocabulary), else the stored corpus section
    direction: str  # <src_lang>-<tgt_lang>
    precision: str  # trainer.precision
    checkpoint: str  # results.json's evaluated: the checkpoint val_* are of
    answer: str  # the checkpoint the test BLEU is of: evaluated (the above), averaged, ema, or by_validation (the
    # run's choice among them, as checkpoint.answer asked: runs of one setting share the rule, not its outcome)
    test_sentences: int | None  # the test sentences test_bleu was computed on
    corpus_name: str = field(default="", compare=False)  # the corpus for a reader

    def described(self, key: str) -> str:
        """A condition for a reader: an answer that is the evaluated checkpoint by that checkpoint's name."""
        value = self.corpus_name or self.corpus if key == "corpus" else getattr(self, key)
        if key == "answer" and value == "evaluated":
            value = self.checkpoint
        return "unknown" if value is None else str(value)


CONDITION_NAMES = {  # how a label and the text name each condition
    "corpus": "corpus",
    "direction": "direction",
    "precision": "precision",
    "checkpoint": "checkpoint",
    "answer": "answer",
    "test_sentences": "test sentences",
}
TESTED_ON = ("corpus", "direction", "test_sentences")  # the conditions a paired test needs equal


@dataclass
class Run:
    """A finished run: its folder, Table 3's columns of its config, its checked results (``results``: the
    fields of :data:`RESULT_FIELDS`, ``answer_test_bleu`` the test BLEU the report shows)."""

    folder: Path
    overrides: tuple[str, ...]  # what defines it, sorted, without the seed
    seed: int | None
    columns: dict[str, Any]
    family: str | None
    results: dict[str, Any]
    data: dict[str, Any] = field(default_factory=dict)  # the config's data section: where the corpus is
    conditions: Conditions = Conditions("unknown", "unknown", "unknown", "best", "evaluated", None)
    eval_limit: int | None = None  # data.eval_limit: the first N validation and test sentences only
    answer: str = "evaluated"  # the checkpoint its test BLEU and translations are of: evaluated, averaged or ema

    @property
    def evaluated(self) -> str:
        """Which checkpoint val_* come from: ``best`` or ``final`` (results.json's ``evaluated``; runs from
        before it was recorded were scored on their best checkpoint)."""
        return self.conditions.checkpoint

    @property
    def hypotheses(self) -> str:
        """The file of the test translations of the run's answer (which its test BLEU is of), in corpus order."""
        return TEST_TRANSLATIONS[self.answer]

    @property
    def partial_test(self) -> bool:
        """Whether test_bleu is of part of the test split: the run cut it to ``eval_limit`` sentences (a
        split of fewer sentences than the limit is whole)."""
        tested = self.conditions.test_sentences
        return self.eval_limit is not None and (tested is None or tested >= self.eval_limit)


def read_run(folder: Path) -> Run:
    """The finished run in ``folder``, every field the report uses checked: :class:`DataError` naming the
    file and the field when one is not as aiayn-train writes it."""
    if not (folder / CONFIG).is_file():
        raise DataError(f"{folder / RESULTS_FILE}: no {CONFIG} beside it; it is not a run of aiayn-train")
    results = read_record(folder / RESULTS_FILE)
    checked = {key: field_of(results, key, folder / RESULTS_FILE, *check) for key, *check in RESULT_FIELDS}
    answer = answer_of(checked, results, folder / RESULTS_FILE)
    config = read_record(folder / CONFIG)
    columns = [field_of(config, key, folder / CONFIG, *COLUMN_FIELDS.get(key, ANY_COLUMN)) for _, key in COLUMNS]
    columns = [describe(value) if isinstance(value, dict) else value for value in columns]  # a component spec
    stored = {key: field_of(config, key, folder / CONFIG, *check) for key, *check in CONFIG_FIELDS}
    chosen = [o.lstrip("+") for o in defining_overrides(checked["overrides"])]
    data = stored["data"]
    corpus, corpus_name = corpus_of(checked["data_cache"], data)
    return Run(
        folder=folder,
        overrides=tuple(sorted(o for o in chosen if o.split("=", 1)[0] != "seed")),
        seed=stored["seed"],
        columns=dict(zip([heading for heading, _ in COLUMNS], columns, strict=True)),
        family=family_of(folder, stored["name"]),
        results=checked,
        data=data,
        conditions=Conditions(
            corpus=corpus,
            direction=f"{stored['data.src_lang'] or '?'}-{stored['data.tgt_lang'] or '?'}",
            precision=str(stored["trainer.precision"] or "unknown"),
            checkpoint=checked["evaluated"],
            answer="by_validation" if stored["checkpoint.answer"] == "by_validation" else answer,
            test_sentences=checked["test_sentences"],
            corpus_name=corpus_name,
        ),
        eval_limit=stored["data.eval_limit"],
        answer=answer,
    )


def answer_of(checked: dict[str, Any], results: Mapping[str, Any], path: Path) -> str:
    """The kind of the run's answer (a key of :data:`~aiayn.files.TEST_TRANSLATIONS`), once its ``answer`` and
    ``answer_test_bleu`` (the test BLEU the report shows) in ``checked`` are checked against the rest, or
    filled in for a run from before answers were recorded: that one answers with its evaluated checkpoint
    (``test_bleu``). aiayn-train names an evaluated answer by the checkpoint evaluated, and always writes
    its BLEU (null without a test split)."""
    answer = checked["answer"]
    if answer is None:
        checked["answer_test_bleu"] = checked["test_bleu"]
        return "evaluated"
    if answer in ("averaged", "ema"):
        kind = answer
    elif answer == checked["evaluated"]:
        kind = "evaluated"
    else:
        raise malformed(
            path, "answer", answer, f"must be averaged, ema or the evaluated checkpoint, {checked['evaluated']}"
        )
    if "answer_test_bleu" not in results:
        raise DataError(f"{path}: no answer_test_bleu beside answer; it is not as aiayn-train writes it")
    return kind


def corpus_of(data_cache: str | None, data: Mapping[str, Any]) -> tuple[str, str]:
    """The corpus a run was trained and tested on, and its name for a reader: its cache entry (the digest
    of the corpus's content and the vocabulary) when results.json records it, else the data section's
    corpus keys (all of them: two text corpora in one folder differ in their files); with the test split
    when the section names it."""
    splits = data.get("splits")
    split = data.get("test_split") or (splits.get("test") if isinstance(splits, Mapping) else None)
    tested = f" (test split {brief(split)})" if split is not None else ""
    if data_cache is not None:
        return data_cache + tested, data_cache + tested
    kind = str(data.get("_target_") or "?").rsplit(".", 1)[-1].removesuffix("DataModule")
    where = data.get("root") or data.get("hub") or "download"
    keys = {key: data[key] for key in CORPUS_KEYS if key in data}
    return json.dumps(keys, sort_keys=True), f"{kind} {brief(where)}{tested}"


def family_of(folder: Path, name: str) -> str | None:
    """``table3`` or ``mini`` when the run's experiment is one of their rows (Hydra's record of the
    experiment chosen, else the run's name), else None."""
    experiment = None
    if (folder / HYDRA_RECORD).exists() or (folder / HYDRA_RECORD).is_symlink():
        record = read_record(folder / HYDRA_RECORD)
        key = "hydra.runtime.choices.experiment"
        allowed = "must be an experiment's name"
        experiment = field_of(record, key, folder / HYDRA_RECORD, optional(is_text), allowed, None)
    family = str(experiment).split("/", 1)[0] if experiment else name.split("_", 1)[0]
    return family if family in FAMILIES else None


@dataclass
class Found:
    """What the paths hold: finished runs, run folders without results, sweeps' states (path -> named by
    the user), and one line for every malformed file skipped."""

    runs: list[Run]
    unfinished: list[Path]
    sweeps: dict[Path, bool]
    skipped: list[str]


def find_runs(paths: Iterable[Path]) -> Found:
    """Every finished run (a folder with ``results.json`` and ``config.yaml``) under ``paths``, once each,
    the run folders without results (failed or unfinished) and the sweeps' ``sweep.json``.

    A path is a run or sweep folder, a folder holding them, or a run's ``results.json``/``config.yaml`` or
    a sweep's ``sweep.json``. Folders are walked without following links. A malformed run found while
    walking is skipped with a warning; one the user named (its folder or file) is refused."""
    candidates: dict[Path, bool] = {}  # run folder -> named by the user, in the order found
    sweeps: dict[Path, bool] = {}
    unfinished: set[Path] = set()
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such run or sweep folder")
        # the user named it: a link given is followed, links below it are not; a run's file is read as
        # such (a link or a pipe named results.json is refused as that file)
        named_file = path.name in (RESULTS_FILE, CONFIG, STATE_FILE) and not path.is_dir()
        root = path.parent.resolve() / path.name if named_file else path.resolve()
        if named_file and root.name != STATE_FILE:
            candidates[root.parent] = True
            continue
        if named_file:  # a sweep's state: the sweep, whose folder holds it
            root = root.parent
        if not root.is_dir():
            raise ValueError(f"{path}: not a run or sweep folder, nor a {RESULTS_FILE}, {CONFIG} or {STATE_FILE}")
        found = []
        for folder, dirs, files in os.walk(root):  # followlinks=False: a link to / is not walked
            here = Path(folder)
            if RESULTS_FILE in files and (CONFIG in files or here == root):
                found.append(here)
            # Hydra writes .hydra/ when a run starts; results.json comes at the end
            elif ".hydra" in dirs and RESULTS_FILE not in files:
                unfinished.add(here)
            if STATE_FILE in files:
                sweeps[here / STATE_FILE] = sweeps.get(here / STATE_FILE, False) or here == root
            if RESULTS_FILE in files or ".hydra" in dirs:
                dirs[:] = [d for d in dirs if d not in RUN_SUBFOLDERS]
        for here in sorted(found, key=lambda f: str(f / RESULTS_FILE)):
            candidates[here] = candidates.get(here, False) or here == root
    runs, skipped = [], []
    for folder, named in candidates.items():
        try:
            runs.append(read_run(folder))
        except DataError as error:
            if named:
                raise
            skipped.append(skip(error))
    return Found(runs, sorted(unfinished - set(candidates)), sweeps, skipped)


def skip(error: Exception) -> str:
    """The warning for a malformed file found while walking, logged; returned for the report."""
    line = f"skipped: {' '.join(str(error).split())}"
    log.warning("%s", line)
    return line


def failed_trials(sweeps: Mapping[Path, bool], finished: set[Path], skipped: list[str]) -> dict[Path, str]:
    """The trials of the sweeps (their ``sweep.json``, named by the user or not) without a finished run:
    run folder -> ``trial-0003 (exit code 1...)``, or ``(running)``. The trials are read as the sweep's
    runner reads them (:func:`read_trials`), from a plain file of a bounded size; a malformed ``sweep.json``
    is skipped (a line in ``skipped``), or refused when the user named it or its folder."""
    failed = {}
    for state, named in sweeps.items():
        try:
            trials = read_trials(read_record(state, STATE_BYTES), state)
        except (DataError, SweepError) as error:
            if named:
                raise DataError(str(error)) from None
            skipped.append(skip(error))
            continue
        for trial in trials:
            where = state.parent / (trial.run_dir or trial.name)
            if trial.state != FINISHED and where not in finished:
                why = "running" if trial.state == RUNNING else " ".join(str(trial.error).split())[:200]
                failed[where] = f"{trial.name} ({why})"
    return failed


def validations(run: Run) -> list[dict[str, float]]:
    """The rows of the run's ``metrics.csv`` that hold a validation while training (``val/bleu``, and
    ``train/tokens`` where the run logged it), each with its finite numbers (and ``minutes`` of training,
    from ``train/seconds``), in step order; none when the file is missing or unreadable."""
    rows = []
    for row in metric_rows(run.folder / METRICS_CSV):
        numbers = {}
        for key, text in row.items():
            try:
                value = float(text)
            except ValueError:
                continue
            if math.isfinite(value):
                numbers[key] = value
        if "train/seconds" in numbers:
            numbers["minutes"] = numbers["train/seconds"] / 60
        if "val/bleu" in numbers and "step" in numbers:
            rows.append(numbers)
    if any("train/tokens" in row for row in rows):  # the others: the evaluated checkpoint's, after training
        rows = [row for row in rows if "train/tokens" in row]
    return sorted(rows, key=lambda row: row["step"])
