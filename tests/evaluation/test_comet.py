"""COMET beside BLEU: our scoring of unbabel-comet's models equals unbabel-comet's own (recorded in
``tests/assets/comet_reference.json`` by ``tests/assets/comet_reference.py``, which runs unbabel-comet in
an environment of its own), its paired test is sacreBLEU's, aiayn-eval reports both for one system and
for two, a Hub id is read from the Hugging Face cache and never downloaded unasked, and a model that is
not what it claims is refused in one line without running anything."""

from __future__ import annotations

import json
import re
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from sacrebleu.metrics.base import Metric, Score, Signature
from sacrebleu.significance import PairedTest

from aiayn.cli import report as report_cli
from aiayn.data.corpus import read_lines
from aiayn.errors import FieldError
from aiayn.evaluation.comet import CometSettings
from aiayn.experiments.report.document import write_report
from aiayn.scoring import paired_bootstrap_segments
from helpers.extras import dev_extra
from helpers.report_layout import copy_run, perturbed, table_rows
from helpers.runs import eval_in_process, exit_status
from helpers.tiny_comet import SAMPLES, VARIANTS, write_tiny_comet

REFERENCE = json.loads((Path(__file__).parents[1] / "assets" / "comet_reference.json").read_text())
CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("wandb_offline")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dev_extra("entmax")
    return write_tiny_comet(tmp_path_factory.mktemp("comet") / "sparsemax", "sparsemax")


def columns(samples: list[dict[str, str]]) -> tuple[list[str], list[str], list[str]]:
    return [s["src"] for s in samples], [s["mt"] for s in samples], [s["ref"] for s in samples]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("batch_size", [1, 4])
def test_our_scores_are_unbabel_comets(variant: str, batch_size: int, tmp_path: Path) -> None:
    """Every layer, mix and pooling setting of the regression models; one segment a batch or several
    padded together (and a translation truncated, another empty)."""
    dev_extra("entmax")
    folder = write_tiny_comet(tmp_path / variant, variant)
    model = CometSettings(str(folder), comet_batch_size=batch_size).load(CPU)
    scores = model.score(*columns(SAMPLES), batch_size=batch_size)
    theirs = REFERENCE["scores"][variant]
    assert scores.segments == pytest.approx(theirs["segments"], abs=1e-5)
    assert scores.system == pytest.approx(theirs["system"], abs=1e-5)
    assert len(set(np.round(scores.segments, 4))) == len(SAMPLES)  # the samples are told apart


class SegmentMean(Metric):
    """A sacreBLEU metric whose corpus score is the mean of its segments' (COMET's): each "hypothesis" is
    its segment's score, so sacreBLEU's own PairedTest can run on COMET scores."""

    _SIGNATURE_TYPE = Signature

    def __init__(self) -> None:
        super().__init__()
        self.num_refs = 1

    def _extract_corpus_statistics(self, hypotheses: list[str], references: object) -> list[list[float]]:
        return [[float(hypothesis), 1.0] for hypothesis in hypotheses]

    def _compute_score_from_stats(self, stats: list[float]) -> Score:
        return Score("mean", stats[0] / stats[1])

    def _aggregate_and_compute(self, stats: list[list[float]]) -> Score:
        return self._compute_score_from_stats(np.sum(stats, 0))

    def _preprocess_segment(self, sent: str) -> str:
        return sent

    def _extract_reference_info(self, refs: object) -> dict:
        return {}

    def _compute_segment_statistics(self, hypothesis: str, ref_kwargs: dict) -> list[float]:
        return [float(hypothesis), 1.0]


def test_the_segments_paired_test_is_sacrebleus(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    base = rng.normal(0.5, 0.2, 300)
    systems = [("base", base), ("better", base + rng.normal(0.03, 0.1, 300)), ("close", base + rng.normal(0, 0.1, 300))]
    ours = paired_bootstrap_segments(systems, "COMET tiny")
    as_text = [(name, [repr(float(score)) for score in scores]) for name, scores in systems]
    _, theirs = PairedTest(as_text, {"mean": SegmentMean()}, [[""] * 300], test_type="bs")()
    for mine, sacrebleus in zip(ours.systems, theirs["mean"], strict=True):
        assert mine.score == pytest.approx(sacrebleus.score, abs=1e-12)
        assert mine.mean == pytest.approx(sacrebleus.mean, abs=1e-6)
        assert mine.ci == pytest.approx(sacrebleus.ci, abs=1e-6)
        assert mine.p_value == sacrebleus.p_value
    base_result, better, close = ours.systems
    assert better.p_value < 0.05 <= close.p_value
    assert better.difference == pytest.approx(better.score - base_result.score)
    assert better.difference_ci[0] <= better.difference <= better.difference_ci[1] and better.difference_ci[0] > 0
    assert ours.signature == "COMET tiny|bs:1000|seed:12345"
    monkeypatch.setenv("SACREBLEU_SEED", "none")
    assert paired_bootstrap_segments(systems[:2], "COMET tiny").systems[1].difference_ci is None
    with pytest.raises(ValueError, match="close: 299 segment scores but 300 for base"):
        paired_bootstrap_segments([systems[0], ("close", systems[2][1][:-1])], "COMET tiny")


def test_aiayn_eval_reports_comet_and_its_paired_test(
    smoke_run_dir: Path,
    corpus_root: Path,
    tiny: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    checkpoint = smoke_run_dir / "checkpoints" / "step0000012.ckpt"
    files = {}
    for name, lang in (("source", "en"), ("reference", "de")):  # 24 lines: seconds to translate
        files[name] = tmp_path / f"text.{lang}"
        lines = read_lines(corpus_root / f"test_2016_flickr.{lang}")[:24]
        files[name].write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    sources, references = read_lines(files["source"]), read_lines(files["reference"])
    system = tmp_path / "system.de"
    system.write_text("".join(line + "\n" for line in references[:12] + sources[12:]), encoding="utf-8")
    common = [f"checkpoint={checkpoint}", f"source={files['source']}", f"reference={files['reference']}",
              "decoding=greedy", "decoding.max_len_offset=3", f"output_dir={tmp_path / 'eval'}", f"compare={system}",
              "comet.batch_size=7"]  # fmt: skip
    status, printed = eval_in_process([*common, f"comet.model={tiny}"], monkeypatch, capsys)
    assert status == 0, printed
    (written,) = (tmp_path / "eval").glob("*.json")
    report = json.loads(written.read_text())
    model = CometSettings(str(tiny)).load(CPU)
    ours = model.score(sources, read_lines(Path(report["hypotheses"])), references, batch_size=16)
    theirs = model.score(sources, read_lines(system), references, batch_size=16)
    assert report["comet_segments"] == pytest.approx(ours.segments, abs=1e-6)
    assert report["comet"] == pytest.approx(ours.system, abs=1e-6)
    assert (report["comet_model"], report["comet_source"]) == (str(tiny), str(tiny))
    compared = report["compare"]["comet_test"]
    test = paired_bootstrap_segments([("a", ours.segments), ("b", theirs.segments)], f"COMET {tiny}")
    assert compared["comet"] == pytest.approx(theirs.system, abs=1e-6)
    assert compared["comet_segments"] == pytest.approx(theirs.segments, abs=1e-6)
    assert compared["p_value"] == pytest.approx(test.systems[1].p_value, abs=2e-3)  # segment noise at 1e-7
    assert compared["difference"] == pytest.approx(theirs.system - ours.system, abs=1e-6)
    assert compared["signature"] == f"COMET {tiny}|bs:1000|seed:12345"
    assert f"COMET     {report['comet']:.4f}  {tiny} (the mean of 24 segments)" in printed
    assert f"checkpoint COMET {report['comet']:.4f}" in printed
    assert f"compare    COMET {compared['comet']:.4f}" in printed
    assert printed.count("paired bootstrap") == 2  # BLEU's and COMET's

    # the same evaluation with another COMET model is another evaluation: its own files, the first kept
    other = write_tiny_comet(tmp_path / "softmax", "softmax_norm")
    status, printed = eval_in_process([*common, f"comet.model={other}"], monkeypatch, capsys)
    assert status == 0, printed
    second = set((tmp_path / "eval").glob("*.json")) - {written}
    assert len(second) == 1 and json.loads(written.read_text()) == report
    assert json.loads(second.pop().read_text())["comet_model"] == str(other)


def hub_cache(root: Path, repo: str, folder: Path) -> Path:
    """``folder`` as the Hugging Face cache holds a downloaded snapshot of ``repo``."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    entry = root / f"models--{repo.replace('/', '--')}"
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(commit)
    snapshot = entry / "snapshots" / commit
    shutil.copytree(folder, snapshot)
    return snapshot


def test_a_hub_id_is_read_from_the_cache_and_never_downloaded_unasked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev_extra("entmax")
    constants = dev_extra("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # read once at import: $HF_HUB_CACHE
    asked: list[str] = []

    def no_network(host: object, *args: object, **kwargs: object) -> list:
        asked.append(str(host))
        raise RuntimeError("this test has no network")  # not an OSError: no HTTP library retries it

    monkeypatch.setattr(socket, "getaddrinfo", no_network)  # what any library's connection asks first
    # the model and its encoder, each a Hub id in the cache, as Unbabel/wmt22-comet-da and xlm-roberta-large
    model = write_tiny_comet(tmp_path / "model", "softmax_norm")
    hub_cache(tmp_path / "hub", "someone/tiny-xlmr", model / "encoder")
    shutil.rmtree(model / "encoder")
    edited(model, tmp_path / "by_id", {"pretrained_model": "someone/tiny-xlmr"})
    snapshot = hub_cache(tmp_path / "hub", "someone/tiny-comet", tmp_path / "by_id")
    settings = CometSettings("someone/tiny-comet")
    assert settings.folder() == snapshot
    scores = settings.load(CPU).score(*columns(SAMPLES), batch_size=16)
    assert scores.segments == pytest.approx(REFERENCE["scores"]["softmax_norm"]["segments"], abs=1e-5)
    with pytest.raises(FieldError, match=r"^comet_model=someone/missing is not in the Hugging Face cache: "
                                         r"download it with comet.download=true"):  # fmt: skip
        CometSettings("someone/missing").folder()
    assert asked == []  # nothing above asked the network
    with pytest.raises(RuntimeError, match="this test has no network"):
        CometSettings("someone/missing", comet_download=True).folder()
    assert asked == ["huggingface.co"]  # asked to download: it tries


class Marker:
    """Writes a file when unpickled: a checkpoint holding it would run code if loaded unsafely."""

    path = ""

    def __reduce__(self) -> tuple:
        return (Path(self.path).touch, ())


def edited(tiny: Path, folder: Path, change: dict, weights: dict | None = None) -> Path:
    """A copy of the tiny model with ``change`` applied to its hyper-parameters (both copies) and
    ``weights`` to its state dict; its encoder's folder too, where it has one."""
    stored = torch.load(tiny / "checkpoints" / "model.ckpt", weights_only=True)
    stored["hyper_parameters"].update(change)
    stored["state_dict"].update(weights or {})
    (folder / "checkpoints").mkdir(parents=True)
    torch.save(stored, folder / "checkpoints" / "model.ckpt")
    (folder / "hparams.yaml").write_text(yaml.safe_dump(stored["hyper_parameters"]))
    if (tiny / "encoder").is_dir():
        shutil.copytree(tiny / "encoder", folder / "encoder")
    return folder


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"class_identifier": "unified_metric"}, "has class_identifier='unified_metric'; only regression_metric"),
        ({"encoder_model": "BERT"}, "has encoder_model='BERT'; only XLM-RoBERTa encoders are supported"),
        ({"pool": "mix"}, "has pool='mix'; it must be one of avg, max, cls"),
        ({"layer_transformation": "entmax15"}, "has layer_transformation='entmax15'; it must be one of"),
        ({"activations": "Linear"}, "has activations='Linear'; it must be one of Tanh, Sigmoid"),
        ({"final_activation": "Module"}, "has final_activation='Module'; it must be null or one of Tanh"),
        ({"layer_norm": "yes"}, "has layer_norm='yes'; it must be true or false"),
        ({"layer": 9}, "has layer=9, but its encoder has 2 layers"),
        ({"hidden_sizes": [48, 4096]}, "shape (16, 48) for estimator.3.weight; its settings make (4096, 48)"),
        ({"pretrained_model": "/etc"}, "names the encoder folder /etc, outside the model's folder"),
        ({"pretrained_model": "../encoder"}, "names the encoder folder ../encoder, outside the model's folder"),
        ({"pretrained_model": "not an id!"}, "names the encoder not an id!: neither a folder inside the model's nor"),
    ],
    ids=["class", "encoder", "pool", "transform", "activation", "final", "norm", "layer", "shapes", "absolute",
         "outside", "bad-id"],
)  # fmt: skip
def test_a_model_with_settings_it_cannot_honour_is_refused(
    change: dict, message: str, tiny: Path, tmp_path: Path
) -> None:
    if change.get("pretrained_model") == "../encoder":
        shutil.copytree(tiny / "encoder", tmp_path / "encoder")  # a folder beside the model's, not in it
    folder = edited(tiny, tmp_path / "edited", change)
    with pytest.raises(FieldError, match=re.escape(message)):
        CometSettings(str(folder)).load(CPU)


def test_an_activation_is_named_as_unbabel_comet_reads_it(tiny: Path, tmp_path: Path) -> None:
    """``getattr(torch.nn, name.title())``: ``tanh`` is ``Tanh``, so the same model scores the same."""
    folder = edited(tiny, tmp_path / "lower", {"activations": "tanh"})
    scores = CometSettings(str(folder)).load(CPU).score(*columns(SAMPLES), batch_size=16)
    assert scores.segments == pytest.approx(REFERENCE["scores"]["sparsemax"]["segments"], abs=1e-5)


def test_a_checkpoint_that_would_run_code_is_refused_unrun(tiny: Path, tmp_path: Path) -> None:
    folder = edited(tiny, tmp_path / "shared", {})
    Marker.path = str(tmp_path / "ran")
    stored = torch.load(tiny / "checkpoints" / "model.ckpt", weights_only=True)
    stored["callbacks"] = Marker()
    torch.save(stored, folder / "checkpoints" / "model.ckpt")
    with pytest.raises(FieldError, match="has a checkpoint that cannot be read safely"):
        CometSettings(str(folder)).load(CPU)
    assert not (tmp_path / "ran").exists()
    assert CometSettings(str(tiny / "checkpoints" / "model.ckpt")).folder() == tiny.resolve()  # the file: its model
    (tmp_path / "other").mkdir()
    shutil.copy(tiny / "checkpoints" / "model.ckpt", tmp_path / "other" / "model.ckpt")
    with pytest.raises(FieldError, match=r"is a file; give the model's folder \(with checkpoints/model.ckpt"):
        CometSettings(str(tmp_path / "other" / "model.ckpt")).folder()
    (folder / "checkpoints" / "model.ckpt").unlink()
    with pytest.raises(FieldError, match=r"is not a COMET model folder: it needs checkpoints/model.ckpt and hparams"):
        CometSettings(str(folder)).folder()


def test_a_model_aiayn_eval_cannot_score_with_is_refused_before_translating(
    smoke_run_dir: Path, tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    kiwi = edited(tiny, tmp_path / "kiwi", {"class_identifier": "unified_metric"})
    checkpoint = smoke_run_dir / "checkpoints" / "step0000012.ckpt"
    argv = [f"checkpoint={checkpoint}", f"comet.model={kiwi}", f"output_dir={tmp_path / 'eval'}"]
    status, printed = eval_in_process(argv, monkeypatch, capsys)
    assert status == 2 and printed.startswith(f"aiayn-eval: error: comet.model={kiwi} has class_identifier=")
    assert not (tmp_path / "eval").exists()  # nothing translated, nothing written


def test_comet_settings_are_checked_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    for argv, message in (
        (["comet.model=not a model"], "comet.model=not a model is neither a folder nor a Hub id"),
        (["comet.model=a/b", "comet.batch_size=0"], "comet.batch_size=0 must be a whole number >= 1"),
        (["comet.model=a/b", "comet.download=maybe"], "comet.download=maybe must be true or false"),
        (["comet.model=a/b", "tune.alpha=[0.6,1.0]"], "comet.model=a/b is for one setting; tune= ranks"),
    ):
        status, printed = eval_in_process(["checkpoint=model.ckpt", *argv], monkeypatch, capsys)
        assert status == 2 and printed.startswith(f"aiayn-eval: error: {message}"), printed
        assert len(printed.strip().splitlines()) == 1


def test_the_report_adds_test_comet_and_its_paired_test(
    smoke_run_dir: Path, corpus_root: Path, tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:  # fmt: skip
    sources = read_lines(corpus_root / "test_2016_flickr.en")[:16]  # a smoke run tests the first 16 lines
    tested = read_lines(corpus_root / "test_2016_flickr.de")[:16]
    hypotheses: dict[str, list[list[str]]] = {}
    for positional, drop in {"sinusoidal": 0.1, "learned": 0.6}.items():
        hypotheses[positional] = [perturbed(tested, drop, seed + len(hypotheses) * 10) for seed in (1, 2)]
        for seed, lines in zip((1, 2), hypotheses[positional], strict=True):
            copy_run(smoke_run_dir, tmp_path / "sweep" / f"p={positional},seed={seed}", positional, seed, lines)
    comet = CometSettings(str(tiny))
    written = write_report([tmp_path / "sweep"], tmp_path / "report", data_root=corpus_root, comet=comet)
    model = comet.load(CPU)
    per_run = {name: [model.score(sources, lines, tested, batch_size=16) for lines in runs]
               for name, runs in hypotheses.items()}  # fmt: skip
    rows = table_rows(written.markdown)
    first, second = rows
    base, other = (per_run[label.split("=")[1]] for label in (first, second))
    for label, scores in ((first, base), (second, other)):
        means = [s.system for s in scores]
        shown = f"{np.mean(means):.4f} ± {np.std(means, ddof=1):.4f}"
        assert rows[label]["COMET (test)"] == shown
    test = paired_bootstrap_segments(
        [("a", base[0].segments + base[1].segments), ("b", other[0].segments + other[1].segments)], "COMET"
    )
    p_value = test.systems[1].p_value
    assert rows[first]["p COMET (test)"] == ""
    assert rows[second]["p COMET (test)"] == f"{p_value:.4f}{'*' if p_value < 0.05 else ''}"
    assert f"COMET (test): the mean of the test segments' COMET ({tiny}" in written.markdown
    record = json.loads((tmp_path / "report" / "report.json").read_text())["rows"][1]["comet"]
    assert record["model"] == str(tiny) and record["p_test"] == pytest.approx(p_value) and record["test"]["n"] == 2
    assert "p_comet" in (tmp_path / "report" / "report.csv").read_text().splitlines()[0]

    # without --data-root there are no sources to score against: refused before anything is written
    argv = ["aiayn-report", str(tmp_path / "sweep"), "--out", str(tmp_path / "other"), "--comet", str(tiny),
            "--wandb", "disabled"]  # fmt: skip
    status = exit_status(report_cli.main, argv, monkeypatch)
    err = capsys.readouterr().err
    assert status == 2 and "--comet scores the test translations against their sources and references" in err
    assert not (tmp_path / "other").exists()
