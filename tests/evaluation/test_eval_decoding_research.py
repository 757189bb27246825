"""``aiayn-eval`` for decoding research: an ensemble of checkpoints is one system (an ensemble of one, or of
two copies of one checkpoint, translates as that checkpoint does; members of another tokenizer are
refused), ``nbest=`` writes aiayn-translate's n-best format and scores the same 1-best as ``nbest=1``,
``seed=`` names its samples, and ``tune=`` scores a grid of decoding settings on the validation split
only. ``main()`` in this process, on the shared smoke run's checkpoint (greedy or two beams, at most 3
tokens past the source: an untrained model's translations run to the length limit)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from sentencepiece import sentencepiece_model_pb2

from aiayn.cli import evaluate as evaluate_cli
from aiayn.cli import translate as translate_cli
from aiayn.data.corpus import read_lines
from aiayn.evaluation.translator import Translator
from aiayn.training.checkpoints import RUN_KEY
from helpers.runs import exit_status

SHORT = ("decoding.max_len_offset=3", "device=cpu", "tokenized_bleu=false")
LINES = 40  # of the test split: the source= and reference= of most evaluations here


def run_eval(argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """``aiayn-eval`` in this process: status, stdout, stderr."""
    status = exit_status(evaluate_cli.main, ["aiayn-eval", *SHORT, *argv], monkeypatch)
    out = capsys.readouterr()
    return status, out.out, out.err


def one_line(status: int, err: str) -> str:
    assert status == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


def report_in(folder: Path, pattern: str = "*.json") -> dict[str, Any]:
    (found,) = folder.glob(pattern)
    return json.loads(found.read_text())


@pytest.fixture(scope="module")
def step12(smoke_run_dir: Path) -> Path:
    return smoke_run_dir / "checkpoints" / "step0000012.ckpt"


@pytest.fixture(scope="module")
def texts(corpus_root: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """``source=<file> reference=<file>``: the first :data:`LINES` lines of the test split, an empty line among them."""
    folder = tmp_path_factory.mktemp("texts")
    source = read_lines(corpus_root / "test_2016_flickr.en")[:LINES]
    reference = read_lines(corpus_root / "test_2016_flickr.de")[:LINES]
    source[5] = ""  # an empty line has no candidates: its n-best has no line, its hypothesis is empty
    for name, lines in (("src.en", source), ("ref.de", reference)):
        (folder / name).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return [f"source={folder / 'src.en'}", f"reference={folder / 'ref.de'}"]


@pytest.fixture(scope="module")
def greedy_hypotheses(step12: Path, texts: list[str], tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The single model's greedy hypotheses of :func:`texts`, as aiayn-eval writes them."""
    out = tmp_path_factory.mktemp("single")
    with pytest.MonkeyPatch.context() as monkeypatch:
        argv = ["aiayn-eval", *SHORT, f"checkpoint={step12}", *texts, "decoding=greedy", f"output_dir={out}"]
        assert exit_status(evaluate_cli.main, argv, monkeypatch) == 0
    (hyp,) = out.glob("step0000012.src.en.beam1-alpha0.0.*.hyp.txt")
    return read_lines(hyp)


def copy_of_checkpoint(step12: Path, folder: Path, change: Any = None) -> Path:
    """``step12`` in a run folder of its own under ``folder``, its stored run entry ``change``d (in place)."""
    path = folder / "run" / "checkpoints" / "copy.ckpt"
    path.parent.mkdir(parents=True)
    if change is None:
        shutil.copyfile(step12, path)
        return path
    stored = torch.load(step12, weights_only=True)
    change(stored[RUN_KEY])
    torch.save(stored, path)
    return path


def test_an_ensemble_of_one_or_of_two_copies_translates_as_the_single_model(
    step12: Path,
    texts: list[str],
    greedy_hypotheses: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    greedy = [*texts, "decoding=greedy"]
    status, _, err = run_eval([f"checkpoint=[{step12}]", *greedy, f"output_dir={tmp_path / 'one'}"],
                              monkeypatch, capsys)  # fmt: skip
    assert status == 0, err
    (hyp,) = (tmp_path / "one").glob("*.hyp.txt")
    assert hyp.name.startswith("step0000012.src.en.")  # an ensemble of one is the model
    assert read_lines(hyp) == greedy_hypotheses

    # two copies, the copy first: the default output folder is the first member's run folder's eval/
    copy = copy_of_checkpoint(step12, tmp_path)
    status, printed, err = run_eval([f"checkpoint=[{copy},{step12}]", *greedy], monkeypatch, capsys)
    assert status == 0, err
    eval_dir = tmp_path / "run" / "eval"
    (hyp,) = eval_dir.glob("ensemble2-copy.src.en.beam1-alpha0.0.*.hyp.txt")
    assert read_lines(hyp) == greedy_hypotheses  # the mean of two equal log-probabilities is theirs
    report = report_in(eval_dir)
    assert report["checkpoint"] == [str(copy), str(step12)] and report["system"] == "ensemble2-copy"
    assert [member[0] for member in report["members"]] == [str(copy.resolve()), str(step12.resolve())]
    assert report["members"][0][1][0] == "copy.ckpt" and report["members"][1][1][0] == "step0000012.ckpt"
    assert str(hyp) in printed

    # fairseq's mean of the probabilities: of two equal distributions, theirs; the n-best say how they combined
    members, prob = f"checkpoint=[{copy},{step12}]", ["decoding.ensemble=prob", f"output_dir={tmp_path / 'prob'}"]
    status, _, err = run_eval([members, *greedy, *prob], monkeypatch, capsys)
    assert status == 0, err
    (hyp,) = (tmp_path / "prob").glob("*.hyp.txt")
    assert read_lines(hyp) == greedy_hypotheses and report_in(tmp_path / "prob")["decoding"]["ensemble"] == "prob"
    status, _, err = run_eval([members, *texts, "decoding=sample", "nbest=2", *prob], monkeypatch, capsys)
    assert status == 0, err
    (nbest,) = (tmp_path / "prob").glob("*.nbest.jsonl")
    assert {json.loads(line)["ensemble"] for line in nbest.read_text().splitlines()} == {"prob"}


def test_members_of_another_tokenizer_or_direction_are_refused_in_one_line(
    step12: Path, texts: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    def retokenized(run: dict[str, Any]) -> None:  # the same pieces, one score changed: another tokenizer
        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(run["tokenizer"])
        proto.pieces[10].score -= 1.0
        run["tokenizer"] = proto.SerializeToString()

    def reversed_direction(run: dict[str, Any]) -> None:
        data = run["config"]["data"]
        data["src_lang"], data["tgt_lang"] = data["tgt_lang"], data["src_lang"]

    other = copy_of_checkpoint(step12, tmp_path / "tokenizer", retokenized)
    backwards = copy_of_checkpoint(step12, tmp_path / "direction", reversed_direction)
    common = [*texts, "decoding=greedy", f"output_dir={tmp_path / 'eval'}"]
    cases = (
        ([f"checkpoint=[{step12},{other}]"], f"aiayn-eval: error: checkpoint={other} has another tokenizer than"),
        ([f"checkpoint={step12}", f"compare=[{step12},{other}]"], f"compare={other} has another tokenizer than"),
        ([f"checkpoint=[{step12},{backwards}]"], f"checkpoint={backwards} translates de→en, {step12} en→de"),
        ([f"checkpoint={step12}", f"compare=[{backwards},{backwards}]"], f"compare={backwards} translates de→en"),
    )
    for argv, message in cases:
        status, _, err = run_eval([*argv, *common], monkeypatch, capsys)
        assert message in one_line(status, err)
    assert not (tmp_path / "eval").exists()  # refused before anything was translated


def test_nbest_writes_translates_format_and_its_first_are_the_plain_hypotheses(
    step12: Path, texts: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    beam2 = [f"checkpoint={step12}", *texts, "decoding.beam_size=2"]
    for nbest in (1, 2):
        status, printed, err = run_eval([*beam2, f"nbest={nbest}", f"output_dir={tmp_path / str(nbest)}"],
                                        monkeypatch, capsys)  # fmt: skip
        assert status == 0, err
    (plain,), (best,) = ((tmp_path / n).glob("*.hyp.txt") for n in ("1", "2"))
    assert read_lines(best) == read_lines(plain)  # scored on the 1-best, line for line
    assert report_in(tmp_path / "2")["sacrebleu"] == report_in(tmp_path / "1")["sacrebleu"]
    assert "seed" not in report_in(tmp_path / "1")["settings"]  # beam search draws nothing
    assert not list((tmp_path / "1").glob("*.nbest.jsonl"))
    (nbest_file,) = (tmp_path / "2").glob("*.nbest.jsonl")
    assert nbest_file.name == best.name.replace(".hyp.txt", ".nbest.jsonl") and str(nbest_file) in printed
    rows = [json.loads(line) for line in nbest_file.read_text(encoding="utf-8").splitlines()]
    assert all(list(row) == ["line", "rank", "text", "score", "log_prob"] for row in rows)
    firsts = {row["line"]: row["text"] for row in rows if row["rank"] == 1}
    assert [firsts.get(i, "") for i in range(LINES)] == read_lines(plain) and 5 not in firsts
    assert [row["rank"] for row in rows] == [1, 2] * (LINES - 1)
    assert all(a["score"] >= b["score"] for a, b in zip(rows[::2], rows[1::2], strict=True))

    # aiayn-translate nbest= writes the very same lines (one formatting function)
    source = texts[0].removeprefix("source=")
    argv = ["aiayn-translate", f"checkpoint={step12}", f"input={source}", f"output={tmp_path / 'out.jsonl'}",
            "decoding.beam_size=2", "nbest=2", *SHORT[:2]]  # fmt: skip
    assert exit_status(translate_cli.main, argv, monkeypatch) == 0
    assert (tmp_path / "out.jsonl").read_text(encoding="utf-8") == nbest_file.read_text(encoding="utf-8")

    status, _, err = run_eval([*beam2, "nbest=3"], monkeypatch, capsys)  # before any model is loaded
    assert one_line(status, err).startswith("aiayn-eval: error: nbest=3 must be a whole number from 1 to the beam")


def test_samples_are_named_by_their_seed_and_the_first_of_n_is_the_single_sample(
    step12: Path, texts: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    sample = [f"checkpoint={step12}", *texts, "decoding=sample", f"output_dir={tmp_path}"]
    for extra in (["seed=1"], ["seed=1", "nbest=3"], ["seed=2"]):
        status, _, err = run_eval([*sample, *extra], monkeypatch, capsys)
        assert status == 0, err
    reports = {}
    for path in tmp_path.glob("*.json"):
        report = json.loads(path.read_text())
        reports[report["settings"]["seed"], report["nbest"]] = report
    assert set(reports) == {(1, 1), (1, 3), (2, 1)}  # three evaluations, three names
    assert all(Path(r["hypotheses"]).name.startswith("step0000012.src.en.sample-seed") for r in reports.values())
    one, three, other = (read_lines(Path(reports[key]["hypotheses"])) for key in ((1, 1), (1, 3), (2, 1)))
    assert three == one and other != one
    rows = [json.loads(line) for line in Path(reports[1, 3]["nbest_file"]).read_text().splitlines()]
    assert [row["rank"] for row in rows] == [1, 2, 3] * (LINES - 1)


def test_tune_scores_every_setting_on_the_validation_split_and_picks_the_best(
    step12: Path,
    texts: list[str],
    corpus_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    translations = []
    translate = Translator.translate

    def counted(self: Translator, lines: list[str], first_line: int = 1) -> list[str]:
        translations.append(self.decoding)
        return translate(self, lines, first_line)

    monkeypatch.setattr(Translator, "translate", counted)
    tuned = [f"checkpoint={step12}", f"data.root={corpus_root}", "tune.alpha=[0.6,1.0]", "tune.beam_size=[1,2]"]
    status, printed, err = run_eval([*tuned, f"output_dir={tmp_path}"], monkeypatch, capsys)
    assert status == 0, err
    (written,) = tmp_path.glob("step0000012.val.*.tune.json")
    report = json.loads(written.read_text())
    assert report["evaluated"] == "val" and report["sentences"] == 100
    assert report["tuned"] == {"beam_size": [1, 2], "alpha": [0.6, 1.0]}
    grid = report["grid"]
    assert [row["decoding"] for row in grid] == [{"beam_size": b, "alpha": a} for b in (1, 2) for a in (0.6, 1.0)]
    # one beam ignores α: its two settings are translated once
    assert [row["same_as"] for row in grid] == [None, 0, None, None] and len(translations) == 3
    assert grid[1]["sacrebleu"] == grid[0]["sacrebleu"]
    best = max(range(4), key=lambda i: grid[i]["sacrebleu"])
    assert report["best"]["index"] == best and report["best"]["sacrebleu"] == grid[best]["sacrebleu"]
    assert report["best"]["overrides"] == " ".join(f"decoding.{k}={v}" for k, v in grid[best]["decoding"].items())
    for row in grid:
        assert row["length_ratio"] == pytest.approx(row["sys_len"] / row["ref_len"])
        assert 0 < row["brevity_penalty"] <= 1
    lines = printed.splitlines()
    assert lines[1].split() == ["setting", "sacreBLEU", "ratio", "BP"]
    assert lines[2].startswith("beam_size=1 alpha=0.6") and f"{grid[0]['sacrebleu']:.2f}" in lines[2]
    assert f"best: {lines[2 + best].split('  ')[0]}" in printed and str(written) in printed

    # the greedy row is what aiayn-eval scores for split=val with decoding=greedy
    greedy = [f"checkpoint={step12}", f"data.root={corpus_root}", "split=val", "decoding=greedy"]
    status, _, err = run_eval([*greedy, f"output_dir={tmp_path / 'greedy'}"], monkeypatch, capsys)
    assert status == 0, err
    assert report_in(tmp_path / "greedy")["sacrebleu"] == pytest.approx(grid[0]["sacrebleu"])

    # your own development set is allowed; the test split, or any other, never is
    status, printed, err = run_eval([*tuned[:1], *texts, "tune.beam_size=[1]", f"output_dir={tmp_path / 'dev'}"],
                                    monkeypatch, capsys)  # fmt: skip
    assert status == 0 and "best: beam_size=1" in printed, err
    for argv, message in (
        (["split=test"], "aiayn-eval: error: split=test is not the validation split; tune= chooses"),
        (["split=train"], "aiayn-eval: error: split=train is not the validation split"),
        ([f"compare={step12}"], f"aiayn-eval: error: compare={step12} is for one setting; tune= scores"),
        (["tune.beam_size=[0]"], "aiayn-eval: error: tune.beam_size=0 must be a whole number >= 1"),
        (["tune.alpha=[]"], "aiayn-eval: error: tune.alpha=[] must be a list of values to try"),
    ):
        status, _, err = run_eval([*tuned, *argv, f"output_dir={tmp_path / 'refused'}"], monkeypatch, capsys)
        assert one_line(status, err).startswith(message)
    assert not (tmp_path / "refused").exists()
