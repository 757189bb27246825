"""A Table-3-style report of finished runs: one row per setting (the runs that differ only in their seed),
with the paper's numbers beside ours where the setting is one of its rows, whether each setting's test BLEU
differs significantly from the first row's (sacreBLEU's paired bootstrap on the seeds' test translations),
and plots of BLEU and perplexity against what the settings vary (heads, d_k, positional encoding, model
size).

Run folders are shared and copied, so what they hold is read as untrusted data:

- a setting is keyed by its overrides and by what else defines a run (:class:`Conditions`: the corpus and
  its fingerprint, the direction, the precision, the checkpoint scored, the number of test sentences):
  runs that differ in any of these are never averaged together;
- every field the report reads from a ``results.json``, ``config.yaml``, ``.hydra/hydra.yaml`` or
  ``sweep.json`` is checked (type and range) and only plain files are read, never through a link; a file
  that fails is skipped with one warning line naming it and the field, or refused (:class:`DataError`)
  where the user named its run or sweep folder, or the file, directly;
- folders are walked without following links, and a run's stored ``data`` section is only read for the
  test references from the folder the user gives (``data_root``): never a stored folder, download or
  Hugging Face Hub dataset;
- nothing is written but ``report.md`` and the plots, atomically, into the output folder.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import reprlib
import stat
import statistics
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any

import yaml

from aiayn.config.naming import defining_overrides
from aiayn.data.corpus import read_lines
from aiayn.data.stored import instantiated_from_checkpoint, stored_targets
from aiayn.errors import DataError, whole
from aiayn.experiments.table3 import COLUMNS, FAMILIES, PAPER, family_rows
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
PARTIAL = "‡"  # after a test BLEU of part of the test split (data.eval_limit)
TEST_HYPOTHESES = "test.hyp.txt"  # a run's test translations, in corpus order (results.json's "evaluated")
RESULTS, CONFIG, SWEEP_STATE = "results.json", "config.yaml", "sweep.json"
HYDRA_RECORD = Path(".hydra") / "hydra.yaml"
RUN_SUBFOLDERS = {".hydra", "checkpoints", "csv", "wandb"}  # hold no runs: not walked
# A run's records are kilobytes, a sweep's state grows with its trials, test translations with the test
# split: larger files are not a run's, and are not read into memory.
RECORD_BYTES, SWEEP_BYTES, HYPOTHESES_BYTES = 1 << 20, 64 << 20, 256 << 20
EVALUATED = ("best", "final", "averaged")  # results.json's "evaluated": the checkpoint val_* and test_* are of
# A name in a record (a language, a precision, a positional encoding, a cache entry): no space, no
# separator a path or a markdown table would read, no control character.
NAME = re.compile(r"[\w.+-]{1,200}")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class Unpaired(Exception):
    """Why a setting's test translations cannot be compared with the first row's (said under the table)."""


# -- reading a run's files: every field the report uses is checked -----------------------------------

_shown = reprlib.Repr()
_shown.maxstring = _shown.maxother = 60
_shown.maxlong, _shown.maxlevel, _shown.maxlist, _shown.maxdict = 24, 2, 4, 4


def shown(value: Any) -> str:
    """A value of a record as one short line, whatever its size or nesting."""
    return _shown.repr(value)


def brief(value: Any) -> str:
    """A stored value in a label or a line of the report: text as it is (cut short, on one line), anything
    else as :func:`shown`."""
    return CONTROL.sub(" ", value[:100]) if isinstance(value, str) else shown(value)


def malformed(path: Path, key: str, value: Any, allowed: str) -> DataError:
    return DataError(f"{path}: {key}={shown(value)} {allowed}; it is not as aiayn-train writes it")


def plain_file(path: Path, limit: int) -> bytes:
    """The bytes of ``path``, a plain file of at most ``limit`` bytes: a link (it may lead anywhere), a
    pipe or device (reading may never end) and a larger file are refused with :class:`DataError`, and so is
    a file in a linked folder (``.hydra`` a link to another folder)."""
    if path.parent.is_symlink():
        raise DataError(f"{path}: {path.parent} is a link; a run's files are read only in its own folder")
    try:
        handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as error:
        why = "is a link; a run's files are read only as plain files" if path.is_symlink() else error.strerror
        raise DataError(f"{path}: {why}") from None
    try:
        status = os.fstat(handle)
        if not stat.S_ISREG(status.st_mode):
            raise DataError(f"{path}: is not a plain file")
        if status.st_size > limit:
            raise DataError(f"{path}: {status.st_size} bytes, more than the {limit} bytes such a file has")
        with os.fdopen(handle, "rb", closefd=False) as file:
            content = file.read(limit + 1)
        if len(content) > limit:
            raise DataError(f"{path}: more than the {limit} bytes such a file has")
        return content
    except OSError as error:
        raise DataError(f"{path}: cannot be read ({error.strerror})") from None
    finally:
        os.close(handle)


class _PlainYaml(yaml.SafeLoader):
    """YAML without aliases: OmegaConf and Hydra write none, and an alias can make a file of a few bytes
    a value of gigabytes once it is copied out."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise yaml.YAMLError(f"an alias (*{self.peek_event().anchor})")
        return super().compose_node(parent, index)


def read_record(path: Path, limit: int = RECORD_BYTES) -> dict[str, Any]:
    """A ``.json`` or ``.yaml`` record of a run or sweep: a mapping, or :class:`DataError` in one line."""
    content = plain_file(path, limit)
    try:
        text = content.decode("utf-8")
        record = json.loads(text) if path.suffix == ".json" else yaml.load(text, Loader=_PlainYaml)
    except (ValueError, yaml.YAMLError, RecursionError) as error:
        first = " ".join(str(error).split())[:200] or type(error).__name__
        raise DataError(f"{path}: cannot be parsed ({first})") from None
    if not isinstance(record, dict):
        raise DataError(f"{path}: holds {shown(record)}, not a mapping of fields")
    try:
        odd = next(not_plain(record, ""), None)
    except RecursionError:
        odd = ("", "nested too deeply")
    if odd is not None:
        raise DataError(f"{path}: {odd[0] or 'the file'} {odd[1]}; it is not as aiayn-train writes it")
    return record


def not_plain(value: Any, key: str) -> Iterator[tuple[str, str]]:
    """Where ``value`` holds more than JSON does (YAML dates, binary, sets, keys that are not text), which
    neither aiayn nor Hydra writes and which would trip code that compares or prints records."""
    if isinstance(value, dict):
        for name, item in value.items():
            if not isinstance(name, str):
                yield key, f"has the key {shown(name)}, not text"
            yield from not_plain(item, f"{key}.{name}" if key else str(name))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from not_plain(item, f"{key}[{index}]")
    elif value is not None and not isinstance(value, str | int | float | bool):
        yield key, f"holds a {type(value).__name__}, not a plain value"


MISSING = object()


def at(record: Mapping[str, Any], key: str, path: Path) -> Any:
    """``record``'s value at the dotted ``key``, or MISSING; a level that is not a mapping is malformed."""
    value: Any = record
    parts = key.split(".")
    for depth, part in enumerate(parts):
        if not isinstance(value, Mapping):
            raise malformed(path, ".".join(parts[:depth]), value, "must be a mapping")
        if part not in value:
            return MISSING
        value = value[part]
    return value


def field_of(
    record: Mapping[str, Any], key: str, path: Path, valid: Callable[[Any], bool], allowed: str, default: Any = MISSING
) -> Any:
    """``record``'s checked ``key``: a missing one is ``default`` (required when there is none)."""
    value = at(record, key, path)
    if value is MISSING:
        if default is MISSING:
            raise DataError(f"{path}: no {key}; it is not as aiayn-train writes it")
        return default
    if not valid(value):
        raise malformed(path, key, value, allowed)
    return value


def whole_in(low: int, high: int) -> Callable[[Any], bool]:
    return lambda value: whole(value, low) and value <= high


def number_in(low: float, high: float, diverged: bool = False) -> Callable[[Any], bool]:
    """A finite number (not a bool) from ``low`` to ``high``; with ``diverged``, also +inf and NaN (a
    diverged run's perplexity, which the report leaves out)."""

    def valid(value: Any) -> bool:
        if not isinstance(value, int | float) or isinstance(value, bool):
            return False
        if isinstance(value, float) and (math.isnan(value) or value == math.inf):
            return diverged
        return low <= value <= high

    return valid


def optional(valid: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or valid(value)


def is_name(value: Any) -> bool:
    return isinstance(value, str) and NAME.fullmatch(value) is not None


def is_text(value: Any, longest: int = 1000) -> bool:
    return isinstance(value, str) and len(value) <= longest and CONTROL.search(value) is None


def is_overrides(value: Any) -> bool:
    return isinstance(value, list) and len(value) <= 1000 and all(is_text(o) and o.strip() for o in value)


BLEU = (number_in(0, 100), "must be a BLEU score from 0 to 100")
# The fields of results.json the report reads: (key, check, what it must be, default; none: required).
RESULT_FIELDS: tuple[tuple[str, Callable[[Any], bool], str, Any], ...] = (
    ("params", whole_in(0, 10**13), "must be a whole number of parameters", MISSING),
    ("steps", whole_in(0, 10**12), "must be a whole number of steps", MISSING),
    ("val_bleu", *BLEU, MISSING),
    ("val_ppl", number_in(1, 1e30, diverged=True), "must be a perplexity (Infinity or NaN: diverged)", MISSING),
    ("test_bleu", *BLEU, None),
    ("best_val_bleu", optional(BLEU[0]), BLEU[1] + " or null", None),
    ("wall_s", number_in(0, 1e10), "must be seconds (a number of at least 0)", None),
    ("evaluated", lambda v: v in EVALUATED, f"must be one of {', '.join(EVALUATED)}", "best"),
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
    "model.positional": (is_name, "must be the name of a positional encoding"),
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
    checkpoint: str  # results.json's evaluated
    test_sentences: int | None  # the test sentences test_bleu was computed on
    corpus_name: str = field(default="", compare=False)  # the corpus for a reader

    def described(self, key: str) -> str:
        value = self.corpus_name or self.corpus if key == "corpus" else getattr(self, key)
        return "unknown" if value is None else str(value)


CONDITION_NAMES = {  # how a label and the text name each condition
    "corpus": "corpus",
    "direction": "direction",
    "precision": "precision",
    "checkpoint": "checkpoint",
    "test_sentences": "test sentences",
}
TESTED_ON = ("corpus", "direction", "test_sentences")  # the conditions a paired test needs equal


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
    conditions: Conditions = Conditions("unknown", "unknown", "unknown", "best", None)
    eval_limit: int | None = None  # data.eval_limit: the first N validation and test sentences only

    @property
    def evaluated(self) -> str:
        """Which checkpoint val_*, test_* and test.hyp.txt come from: ``best`` or ``final`` (results.json's
        ``evaluated``; runs from before it was recorded were scored on their best checkpoint)."""
        return self.conditions.checkpoint

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
        raise DataError(f"{folder / RESULTS}: no {CONFIG} beside it; it is not a run of aiayn-train")
    results = read_record(folder / RESULTS)
    checked = {key: field_of(results, key, folder / RESULTS, *check) for key, *check in RESULT_FIELDS}
    config = read_record(folder / CONFIG)
    columns = [field_of(config, key, folder / CONFIG, *COLUMN_FIELDS.get(key, ANY_COLUMN)) for _, key in COLUMNS]
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
        results=results,
        data=data,
        conditions=Conditions(
            corpus=corpus,
            direction=f"{stored['data.src_lang'] or '?'}-{stored['data.tgt_lang'] or '?'}",
            precision=str(stored["trainer.precision"] or "unknown"),
            checkpoint=checked["evaluated"],
            test_sentences=checked["test_sentences"],
            corpus_name=corpus_name,
        ),
        eval_limit=stored["data.eval_limit"],
    )


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


# -- finding runs ---------------------------------------------------------------------------------


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
        named_file = path.name in (RESULTS, CONFIG, SWEEP_STATE) and not path.is_dir()
        root = path.parent.resolve() / path.name if named_file else path.resolve()
        if named_file and root.name != SWEEP_STATE:
            candidates[root.parent] = True
            continue
        if named_file:  # a sweep's state: the sweep, whose folder holds it
            root = root.parent
        if not root.is_dir():
            raise ValueError(f"{path}: not a run or sweep folder, nor a {RESULTS}, {CONFIG} or {SWEEP_STATE}")
        found = []
        for folder, dirs, files in os.walk(root):  # followlinks=False: a link to / is not walked
            here = Path(folder)
            if RESULTS in files and (CONFIG in files or here == root):
                found.append(here)
            # Hydra writes .hydra/ when a run starts; results.json comes at the end
            elif ".hydra" in dirs and RESULTS not in files:
                unfinished.add(here)
            if SWEEP_STATE in files:
                sweeps[here / SWEEP_STATE] = sweeps.get(here / SWEEP_STATE, False) or here == root
            if RESULTS in files or ".hydra" in dirs:
                dirs[:] = [d for d in dirs if d not in RUN_SUBFOLDERS]
        for here in sorted(found, key=lambda f: str(f / RESULTS)):
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


@dataclass
class Trial:
    """A sweep's trial, as the report reads ``sweep.json``."""

    number: int
    state: str
    run_dir: str | None
    error: str | None


TRIAL_FIELDS: tuple[tuple[str, Callable[[Any], bool], str, Any], ...] = (
    ("number", whole_in(0, 10**9), "must be a trial's whole number", MISSING),
    ("state", is_name, "must be a trial's state", "unknown"),
    ("run_dir", optional(lambda v: inside_folder(v) and is_text(v)), "must be a folder inside the sweep's", None),
    ("error", optional(lambda v: isinstance(v, str)), "must be a message", None),
)


def inside_folder(value: Any) -> bool:
    """A relative path that stays below the folder it is relative to: no ``..``, no root, no home, no
    protocol (``local://``, ``s3://``)."""
    if not isinstance(value, str) or not value or "://" in value or value.startswith("~"):
        return False
    parts = PurePath(value).parts
    return not PurePath(value).is_absolute() and ".." not in parts and bool(parts)


def read_sweep(path: Path) -> list[Trial]:
    """The trials of ``sweep.json``, every field the report uses checked."""
    trials = field_of(read_record(path, SWEEP_BYTES), "trials", path, lambda v: isinstance(v, list), "must be a list")
    read = []
    for index, trial in enumerate(trials):
        if not isinstance(trial, dict):
            raise malformed(path, f"trials[{index}]", trial, "must be a mapping")
        values = {key: field_of(trial, key, path, *check) for key, *check in TRIAL_FIELDS}
        read.append(Trial(**values))
    return read


def failed_trials(sweeps: Mapping[Path, bool], finished: set[Path], skipped: list[str]) -> dict[Path, str]:
    """The trials of the sweeps (their ``sweep.json``, named by the user or not) without a finished run:
    run folder -> ``trial-0003 (exit code 1...)``, or ``(running)``. A malformed ``sweep.json`` is skipped
    (a line in ``skipped``), or refused when the user named it or its folder."""
    failed = {}
    for state, named in sweeps.items():
        try:
            trials = read_sweep(state)
        except DataError as error:
            if named:
                raise
            skipped.append(skip(error))
            continue
        for trial in trials:
            where = state.parent / (trial.run_dir or f"trial-{trial.number}")
            if trial.state != "finished" and where not in finished:
                why = "running" if trial.state == "running" else " ".join(str(trial.error).split())[:200]
                failed[where] = f"trial-{trial.number:04d} ({why})"
    return failed


# -- settings -------------------------------------------------------------------------------------


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
        """``mean ± std`` over seeds (the sample standard deviation), ``mean`` for one run, ``-`` for none."""
        values = self.values(key)
        if not values:
            return "-"
        if len(values) == 1:
            return f"{values[0]:.2f}"
        return f"{statistics.fmean(values):.2f} ± {statistics.stdev(values):.2f}"

    def evaluated(self) -> str:
        """The checkpoint the runs' numbers come from: ``best`` or ``final`` (all runs of a setting share it)."""
        return self.conditions.checkpoint

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
    """Runs grouped by their overrides without the seed and by their :class:`Conditions`: runs that differ
    in either are never merged. A setting's label leaves out the overrides all runs share (a sweep's fixed
    arguments) and adds the conditions that differ between settings. Settings that are Table 3 rows get
    the row's name."""
    shared = set.intersection(*(set(run.overrides) for run in runs)) if runs else set()
    settings: dict[tuple[tuple[str, ...], Conditions], Setting] = {}
    for run in runs:  # in the order found: the table's order after the paper's rows
        own = tuple(o for o in run.overrides if o not in shared)
        key = (own, run.conditions)
        setting = settings.setdefault(key, Setting(" ".join(own) or "(as configured)", run.columns, run.conditions))
        same = next((other for other in setting.runs if run.seed is not None and other.seed == run.seed), None)
        if same is None:
            setting.runs.append(run)
            continue
        # one run per seed (two sweeps may both hold base; a seed may be proposed twice): the newest
        newer, older = sorted((run, same), key=lambda r: (r.folder / RESULTS).stat().st_mtime, reverse=True)
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
    shows them); the checkpoint and test sentences (columns show them) where two labels would be alike;
    a number where they still are."""
    differ = varying(settings)
    always = [key for key in differ if key not in ("checkpoint", "test_sentences")]
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
    """The reference setting first (the one that is Table 3's base row, else the first found), then
    Table 3's rows in the paper's order, then the rest as found."""
    base = next((s for s in settings if s.paper_row == "base"), settings[0])
    rows = sorted(
        (s for s in settings if s is not base), key=lambda s: ROW_ORDER.get(s.paper_row or "", len(ROW_ORDER))
    )
    return [base, *rows]


# -- paired tests ---------------------------------------------------------------------------------


class RunTexts:
    """The runs' test hypotheses and references, each corpus read once, from ``data_root`` only: the
    folder the user gave; without it, no references are read."""

    def __init__(self, data_root: Path | None = None) -> None:
        self.data_root = data_root
        self._references: dict[str, list[str] | str] = {}  # by data section: the references, or why none

    @staticmethod
    def hypotheses(run: Run) -> list[str]:
        path = run.folder / TEST_HYPOTHESES
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

    def references(self, run: Run) -> list[str]:
        if self.data_root is None:
            raise Unpaired("the test references are read only from the corpus folder given with --data-root")
        key = json.dumps([run.data, run.eval_limit, run.conditions.test_sentences], sort_keys=True, default=str)
        if key not in self._references:
            try:
                self._references[key] = tested_references(run, self.data_root)
            # Any failure (no such file, a config of another aiayn, a library missing) leaves the report
            # without this p-value, never without the report.
            except Exception as error:
                message = " ".join(str(error).split()) or type(error).__name__
                self._references[key] = f"the test references of {run.folder} cannot be read ({message})"
        found = self._references[key]
        if isinstance(found, str):
            raise Unpaired(found)
        return found


def reading_classes() -> dict[str, type]:
    """The data modules whose test split the report reads, by the names a stored ``_target_`` gives them."""
    from aiayn.data.datamodule import Multi30kDataModule, TextDataModule, WMT14DataModule

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


def tested_references(run: Run, data_root: Path) -> list[str]:
    """The references ``run``'s ``test.hyp.txt`` was scored against: the test split of its corpus, read
    from ``data_root`` (:func:`readable_section`), built only from aiayn's own classes (as aiayn-eval
    builds a checkpoint's), cut to the run's ``eval_limit`` as its training cut it."""
    if "_target_" not in run.data:
        raise Unpaired(f"{run.folder / CONFIG} has no data section")
    section = readable_section(run, data_root)
    datamodule = instantiated_from_checkpoint(section, "data", run.folder / CONFIG, root=data_root)
    references = datamodule.split_texts("test")[1]
    references = references[: datamodule.eval_limit] if datamodule.eval_limit else references
    tested = run.conditions.test_sentences
    if tested is not None and tested != len(references):
        raise Unpaired(f"{len(references)} test references in {data_root}, {run.folder / RESULTS} scored {tested}")
    return references


def paired_p_value(base: Setting, setting: Setting, texts: RunTexts) -> float | str:
    """The p-value of sacreBLEU's paired bootstrap of ``setting``'s test BLEU against ``base``'s, or why
    there is none. Runs are paired by seed (the seeds both settings have); each setting's test
    hypotheses of those seeds are concatenated in seed order and scored against the test references,
    repeated once per seed, so every seed's translations count and each sentence is paired with the
    same seed's translation of it. Settings tested on another corpus, direction or number of test
    sentences are not compared."""
    for key in TESTED_ON:
        ours, theirs = base.conditions.described(key), setting.conditions.described(key)
        if ours != theirs:
            return f"tested with {CONDITION_NAMES[key]} {theirs}, the first row with {CONDITION_NAMES[key]} {ours}"
    firsts = {run.seed: run for run in base.runs if run.seed is not None}
    pairs = sorted(((r.seed, firsts[r.seed], r) for r in setting.runs if r.seed in firsts), key=lambda p: p[0])
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


def significance(settings: Sequence[Setting], data_root: Path | None = None) -> dict[str, float | str]:
    """For each setting after the first (:func:`ordered`), by label: :func:`paired_p_value` against the
    first, with the test references read from ``data_root``."""
    base, *others = ordered(settings)
    texts = RunTexts(data_root)
    return {setting.label: paired_p_value(base, setting, texts) for setting in others}


def p_cell(value: float | str | None) -> str:
    """A ``p (test)`` cell: blank for the first row, ``-`` without a test, else the p-value (marked when
    significant)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return "-"
    return f"{value:.4f}{SIGNIFICANT if value < SIGNIFICANCE_LEVEL else ''}"


# -- the table and the plots ----------------------------------------------------------------------


def scored_on_final(settings: Sequence[Setting]) -> bool:
    """Whether any run's numbers come from its final checkpoint (then the best validation BLEU is shown too)."""
    return any(run.evaluated == "final" for setting in settings for run in setting.runs)


def cell(value: Any) -> str:
    """A markdown table cell: ``|`` escaped (an override may hold one)."""
    return str(value).replace("|", "\\|")


def markdown_table(settings: Sequence[Setting], p_values: Mapping[str, float | str] | None = None) -> str:
    """Table 3's layout (rows :func:`ordered`): the changed values (blank where as the first row), params,
    the checkpoint scored, PPL and BLEU (mean ± std over seeds; with the best validation BLEU when a run is
    scored on its final checkpoint), the test sentences the test BLEU is of (:data:`PARTIAL` after a test
    BLEU of part of the split), the p-value of the test BLEU against the first row's
    (:func:`significance`), steps and wall time; the paper's PPL and BLEU where the setting is its row."""
    base, *_ = settings = ordered(settings)
    p_values = p_values or {}
    best = scored_on_final(settings)
    headings = [
        "setting", *(h for h, _ in COLUMNS), "params ×10⁶", "seeds", "steps", "checkpoint", "PPL (val)",
        "BLEU (val)", *(["BLEU (val, best)"] if best else []), "BLEU (test)", "test sentences", "p (test)",
        "minutes", "paper row", "paper PPL", "paper BLEU", "paper params ×10⁶",
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
        test_bleu = setting.spread("test_bleu")
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
            f"{test_bleu} {PARTIAL}" if setting.partial_test and test_bleu != "-" else test_bleu,
            setting.test_sentences(),
            p_cell(None if setting is base else p_values.get(setting.label, "not tested")),
            f"{wall / 60:.1f}" if wall is not None else "-",
            setting.paper_row or "",
            f"{paper.ppl:.2f}" if paper else "",
            f"{paper.bleu:.1f}" if paper else "",
            f"{paper.params_millions or PAPER['base'].params_millions:g}" if paper else "",  # blank: as base
        ]
        lines.append("| " + " | ".join(map(cell, cells)) + " |")
    return "\n".join(lines)


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


def plot(settings: Sequence[Setting], folder: Path) -> list[Path]:
    """``bleu_ppl_vs_<axis>.png`` for every axis the settings vary along: validation BLEU and perplexity,
    mean with the standard deviation over seeds as error bars. Written atomically: a link of that name
    in a shared folder is replaced, not followed."""
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


# -- the report -----------------------------------------------------------------------------------


def write_report(paths: Sequence[Path], output: Path, data_root: Path | None = None) -> tuple[str, list[Path]]:
    """Write ``report.md`` and the plots into ``output`` (nothing else, nowhere else); returns the markdown
    and the plot files. The test references of the paired tests are read from ``data_root`` only."""
    found = find_runs(paths)
    if not found.runs:
        raise ValueError(f"no finished run (a folder with results.json) under {', '.join(map(str, paths))}")
    failed = failed_trials(found.sweeps, {run.folder for run in found.runs}, found.skipped)
    settings = group_settings(found.runs)
    if output.exists() and not output.is_dir():
        raise ValueError(f"{output}: not a folder; give --out <folder> for report.md and the plots")
    output.mkdir(parents=True, exist_ok=True)
    plots = plot(settings, output)
    p_values = significance(settings, data_root)
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
        "(Table 3 uses newstest2013) and BLEU on the test split, from the checkpoint named in the checkpoint column "
        "(best: the best by validation; final: the last of training), beam search, no averaging; mean ± sample "
        f"std over seeds.{best} Blank: as the first row. Paper: Vaswani et al. (2017) Table 3 (WMT14 En-De, "
        "tokenized BLEU).",
        "",
        "A setting's runs differ only in their seed: runs of another corpus, direction, precision, checkpoint "
        "or number of test sentences are other settings (in brackets after the setting where settings differ)."
        + (f" Every row: {'; '.join(same)}." if same else ""),
        f"test sentences: how many the test BLEU is of (results.json's test_sentences; ?: not recorded). "
        f"first N and {PARTIAL}: only the first N sentences of the test split (data.eval_limit), not "
        "comparable with a score on the whole split.",
        "",
        f"p (test): sacreBLEU's paired bootstrap resampling ({BOOTSTRAP_SAMPLES} resamples, seed "
        f"{seed if seed is not None else 'unfixed'}) of the setting's test BLEU against the first row's. Runs are "
        f"paired by seed (the seeds both settings have): each setting's {TEST_HYPOTHESES} of those seeds are "
        "concatenated in seed order and scored against the test references repeated as many times; the "
        "references are read from the corpus folder given with --data-root, never from where a run's config "
        f"says. {SIGNIFICANT}: p < {SIGNIFICANCE_LEVEL}, a difference chance alone rarely makes; p ≥ "
        f"{SIGNIFICANCE_LEVEL} means not significant: the difference may be chance. -: no test, for the reason "
        "below the table.",
        "",
        markdown_table(settings, p_values),
    ]
    unpaired = {label: why for label, why in p_values.items() if isinstance(why, str)}
    if unpaired:
        text += ["", *(f"p (test) of {label}: -, {why}." for label, why in unpaired.items())]
    others = [folder for folder in found.unfinished if folder not in failed]
    if failed or others or found.skipped:
        text += ["", f"Not in the table: {len(failed)} unfinished trial(s) {', '.join(failed.values())}; "
                 f"{len(others)} other run folder(s) without results; {len(found.skipped)} malformed file(s)"
                 " skipped."]  # fmt: skip
        text += [f"- {line}" for line in found.skipped]
    text += ["", *(f"![{p.stem}]({p.name})" for p in plots)]
    markdown = "\n".join(text) + "\n"
    atomic_write(output / "report.md", markdown)
    return markdown, plots
