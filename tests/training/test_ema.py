"""The exponential moving average of the weights (``ema.decay``): after each real optimizer step it is the
formula of the weights that step left (a step the non-finite guard skipped included), a resumed run
continues it bit for bit, two DDP ranks hold the same one, the run tests it as ``checkpoints/ema.ckpt``
(which aiayn-eval and aiayn-export take as any checkpoint), a bad setting is one line naming its key,
and a tampered EMA in a checkpoint is refused before anything is restored."""

from __future__ import annotations

import copy
import json
import math
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import sacrebleu
import torch

from aiayn.cli import evaluate as evaluate_cli
from aiayn.config.compose import compose_run_config
from aiayn.config.plan import plan_run
from aiayn.data.corpus import read_lines
from aiayn.errors import CheckpointError, ConfigError
from aiayn.experiments.run import build_trainer, run_callbacks, train
from aiayn.export.checkpoint import ExportSettings, export_checkpoint
from aiayn.export.folder import read_provenance
from aiayn.training.callbacks.ema import ExponentialMovingAverage
from aiayn.training.callbacks.preemption import Preempted
from aiayn.training.checkpoints import load_model
from aiayn.training.module import TranslationModule
from aiayn.training.restored_state import RestoredState
from helpers import ddp_ranks
from helpers.bleu import sacrebleu_of
from helpers.runs import exit_status, refusal, resumable_run

DECAY, START, STEPS = 0.8, 2, 6  # steps 1-2 copy the weights, 3-6 average them
SKIPPED = 4  # the optimizer step whose loss is made NaN: the guard skips its update
EVAL_PAIRS = 4
KEY = ExponentialMovingAverage(DECAY).state_key  # the EMA's entry in a checkpoint's callbacks
TIED = ("model.src_embed.weight", "model.tgt_embed.weight", "model.output_proj.weight")  # §3.4: one matrix


def ema_overrides(root: Path, cache: Path) -> list[str]:
    """A short resumable run with the EMA on, validated at its last step only, its untrained model's
    translations cut 3 tokens past the source; warmup 10 makes each step move the weights far more than
    the tolerance of the comparisons below."""
    extra = ["optim.warmup=10", "decoding.max_len_offset=3", f"ema.decay={DECAY}", f"ema.start_step={START}"]
    return resumable_run(root, cache, *extra, eval_pairs=EVAL_PAIRS)


def skip_step(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """Makes the training loss of optimizer step ``step`` (counted from 1) NaN, so that the guard skips it."""
    original = TranslationModule.training_loss

    def poisoned(self: TranslationModule, batch: dict[str, Any]) -> tuple[torch.Tensor, int]:
        loss, n_tokens = original(self, batch)
        return (loss * math.nan if self.trainer.global_step == step - 1 else loss), n_tokens

    monkeypatch.setattr(TranslationModule, "training_loss", poisoned)


class EmaWatch(pl.Callback):
    """Records, in float64, the weights the module starts from and those after each optimizer step, and
    the EMA after each step (the run's callbacks come before this one, the EMA's update included)."""

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []
        self.ema: list[dict[str, torch.Tensor]] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.weights.append({n: p.detach().double() for n, p in pl_module.named_parameters()})

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        if trainer.global_step == len(self.weights):  # a step ended (none happens mid-accumulation here)
            self.weights.append({n: p.detach().double() for n, p in pl_module.named_parameters()})
            self.ema.append({n: t.clone() for n, t in ddp_ranks.the_ema(trainer).weights.items()})


class SignalAfterStep(pl.Callback):
    """Sends this process SIGTERM once optimizer step ``step`` is done, as a scheduler preempting the job."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            signal.raise_signal(signal.SIGTERM)  # the run's Preemption callback handles it


def saved(run_dir: Path, name: str) -> dict[str, Any]:
    return torch.load(run_dir / "checkpoints" / name, weights_only=True)


@pytest.fixture(scope="module")
def ema_run(
    corpus_root: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], Path, EmaWatch]:
    """The 6-step run of :func:`ema_overrides`, its step 4 skipped: results, folder, recorded weights and EMA."""
    run_dir = tmp_path_factory.mktemp("ema") / "run"
    overrides = [*ema_overrides(corpus_root, cache_dir), f"trainer.max_steps={STEPS}"]
    watch = EmaWatch()
    with pytest.MonkeyPatch.context() as monkeypatch:
        skip_step(monkeypatch, SKIPPED)
        results = train(compose_run_config(overrides), run_dir, overrides, callbacks=[watch])
    return results, run_dir, watch


def test_the_ema_after_each_real_step_is_the_formula_of_the_weights_that_step_left(
    ema_run: tuple[dict[str, Any], Path, EmaWatch],
) -> None:
    results, run_dir, watch = ema_run
    assert results["steps"] == STEPS and len(watch.weights) == len(watch.ema) + 1 == STEPS + 1
    before, after = watch.weights[SKIPPED - 1], watch.weights[SKIPPED]
    assert all(torch.equal(before[name], after[name]) for name in before)  # the skipped step changed no weight
    expected = dict(watch.weights[0])
    for step in range(1, STEPS + 1):
        weights = watch.weights[step]
        # the skipped step too: the EMA moves toward the unchanged weights, as the schedule moves on
        expected = {n: w if step <= START else DECAY * expected[n] + (1 - DECAY) * w for n, w in weights.items()}
        ema = watch.ema[step - 1]
        assert ema.keys() == expected.keys() and all(t.dtype == torch.float32 for t in ema.values())
        for name, value in expected.items():
            torch.testing.assert_close(ema[name].double(), value, rtol=1e-6, atol=1e-7, msg=f"step {step}: {name}")
    # an average, not a copy: the EMA lags the final weights by far more than the tolerance
    assert max((ema[n].double() - w).abs().max().item() for n, w in weights.items()) > 1e-3
    stored = saved(run_dir, "last.ckpt")["callbacks"][KEY]["weights"]  # the final step's, bit for bit
    assert stored.keys() == ema.keys() and all(torch.equal(stored[n], ema[n]) for n in ema)


def test_the_run_tests_ema_ckpt_which_aiayn_eval_and_aiayn_export_take_as_any_checkpoint(
    ema_run: tuple[dict[str, Any], Path, EmaWatch],
    corpus_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    results, run_dir, watch = ema_run
    ema, path = watch.ema[-1], run_dir / "checkpoints" / "ema.ckpt"
    checkpoint = saved(run_dir, "ema.ckpt")
    assert checkpoint["global_step"] == STEPS and not {"optimizer_states", "loops", "callbacks"} & set(checkpoint)
    weights = checkpoint["state_dict"]
    assert weights.keys() == saved(run_dir, "last.ckpt")["state_dict"].keys()
    assert all(torch.equal(weights[name], ema[name]) for name in ema)
    assert len({weights[name].data_ptr() for name in TIED}) == 1  # the tied matrices stay one tensor

    references = read_lines(corpus_root / "test_2016_flickr.de")[:EVAL_PAIRS]
    score, signature = sacrebleu_of(run_dir / "test.ema.hyp.txt", references)
    assert results["test_bleu_ema"] == pytest.approx(score, abs=1e-9) and results["sacrebleu_signature"] == signature
    hypotheses = read_lines(run_dir / "test.ema.hyp.txt")
    assert results["test_chrf_ema"] == pytest.approx(sacrebleu.corpus_chrf(hypotheses, [references]).score, abs=1e-9)

    model, _, _ = load_model(path)
    assert all(torch.equal(weights[f"model.{name}"], tensor) for name, tensor in model.state_dict().items())
    for lang, name in (("en", "src.en"), ("de", "ref.de")):
        lines = read_lines(corpus_root / f"test_2016_flickr.{lang}")[:4]
        (tmp_path / name).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    texts = [
        f"source={tmp_path / 'src.en'}",
        f"reference={tmp_path / 'ref.de'}",
        "decoding=greedy",
        "decoding.max_len_offset=3",
    ]
    argv = ["aiayn-eval", f"checkpoint={path}", *texts, f"output_dir={tmp_path / 'eval'}"]
    assert exit_status(evaluate_cli.main, argv, monkeypatch) == 0
    (report,) = (tmp_path / "eval").glob("ema.src.en.beam1-alpha0.0.*.json")
    assert json.loads(report.read_text())["sentences"] == 4
    export_checkpoint(ExportSettings(path, "ctranslate2", tmp_path / "exported"))
    provenance = read_provenance(tmp_path / "exported")
    assert provenance["checkpoint"] == str(path.resolve()) and provenance["global_step"] == STEPS


def test_a_run_without_ema_writes_no_ema_checkpoint_scores_or_state(
    corpus_root: Path, cache_dir: Path, tmp_path: Path
) -> None:
    overrides = [
        *resumable_run(corpus_root, cache_dir, pairs=100, eval_pairs=EVAL_PAIRS),
        "trainer.max_steps=2",
        "decoding.max_len_offset=3",
        "ema.decay=null",  # the default's EMA off: the run answers with its evaluated checkpoint
        "checkpoint.answer=evaluated",
    ]
    results = train(compose_run_config(overrides), tmp_path, overrides)
    assert "test_bleu" in results and not {"test_bleu_ema", "test_chrf_ema"} & set(results)
    assert results["answer"] == "best" and results["answer_test_bleu"] == results["test_bleu"]
    assert not (tmp_path / "checkpoints" / "ema.ckpt").exists()
    assert not (tmp_path / "test.ema.hyp.txt").exists()
    assert not any(key.startswith("ExponentialMovingAverage") for key in saved(tmp_path, "last.ckpt")["callbacks"])


def test_a_preempted_and_requeued_run_continues_the_ema_of_an_uninterrupted_run_bit_for_bit(
    ema_run: tuple[dict[str, Any], Path, EmaWatch],
    corpus_root: Path,
    cache_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGTERM after step 3 (the first averaging step): last.ckpt is written inside that step, after the
    EMA's update; the same command in the same folder continues to step 6 (step 4 skipped again)."""
    _, whole_dir, _ = ema_run
    skip_step(monkeypatch, SKIPPED)
    overrides = [*ema_overrides(corpus_root, cache_dir), f"trainer.max_steps={STEPS}"]
    run_dir = tmp_path / "run"
    with pytest.raises(Preempted):
        train(compose_run_config(overrides), run_dir, overrides, callbacks=[SignalAfterStep(3)])
    assert saved(run_dir, "last.ckpt")["global_step"] == 3
    results = train(compose_run_config(overrides), run_dir, overrides)
    assert results["steps"] == STEPS and results["resumed_from"] == str(run_dir / "checkpoints" / "last.ckpt")
    expected, actual = saved(whole_dir, "last.ckpt"), saved(run_dir, "last.ckpt")
    expected, actual = expected["callbacks"][KEY]["weights"], actual["callbacks"][KEY]["weights"]
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    expected, actual = saved(whole_dir, "ema.ckpt")["state_dict"], saved(run_dir, "ema.ckpt")["state_dict"]
    assert expected.keys() == actual.keys() and all(torch.equal(expected[name], actual[name]) for name in expected)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("ema.decay=1.5", "ema.decay=1.5"),
        ("ema.decay=-0.1", "ema.decay=-0.1"),
        ("ema.decay=true", "ema.decay=true"),
        ("ema.start_step=-1", "ema.start_step=-1"),
        ("ema=0.999", "ema=0.999"),
        ("+ema.deacy=0.9", "ema.deacy=0.9"),
    ],
)
def test_a_bad_ema_setting_is_refused_before_any_work_naming_its_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as refused:
        plan_run(compose_run_config([override]), [override])
    assert str(refused.value).startswith(key) and "\n" not in str(refused.value)


def test_aiayn_train_with_a_bad_ema_decay_ends_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    error = refusal(["ema.decay=1.5"], monkeypatch, capsys)
    assert error == "ema.decay=1.5 must lie in [0, 1) (e.g. 0.999), or be null or 0 for no EMA"


@pytest.fixture(scope="module")
def ema_restorer(ema_run: tuple[dict[str, Any], Path, EmaWatch], corpus_root: Path, cache_dir: Path) -> RestoredState:
    """The check a resume of the EMA run passes its checkpoints through, built as aiayn-train builds it."""
    _, run_dir, _ = ema_run
    plan = plan_run(compose_run_config(ema_overrides(corpus_root, cache_dir)))
    module = plan.module.build()
    module.trainer = build_trainer(plan, run_dir, run_callbacks(plan, run_dir).all(), [], module)
    return RestoredState(run_dir / "checkpoints", module)


def changed_ema(change: Callable[[torch.Tensor], Any]) -> Callable[[dict[str, Any]], None]:
    """A change of a checkpoint's EMA of the shared embedding matrix (``change`` of it replaces it)."""

    def apply(checkpoint: dict[str, Any]) -> None:
        weights = checkpoint["callbacks"][KEY]["weights"]
        weights[TIED[0]] = change(weights[TIED[0]])

    return apply


def added_ema(checkpoint: dict[str, Any]) -> None:
    checkpoint["callbacks"][KEY]["weights"]["model.extra"] = torch.zeros(1)


def dropped_ema(checkpoint: dict[str, Any]) -> None:
    del checkpoint["callbacks"][KEY]["weights"][TIED[0]]


EMA_FIELD = f"callbacks[{KEY!r}]"


@pytest.mark.parametrize(
    ("field", "change"),
    [
        (f"weights[{TIED[0]}]=torch.float32 (1, 64)", changed_ema(lambda t: t[:1])),
        (f"weights[{TIED[0]}]=torch.float16", changed_ema(lambda t: t.half())),
        (
            f"weights[{TIED[0]}]=its values are not all finite",
            changed_ema(lambda t: t.index_fill(0, torch.tensor([7]), math.nan)),
        ),
        (f"weights[{TIED[0]}]=list", changed_ema(lambda t: [1.0])),
        ("weights[model.extra]=present", added_ema),
        (f"weights[{TIED[0]}]=missing", dropped_ema),
        (f"{EMA_FIELD}.step=present", lambda c: c["callbacks"][KEY].update(step=3)),
        (f"{EMA_FIELD}=list is not a mapping", lambda c: c["callbacks"].update({KEY: [1]})),
    ],
)
def test_a_checkpoint_with_a_tampered_ema_is_refused_naming_the_field(
    ema_restorer: RestoredState,
    ema_run: tuple[dict[str, Any], Path, EmaWatch],
    field: str,
    change: Callable[[dict[str, Any]], Any],
) -> None:
    path = ema_run[1] / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    assert ema_restorer(copy.deepcopy(checkpoint), path)["callbacks"][KEY]  # as written, it passes, EMA kept
    change(checkpoint)
    with pytest.raises(CheckpointError) as refused:
        ema_restorer(checkpoint, path)
    message = str(refused.value)
    assert "\n" not in message and str(path) in message and field in message, message


@pytest.mark.slow
def test_two_ddp_ranks_hold_the_same_ema_which_the_checkpoint_and_ema_ckpt_hold(ddp_run: Path) -> None:
    results = json.loads((ddp_run / "results.json").read_text())
    assert results["batch"]["world_size"] == 2 and results["steps"] == ddp_ranks.STEPS and "test_bleu_ema" in results
    ranks = [torch.load(ddp_run / f"ema.rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    stored, written = saved(ddp_run, "last.ckpt")["callbacks"][KEY]["weights"], saved(ddp_run, "ema.ckpt")
    assert ranks[0].keys() == ranks[1].keys() == stored.keys()
    for name in stored:
        assert torch.equal(ranks[0][name], ranks[1][name]) and torch.equal(ranks[0][name], stored[name]), name
        assert torch.equal(written["state_dict"][name], stored[name]), name
    weights = saved(ddp_run, "last.ckpt")["state_dict"]  # an average of 3 averaging steps, not the weights
    assert not all(torch.equal(weights[name], stored[name]) for name in stored)
