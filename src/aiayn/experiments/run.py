"""One training run, as a story: check the config → build the data, the module, the callbacks and the
trainer → fit → validate and test the evaluated checkpoint (the best, or the final one), test the average
of the newest → ``results.json``.

The composed config comes from Hydra (``aiayn-train``) or :func:`aiayn.config.compose.compose_run_config`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from hydra.utils import instantiate
from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import Logger
from pytorch_lightning.utilities.rank_zero import rank_zero_only

from aiayn.config.build import build_loggers, instantiated, module_kwargs, trainer_options
from aiayn.config.naming import run_identity
from aiayn.config.preflight import check_run_config
from aiayn.data import TranslationDataModule
from aiayn.experiments.resume import resume_from
from aiayn.files import atomic_write, run_folder_held
from aiayn.model import count_parameters
from aiayn.scoring import corpus_scores
from aiayn.training.batching import batch_layout, configure_batching
from aiayn.training.callbacks.checkpointing import FinalStepValidation, LastCheckpoint, validation_checkpoints
from aiayn.training.callbacks.faults import NonFiniteGuard
from aiayn.training.callbacks.preemption import Preemption
from aiayn.training.callbacks.progress import progress_callbacks, progress_style
from aiayn.training.callbacks.run_state import RandomState, SelfContainedCheckpoints
from aiayn.training.callbacks.samples import ValidationSamples
from aiayn.training.callbacks.throughput import TokenThroughput
from aiayn.training.checkpoints import (
    RunCheckpointIO,
    average_checkpoints,
    save_checkpoint,
    step_checkpoints,
)
from aiayn.training.loggers import finish_loggers, log_run_config
from aiayn.training.module import TranslationModule
from aiayn.training.restored_state import RestoredState


@dataclass
class RunResults:
    """``results.json``: what a finished run reports, each field once. The test fields are absent for a
    corpus without a test split, the averaged ones when fewer than two checkpoints were averaged."""

    params: int
    val_bleu: float  # val_* and test_* are the evaluated checkpoint's
    val_ppl: float
    val_loss: float
    best_val_bleu: float | None  # the best validation BLEU of the run (best.ckpt's), when it monitors val/bleu
    decoding: dict[str, Any]
    steps: int
    epochs: int
    train_tokens: int  # real source + target tokens of the whole run, all ranks, resumed parts included
    train_tokens_per_s: float
    evaluated: str  # checkpoint.evaluate: "best" or "final"
    evaluated_checkpoint: str  # relative to the run folder, unless it lies in the folder of a resumed run
    best_checkpoint: str
    resumed_from: str | None
    test: dict[str, Any]  # test_bleu, test_chrf, test_ppl, test_split, test_sentences, sacrebleu_signature
    averaged: dict[str, Any]  # test_bleu_averaged, test_chrf_averaged, averaged_checkpoints
    batch: dict[str, Any]  # the effective batch (aiayn.training.batching)
    data: dict[str, int]  # pairs kept and dropped, by reason (aiayn.data.datamodule)
    data_cache: str  # the data's cache entry: corpus content, direction and vocabulary (what aiayn-report keys by)
    skipped_steps: int  # non-finite loss or gradients (aiayn.training.callbacks.faults)
    overflow_steps: int  # fp16 steps the gradient scaler skipped
    wall_s: float
    overrides: list[str]  # the command line's, which define the run

    def to_dict(self) -> dict[str, Any]:
        """The fields in order, with the test and averaged scores' own keys in place of the two groups."""
        flat: dict[str, Any] = {}
        for key, value in asdict(self).items():
            flat.update(value if key in ("test", "averaged") else {key: value})
        return flat


@dataclass
class RunCallbacks:
    """The callbacks every run has, by role; :meth:`all` in the order Lightning runs them (it moves the
    checkpoint writers, :class:`~pytorch_lightning.callbacks.Checkpoint` subclasses, to the end). At a
    validation ``last.ckpt`` is written after ``best.ckpt`` and the step checkpoint: a run killed between
    them continues from the previous ``last.ckpt`` and writes them again (the newer step checkpoint is
    set aside), and one killed after it has every checkpoint of the validation."""

    best: ModelCheckpoint
    last: LastCheckpoint
    steps: ModelCheckpoint
    preemption: Preemption
    guard: NonFiniteGuard
    throughput: TokenThroughput
    others: list[pl.Callback]

    def all(self) -> list[pl.Callback]:
        return [self.best, self.steps, self.last, self.preemption, self.guard, self.throughput, *self.others]


def train(
    cfg: DictConfig,
    run_dir: Path,
    overrides: Sequence[str] = (),
    group: str | None = None,
    callbacks: Sequence[pl.Callback] = (),
) -> dict[str, Any]:
    """Train as ``cfg`` says, writing checkpoints, metrics and ``results.json`` into ``run_dir``.

    ``overrides`` (the command line's) name the run on the dashboard and ``group`` (its sweep's or
    multirun's) groups it; ``callbacks`` join the run's own. The loggers' runs are finished also when
    training raises.

    The run continues from ``cfg.resume`` when set, or from ``run_dir/checkpoints/last.ckpt`` when the
    folder has one (a requeued SLURM job, a restarted run): weights, optimizer, schedule, the position
    in the epoch and the random state, so that it ends as an uninterrupted run would.
    """
    start = time.perf_counter()
    with sole_writer(run_dir):
        # Every setting is checked before any work starts: a typo costs seconds, not a queued job.
        check_run_config(cfg)
        progress = progress_style(cfg.progress)
        datamodule = instantiated(cfg.data)
        resolved = OmegaConf.to_container(cfg, resolve=True)
        run = run_callbacks(cfg, run_dir, resolved, overrides, progress)  # their settings are checked here
        loggers = build_loggers(cfg.logger, run_dir, run_identity(cfg.name, overrides, group))
        if rank_zero_only.rank == 0:  # before the DDP ranks start: a data error ends the run here, in one line
            datamodule.prepare_data()
        pl.seed_everything(cfg.seed, workers=True)  # before the module: its initial weights are drawn
        module = TranslationModule(**module_kwargs(cfg))
        trainer = build_trainer(cfg.trainer, run_dir, progress, [*run.all(), *callbacks], loggers, module)
        batching = configure_batching(trainer, cfg.tokens_per_step, cfg.data.max_tokens, cfg.checkpoint.every_steps)
        own = overrides if group else None  # a multirun's job, a sweep's trial: its folder is its overrides'
        resume = resume_from(cfg.resume, run_dir, resolved, datamodule.cache_folder(), batch_layout(trainer), own)
        run_dir.mkdir(parents=True, exist_ok=True)
        if trainer.is_global_zero:
            atomic_write(run_dir / "config.yaml", OmegaConf.to_yaml(resolved))
        results = None
        try:
            log_run_config(loggers, resolved, overrides, trainer, module.model, batching)
            fit(trainer, module, datamodule, run.last, resume)
            best = best_checkpoint(run)
            evaluated = best if cfg.checkpoint.evaluate == "best" else run.last.path
            val = validate_checkpoint(trainer, module, datamodule, evaluated)
            test = test_checkpoint(trainer, module, datamodule, evaluated, run_dir)
            averaged = test_averaged(trainer, module, datamodule, run_dir, cfg.checkpoint.average_last)
            results = RunResults(
                params=count_parameters(module.model),
                val_bleu=val["val/bleu"],
                val_ppl=val["val/ppl"],
                val_loss=val["val/loss"],
                best_val_bleu=best_score(run.best),
                decoding=module.decoding.to_dict(),
                steps=trainer.global_step,
                epochs=trainer.current_epoch,
                train_tokens=run.throughput.all_tokens,
                train_tokens_per_s=run.throughput.tokens_per_s,
                evaluated=cfg.checkpoint.evaluate,
                evaluated_checkpoint=in_run(evaluated, run_dir),
                best_checkpoint=in_run(best, run_dir),
                resumed_from=str(resume) if resume else None,
                batch=batching,
                data=datamodule.filtered,
                data_cache=datamodule.cache_folder().name,
                skipped_steps=run.guard.skipped,
                overflow_steps=run.guard.overflows,
                wall_s=time.perf_counter() - start,
                overrides=list(overrides),
                test=test,
                averaged=averaged,
            ).to_dict()
            if trainer.is_global_zero:
                atomic_write(run_dir / "results.json", json.dumps(results, indent=2) + "\n")
        finally:
            finish_loggers(loggers, failed=results is None, summary=results)
        return results


def best_checkpoint(run: RunCallbacks) -> Path:
    """``best.ckpt``; ``last.ckpt`` when no validation ranked one, or when a resume set the abandoned
    branch's best aside and no later validation bettered the score it resumed with."""
    best = Path(run.best.best_model_path) if run.best.best_model_path else None
    return best if best is not None and best.is_file() else run.last.path


def best_score(best: ModelCheckpoint) -> float | None:
    """The best validation BLEU (the score of ``best.ckpt``) when the run ranks by it."""
    score = best.best_model_score
    return float(score) if best.monitor == "val/bleu" and score is not None else None


def in_run(path: Path, run_dir: Path) -> str:
    """``path`` relative to the run folder, unless it lies in the folder of a resumed run."""
    return str(path.relative_to(run_dir) if path.is_relative_to(run_dir) else path)


def sole_writer(run_dir: Path) -> AbstractContextManager[None]:
    """This process is the one writer of ``run_dir`` while the run lasts (:mod:`aiayn.files`); under DDP
    the first rank holds it for all (the others write nothing there that it does not coordinate)."""
    return run_folder_held(run_dir) if rank_zero_only.rank == 0 else nullcontext()


def run_callbacks(
    cfg: DictConfig, run_dir: Path, resolved: dict[str, Any], overrides: Sequence[str], progress: str
) -> RunCallbacks:
    """The callbacks of a run as ``cfg`` sets them, the user's ``callbacks`` entries among the others."""
    best, last, steps = validation_checkpoints(
        run_dir / "checkpoints", cfg.checkpoint.monitor, cfg.checkpoint.mode, cfg.checkpoint.keep_last
    )
    return RunCallbacks(
        best=best,
        last=last,
        steps=steps,
        preemption=Preemption(last),
        guard=NonFiniteGuard(cfg.max_nonfinite_steps, last.path),
        throughput=TokenThroughput(peak_tflops=cfg.peak_tflops),
        others=[
            FinalStepValidation(),
            SelfContainedCheckpoints(resolved, overrides),
            RandomState(),
            ValidationSamples(cfg.dashboard.samples, cfg.dashboard.attention_every),
            *progress_callbacks(progress),
            *(instantiate(callback) for callback in cfg.callbacks),
        ],
    )


def build_trainer(
    trainer: DictConfig,
    run_dir: Path,
    progress: str,
    callbacks: list[pl.Callback],
    loggers: list[Logger],
    module: TranslationModule,
) -> pl.Trainer:
    """Lightning's Trainer with the ``trainer`` section's arguments. Its checkpoints go through
    :class:`~aiayn.training.checkpoints.RunCheckpointIO`: written atomically (unless the user brings
    their own checkpoint input/output, for cloud storage ...), checked against ``module`` and this run
    before anything is restored, deleted only inside ``run_dir/checkpoints``."""
    options = trainer_options(trainer)
    options.setdefault("enable_progress_bar", progress != "quiet")  # an explicit trainer.* wins
    options.setdefault("enable_model_summary", progress != "quiet")
    plugins = list(options.pop("plugins", None) or [])
    own = [plugin for plugin in plugins if isinstance(plugin, CheckpointIO)]
    folder = run_dir / "checkpoints"
    io = RunCheckpointIO(folder, RestoredState(folder, module), inner=own[0] if own else None)
    plugins = [plugin for plugin in plugins if not isinstance(plugin, CheckpointIO)] + [io]
    return pl.Trainer(**options, callbacks=callbacks, logger=loggers, plugins=plugins, default_root_dir=str(run_dir))


def fit(
    trainer: pl.Trainer,
    module: TranslationModule,
    datamodule: TranslationDataModule,
    last: LastCheckpoint,
    resume: Path | None,
) -> None:
    """Train (from ``resume`` when given) until a limit; ``last.ckpt`` then holds the final state."""
    trainer.fit(module, datamodule=datamodule, ckpt_path=str(resume) if resume else None, weights_only=True)
    last.after_fit(trainer)
    # Continued from its final checkpoint (a run killed while it evaluated), Lightning skips the loop and
    # keeps the counters of the middle of the last step, which the evaluations after training are logged
    # at; an uninterrupted fit ends with them at the final step and with its last epoch ended.
    trainer.fit_loop.epoch_loop._batches_that_stepped = trainer.global_step
    epochs = trainer.fit_loop.epoch_progress.current
    epochs.processed = epochs.completed = epochs.started


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
    ckpt_path = str(checkpoint)
    test = trainer.test(module, datamodule=datamodule, ckpt_path=ckpt_path, verbose=False, weights_only=True)[0]
    scores = test_scores(trainer, module, datamodule, run_dir / "test.hyp.txt")
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
    trainer.test(module, datamodule=datamodule, ckpt_path=str(averaged), verbose=False, weights_only=True)
    scores = test_scores(trainer, module, datamodule, run_dir / "test.averaged.hyp.txt")
    return {
        "test_bleu_averaged": scores["sacrebleu"],
        "test_chrf_averaged": scores["chrf"],
        "averaged_checkpoints": [source.name for source in sources],
    }


def test_scores(
    trainer: pl.Trainer, module: TranslationModule, datamodule: TranslationDataModule, output: Path
) -> dict[str, Any]:
    """Corpus scores of the test hypotheses just made; rank 0 writes them to ``output`` in corpus order
    (every rank has all hypotheses and scores)."""
    references = datamodule.references["test"]
    missing = len(references) - len(module.test_hypotheses)
    if missing:
        raise RuntimeError(f"{missing} of {len(references)} test sentences were not translated")
    ordered = [module.test_hypotheses[i] for i in range(len(references))]
    if trainer.is_global_zero:
        atomic_write(output, "".join(line + "\n" for line in ordered))
    return corpus_scores(ordered, references)
