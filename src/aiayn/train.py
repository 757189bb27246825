"""One training run: fit → validate and test the best checkpoint, test the averaged one → results.json."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from hydra.utils import instantiate
from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import ModelCheckpoint

from aiayn.batching import configure_batching
from aiayn.callbacks import (
    FinalCheckpoint,
    RandomState,
    RunProgressBar,
    SelfContainedCheckpoints,
    TokenThroughput,
    ValidationReport,
)
from aiayn.checkpoints import (
    STEP_NAME,
    AtomicCheckpointIO,
    average_checkpoints,
    check_resumable,
    save_checkpoint,
    step_checkpoints,
)
from aiayn.config import model_config, module_kwargs
from aiayn.dashboard import ValidationSamples
from aiayn.errors import ConfigError, instantiated
from aiayn.faults import NonFiniteGuard, Preemption
from aiayn.loggers import build_loggers, finish_loggers, log_run_config, run_identity
from aiayn.model import count_parameters
from aiayn.module import TranslationModule
from aiayn.preflight import check_run_config
from aiayn.scoring import corpus_scores

PROGRESS_STYLES = ("auto", "rich", "tqdm", "quiet")  # quiet: no bar, one log line per validation (CI logs)


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
    # Every setting is checked before any work starts: a typo costs seconds, not a queued job.
    check_run_config(cfg)
    progress = progress_style(cfg.progress)
    datamodule = instantiated(cfg.data)
    checkpoint_dir = run_dir / "checkpoints"
    resume = resume_from(cfg.resume, checkpoint_dir, model_config(cfg))
    pl.seed_everything(cfg.seed, workers=True)  # before the module: its initial weights are drawn
    module = TranslationModule(**module_kwargs(cfg))

    resolved = OmegaConf.to_container(cfg, resolve=True)
    checkpoint = ModelCheckpoint(
        dirpath=checkpoint_dir,
        filename="best",
        monitor=cfg.checkpoint.monitor,
        mode=cfg.checkpoint.mode,
        save_top_k=1,
        auto_insert_metric_name=False,
        # written at validations only (an end-of-epoch save marks the epoch done: not resumable mid-epoch);
        # a resumed run rewrites its own files, never best-v1.ckpt
        enable_version_counter=False,
        save_on_train_epoch_end=False,
    )
    # Lightning's save_last only follows saves of the best; this one rewrites last.ckpt at every validation.
    latest = ModelCheckpoint(
        dirpath=checkpoint_dir,
        filename="last",
        save_top_k=1,
        enable_version_counter=False,
        save_on_train_epoch_end=False,
    )
    # The newest keep_last validations' weights, for averaging (§6.1): "top k" by step keeps the newest.
    periodic = ModelCheckpoint(
        dirpath=checkpoint_dir,
        filename=STEP_NAME,
        monitor="step",
        mode="max",
        save_top_k=cfg.checkpoint.keep_last,
        auto_insert_metric_name=False,
        enable_version_counter=False,
        save_on_train_epoch_end=False,
    )
    throughput = TokenThroughput(peak_tflops=cfg.peak_tflops)
    final = FinalCheckpoint(checkpoint_dir / "last.ckpt")
    guard = NonFiniteGuard(cfg.max_nonfinite_steps, final.path)
    display = {"rich": [RunProgressBar()], "tqdm": [], "quiet": [ValidationReport()]}[progress]
    loggers = build_loggers(cfg.logger, run_dir, run_identity(cfg.name, overrides, group))
    trainer_kwargs = trainer_options(cfg.trainer)
    trainer_kwargs.setdefault("enable_progress_bar", progress != "quiet")  # an explicit trainer.* wins
    trainer_kwargs.setdefault("enable_model_summary", progress != "quiet")
    plugins = list(trainer_kwargs.pop("plugins", None) or [])
    if not any(isinstance(plugin, CheckpointIO) for plugin in plugins):
        plugins.append(AtomicCheckpointIO())  # unless the user brings their own (cloud storage ...)
    trainer = pl.Trainer(
        **trainer_kwargs,
        callbacks=[
            checkpoint,
            latest,
            periodic,
            final,
            Preemption(final.path),
            guard,
            throughput,
            SelfContainedCheckpoints(resolved),
            RandomState(),
            ValidationSamples(cfg.dashboard.samples, cfg.dashboard.attention_every),
            *display,
            *(instantiate(callback) for callback in cfg.callbacks),
            *callbacks,
        ],
        logger=loggers,
        plugins=plugins,
        default_root_dir=str(run_dir),
    )
    batching = configure_batching(trainer, cfg.tokens_per_step, cfg.data.max_tokens, cfg.checkpoint.every_steps)
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(resolved, run_dir / "config.yaml")
    results = None
    try:
        log_run_config(loggers, resolved, overrides, trainer, module.model, batching)
        results = fit_and_test(cfg, run_dir, trainer, module, datamodule, checkpoint, throughput, final, resume)
        results["batch"] = batching
        results["data"] = datamodule.filtered
        results["skipped_steps"] = guard.skipped  # non-finite loss or gradients (aiayn.faults)
        results["overflow_steps"] = guard.overflows  # fp16 steps the gradient scaler skipped
        results["wall_s"] = time.perf_counter() - start
        results["overrides"] = list(overrides)
        if trainer.is_global_zero:
            (run_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    finally:
        finish_loggers(loggers, failed=results is None, summary=results)
    return results


def fit_and_test(
    cfg: DictConfig,
    run_dir: Path,
    trainer: pl.Trainer,
    module: TranslationModule,
    datamodule: pl.LightningDataModule,
    checkpoint: ModelCheckpoint,
    throughput: TokenThroughput,
    final: FinalCheckpoint,
    resume: Path | None = None,
) -> dict[str, Any]:
    """Fit (from ``resume`` when given), then validate and test the best checkpoint and test the
    average of the newest ones. Without a test split, the scores are the validation's."""
    trainer.fit(module, datamodule=datamodule, ckpt_path=str(resume) if resume else None, weights_only=True)
    last = final.path
    if final.saved_step != trainer.global_step:  # stopped otherwise (an epoch limit, nothing left to do)
        trainer.save_checkpoint(last, weights_only=False)

    best = checkpoint.best_model_path or str(last)
    val = trainer.validate(module, datamodule=datamodule, ckpt_path=best, verbose=False, weights_only=True)[0]
    results = {
        "params": count_parameters(module.model),
        "val_bleu": val["val/bleu"],
        "val_ppl": val["val/ppl"],
        "val_loss": val["val/loss"],
        "decoding": OmegaConf.to_container(cfg.decoding, resolve=True),
        "steps": trainer.global_step,
        "epochs": trainer.current_epoch,
        "train_tokens": throughput.all_tokens,
        "train_tokens_per_s": throughput.tokens_per_s,
        # relative to the run folder, unless it lies in the folder of the run this one resumed
        "best_checkpoint": str(Path(best).relative_to(run_dir) if Path(best).is_relative_to(run_dir) else best),
        "resumed_from": str(resume) if resume else None,
    }
    if "test" not in datamodule.roles:
        return results
    test = trainer.test(module, datamodule=datamodule, ckpt_path=best, verbose=False, weights_only=True)[0]
    references = datamodule.references["test"]
    write = trainer.is_global_zero  # every rank has all hypotheses and scores; one writes them
    test_scores = score_hypotheses(module.test_hypotheses, references, run_dir / "test.hyp.txt" if write else None)
    results.update(
        test_bleu=test_scores["sacrebleu"],
        test_chrf=test_scores["chrf"],
        test_ppl=test["test/ppl"],
        test_split=datamodule.split_names["test"],
        sacrebleu_signature=test_scores["sacrebleu_signature"],
    )
    sources = step_checkpoints(run_dir)[-cfg.checkpoint.average_last :] if cfg.checkpoint.average_last >= 2 else []
    if len(sources) >= 2:  # averaging a single checkpoint would only copy it
        averaged = Path(checkpoint.dirpath) / "averaged.ckpt"
        if trainer.is_global_zero:
            save_checkpoint(average_checkpoints(sources), averaged)
        trainer.strategy.barrier("averaged checkpoint written")
        trainer.test(module, datamodule=datamodule, ckpt_path=str(averaged), verbose=False, weights_only=True)
        output = run_dir / "test.averaged.hyp.txt" if write else None
        scores = score_hypotheses(module.test_hypotheses, references, output)
        results["test_bleu_averaged"] = scores["sacrebleu"]
        results["test_chrf_averaged"] = scores["chrf"]
        results["averaged_checkpoints"] = [source.name for source in sources]
    return results


def trainer_options(trainer: DictConfig) -> dict[str, Any]:
    """The ``pl.Trainer`` arguments of ``trainer``; ``strategy`` and ``plugins`` entries with a
    ``_target_`` (as in ``hardware/*.yaml``) become the objects they name."""
    return instantiate(trainer, _convert_="all")


def resume_from(requested: bool | str | None, checkpoint_dir: Path, model: dict[str, Any]) -> Path | None:
    """The checkpoint to continue from: ``requested`` when it is a path; else the run folder's own
    ``last.ckpt`` (a restarted or requeued run; ``resume=true`` chose the folder of the latest run), which
    ``resume=true`` requires. The checkpoint must hold the training state of a model like ``model``."""
    if isinstance(requested, str):
        path = Path(requested).expanduser()
        if not path.is_file():
            raise ConfigError(
                "resume", requested, "is not a file; give a checkpoint such as <run>/checkpoints/last.ckpt"
            )
    else:
        path = checkpoint_dir / "last.ckpt"
        if not path.is_file():
            if requested is True:
                raise ConfigError(
                    "resume", True, f"found no earlier run with checkpoints/last.ckpt in {checkpoint_dir.parents[1]}"
                )
            return None
    check_resumable(path, model)
    return path


def progress_style(requested: str) -> str:
    """``rich``, ``tqdm`` or ``quiet``; ``auto`` is the rich bar on a terminal and quiet elsewhere (CI,
    SLURM and nohup logs, where a bar would print nothing until its end, or a line per refresh)."""
    if requested not in PROGRESS_STYLES:
        raise ConfigError("progress", requested, f"is not a progress display; use one of {', '.join(PROGRESS_STYLES)}")
    if requested == "auto":
        return "rich" if sys.stdout.isatty() else "quiet"
    return requested


def score_hypotheses(hypotheses: dict[int, str], references: list[str], output: Path | None) -> dict[str, Any]:
    """Scores of the test hypotheses, which are written in corpus order to ``output`` (unless None)."""
    missing = len(references) - len(hypotheses)
    if missing:
        raise RuntimeError(f"{missing} of {len(references)} test sentences were not translated")
    ordered = [hypotheses[i] for i in range(len(references))]
    if output is not None:
        output.write_text("".join(line + "\n" for line in ordered), encoding="utf-8")
    return corpus_scores(ordered, references)
