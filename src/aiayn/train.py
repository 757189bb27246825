"""One training run: compose → fit → validate and test the best checkpoint → results.json."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import sacrebleu
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import ModelCheckpoint

from aiayn.callbacks import TokenThroughput
from aiayn.config import module_kwargs
from aiayn.data.tokenizer import PAD_ID
from aiayn.model import count_parameters
from aiayn.module import BLEU_SETTINGS, TranslationModule


def train(cfg: DictConfig, run_dir: Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """Train as ``cfg`` says, writing checkpoints, metrics and ``results.json`` into ``run_dir``."""
    start = time.perf_counter()
    run_dir.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(cfg.seed, workers=True)
    OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)

    datamodule = instantiate(cfg.data)
    module = TranslationModule(**module_kwargs(cfg))
    checkpoint_dir = run_dir / "checkpoints"
    checkpoint = ModelCheckpoint(
        dirpath=checkpoint_dir,
        filename="best",
        monitor=cfg.checkpoint.monitor,
        mode=cfg.checkpoint.mode,
        save_top_k=1,
        auto_insert_metric_name=False,
    )
    # Lightning's save_last only follows saves of the best; this one rewrites last.ckpt at every validation.
    latest = ModelCheckpoint(dirpath=checkpoint_dir, filename="last", save_top_k=1)
    throughput = TokenThroughput(pad_id=PAD_ID)
    loggers = [instantiate(logger, save_dir=str(run_dir)) for logger in cfg.logger.values()]
    trainer = pl.Trainer(
        **OmegaConf.to_container(cfg.trainer, resolve=True),
        callbacks=[checkpoint, latest, throughput],
        logger=loggers or False,
        default_root_dir=str(run_dir),
    )
    trainer.fit(module, datamodule=datamodule)
    last = checkpoint_dir / "last.ckpt"
    trainer.save_checkpoint(last)  # the final state, also when training stopped between validations

    best = checkpoint.best_model_path or str(last)
    val = trainer.validate(module, datamodule=datamodule, ckpt_path=best, verbose=False)[0]
    test = trainer.test(module, datamodule=datamodule, ckpt_path=best, verbose=False)[0]
    test_bleu, signature = score_hypotheses(module.test_hypotheses, datamodule.references["test"], run_dir)
    results = {
        "params": count_parameters(module.model),
        "val_bleu": val["val/bleu"],
        "val_ppl": val["val/ppl"],
        "val_loss": val["val/loss"],
        "test_bleu": test_bleu,
        "test_ppl": test["test/ppl"],
        "test_split": cfg.data.test_split,
        "sacrebleu_signature": signature,
        "steps": trainer.global_step,
        "epochs": trainer.current_epoch,
        "train_tokens": throughput.tokens,
        "train_tokens_per_s": throughput.tokens_per_s,
        "wall_s": time.perf_counter() - start,
        "best_checkpoint": str(Path(best).relative_to(run_dir)) if best else None,
        "overrides": list(overrides or []),
    }
    if trainer.is_global_zero:
        (run_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def score_hypotheses(hypotheses: dict[int, str], references: list[str], run_dir: Path) -> tuple[float, str]:
    """sacreBLEU of the test hypotheses (in corpus order), written to ``test.hyp.txt``; returns score and
    signature."""
    missing = len(references) - len(hypotheses)
    if missing:
        raise RuntimeError(f"{missing} of {len(references)} test sentences were not translated")
    ordered = [hypotheses[i] for i in range(len(references))]
    (run_dir / "test.hyp.txt").write_text("".join(line + "\n" for line in ordered), encoding="utf-8")
    bleu = sacrebleu.BLEU(**BLEU_SETTINGS)
    score = bleu.corpus_score(ordered, [references])
    return score.score, str(bleu.get_signature())
