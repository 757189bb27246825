"""aiayn-report over run folders it did not make (issue 26, item 6 and the property for reports): runs that
differ in what defines them are never averaged together, a partial test set is shown as one, a malformed
results.json, config.yaml, hydra.yaml or sweep.json is skipped with one warning line (or refused in one
line where the user named it), a stored data section is never read from where it says, and nothing is
written outside the output folder. Every run here is a copy of the session's smoke run's small files,
with fields changed: nothing is trained."""

from __future__ import annotations

import csv
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import aiayn
from aiayn.cli import report as report_cli
from aiayn.experiments.report.document import write_report
from aiayn.experiments.report.plots import validations
from aiayn.experiments.report.runs import RESULT_FIELDS, find_runs
from aiayn.experiments.report.settings import group_settings
from aiayn.experiments.results import ANSWERS, RESULTS_FILE
from aiayn.experiments.run_info import SOFTWARE, software_versions
from aiayn.training.metrics import EVALUATED_CHECKPOINTS


class _Removed:
    def __repr__(self) -> str:
        return "removed"  # the same in every pytest-xdist worker, which must collect the same test ids


DELETE = _Removed()  # a field removed from a record
FILES = ("config.yaml", "results.json", "test.hyp.txt", ".hydra/hydra.yaml")
TESTED = "test.*.hyp.txt"  # the other tested checkpoints' translations (test.ema.hyp.txt), which the answer's may be


def put(record: dict[str, Any], key: str, value: Any) -> None:
    """``record`` with ``value`` at the dotted ``key`` (removed for DELETE)."""
    *parents, last = key.split(".")
    for part in parents:
        record = record[part]
    if value is DELETE:
        record.pop(last, None)
    else:
        record[last] = value


def copied_run(
    smoke: Path,
    folder: Path,
    seed: int,
    bleu: float = 10.0,
    overrides: tuple[str, ...] = (),
    results: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
) -> Path:
    """The smoke run's files in ``folder`` as the run of ``seed`` with validation BLEU ``bleu`` and more
    ``overrides``, its ``results`` and ``config`` fields (dotted keys) changed."""
    for name in [*FILES, *(path.name for path in smoke.glob(TESTED))]:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(smoke / name, folder / name)
    stored = yaml.safe_load((folder / "config.yaml").read_text())
    for key, value in {"seed": seed, **(config or {})}.items():
        put(stored, key, value)
    (folder / "config.yaml").write_text(yaml.safe_dump(stored))
    record = json.loads((folder / "results.json").read_text())
    record["overrides"] = [*record["overrides"], *overrides, f"seed={seed}"]
    for key, value in {"val_bleu": bleu, **(results or {})}.items():
        put(record, key, value)
    (folder / "results.json").write_text(json.dumps(record))
    return folder


def table_rows(markdown: str) -> dict[str, dict[str, str]]:
    """The report's table: setting -> heading -> cell."""
    header, *rows = ([cell.strip() for cell in line.strip("|").split(" | ")]
                        for line in markdown.splitlines() if line.startswith("| "))  # fmt: skip
    return {row[0]: dict(zip(header, row, strict=True)) for row in rows}


REPORT_LOGGER = "aiayn.experiments.report"  # the report's modules log below it


def report(argv: list[Any], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """aiayn-report in this process: its exit status, stdout and stderr."""
    try:
        report_cli.main([str(arg) for arg in argv])
        status = 0
    except SystemExit as stopped:
        status = int(stopped.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


# -- 1. what defines a run keys a setting ------------------------------------------------------------

CONDITIONS = {  # name -> (the first seed's changes, the second seed's): (results fields, config fields)
    # without results.json's data_cache (older runs): the stored data section tells corpora apart
    "corpus": (({"data_cache": DELETE}, {}), ({"data_cache": DELETE}, {"data.root": "/elsewhere/corpus"})),
    "corpus fingerprint": (
        ({"data_cache": "multi30k-de-en-bpe1000-aaaaaaaaaaaa"}, {}),
        ({"data_cache": "multi30k-de-en-bpe1000-bbbbbbbbbbbb"}, {}),
    ),
    "direction": (({}, {}), ({}, {"data.src_lang": "de", "data.tgt_lang": "en"})),
    "precision": (({}, {}), ({}, {"trainer.precision": "bf16-mixed"})),
    "checkpoint": (({"evaluated": "best", "answer": "ema"}, {}), ({"evaluated": "final", "answer": "ema"}, {})),
    "answer": (
        ({"evaluated": "best", "answer": "best"}, {"checkpoint.answer": "evaluated"}),
        ({"evaluated": "best", "answer": "ema"}, {"checkpoint.answer": "ema"}),
    ),
    # one answer given by two rules: the EMA always, and the EMA as validation chose it
    "answer, by rule": (
        ({"evaluated": "best", "answer": "ema"}, {"checkpoint.answer": "ema"}),
        ({"evaluated": "best", "answer": "ema"}, {"checkpoint.answer": "by_validation"}),
    ),
    "test sentences": (({"test_sentences": 16}, {}), ({"test_sentences": 8}, {})),
    "test sentences, one unknown": (({"test_sentences": 16}, {}), ({"test_sentences": DELETE}, {})),
}


@pytest.mark.parametrize("condition", CONDITIONS)
def test_runs_that_differ_in_what_defines_a_run_are_never_averaged(
    condition: str, smoke_run_dir: Path, tmp_path: Path
) -> None:
    for seed, ((results, config), bleu) in enumerate(zip(CONDITIONS[condition], (10.0, 30.0), strict=True), 1):
        copied_run(smoke_run_dir, tmp_path / "runs" / f"seed{seed}", seed, bleu, results=results, config=config)
    markdown = write_report([tmp_path / "runs"], tmp_path / "out").markdown
    rows = table_rows(markdown)
    assert len(rows) == 2, markdown  # never "20.00 ± 14.14" over both
    assert sorted(row["BLEU (val)"] for row in rows.values()) == ["10.00", "30.00"]
    assert all(row["seeds"] == "1" for row in rows.values())
    assert all(f"[{condition.split(',')[0].replace(' fingerprint', '')}=" in label for label in rows)  # told apart

    # alike, they are one setting of two seeds
    for seed, bleu in ((1, 10.0), (2, 30.0)):
        results, config = CONDITIONS[condition][0]
        copied_run(smoke_run_dir, tmp_path / "alike" / f"seed{seed}", seed, bleu, results=results, config=config)
    ((label, row),) = table_rows(write_report([tmp_path / "alike"], tmp_path / "out").markdown).items()
    assert row["seeds"] == "2" and row["BLEU (val)"] == "20.00 ± 14.14" and "[" not in label


def test_runs_of_the_same_overrides_but_another_model_are_never_averaged(smoke_run_dir: Path, tmp_path: Path) -> None:
    # Both ran `aiayn-train` on its defaults, once before the default dropout changed and once after.
    for seed, dropout, bleu in ((1, 0.1, 10.0), (1, 0.3, 30.0), (2, 0.3, 20.0)):
        copied_run(
            smoke_run_dir, tmp_path / "runs" / f"p{dropout}-s{seed}", seed, bleu, config={"model.dropout": dropout}
        )
    rows = table_rows(write_report([tmp_path / "runs"], tmp_path / "out").markdown)
    by_dropout = {row["P_drop"]: (row["seeds"], row["BLEU (val)"]) for row in rows.values()}
    assert by_dropout == {"0.1": ("1", "10.00"), "0.3": ("2", "25.00 ± 7.07")}, rows


@pytest.mark.parametrize(
    ("eval_limit", "test_sentences", "cell", "partial"),
    [
        (16, 16, "first 16", True),
        (16, None, "first ≤16", True),
        (None, 100, "100", False),
        (None, None, "?", False),
        (200, 100, "100", False),
    ],
)
def test_a_test_bleu_of_part_of_the_test_split_says_so(
    eval_limit: int | None,
    test_sentences: int | None,
    cell: str,
    partial: bool,
    smoke_run_dir: Path,
    tmp_path: Path,
) -> None:
    results = {"test_sentences": DELETE if test_sentences is None else test_sentences}
    copied_run(smoke_run_dir, tmp_path / "run", 1, results=results, config={"data.eval_limit": eval_limit})
    markdown = write_report([tmp_path / "run"], tmp_path / "out").markdown
    (row,) = table_rows(markdown).values()
    assert row["test sentences"] == cell
    assert row["BLEU (test)"].endswith(" ‡") is partial
    assert "only the first N sentences of the test split (data.eval_limit)" in markdown


# -- 2. malformed files: skipped while walking, refused when named ---------------------------------

NAN, INF = float("nan"), float("inf")
BAD_VALUES = [  # (file, dotted field, hostile value)
    *(("results.json", "val_bleu", v) for v in ("abc", NAN, 1e308, -5, [1], {"a": 1}, None, True)),
    *(("results.json", "val_ppl", v) for v in (-1.0, 1e300, "inf", -INF)),
    ("results.json", "params", 10**400),
    ("results.json", "params", 1.5),
    ("results.json", "steps", {"a": 1}),
    ("results.json", "wall_s", INF),
    ("results.json", "test_bleu", "NaN"),
    ("results.json", "best_val_bleu", [20.0]),
    ("results.json", "overrides", "seed=1"),
    ("results.json", "overrides", [1, 2]),
    ("results.json", "overrides", ["model.d_ff=1\n| forged | row |"]),
    ("results.json", "test_sentences", -1),
    ("results.json", "test_sentences", 0.5),
    ("results.json", "evaluated", "../../x"),
    ("results.json", "answer", "evaluated"),  # aiayn-train names the evaluated checkpoint: best or final
    ("results.json", "answer", "final"),  # not the evaluated one (best)
    ("results.json", "answer", ["ema"]),
    ("results.json", "answer_test_bleu", 101.0),
    ("results.json", "answer_test_bleu", DELETE),
    ("results.json", "data_cache", "local://x"),
    ("results.json", "data_cache", "../cache"),
    ("results.json", "val_bleu", DELETE),
    ("results.json", "overrides", DELETE),
    ("config.yaml", "seed", "one"),
    ("config.yaml", "seed", 1.5),
    ("config.yaml", "model.d_model", -1),
    ("config.yaml", "model.n_heads", "8"),
    ("config.yaml", "model.d_k", 10**30),
    ("config.yaml", "model", [1, 2]),
    ("config.yaml", "model.dropout", NAN),
    ("config.yaml", "model.positional", "a | b"),
    ("config.yaml", "model.d_k", DELETE),
    ("config.yaml", "optim.label_smoothing", 2),
    ("config.yaml", "data", "local://corpus"),
    ("config.yaml", "data.src_lang", ["en"]),
    ("config.yaml", "data.eval_limit", -3),
    ("config.yaml", "trainer.precision", [16]),
    ("config.yaml", "trainer", "gpu"),
    ("config.yaml", "name", 5),
    (".hydra/hydra.yaml", "hydra.runtime.choices.experiment", [1]),
    (".hydra/hydra.yaml", "hydra.runtime", "x"),
]
ALIASES = "a: &a [x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\nc: [*b, *b, *b, *b, *b, *b]\n"
BAD_FILES = [  # (file, its whole content, what the one line says)
    ("results.json", "{not json", "cannot be parsed"),
    ("results.json", "[]", "not a mapping"),
    ("results.json", "[" * 100_000 + "]" * 100_000, "cannot be parsed"),
    ("results.json", b"\xff\xfe{}", "cannot be parsed"),
    ("results.json", "", "cannot be parsed"),
    ("config.yaml", ALIASES, "alias"),
    ("config.yaml", "seed: 2024-01-01\n", "seed holds a date"),
    ("config.yaml", "{1: 2}\n", "not text"),
    ("config.yaml", "", "not a mapping"),
    ("config.yaml", "model: !!python/object:os.system {}\n", "cannot be parsed"),
    (".hydra/hydra.yaml", "hydra: [\n", "cannot be parsed"),
]


def hostile_value(folder: Path, file: str, key: str, value: Any) -> None:
    path = folder / file
    record = json.loads(path.read_text()) if file.endswith(".json") else yaml.safe_load(path.read_text())
    put(record, key, value)
    path.write_text(json.dumps(record) if file.endswith(".json") else yaml.safe_dump(record))


def hostile_file(folder: Path, file: str, content: str | bytes) -> None:
    path = folder / file
    path.write_bytes(content if isinstance(content, bytes) else content.encode())


def linked_results(folder: Path) -> None:  # results.json a link to a file outside the run
    outside = folder.parent.parent / "outside.json"
    shutil.move(folder / "results.json", outside)
    (folder / "results.json").symlink_to(outside)


def linked_hydra(folder: Path) -> None:  # .hydra a link to a folder outside the run
    outside = folder.parent.parent / "outside-hydra"
    shutil.move(folder / ".hydra", outside)
    (folder / ".hydra").symlink_to(outside)


def piped_results(folder: Path) -> None:  # a pipe: reading it would wait forever
    (folder / "results.json").unlink()
    os.mkfifo(folder / "results.json")


def no_config(folder: Path) -> None:
    (folder / "config.yaml").unlink()


SPECIAL = {
    "results.json a link": (linked_results, "results.json", "is a link"),
    ".hydra a link": (linked_hydra, ".hydra/hydra.yaml", "is a link"),
    "results.json a pipe": (piped_results, "results.json", "not a plain file"),
}
CASES = {
    **{f"{file}:{key}={value!r}"[:80]: (lambda f, a=(file, key, value): hostile_value(f, *a), file, key)
       for file, key, value in BAD_VALUES},
    **{f"{file}:{content[:20]!r}": (lambda f, a=(file, content): hostile_file(f, *a), file, says)
       for file, content, says in BAD_FILES},
    **SPECIAL,
}  # fmt: skip


@pytest.fixture
def shared(smoke_run_dir: Path, tmp_path: Path) -> Path:
    """A folder of someone else's: a sweep of a good run (seed 1) and another (seed 2) to spoil."""
    copied_run(smoke_run_dir, tmp_path / "shared" / "sweep" / "good", 1)
    copied_run(smoke_run_dir, tmp_path / "shared" / "sweep" / "bad", 2)
    return tmp_path / "shared"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_a_malformed_run_is_skipped_in_one_line_or_refused_where_named(
    case: str, shared: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    spoil, file, says = CASES[case]
    bad = shared / "sweep" / "bad"
    spoil(bad)
    caplog.set_level(logging.WARNING, REPORT_LOGGER)
    status, out, err = report([shared, "--out", tmp_path / "out"], capsys)
    (warning,) = [r.getMessage() for r in caplog.records if r.name.startswith(REPORT_LOGGER)]
    assert status == 0 and err == f"aiayn-report: warning: {warning}\n", err  # one line
    assert "\n" not in warning and f"{bad.resolve() / file}: " in warning and says in warning, warning
    (row,) = table_rows(out).values()
    assert row["seeds"] == "1" and "1 malformed file(s) skipped" in out
    # named directly (its folder, or its results.json), the run is refused in one line
    for named in (bad, bad / "results.json"):
        status, out, err = report([named, "--out", tmp_path / "named"], capsys)
        assert status == 2 and out == "" and len(err.splitlines()) == 1, err
        assert err.startswith(f"aiayn-report: error: {bad.resolve() / file}: ") and says in err, err
    assert not (tmp_path / "named").exists()  # refused before anything was written


def test_a_folder_without_config_named_directly_is_refused(
    shared: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = shared / "sweep" / "bad"
    no_config(bad)
    status, out, _ = report([shared, "--out", tmp_path / "out"], capsys)
    assert status == 0 and table_rows(out)  # a results.json alone is not a run: passed over
    status, _, err = report([bad], capsys)
    assert status == 2 and err == f"aiayn-report: error: {bad.resolve() / 'results.json'}: no config.yaml beside it; " \
        "it is not a run of aiayn-train\n"  # fmt: skip


TRIAL = {"number": 1, "params": {"seed": 2}, "state": "failed", "run_dir": "bad"}  # as aiayn-sweep writes it
SWEEPS = [  # (sweep.json's content, what the one line says): read as aiayn-sweep reads it
    ("{", "cannot be parsed"),
    ({}, "unreadable sweep state ('trials')"),
    ({"trials": "x"}, "must be a mapping, not str"),
    ({"trials": [5]}, "must be a mapping, not int"),
    ({"trials": [{"number": 1}]}, "missing 1 required positional argument: 'params'"),
    ({"trials": [{**TRIAL, "number": "1"}]}, "a trial's number 1 is not a whole number"),
    ({"trials": [{**TRIAL, "number": -1}]}, "number -1 is not a whole number"),
    ({"trials": [{**TRIAL, "run_dir": "../../etc"}]}, "run_dir '../../etc' is not a folder inside the sweep's"),
    ({"trials": [{**TRIAL, "run_dir": "local://x"}]}, "run_dir 'local://x' is not a folder inside the sweep's"),
    ({"trials": [{**TRIAL, "run_dir": "/home"}]}, "run_dir '/home' is not a folder inside the sweep's"),
    ({"trials": [{**TRIAL, "run_dir": "a\x00b"}]}, "run_dir 'a\\x00b' is not a folder inside the sweep's"),
    ({"trials": [{**TRIAL, "state": ["failed"]}]}, "state=['failed'] is not what aiayn-sweep writes there"),
    ({"trials": [{**TRIAL, "error": {"x": 1}}]}, "error={'x': 1} is not what aiayn-sweep writes there"),
]


@pytest.mark.parametrize(("content", "says"), SWEEPS)
def test_a_malformed_sweep_json_is_skipped_in_one_line_or_refused_where_named(
    content: Any,
    says: str,
    shared: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = shared / "sweep" / "sweep.json"
    state.write_text(content if isinstance(content, str) else json.dumps(content))
    caplog.set_level(logging.WARNING, REPORT_LOGGER)
    status, out, err = report([shared, "--out", tmp_path / "out"], capsys)
    (warning,) = [r.getMessage() for r in caplog.records if r.name.startswith(REPORT_LOGGER)]
    assert status == 0 and err == f"aiayn-report: warning: {warning}\n", err
    assert warning.startswith(f"skipped: {state.resolve()}: ") and says in warning, warning
    assert len(table_rows(out)) == 1  # both runs, one setting of two seeds
    for named in (state.parent, state):
        status, _, err = report([named, "--out", tmp_path / "out"], capsys)
        assert status == 2 and len(err.splitlines()) == 1 and f"{state.resolve()}: " in err and says in err, err


def test_links_in_a_shared_folder_are_not_walked(
    shared: Path, smoke_run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    elsewhere = copied_run(smoke_run_dir, tmp_path / "elsewhere" / "run", 3, bleu=99.0)
    (shared / "sweep" / "link").symlink_to(elsewhere.parent, target_is_directory=True)
    (shared / "sweep" / "root").symlink_to("/", target_is_directory=True)
    status, out, _ = report([shared, "--out", tmp_path / "out"], capsys)
    (row,) = table_rows(out).values()
    assert status == 0 and row["seeds"] == "2" and "99.00" not in out


# -- 3. a stored data section is a description, never a place to read ------------------------------

_opened: list[str] | None = None  # while a test watches: every file and folder this process opens


def _audit(event: str, args: tuple[Any, ...]) -> None:
    watched = _opened is not None and event in ("open", "os.listdir", "os.scandir") and args
    if watched and isinstance(args[0], str | bytes | os.PathLike):
        _opened.append(os.fsdecode(args[0]))


@pytest.fixture(scope="session")
def _audit_hook() -> None:
    sys.addaudithook(_audit)  # for good: Python has no way to remove one; it records only while watched


@pytest.fixture
def opened(_audit_hook: None) -> Iterator[list[str]]:
    """The paths this process opens while the test runs."""
    global _opened
    _opened = []
    try:
        yield _opened
    finally:
        _opened = None


TEXT = {"_target_": "aiayn.data.TextDataModule", "src_lang": "en", "tgt_lang": "de", "train": ["train.en", "train.de"],
        "val": ["val.en", "val.de"], "test": ["test_2016_flickr.en", "test_2016_flickr.de"]}  # fmt: skip
SECTIONS = {  # stored data section (changes of the smoke run's) -> what the one line says; None: read from data_root
    "Multi30k, stored root elsewhere": ({}, None),
    "a download's cache elsewhere": ({"root": None, "cache_dir": "{stored}/cache"}, None),
    "text files, stored root elsewhere": ({**TEXT, "root": "{stored}"}, None),
    "not a data module": ({"_target_": "os.system"}, "data._target_='os.system' is not a corpus the report reads"),
    "a nested corpus": ({"corpus": {"_target_": "aiayn.data.corpus.Multi30k", "root": "{stored}"}}, "data.corpus."),
    "the Hub": ({"_target_": "aiayn.data.WMT14DataModule", "root": None, "hub": "wmt/wmt14", "config": "de-en"},
                "is not a save_to_disk copy"),
    "absolute text files": ({**TEXT, "test": ["{stored}/test_2016_flickr.en", "/etc/hostname"]}, "inside --data-root"),
    "text files above the root": ({**TEXT, "test": ["../test_2016_flickr.en", "x.de"]}, "inside --data-root"),
    "a protocol": ({**TEXT, "test": ["local://test_2016_flickr.en", "x.de"]}, "inside --data-root"),
    "a string for a pair": ({**TEXT, "train": "train.en"}, "data.train='train.en' does not name two files"),
    "a list for a split": ({"val_split": ["val"]}, "cannot be read"),
    "a mapping for a split": ({"test_split": {"a": 1}}, "cannot be read"),
    "no such split": ({"test_split": "test_2099"}, "cannot be read"),
}  # fmt: skip


@pytest.mark.parametrize("section", SECTIONS)
def test_test_references_are_read_only_from_the_data_root_the_user_gives(
    section: str, smoke_run_dir: Path, corpus_root: Path, tmp_path: Path, opened: list[str]
) -> None:
    stored = tmp_path / "stored"  # where the runs' configs say their corpus is: a sentinel
    shutil.copytree(corpus_root, stored)
    (stored / "test_2016_flickr.de").write_text("not\nthe\nreferences\n")
    before = sorted(str(p) for p in stored.rglob("*"))
    changes, says = SECTIONS[section]
    data = yaml.safe_load((smoke_run_dir / "config.yaml").read_text())["data"]
    data = {**data, "root": str(stored), **json.loads(json.dumps(changes).replace("{stored}", str(stored)))}
    if data["_target_"] == TEXT["_target_"]:  # Multi30k's keys, which a text corpus does not take
        del data["val_split"], data["test_split"]
    for positional in ("sinusoidal", "learned"):
        overrides = (f"model.positional={positional}",)
        copied_run(smoke_run_dir, tmp_path / "runs" / positional, 1, overrides=overrides, config={"data": data})
    opened.clear()  # from here on, the report's
    for data_root in (None, corpus_root):
        markdown = write_report([tmp_path / "runs"], tmp_path / "out", data_root=data_root).markdown
        p_value = [row["p (test)"] for row in table_rows(markdown).values()][1]
        reasons = [line for line in markdown.splitlines() if line.startswith("p (test) of ")]
        if data_root is None:  # nothing is read without it
            assert p_value == "-" and reasons[0].endswith("read only from the corpus folder given with --data-root.")
        elif says is None:  # the user's copy, with the references the runs were scored on
            assert p_value.rstrip("*").replace(".", "").isdigit() and not reasons, markdown
        else:
            assert p_value == "-" and len(reasons) == 1 and says in reasons[0], reasons
    assert not [path for path in opened if path.startswith(str(stored))]  # not even opened
    assert sorted(str(p) for p in stored.rglob("*")) == before  # nothing made there (no download, no cache)


def test_a_data_root_that_is_not_a_folder_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = report([tmp_path, "--data-root", tmp_path / "none"], capsys)
    assert status == 2 and err == f"aiayn-report: error: --data-root {tmp_path / 'none'} is not a folder; give your " \
        "copy of the runs' corpus\n"  # fmt: skip


# -- 4. nothing is written outside the output ---------------------------------------------------------


def tree(folder: Path) -> dict[str, tuple[bool, bytes | str]]:
    """Every path under ``folder``: whether it is a link, and its bytes (a link's target)."""
    return {
        str(path.relative_to(folder)): (
            path.is_symlink(),
            os.readlink(path) if path.is_symlink() else path.read_bytes(),
        )
        for path in sorted(folder.rglob("*"))
        if path.is_symlink() or path.is_file()
    }


def test_nothing_is_written_outside_the_output_folder(
    smoke_run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = tmp_path / "sweep"
    for positional in ("sinusoidal", "learned"):
        overrides = (f"model.positional={positional}",)
        config = {"model.positional": positional}
        copied_run(smoke_run_dir, sweep / positional, 1, overrides=overrides, config=config)
    sentinel = tmp_path / "sentinel"
    sentinel.mkdir()
    for name in ("report.md", "bleu_ppl_vs_positional.png"):  # a shared folder's links to the reader's files
        (sentinel / name).write_text("mine")
        (sweep / name).symlink_to(sentinel / name)
    inputs = tree(sweep)
    status, _, _ = report([sweep, "--out", tmp_path / "out"], capsys)
    assert status == 0 and tree(sweep) == inputs  # the input folders are read, not written
    written = ["bleu_ppl_vs_positional.png", "report.csv", "report.json", "report.md", "report.tex"]
    assert sorted(tree(tmp_path / "out")) == written
    status, _, err = report([sweep], capsys)  # no --out: into the folder named first, whose links are refused
    assert status == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"aiayn-report: error: {sweep}/") and ": is a link; aiayn writes only plain files" in err
    assert tree(sentinel) == {"bleu_ppl_vs_positional.png": (False, b"mine"), "report.md": (False, b"mine")}
    assert tree(sweep) == inputs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "sentinel", "sweep"]


def test_the_report_reads_results_json_as_the_run_writes_it(smoke_run_dir: Path) -> None:
    """One schema: every field the report reads is one a run writes, in the words the run uses."""
    written = json.loads((smoke_run_dir / RESULTS_FILE).read_text())
    assert {key for key, *_ in RESULT_FIELDS} <= set(written)
    assert written["evaluated"] in EVALUATED_CHECKPOINTS and written["answer"] in ANSWERS


def test_results_json_records_the_versions_that_decide_the_numbers(smoke_run_dir: Path) -> None:
    written = json.loads((smoke_run_dir / RESULTS_FILE).read_text())["versions"]
    assert list(written) == list(SOFTWARE) and written == software_versions()
    assert written["aiayn"] == aiayn.__version__ and written["torch"].startswith(torch.__version__.split("+")[0])


# -- 6. the table in the formats a paper's build reads -------------------------------------------------


def test_the_table_is_written_as_csv_json_and_latex_with_the_same_rows(smoke_run_dir: Path, tmp_path: Path) -> None:
    for seed, bleu, heads in ((1, 10.0, None), (2, 14.0, None), (1, 20.0, 1)):
        overrides, config = ((f"model.n_heads={heads}",), {"model.n_heads": heads}) if heads else ((), {})
        copied_run(smoke_run_dir, tmp_path / "runs" / f"{heads}-{seed}", seed, bleu, overrides, config=config)
    written = write_report([tmp_path / "runs"], tmp_path / "out")
    assert [path.name for path in written.exports] == ["report.csv", "report.json", "report.tex"]
    rows = list(csv.DictReader((tmp_path / "out" / "report.csv").open(newline="")))
    shown = table_rows(written.markdown)
    assert [row["setting"] for row in rows] == list(shown)  # the same rows in the same order
    by_label = {row["setting"]: row for row in rows}
    heads, seeds = by_label["model.n_heads=1"], by_label["(as configured)"]
    assert (float(seeds["val_bleu_mean"]), float(seeds["val_bleu_std"]), seeds["val_bleu_n"]) == (12.0, 8**0.5, "2")
    assert (float(heads["val_bleu_mean"]), heads["val_bleu_std"], heads["seeds"], heads["h"]) == (20.0, "", "1", "1")
    assert rows[0]["p_test"] == "" and seeds["p_note"].startswith("the test references are read only from")
    record = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [row["val_bleu"] for row in record["rows"]] == [
        {"mean": 20.0, "std": None, "n": 1},
        {"mean": 12.0, "std": pytest.approx(8**0.5), "n": 2},
    ]
    tex = (tmp_path / "out" / "report.tex").read_text()
    lines = tex.splitlines()
    assert lines[0].startswith(r"\begin{tabular}{l") and lines[-1] == r"\end{tabular}"
    body = [line for line in lines if line.endswith(r"\\")]
    assert len(body) == 1 + len(rows) and all(line.count(" & ") == len(shown[heads["setting"]]) - 1 for line in body)
    assert r"12.00 $\pm$ 2.83" in tex and "±" not in tex and "_" not in tex.replace(r"\_", "")
    if shutil.which("pdflatex"):  # compiled where a TeX is installed
        (tmp_path / "paper.tex").write_text(
            "\\documentclass{article}\\usepackage[utf8]{inputenc}\\begin{document}\n"
            f"\\input{{{tmp_path / 'out' / 'report.tex'}}}\n\\end{{document}}\n"
        )
        done = subprocess.run(["pdflatex", "-interaction=nonstopmode", "paper.tex"], cwd=tmp_path, capture_output=True)
        assert done.returncode == 0, done.stdout[-2000:]


def test_each_setting_gets_its_learning_curves_against_steps_minutes_and_flops(
    smoke_run_dir: Path, tmp_path: Path
) -> None:
    """The run logs, at each validation, the tokens trained on so far and the training seconds: the last
    validation's tokens are all the run's (results.json's train_tokens)."""
    results = json.loads((smoke_run_dir / RESULTS_FILE).read_text())
    for seed in (1, 2):
        folder = copied_run(smoke_run_dir, tmp_path / "runs" / f"seed{seed}", seed)
        (folder / "csv").mkdir()
        shutil.copyfile(smoke_run_dir / "csv" / "metrics.csv", folder / "csv" / "metrics.csv")
    written = write_report([tmp_path / "runs"], tmp_path / "out")
    (run, *_), *_ = [setting.runs for setting in group_settings(find_runs([tmp_path / "runs"]).runs)]
    rows = validations(run)
    assert [row["step"] for row in rows] == [5.0, 11.0]  # the validations while training (metrics.csv's steps)
    assert 0 < rows[0]["train/tokens"] < rows[1]["train/tokens"] == results["train_tokens"]
    assert 0 < rows[0]["train/seconds"] < rows[1]["train/seconds"]
    curves = [path for path in written.plots if path.name.startswith("curves_")]
    assert [path.name for path in curves] == ["curves_1_as_configured.png"] and curves[0].stat().st_size > 10_000
    assert "![curves_1_as_configured](curves_1_as_configured.png)" in written.markdown


def test_recipes_are_compared_at_a_matched_step_and_at_matched_minutes(smoke_run_dir: Path, tmp_path: Path) -> None:
    """Setting A validates at steps 5 and 11 (1 and 2 training minutes), B at 5, 11 and 17 (0.5, 1 and 1.5):
    at step 11, the last both reached, A has 3 and B 4; at 1.5 minutes, the least either trained, A has
    its step-5 BLEU (1) and B its step-17 one (9)."""
    curves = {"a": [(5, 1.0, 60), (11, 3.0, 120)], "b": [(5, 2.0, 30), (11, 4.0, 60), (17, 9.0, 90)]}
    for heads, (name, rows) in enumerate(curves.items(), start=1):
        overrides, config = (f"model.n_heads={heads}",), {"model.n_heads": heads}
        folder = copied_run(smoke_run_dir, tmp_path / "runs" / name, 1, 10.0, overrides, config=config)
        (folder / "csv").mkdir()
        lines = ["step,train/seconds,train/tokens,val/bleu", *(f"{s},{t},{100 * s},{b}" for s, b, t in rows)]
        (folder / "csv" / "metrics.csv").write_text("\n".join(lines) + "\n")
    written = write_report([tmp_path / "runs"], tmp_path / "out")
    named = {"model.n_heads=1": "a", "model.n_heads=2": "b"}
    cells = {named[label]: row for label, row in table_rows(written.markdown).items()}
    assert [cells[name]["BLEU (val) at step 11"] for name in ("a", "b")] == ["3.00", "4.00"]
    assert [cells[name]["BLEU (val) at 1.5 min"] for name in ("a", "b")] == ["1.00", "9.00"]
    rows = json.loads((tmp_path / "out" / "report.json").read_text())["rows"]
    record = {named[row["setting"]]: row for row in rows}
    assert record["b"]["val_bleu_matched"] == [
        {"axis": "step", "at": 11.0, "mean": 4.0, "std": None, "n": 1},
        {"axis": "minutes", "at": 1.5, "mean": 9.0, "std": None, "n": 1},
    ]
