"""One training run, as a recipe: plan it (every setting checked and built once, :mod:`aiayn.config.plan`)
→ the callbacks, loggers, data, module and trainer → continue a checkpoint, or not → fit → validate and
test the evaluated checkpoint (the best, or the final one), the average of the newest and the EMA of the
weights, and choose the run's answer (:mod:`aiayn.experiments.after_training`) → ``results.json``.

The composed config comes from Hydra (``aiayn-train``) or :func:`aiayn.config.compose.compose_run_config`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import Logger
from pytorch_lightning.utilities.rank_zero import rank_zero_only

from aiayn.config.build import build_loggers, config_keys, instantiated
from aiayn.config.plan import FIT_KEYS, RunPlan, plan_run
from aiayn.data import TranslationDataModule
from aiayn.errors import ConfigError
from aiayn.experiments.after_training import run_answer, test_averaged, test_checkpoint, test_ema, validate_checkpoint
from aiayn.experiments.results import RESULTS_FILE, RunResults
from aiayn.experiments.resume import requested_checkpoint, resume_from
from aiayn.experiments.run_info import log_run_config, software_versions
from aiayn.files import atomic_write, run_folder_held
from aiayn.model import count_parameters
from aiayn.training.batching import batch_layout
from aiayn.training.callbacks.checkpointing import FinalStepValidation, LastCheckpoint, validation_checkpoints
from aiayn.training.callbacks.ema import ExponentialMovingAverage
from aiayn.training.callbacks.faults import NonFiniteGuard
from aiayn.training.callbacks.garbage import FreedMemoryRelease
from aiayn.training.callbacks.namespaces import as_callback
from aiayn.training.callbacks.preemption import Preemption
from aiayn.training.callbacks.progress import progress_callbacks
from aiayn.training.callbacks.run_state import RandomState, SelfContainedCheckpoints
from aiayn.training.callbacks.shapes import ShapeWarmUp
from aiayn.training.callbacks.throughput import TokenThroughput
from aiayn.training.checkpoint_io import RunCheckpointIO
from aiayn.training.cluster import cluster_environment
from aiayn.training.loggers.finish import finish_loggers
from aiayn.training.module import TranslationModule
from aiayn.training.restored_state import RestoredState

log = logging.getLogger(__name__)


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
    ema: ExponentialMovingAverage | None  # ema.decay null or 0: none
    others: list[pl.Callback]

    def all(self) -> list[pl.Callback]:
        ema = [self.ema] if self.ema is not None else []
        return [self.best, self.steps, self.last, self.preemption, self.guard, self.throughput, *ema, *self.others]


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
    with sole_writer(run_dir), config_keys("", FIT_KEYS, only=True):
        # Every setting is checked before any work starts: a typo costs seconds, not a queued job.
        plan = plan_run(cfg, overrides, group)
        requested_checkpoint(plan.resume, run_dir)  # nothing to continue: refused before the data is prepared
        run = run_callbacks(plan, run_dir)
        loggers = build_loggers(plan.logger, run_dir, plan.identity)
        if rank_zero_only.rank == 0:  # before the DDP ranks start: a data error ends the run here, in one line
            plan.data.prepare_data()
        pl.seed_everything(plan.seed, workers=True)  # before the module: its initial weights are drawn
        module = plan.module.build()
        trainer = build_trainer(plan, run_dir, [*run.all(), *callbacks], loggers, module)
        batching = plan.batching
        if trainer.world_size != plan.world_size:  # the batches were planned for the processes the settings make
            raise ConfigError(
                "trainer.devices",
                plan.trainer.get("devices", "auto"),
                f"with trainer.num_nodes={plan.trainer.get('num_nodes', 1)} makes {plan.world_size} process(es), "
                f"but this run has {trainer.world_size} (its launcher's); set them to what the launcher starts",
            )
        # The batch layout is the built trainer's (its world size), the tokenizer the prepared cache's.
        resume = resume_from(
            plan.resume, run_dir, plan.resolved, plan.data.cache_folder(), batch_layout(trainer), plan.own_overrides
        )
        run_dir.mkdir(parents=True, exist_ok=True)
        if trainer.is_global_zero:
            atomic_write(run_dir / "config.yaml", OmegaConf.to_yaml(plan.resolved))
        results = None
        try:
            log_run_config(loggers, plan.resolved, plan.overrides, trainer, module.model, batching)
            fit(trainer, module, plan.data, run.last, resume)
            results = collect_results(plan, trainer, module, run, run_dir, resume, batching, start)
            if trainer.is_global_zero:
                atomic_write(run_dir / RESULTS_FILE, json.dumps(results, indent=2) + "\n")
        finally:
            finish_loggers(loggers, failed=results is None, summary=results)
        return results


def collect_results(
    plan: RunPlan,
    trainer: pl.Trainer,
    module: TranslationModule,
    run: RunCallbacks,
    run_dir: Path,
    resume: Path | None,
    batching: dict[str, Any],
    start: float,
) -> dict[str, Any]:
    """Validate and test the evaluated checkpoint (the best, or the final one), test the average of the
    newest, and gather what the run reports (:class:`RunResults`)."""
    data = plan.data
    # The run's own counts, read before the evaluations: Lightning restores every callback's state from
    # the checkpoint it validates or tests (best.ckpt's counts are those of an earlier step).
    skipped, overflows = run.guard.skipped, run.guard.overflows
    best = best_checkpoint(run)
    evaluated = best if plan.checkpoint.evaluate == "best" else run.last.path
    val = validate_checkpoint(trainer, module, data, evaluated)
    test = test_checkpoint(trainer, module, data, evaluated, run_dir)
    averaged = test_averaged(trainer, module, data, run_dir, plan.checkpoint.average_last)
    ema = test_ema(trainer, module, data, run_dir, run.ema, run.last)
    answer = run_answer(plan.checkpoint, in_run(evaluated, run_dir), val["val/bleu"], test, averaged, ema)
    return RunResults(
        params=count_parameters(module.model),
        val_bleu=val["val/bleu"],
        val_ppl=val["val/ppl"],
        val_loss=val["val/loss"],
        best_val_bleu=best_score(run.best) if run.best.monitor == "val/bleu" else None,
        best_score=best_score(run.best),
        decoding=module.decoding.to_dict(),
        val_decoding=module.val_decoding.to_dict(),
        steps=trainer.global_step,
        epochs=trainer.current_epoch,
        train_tokens=run.throughput.all_tokens,
        train_tokens_per_s=run.throughput.tokens_per_s,
        evaluated=plan.checkpoint.evaluate,
        evaluated_checkpoint=in_run(evaluated, run_dir),
        best_checkpoint=in_run(best, run_dir),
        resumed_from=str(resume) if resume else None,
        batch=batching,
        data=data.filtered,
        data_cache=data.cache_folder().name,
        skipped_steps=skipped,
        overflow_steps=overflows,
        wall_s=time.perf_counter() - start,
        overrides=plan.overrides,
        versions=software_versions(),
        test=test,
        averaged=averaged,
        ema=ema,
        answer=answer,
    ).to_dict()


def best_checkpoint(run: RunCallbacks) -> Path:
    """``best.ckpt``; ``last.ckpt`` when no validation ranked one, or when a resume set the abandoned
    branch's best aside and no later validation bettered the score it resumed with."""
    best = Path(run.best.best_model_path) if run.best.best_model_path else None
    return best if best is not None and best.is_file() else run.last.path


def best_score(best: ModelCheckpoint) -> float | None:
    """The best value of the monitored metric (the score of ``best.ckpt``), if a validation ranked one."""
    score = best.best_model_score
    return float(score) if score is not None else None


def in_run(path: Path, run_dir: Path) -> str:
    """``path`` relative to the run folder, unless it lies in the folder of a resumed run."""
    return str(path.relative_to(run_dir) if path.is_relative_to(run_dir) else path)


def sole_writer(run_dir: Path) -> AbstractContextManager[None]:
    """This process is the one writer of ``run_dir`` while the run lasts (:mod:`aiayn.files`); under DDP
    the first rank holds it for all (the others write nothing there that it does not coordinate)."""
    return run_folder_held(run_dir) if rank_zero_only.rank == 0 else nullcontext()


def run_callbacks(plan: RunPlan, run_dir: Path) -> RunCallbacks:
    """The callbacks of a run as its plan sets them, the config's ``callbacks`` entries among the others."""
    policy = plan.checkpoint
    with config_keys(""):  # the config's own callbacks: Lightning callbacks, or the run stops naming the key
        own = [as_callback(instantiated(callback)) for callback in plan.callbacks]
    best, last, steps = validation_checkpoints(
        run_dir / "checkpoints", policy.monitor, policy.mode, policy.keep_last, policy.average_every
    )
    return RunCallbacks(
        best=best,
        last=last,
        steps=steps,
        preemption=Preemption(last),
        guard=NonFiniteGuard(plan.max_nonfinite_steps, last.path),
        throughput=TokenThroughput(peak_tflops=plan.peak_tflops),
        ema=plan.ema.callback(),
        others=[
            FinalStepValidation(),
            SelfContainedCheckpoints(plan.resolved, plan.overrides),
            RandomState(),
            plan.samples,
            plan.sdpa,
            *([plan.collection] if plan.collection is not None else []),
            FreedMemoryRelease(),
            ShapeWarmUp(),
            *progress_callbacks(plan.progress),
            *own,
        ],
    )


def build_trainer(
    plan: RunPlan, run_dir: Path, callbacks: list[pl.Callback], loggers: list[Logger], module: TranslationModule
) -> pl.Trainer:
    """Lightning's Trainer with the plan's arguments. Its checkpoints go through
    :class:`~aiayn.training.checkpoint_io.RunCheckpointIO`: written atomically (unless the user brings
    their own checkpoint input/output, for cloud storage ...), checked against ``module`` and this run
    before anything is restored, deleted only inside ``run_dir/checkpoints``. In a SLURM job of one task
    (``wandb agent`` in an sbatch script) Lightning starts the DDP ranks itself (:mod:`aiayn.training.cluster`)."""
    options = dict(plan.trainer)
    plugins = list(options.pop("plugins", None) or [])
    own = [plugin for plugin in plugins if isinstance(plugin, CheckpointIO)]
    folder = run_dir / "checkpoints"
    io = RunCheckpointIO(folder, RestoredState(folder, module), inner=own[0] if own else None)
    plugins = [plugin for plugin in plugins if not isinstance(plugin, CheckpointIO)] + [io]
    plugins += cluster_environment(options, plugins)  # a one-task SLURM job (wandb agent): Lightning starts the ranks
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
