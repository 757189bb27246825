"""``aiayn-eval`` and ``aiayn-summary`` on files from somebody else (issue 26, items 4, 9 and 10): a
checkpoint's stored corpus section is a description, never a place to read or fetch; wrong stored
values end in one line; a compared checkpoint is decoded exactly as the first; outputs of other texts
or options never replace each other; a summary leaves nothing behind. ``main()`` in this process, on
copies of the shared smoke run's checkpoint with their stored config changed."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from aiayn.cli import evaluate as evaluate_cli
from aiayn.cli import summary as summary_cli
from aiayn.data.corpus import read_lines
from aiayn.errors import show
from aiayn.training.checkpoints import RUN_KEY
from helpers.extras import dev_extra
from helpers.runs import exit_status

SPLIT_FILES = ("train", "val", "test_2016_flickr")


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``folder`` with its size and modification time."""
    return {str(path): (path.lstat().st_size, path.lstat().st_mtime_ns) for path in sorted(folder.rglob("*"))}


@pytest.fixture
def sentinel(tmp_path: Path, corpus_root: Path) -> Path:
    """A folder a crafted checkpoint points at: a Multi30k-shaped corpus whose test split has 3 lines."""
    folder = tmp_path / "sentinel"
    folder.mkdir()
    for stem in SPLIT_FILES:
        for lang in ("en", "de"):
            lines = read_lines(corpus_root / f"{stem}.{lang}")[: 3 if stem.startswith("test") else None]
            (folder / f"{stem}.{lang}").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return folder


@pytest.fixture
def crafted(smoke_run_dir: Path, tmp_path: Path) -> Callable[[Callable[[dict[str, Any]], Any]], Path]:
    """``crafted(change)``: a copy of the smoke run's best checkpoint whose stored run config ``change``
    edited (or replaced, when it returns something)."""
    stored = torch.load(smoke_run_dir / "checkpoints" / "best.ckpt", weights_only=True)

    def make(change: Callable[[dict[str, Any]], Any]) -> Path:
        checkpoint = {
            **stored,
            RUN_KEY: {**stored[RUN_KEY], "config": json.loads(json.dumps(stored[RUN_KEY]["config"]))},
        }
        replaced = change(checkpoint[RUN_KEY]["config"])
        if replaced is not None:
            checkpoint[RUN_KEY]["config"] = replaced
        path = tmp_path / "shared" / "checkpoints" / "crafted.ckpt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(checkpoint, path)
        return path

    return make


def evaluate(argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """``aiayn-eval`` in this process, greedy and at most 3 tokens past the source: status, stdout, stderr."""
    fast = ["decoding=greedy", "decoding.max_len_offset=3", "device=cpu"]
    status = exit_status(evaluate_cli.main, ["aiayn-eval", *fast, *argv], monkeypatch)
    out = capsys.readouterr()
    return status, out.out, out.err


def one_line(status: int, err: str) -> str:
    assert status == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


def texts(folder: Path, name: str, lines: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return folder / name


# -- item 4: a stored corpus section is a description, not a place to read ------------------------


@pytest.mark.parametrize("where", ["folder", "download", "hub"])
def test_a_stored_corpus_location_is_never_read_or_fetched(
    where: str,
    crafted: Callable[..., Path],
    sentinel: Path,
    corpus_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    def point(config: dict[str, Any]) -> None:
        data = config["data"]
        if where == "folder":
            data["root"] = str(sentinel)
        elif where == "download":
            data |= {"root": None, "cache_dir": str(sentinel / "cache")}
        else:
            data |= {"_target_": "aiayn.data.WMT14DataModule", "root": None, "hub": "someone/wmt14", "config": "de-en"}
            data |= {"splits": {"train": "train", "val": "validation", "test": "test"}, "cache_dir": str(sentinel)}
            data.pop("val_split"), data.pop("test_split")

    checkpoint = crafted(point)
    monkeypatch.chdir(tmp_path)
    before, here = snapshot(sentinel), set(tmp_path.iterdir())
    status, _, err = evaluate([f"checkpoint={checkpoint}", "split=test"], monkeypatch, capsys)
    field = {
        "folder": f"data.root={sentinel}",
        "download": "data.root=null (a download)",
        "hub": "data.hub=someone/wmt14",
    }
    assert one_line(status, err) == (
        f"aiayn-eval: error: checkpoint {checkpoint}: its corpus is read only from a folder you name, not from its "
        f"stored {field[where]}; set data.root=<your copy of the corpus> (or give source=<file> reference=<file>)"
    )
    assert snapshot(sentinel) == before and set(tmp_path.iterdir()) == here  # nothing read into, nothing written
    if where == "folder":  # the user's own folder is read: its 100 test pairs, not the stored folder's 3
        status, _, err = evaluate(
            [f"checkpoint={checkpoint}", "split=test", f"data.root={corpus_root}", f"output_dir={tmp_path / 'eval'}"],
            monkeypatch,
            capsys,
        )
        assert status == 0, err
        (report,) = (tmp_path / "eval").glob("*.json")
        assert json.loads(report.read_text())["sentences"] == 100


@pytest.mark.parametrize("name", ["absolute", "dotted"])
def test_a_stored_text_corpus_names_no_file_outside_the_users_folder(
    name: str,
    crafted: Callable[..., Path],
    sentinel: Path,
    corpus_root: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    outside = str(sentinel / "test_2016_flickr.en") if name == "absolute" else "../sentinel/test_2016_flickr.en"

    def text_corpus(config: dict[str, Any]) -> None:
        config["data"] = {
            "_target_": "aiayn.data.TextDataModule",
            "src_lang": "en",
            "tgt_lang": "de",
            "root": str(sentinel),
            "train": ["train.en", "train.de"],
            "val": ["val.en", "val.de"],
            "test": [outside, "test_2016_flickr.de"],
        }

    checkpoint = crafted(text_corpus)
    users = sentinel.parent / "mine"
    shutil.copytree(corpus_root, users)
    status, _, err = evaluate([f"checkpoint={checkpoint}", "split=test", f"data.root={users}"], monkeypatch, capsys)
    assert one_line(status, err) == (
        f"aiayn-eval: error: checkpoint {checkpoint}: its stored data.test={show([outside, 'test_2016_flickr.de'])} "
        f"names "
        f"{outside}, outside data.root={users}; put the files in that folder, or give source=<file> reference=<file>"
    )


WRONG = [
    ("src_lang", 123, "data.src_lang=123"),
    ("tgt_lang", ["de"], "data.tgt_lang=['de']"),
    ("test_split", 5, "data.test_split=5"),
    ("val_split", "", "data.val_split=''"),
    ("max_tokens", "many", "data.max_tokens=many"),
    ("eval_limit", -1, "data.eval_limit=-1"),
    ("max_len_ratio", float("nan"), "data.max_len_ratio=nan"),
    ("config", 5, "data.config=5"),
    ("evil", {"_target_": "aiayn.data.Multi30kDataModule"}, "data.evil._target_=aiayn.data.Multi30kDataModule"),
    ("_target_", 7, "data._target_=7"),
    ("splits", "x", "data.splits=x"),
    ("src_lang", "../../elsewhere", "data.src_lang=../../elsewhere must be a plain name"),  # a path under data.root
    ("test_split", "x/../../y", "data.test_split=x/../../y must be a plain name"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("key", "value", "named"), WRONG, ids=[case[0] for case in WRONG])
def test_a_wrong_stored_data_value_ends_in_one_line_naming_it(
    key: str,
    value: Any,
    named: str,
    crafted: Callable[..., Path],
    corpus_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    def damage(config: dict[str, Any]) -> None:
        config["data"][key] = value
        if key == "splits":
            config["data"]["_target_"] = "aiayn.data.WMT14DataModule"

    checkpoint = crafted(damage)
    monkeypatch.chdir(tmp_path)
    here = set(tmp_path.iterdir())
    status, _, err = evaluate(
        [f"checkpoint={checkpoint}", "split=test", f"data.root={corpus_root}"], monkeypatch, capsys
    )
    line = one_line(status, err)
    assert line.startswith(f"aiayn-eval: error: checkpoint {checkpoint}") and named in line, line
    assert set(tmp_path.iterdir()) == here


@pytest.mark.parametrize("where", ["data root", "data section", "decoding"])
def test_stored_values_eval_does_not_use_do_not_stop_it(
    where: str,
    crafted: Callable[..., Path],
    corpus_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    def damage(config: dict[str, Any]) -> Any:
        if where == "data root":
            config["data"]["root"] = [1]  # a location: the user's data.root replaces it
        elif where == "data section":
            config["data"] = "a string"
        else:
            config["decoding"] = {"beam_size": "four", "alpha": "x"}  # eval decodes with its own options
        return None

    source = texts(tmp_path / "in", "src.en", read_lines(corpus_root / "val.en")[:4])
    reference = texts(tmp_path / "in", "ref.de", read_lines(corpus_root / "val.de")[:4])
    argv = [f"checkpoint={crafted(damage)}", f"source={source}", f"reference={reference}"]
    status, _, err = evaluate([*argv, f"output_dir={tmp_path / 'eval'}"], monkeypatch, capsys)
    assert status == 0, err
    (report,) = (tmp_path / "eval").glob("*.json")
    assert json.loads(report.read_text())["sentences"] == 4


# -- item 9: a compared checkpoint is decoded exactly as the first --------------------------------


def test_a_compared_checkpoint_is_decoded_with_the_first_ones_settings(
    smoke_run_dir: Path,
    corpus_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    best = smoke_run_dir / "checkpoints" / "best.ckpt"
    twin = tmp_path / "twin.ckpt"
    shutil.copyfile(best, twin)  # the same weights: decoded alike, the same translations
    source = texts(tmp_path / "in", "src.en", read_lines(corpus_root / "val.en")[:8])
    reference = texts(tmp_path / "in", "ref.de", read_lines(corpus_root / "val.de")[:8])
    argv = [f"checkpoint={best}", f"compare={twin}", f"source={source}", f"reference={reference}",
            "decoding.beam_size=2", "max_tokens=64", f"output_dir={tmp_path / 'eval'}"]  # fmt: skip
    status, _, err = evaluate(argv, monkeypatch, capsys)
    assert status == 0, err
    (written,) = (tmp_path / "eval").glob("*.json")
    report = json.loads(written.read_text())
    compared = report["compare"]
    assert compared["settings"] == report["settings"]
    assert report["settings"] == {
        "backend": "aiayn",
        "compute_type": None,
        "device": "cpu",
        "decoding": report["decoding"],
        "max_tokens": 64,
    }
    assert report["decoding"]["beam_size"] == 2 and report["decoding"]["max_len_offset"] == 3
    assert read_lines(Path(compared["hypotheses"])) == read_lines(Path(report["hypotheses"]))
    assert compared["difference"] == 0


def test_a_compared_checkpoint_is_converted_for_the_engine_as_the_first(
    smoke_run_dir: Path,
    corpus_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    dev_extra("ctranslate2")
    best, step6 = smoke_run_dir / "checkpoints" / "best.ckpt", smoke_run_dir / "checkpoints" / "step0000006.ckpt"
    source = texts(tmp_path / "in", "src.en", read_lines(corpus_root / "val.en")[:8])
    reference = texts(tmp_path / "in", "ref.de", read_lines(corpus_root / "val.de")[:8])
    argv = [f"checkpoint={best}", f"compare={step6}", f"source={source}", f"reference={reference}",
            "backend=ctranslate2", "compute_type=int8", "decoding.length_penalty=power",
            f"output_dir={tmp_path / 'eval'}"]  # fmt: skip
    status, _, err = evaluate(argv, monkeypatch, capsys)
    assert status == 0, err
    (written,) = (tmp_path / "eval").glob("*.json")
    report = json.loads(written.read_text())
    assert report["compare"]["settings"] == report["settings"]
    assert (report["settings"]["backend"], report["settings"]["compute_type"]) == ("ctranslate2", "int8")


# -- item 10: outputs never silently replace other outputs -----------------------------------------


def test_evaluations_of_other_texts_or_options_never_replace_each_other(
    smoke_run_dir: Path,
    corpus_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    best = smoke_run_dir / "checkpoints" / "best.ckpt"
    sources, targets = read_lines(corpus_root / "val.en"), read_lines(corpus_root / "val.de")
    pairs = {
        folder: (
            texts(tmp_path / folder, "test.en", sources[k : k + 5]),
            texts(tmp_path / folder, "test.de", targets[k : k + 5]),
        )
        for folder, k in (("a", 0), ("b", 5))
    }  # two texts with one file name
    out = tmp_path / "eval"

    def run(folder: str, *options: str) -> dict[str, Any]:
        source, reference = pairs[folder]
        argv = [f"checkpoint={best}", f"source={source}", f"reference={reference}", f"output_dir={out}", *options]
        status, printed, err = evaluate(argv, monkeypatch, capsys)
        assert status == 0, err
        scores = Path(printed.strip().splitlines()[-1].split("scores: ")[1])
        return json.loads(scores.read_text())

    reports = [run("a"), run("b"), run("a", "decoding.max_len_offset=4")]
    assert len({report["hypotheses"] for report in reports}) == 3 and len(list(out.glob("*.json"))) == 3
    assert [report["texts_sha256"] == reports[0]["texts_sha256"] for report in reports] == [True, False, True]
    assert read_lines(Path(reports[0]["hypotheses"])) != read_lines(Path(reports[1]["hypotheses"]))
    assert run("a") == {**reports[0], "seconds": pytest.approx(reports[0]["seconds"], abs=60),
                        "sentences_per_s": pytest.approx(reports[0]["sentences_per_s"], rel=10)}  # fmt: skip
    assert len(list(out.iterdir())) == 6  # the same evaluation again replaced its own files, nothing else


def test_a_default_eval_folder_that_is_a_link_is_refused(
    smoke_run_dir: Path,
    corpus_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    checkpoint = tmp_path / "run" / "checkpoints" / "best.ckpt"
    checkpoint.parent.mkdir(parents=True)
    shutil.copyfile(smoke_run_dir / "checkpoints" / "best.ckpt", checkpoint)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "run" / "eval").symlink_to(elsewhere)  # a copied run folder's eval/ may lead anywhere
    source = texts(tmp_path / "in", "src.en", read_lines(corpus_root / "val.en")[:2])
    reference = texts(tmp_path / "in", "ref.de", read_lines(corpus_root / "val.de")[:2])
    status, _, err = evaluate(
        [f"checkpoint={checkpoint}", f"source={source}", f"reference={reference}"], monkeypatch, capsys
    )
    assert one_line(status, err) == (
        f"aiayn-eval: error: output_dir=null would be {tmp_path / 'run' / 'eval'}, a link; name the folder to write to"
    )
    assert not any(elsewhere.iterdir())


@pytest.mark.parametrize("multirun", [False, True])
def test_aiayn_summary_leaves_nothing_where_it_runs(
    multirun: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    models = ["-m", "model=tiny,base"] if multirun else ["model=tiny"]
    monkeypatch.setattr(sys, "argv", ["aiayn-summary", *models])
    summary_cli.main()
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [summary["model"]["d_model"] for summary in printed] == ([64, 512] if multirun else [64])
    assert list(tmp_path.iterdir()) == []  # no .hydra, no outputs/ or multirun/, no log, no lock
