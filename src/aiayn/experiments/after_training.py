"""What a run does once training ends: the evaluated checkpoint validated and tested, the average of the
newest step checkpoints (§6.1) and the EMA of the weights written, tested and validated, and the run's
answer chosen among them (``checkpoint.answer``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytorch_lightning as pl

from aiayn.data import TranslationDataModule
from aiayn.files import TEST_TRANSLATIONS, atomic_write
from aiayn.scoring import corpus_scores
from aiayn.training.callbacks.checkpointing import LastCheckpoint
from aiayn.training.callbacks.ema import ExponentialMovingAverage, ema_checkpoint
from aiayn.training.checkpoint_policy import CheckpointPolicy
from aiayn.training.checkpoints import average_checkpoints, load_checkpoint, save_checkpoint, step_checkpoints
from aiayn.training.module import TranslationModule

log = logging.getLogger(__name__)


def run_answer(
    policy: CheckpointPolicy,
    evaluated: str,
    val_bleu: float,
    test: dict[str, Any],
    averaged: dict[str, Any],
    ema: dict[str, Any],
) -> dict[str, Any]:
    """The run's answer (``checkpoint.answer``): which tested checkpoint it is and its test scores (None
    without a test split). A run too short to average (fewer than two step checkpoints) answers with
    the evaluated checkpoint, and says so. ``by_validation``: of the tested checkpoints, the one with the
    highest validation BLEU (``val_bleu``: the evaluated one's), the first of equal ones in the order
    evaluated, averaged, EMA."""
    name, checkpoint, scores = policy.evaluate, evaluated, (test.get("test_bleu"), test.get("test_chrf"))
    wanted = policy.answer
    if wanted == "by_validation":
        validated = {"evaluated": val_bleu, "averaged": averaged.get("val_bleu_averaged")}
        validated["ema"] = ema.get("val_bleu_ema")
        wanted = max((kind for kind in validated if validated[kind] is not None), key=lambda kind: validated[kind])
    if wanted == "averaged" and averaged:
        name, checkpoint = "averaged", "checkpoints/averaged.ckpt"
        scores = (averaged["test_bleu_averaged"], averaged["test_chrf_averaged"])
    elif wanted == "averaged" and test:
        log.warning("checkpoint.answer=averaged: fewer than two step checkpoints to average; the answer is %s", name)
    elif wanted == "ema":
        name, checkpoint = "ema", "checkpoints/ema.ckpt"
        scores = (ema.get("test_bleu_ema"), ema.get("test_chrf_ema"))
    bleu, chrf = scores
    return {"answer": name, "answer_checkpoint": checkpoint, "answer_test_bleu": bleu, "answer_test_chrf": chrf}


def validate_checkpoint(
    trainer: pl.Trainer, module: TranslationModule, datamodule: TranslationDataModule, checkpoint: Path
) -> dict[str, float]:
    """The validation metrics of ``checkpoint``."""
    ckpt_path = str(checkpoint)
    return trainer.validate(module, datamodule=datamodule, ckpt_path=ckpt_path, verbose=False, weights_only=True)[0]


def test_checkpoint(
    trainer: pl.Trainer, module: TranslationModule, datamodule: TranslationDataModule, checkpoint: Path, run_dir: Path
) -> dict[str, Any]:
    """``checkpoint``'s test scores (``test.hyp.txt`` holds its translations); none without a test split."""
    if "test" not in datamodule.roles:
        return {}
    test, scores = test_and_score(trainer, module, datamodule, checkpoint, run_dir / TEST_TRANSLATIONS["evaluated"])
    return {
        "test_bleu": scores["sacrebleu"],
        "test_chrf": scores["chrf"],
        "test_ppl": test["test/ppl"],
        "test_split": datamodule.split_names["test"],
        "test_sentences": len(datamodule.references["test"]),  # fewer than the split's with data.eval_limit
        "sacrebleu_signature": scores["sacrebleu_signature"],
    }


def test_averaged(
    trainer: pl.Trainer, module: TranslationModule, datamodule: TranslationDataModule, run_dir: Path, average_last: int
) -> dict[str, Any]:
    """Test scores of the element-wise mean of the newest ``average_last`` step checkpoints (§6.1), written
    as ``checkpoints/averaged.ckpt``; none with a single one (averaging it would only copy it)."""
    sources = step_checkpoints(run_dir)[-average_last:] if average_last >= 2 else []
    if "test" not in datamodule.roles or len(sources) < 2:
        return {}
    averaged = run_dir / "checkpoints" / "averaged.ckpt"
    if trainer.is_global_zero:
        save_checkpoint(average_checkpoints(sources), averaged)
    trainer.strategy.barrier("averaged checkpoint written")
    _, scores = test_and_score(trainer, module, datamodule, averaged, run_dir / TEST_TRANSLATIONS["averaged"])
    return {
        "test_bleu_averaged": scores["sacrebleu"],
        "test_chrf_averaged": scores["chrf"],
        "val_bleu_averaged": validated_bleu(trainer, module, datamodule, averaged),
        "averaged_checkpoints": [source.name for source in sources],
    }


def test_ema(
    trainer: pl.Trainer,
    module: TranslationModule,
    datamodule: TranslationDataModule,
    run_dir: Path,
    ema: ExponentialMovingAverage | None,
    last: LastCheckpoint,
) -> dict[str, Any]:
    """Test scores of the EMA of the weights (``ema``: the run's callback), written as
    ``checkpoints/ema.ckpt`` from the final checkpoint (``last.ckpt``, which holds the EMA of its step);
    none when the run keeps no EMA. Written and validated without a test split too: a checkpoint like any
    other, for aiayn-eval, aiayn-translate and aiayn-export, which ``checkpoint.answer=by_validation`` may
    name the run's answer."""
    if ema is None:
        return {}
    path = run_dir / "checkpoints" / "ema.ckpt"
    if trainer.is_global_zero:  # mapped, not read: only the weights and the EMA are copied
        save_checkpoint(ema_checkpoint(load_checkpoint(last.path, mmap=True), ema.state_key), path)
    trainer.strategy.barrier("EMA checkpoint written")
    if "test" not in datamodule.roles:
        return {"val_bleu_ema": validated_bleu(trainer, module, datamodule, path)}
    _, scores = test_and_score(trainer, module, datamodule, path, run_dir / TEST_TRANSLATIONS["ema"])
    return {
        "test_bleu_ema": scores["sacrebleu"],
        "test_chrf_ema": scores["chrf"],
        "val_bleu_ema": validated_bleu(trainer, module, datamodule, path),
    }


def validated_bleu(
    trainer: pl.Trainer, module: TranslationModule, datamodule: TranslationDataModule, checkpoint: Path
) -> float:
    """The validation BLEU of ``checkpoint``, not logged: the dashboards' final ``val/*`` stay the
    evaluated checkpoint's, and ``checkpoint.answer=by_validation`` compares it with this."""
    loggers, trainer.loggers = trainer.loggers, []
    try:
        return float(validate_checkpoint(trainer, module, datamodule, checkpoint)["val/bleu"])
    finally:
        trainer.loggers = loggers


def test_and_score(
    trainer: pl.Trainer, module: TranslationModule, datamodule: TranslationDataModule, checkpoint: Path, output: Path
) -> tuple[dict[str, float], dict[str, Any]]:
    """Test ``checkpoint``: the metrics it logs and the corpus scores of its translations, which rank 0
    writes to ``output`` in corpus order (every rank has all hypotheses and scores)."""
    ckpt_path = str(checkpoint)
    test = trainer.test(module, datamodule=datamodule, ckpt_path=ckpt_path, verbose=False, weights_only=True)[0]
    references = datamodule.references["test"]
    missing = len(references) - len(module.test_hypotheses)
    if missing:
        raise RuntimeError(f"{missing} of {len(references)} test sentences were not translated")
    ordered = [module.test_hypotheses[i] for i in range(len(references))]
    if trainer.is_global_zero:
        atomic_write(output, "".join(line + "\n" for line in ordered))
    return test, corpus_scores(ordered, references)
