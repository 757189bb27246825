"""Non-finite losses and gradients: a step with one is skipped and counted, fp16 overflows are left to the
gradient scaler and counted, and a run of them stops training with the last good checkpoint kept. The
skip is decided on the device (bit for bit no change, on every DDP rank alike) and the run stops at the
next read of the counts."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from aiayn.config.compose import compose_run_config
from aiayn.errors import TrainingDiverged
from aiayn.experiments.run import train
from aiayn.training.module import TranslationModule
from helpers import ddp_ranks
from helpers.runs import resumable_run, train_in_process

pytestmark = pytest.mark.slow


def poison(monkeypatch: pytest.MonkeyPatch, steps: dict[int, str]) -> None:
    """Makes the training loss of the optimizer step ``s`` non-finite as ``steps[s]`` says: ``plus`` adds
    NaN (the gradients stay finite), ``times`` multiplies by NaN (they become NaN too), ``inf`` multiplies
    by inf."""
    original = TranslationModule.training_loss
    poisons = {
        "plus": lambda loss: loss + math.nan,
        "times": lambda loss: loss * math.nan,
        "inf": lambda loss: loss * math.inf,
    }

    def poisoned(self: TranslationModule, batch: dict) -> tuple[torch.Tensor, int]:
        loss, n_tokens = original(self, batch)
        if self.trainer.global_step in steps:
            loss = poisons[steps[self.trainer.global_step]](loss)
        return loss, n_tokens

    monkeypatch.setattr(TranslationModule, "training_loss", poisoned)


class WeightWatch(pl.Callback):
    """Records, per optimizer step, whether the step changed the weights."""

    def __init__(self) -> None:
        self.changed: dict[int, bool] = {}
        self._before: torch.Tensor | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        self._before = torch.cat([p.detach().flatten() for p in pl_module.parameters()]).clone()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        after = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
        assert torch.isfinite(after).all(), f"non-finite weights after step {trainer.global_step}"
        self.changed[trainer.global_step - 1] = not torch.equal(after, self._before)


def metrics(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "csv" / "metrics.csv") as rows:
        return list(csv.DictReader(rows))


def test_a_step_with_a_non_finite_loss_is_skipped_and_counted(
    tmp_path: Path, multi30k_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each kind of non-finite loss for two steps in a row, a good step between kinds: never more in a
    row than max_nonfinite_steps=5 allows, so the run goes on."""
    poison(monkeypatch, {2: "plus", 3: "plus", 5: "times", 6: "times", 8: "inf", 9: "inf"})
    overrides = resumable_run(multi30k_root, cache_dir, "trainer.max_steps=11")
    cfg = compose_run_config(overrides)
    assert cfg.max_nonfinite_steps > 2
    watch = WeightWatch()
    results = train(cfg, tmp_path / "run", overrides, callbacks=[watch])
    assert results["skipped_steps"] == 6 and results["overflow_steps"] == 0 and results["steps"] == 11
    skipped = {2, 3, 5, 6, 8, 9}
    assert watch.changed == {step: step not in skipped for step in range(11)}
    logged = [float(row["train/skipped_steps"]) for row in metrics(tmp_path / "run") if row.get("train/skipped_steps")]
    assert logged[-1] == 6 and max(logged) == 6
    last = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in last["state_dict"].values() if t.is_floating_point())
    adam = last["optimizer_states"][0]["state"]
    assert {float(state["step"]) for state in adam.values()} == {5.0}  # Adam stepped 11 - 6 times


def test_non_finite_losses_in_a_row_stop_the_run_and_keep_the_last_good_checkpoint(
    tmp_path: Path,
    multi30k_root: Path,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    poison(monkeypatch, dict.fromkeys(range(6, 100), "times"))
    monkeypatch.chdir(tmp_path)
    argv = [
        *resumable_run(multi30k_root, cache_dir, "trainer.max_steps=20", "checkpoint.every_steps=4"),
        "max_nonfinite_steps=3", "checkpoint.keep_last=0", f"hydra.run.dir={tmp_path / 'run'}",
    ]  # fmt: skip
    assert train_in_process(argv, monkeypatch) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert error.startswith("aiayn-train: error: training stopped at step 9: non-finite loss at 3 optimizer steps")
    assert f"{last} is kept" in error
    checkpoint = torch.load(last, weights_only=True)
    # the validation at step 8 saved it, after steps 7 and 8 were skipped: the weights of step 6; none at the stop
    assert checkpoint["global_step"] == 8
    assert all(torch.isfinite(t).all() for t in checkpoint["state_dict"].values() if t.is_floating_point())
    assert not (tmp_path / "run" / "results.json").exists()


class StateWatch(pl.Callback):
    """Records, per optimizer step, whether the step left the weights and Adam's state (moments and step
    counters) bit for bit as they were."""

    def __init__(self) -> None:
        self.unchanged: dict[int, tuple[bool, bool]] = {}
        self._before: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    @staticmethod
    def state(trainer: pl.Trainer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        weights = [p.detach().clone() for p in trainer.lightning_module.parameters()]
        adam = trainer.optimizers[0].state.values()
        return weights, [tensor.clone() for state in adam for tensor in state.values()]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        self._before = self.state(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        (weights, adam), (weights_before, adam_before) = self.state(trainer), self._before
        same = [all(map(torch.equal, now, then)) for now, then in ((weights, weights_before), (adam, adam_before))]
        self.unchanged[trainer.global_step - 1] = (same[0], same[1] and len(adam) == len(adam_before))


def test_a_skipped_step_leaves_weights_and_adam_state_bit_identical_between_reads_of_the_counts(
    tmp_path: Path, multi30k_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Metrics every 5 steps: the guard decides on the device at steps 4 and 7 (NaN gradients, then a NaN
    loss with finite gradients) and the host reads its counts only at steps 5 and 10."""
    poison(monkeypatch, {3: "times", 6: "plus"})  # optimizer steps 4 and 7, counted from 1
    overrides = resumable_run(multi30k_root, cache_dir, "trainer.max_steps=10", log_every=5)
    watch = StateWatch()
    results = train(compose_run_config(overrides), tmp_path / "run", overrides, callbacks=[watch])
    assert results["skipped_steps"] == 2 and results["steps"] == 10
    # Fused Adam's kernel skipped the two updates; every other step changed weights and moments.
    assert watch.unchanged == {step: (step in (3, 6),) * 2 for step in range(10)}
    rows = [row for row in metrics(tmp_path / "run") if row.get("train/skipped_steps")]
    assert {int(row["step"]): float(row["train/skipped_steps"]) for row in rows} == {4: 1.0, 9: 2.0}
    adam = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["optimizer_states"][0]
    assert {float(state["step"]) for state in adam["state"].values()} == {8.0}


def test_faults_in_a_row_stop_the_run_at_the_next_read_of_the_counts(
    tmp_path: Path, multi30k_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """max_nonfinite_steps=2 is reached at step 9 (steps 8 and 9 bad), between two reads of the counts: the
    host reads them before the validation of step 10 and stops the run there, before that validation
    writes a checkpoint; step 10 was skipped as well."""
    poison(monkeypatch, dict.fromkeys(range(7, 100), "times"))
    extra = ("trainer.max_steps=30", "checkpoint.every_steps=10", "max_nonfinite_steps=2")
    overrides = resumable_run(multi30k_root, cache_dir, *extra, log_every=7)
    watch = WeightWatch()
    with pytest.raises(TrainingDiverged) as stopped:
        train(compose_run_config(overrides), tmp_path / "run", overrides, callbacks=[watch])
    message = str(stopped.value)
    assert message.startswith("training stopped at step 10: non-finite loss at 3 optimizer steps in a row")
    assert "no checkpoint had been written yet" in message
    assert watch.changed == {step: step < 7 for step in range(10)}
    assert not (tmp_path / "run" / "checkpoints" / "last.ckpt").exists()


def test_a_non_finite_loss_on_one_ddp_rank_skips_the_step_on_every_rank(ddp_run: Path) -> None:
    """The flags are reduced over the ranks on the device: rank 0, whose loss and gradients are finite,
    skips the step as rank 1 does, and the two hold the same weights."""
    results = json.loads((ddp_run / "results.json").read_text())
    assert results["batch"]["world_size"] == 2 and results["steps"] == ddp_ranks.STEPS and results["skipped_steps"] == 1
    ranks = [torch.load(ddp_run / f"weights.rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    assert ranks[0].keys() == ranks[1].keys() and all(torch.equal(ranks[0][n], ranks[1][n]) for n in ranks[0])
    adam = torch.load(ddp_run / "checkpoints" / "last.ckpt", weights_only=True)["optimizer_states"][0]["state"]
    assert {float(state["step"]) for state in adam.values()} == {ddp_ranks.STEPS - 1}  # rank 0's Adam: 1 step skipped


class Overflow(pl.Callback):
    """Makes one gradient infinite after the backward pass of the optimizer steps ``steps`` (the scaled
    fp16 gradients overflowing), with a finite loss."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step in self.steps:
            next(p for p in pl_module.parameters() if p.grad is not None).grad.view(-1)[0] = math.inf


def test_fp16_overflow_steps_are_skipped_by_the_scaler_and_counted(
    tmp_path: Path, multi30k_root: Path, cache_dir: Path
) -> None:
    # Lightning turns precision=16-mixed into bf16 on the CPU; its fp16 plugin with a CPU scaler is the real thing.
    plugin = "{_target_:pytorch_lightning.plugins.MixedPrecision,precision:16-mixed,device:cpu}"
    overrides = resumable_run(
        multi30k_root, cache_dir, "trainer.max_steps=6", "trainer.precision=null", f"+trainer.plugins=[{plugin}]"
    )
    watch = WeightWatch()
    results = train(compose_run_config(overrides), tmp_path / "run", overrides, callbacks=[Overflow({2, 3}), watch])
    assert results["overflow_steps"] == 2 and results["skipped_steps"] == 0
    assert watch.changed == {0: True, 1: True, 2: False, 3: False, 4: True, 5: True}
    scaler = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["MixedPrecision"]
    assert scaler["scale"] == 2.0**16 / 4  # halved at each overflow


def test_a_non_finite_micro_batch_skips_its_whole_accumulated_step(
    tmp_path: Path, multi30k_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    poison(monkeypatch, {2: "plus"})  # both micro-batches of step 2: the step is skipped once, not twice
    extra = ("trainer.max_steps=5", "trainer.accumulate_grad_batches=2", "trainer.gradient_clip_val=1.0")
    overrides = resumable_run(multi30k_root, cache_dir, *extra)
    results = train(compose_run_config(overrides), tmp_path / "run", overrides)
    assert results["skipped_steps"] == 1 and results["steps"] == 5
    adam = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["optimizer_states"][0]["state"]
    assert {float(state["step"]) for state in adam.values()} == {4.0}


def test_results_count_the_runs_skipped_steps_not_those_of_the_checkpoint_tested(
    tmp_path: Path, multi30k_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning restores the callbacks' state from the checkpoint it validates and tests: best.ckpt, here
    from step 1 (the highest validation loss is the first), before the skipped step 2."""
    poison(monkeypatch, {2: "plus"})
    extra = ("trainer.max_steps=4", "checkpoint.every_steps=1", "checkpoint.monitor=val/loss", "checkpoint.mode=max")
    overrides = resumable_run(multi30k_root, cache_dir, *extra)
    results = train(compose_run_config(overrides), tmp_path / "run", overrides)
    best = torch.load(tmp_path / "run" / results["best_checkpoint"], weights_only=True)
    assert best["global_step"] == 1 and best["callbacks"]["NonFiniteGuard"]["skipped"] == 0
    assert results["skipped_steps"] == 1 and results["steps"] == 4
