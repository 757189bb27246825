"""One short run on 2 DDP ranks that the tests of what ranks must agree on share: its rank 1's training loss
is NaN at one step (the guard must skip that step on both ranks) and the EMA of the weights is on (both
ranks must hold the same one). Each rank saves what it held at the end, which a checkpoint holds of rank 0
alone."""

from __future__ import annotations

import math
from pathlib import Path

import pytorch_lightning as pl
import torch

from aiayn.training.callbacks.ema import ExponentialMovingAverage
from helpers.runs import resumable_run

STEPS = 4
NAN_STEP, NAN_RANK = 3, 1  # the optimizer step (counted from 1) whose loss is NaN on that rank alone
EMA_DECAY, EMA_START = 0.8, 1  # step 1 copies the weights; 2, 3 (skipped) and 4 average them


def the_ema(trainer: pl.Trainer) -> ExponentialMovingAverage:
    """The run's EMA callback."""
    (ema,) = [callback for callback in trainer.callbacks if isinstance(callback, ExponentialMovingAverage)]
    return ema


class EachRank(pl.Callback):
    """Adds NaN to rank ``NAN_RANK``'s training loss of optimizer step ``NAN_STEP`` (its gradients stay finite,
    the other rank's loss too), and saves each rank's weights and EMA at the end of training as
    ``<folder>/weights.rank<r>.pt`` and ``<folder>/ema.rank<r>.pt``. Given to a DDP ``aiayn-train`` process
    as ``callbacks=[...]``."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank != NAN_RANK:
            return
        original = pl_module.training_loss

        def poisoned(batch: dict) -> tuple[torch.Tensor, int]:
            loss, n_tokens = original(batch)
            return (loss + math.nan if trainer.global_step == NAN_STEP - 1 else loss), n_tokens

        pl_module.training_loss = poisoned

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rank = trainer.global_rank
        weights = {name: p.detach() for name, p in pl_module.named_parameters()}
        torch.save(weights, self.folder / f"weights.rank{rank}.pt")
        torch.save(the_ema(trainer).weights, self.folder / f"ema.rank{rank}.pt")


def ddp_run_overrides(root: Path, cache: Path, run_dir: Path) -> list[str]:
    """The run's command line (its folder ``run_dir``): 400 pairs give each rank its batches."""
    return [
        "hardware=cpu_ddp",
        f"hydra.run.dir={run_dir}",
        *resumable_run(root, cache, pairs=400, eval_pairs=4, log_every=2),
        f"trainer.max_steps={STEPS}",
        "optim.warmup=10",  # each step moves the weights far from the EMA
        "decoding.max_len_offset=3",
        f"ema.decay={EMA_DECAY}",
        f"ema.start_step={EMA_START}",
        f"callbacks=[{{_target_:helpers.ddp_ranks.EachRank,folder:'{run_dir}'}}]",
    ]
