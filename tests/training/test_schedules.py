"""The learning-rate schedules beside eq. 3 (inverse_sqrt, linear, cosine, wsd): their formulas, their decay
placed by the run's step or time budget (a time-bound run ends at ``optim.min_lr`` whatever the speed), the
placement kept by checkpoints, and resumes that continue the same curve bit for bit."""

from __future__ import annotations

import copy
import csv
import math
from datetime import timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Timer
from torch.utils.data import DataLoader

from aiayn.config.compose import compose_run_config
from aiayn.errors import CheckpointError
from aiayn.experiments.run import train
from aiayn.model import TransformerConfig
from aiayn.training import schedule as schedule_module
from aiayn.training.module import TranslationModule
from aiayn.training.restored_state import RestoredState
from aiayn.training.schedule import (
    PAPER_OPTIM,
    Budget,
    NoamSchedule,
    OptimSettings,
    WarmupDecaySchedule,
    lr_schedule,
)
from helpers.runs import refusal, resumable_run, smoke_run
from helpers.stops import StopAtStep


def lr_at(schedule: Any, step: int) -> float:
    """The learning rate of optimizer step ``step`` (1-based); LambdaLR passes the steps done."""
    return schedule(step - 1)


# -- the formulas -------------------------------------------------------------------------------------------
def test_noam_stays_eq_3_to_the_bit() -> None:
    schedule = lr_schedule(PAPER_OPTIM, 512)
    assert isinstance(schedule, NoamSchedule)
    for step in (1, 100, 3999, 4000, 4001, 100000):
        assert lr_at(schedule, step) == 512**-0.5 * min(step**-0.5, step * 4000**-1.5)  # eq. 3


def test_inverse_sqrt_rises_linearly_to_lr_then_falls_as_the_inverse_square_root_of_the_step() -> None:
    schedule = WarmupDecaySchedule("inverse_sqrt", lr=1e-3, warmup=100)
    expected = {1: 1e-5, 50: 5e-4, 100: 1e-3, 400: 5e-4, 10000: 1e-4}
    assert {step: lr_at(schedule, step) for step in expected} == pytest.approx(expected)
    # With eq. 3's peak as its lr, it is eq. 3 (fairseq's inverse_sqrt is eq. 3 with a free peak).
    same = WarmupDecaySchedule("inverse_sqrt", lr=512**-0.5 * 4000**-0.5, warmup=4000)
    for step in (1, 2000, 4000, 4001, 16000, 100000):
        assert lr_at(same, step) == pytest.approx(lr_at(NoamSchedule(512, 4000), step), rel=1e-12)


# lr 1.0, min_lr 0.1, warmup 10, decay from step 10 to step 110: the learning rates at chosen steps.
DECAYS = {
    "linear": {5: 0.5, 10: 1.0, 11: 0.991, 35: 0.775, 60: 0.55, 85: 0.325, 110: 0.1, 1000: 0.1},
    "cosine": {
        5: 0.5,
        10: 1.0,
        35: 0.1 + 0.45 * (1 + math.cos(math.pi / 4)),
        60: 0.55,
        85: 0.1 + 0.45 * (1 + math.cos(3 * math.pi / 4)),
        110: 0.1,
        1000: 0.1,
    },
}


@pytest.mark.parametrize("kind", sorted(DECAYS))
def test_linear_and_cosine_decay_right_after_warmup_to_min_lr_at_the_last_step(kind: str) -> None:
    schedule = WarmupDecaySchedule(kind, lr=1.0, warmup=10, min_lr=0.1)
    budget = Budget(max_steps=110)
    assert lr_at(schedule, 50) == 1.0  # before the decay is placed: the peak
    assert [done for done in range(111) if schedule.decay_due(done, budget)] == list(range(10, 111))
    schedule.place_decay(10, budget.end(10))
    assert (schedule.decay_start, schedule.decay_end) == (10, 110)
    assert not schedule.decay_due(11, budget)  # placed once
    assert {step: lr_at(schedule, step) for step in DECAYS[kind]} == pytest.approx(DECAYS[kind])


def test_wsd_warms_up_holds_lr_then_decays_linearly_over_the_last_fraction_of_the_steps() -> None:
    schedule = WarmupDecaySchedule("wsd", lr=2.0, warmup=10, min_lr=0.5, decay_fraction=0.2)
    budget = Budget(max_steps=100)
    assert next(done for done in range(101) if schedule.decay_due(done, budget)) == 80
    schedule.place_decay(80, budget.end(80))
    assert (schedule.decay_start, schedule.decay_end) == (80, 100)
    expected = {1: 0.2, 9: 1.8, 10: 2.0, 11: 2.0, 50: 2.0, 80: 2.0, 81: 1.925, 90: 1.25, 99: 0.575, 100: 0.5, 150: 0.5}
    assert {step: lr_at(schedule, step) for step in expected} == pytest.approx(expected)


def test_the_further_along_of_time_and_steps_places_the_decay_and_the_rate_so_far_its_end() -> None:
    schedule = WarmupDecaySchedule("wsd", lr=1.0, warmup=10)
    # 50 of 1000 steps, 80 of 100 seconds: time is further along; at 50 steps in 80 s the budget ends at step 62.
    assert not schedule.decay_due(50, Budget(max_steps=1000, elapsed=79.0, seconds=100.0))
    budget = Budget(max_steps=1000, elapsed=80.0, seconds=100.0)
    assert budget.progress(50) == 0.8 and schedule.decay_due(50, budget) and budget.end(50) == 62
    # Steps further along: max_steps ends the run before the time does.
    assert Budget(max_steps=100, elapsed=10.0, seconds=100.0).end(80) == 100
    assert not schedule.decay_due(10**6, Budget(max_steps=None))  # nothing limits the run: no end to decay to
    # The rate since a point (the decay's start), where given: 40 steps in the 40 s since step 10 at 40 s.
    assert Budget(max_steps=None, elapsed=80.0, seconds=100.0).end(50, since=(10, 40.0)) == 70


@pytest.mark.parametrize("kind", sorted(DECAYS))
def test_a_reprojected_decay_goes_on_from_where_it_stood_to_its_new_end(kind: str) -> None:
    schedule = WarmupDecaySchedule(kind, lr=1.0, warmup=10, min_lr=0.1)
    schedule.place_decay(10, 110, seconds=12.5)
    assert schedule.rate_since() == (10, 12.5)
    before = lr_at(schedule, 60)  # halfway down
    schedule.reproject(60, 210)
    assert (schedule.anchor_step, schedule.anchor_progress, schedule.decay_end) == (60, 0.5, 210)
    assert lr_at(schedule, 60) == before  # no jump
    # The second half of the way down now takes 150 steps: a quarter of the way is at step 135.
    assert schedule.decayed(135) == pytest.approx(0.75) and lr_at(schedule, 210) == pytest.approx(0.1)
    schedule.reproject(200, 150)  # an end already passed: the floor one step on
    assert schedule.decay_end == 201 and lr_at(schedule, 201) == pytest.approx(0.1)


# -- a run bound by time, at two simulated speeds -------------------------------------------------------------
class SimulatedClock(Timer):
    """Lightning's ``Timer`` (it ends the run at its duration and is what the module reads the time from) on a
    simulated clock: every optimizer step takes ``seconds_per_step``, a machine of that speed; nobody sleeps."""

    def __init__(self, seconds: float, seconds_per_step: float, start_up: float = 0.0) -> None:
        super().__init__(duration=timedelta(seconds=seconds))
        self.seconds_per_step, self.start_up = seconds_per_step, start_up
        self.clocked: pl.Trainer | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.clocked = trainer

    def time_elapsed(self, stage: str = "train") -> float:
        steps = self.clocked.global_step if self.clocked is not None else 0
        return self.start_up + steps * self.seconds_per_step if steps else 0.0


class LearningRates(pl.Callback):
    """The learning rate of every optimizer step, as the optimizer applies it."""

    def __init__(self) -> None:
        self.applied: list[float] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: torch.optim.Optimizer) -> None:
        self.applied.append(optimizer.param_groups[0]["lr"])


def tiny_module(**optim: Any) -> TranslationModule:
    model = TransformerConfig(vocab_size=50, n_layers=1, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8, dropout=0.0)
    return TranslationModule(model=model, bos_id=2, eos_id=3, optim=OptimSettings(**optim))


def batches(count: int = 4) -> DataLoader:
    """A few fixed batches of random token ids (no padding), as the collator makes them."""
    generator = torch.Generator().manual_seed(0)
    made = []
    for _ in range(count):
        src, tgt = torch.randint(4, 50, (2, 5), generator=generator), torch.randint(4, 50, (2, 6), generator=generator)
        lengths, rows = torch.tensor([[5, 5]] * 2), torch.arange(10)
        made.append({"src": src, "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:], "lengths": lengths, "target_rows": rows})
    return DataLoader(made, batch_size=None)


def clocked_fit(module: TranslationModule, clock: SimulatedClock) -> tuple[pl.Trainer, LearningRates]:
    """``module`` trained on :func:`batches` until ``clock`` runs out (max_steps is far), no validation; the
    trainer and the learning rate of every step."""
    rates = LearningRates()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1000,
        max_epochs=-1,
        callbacks=[clock, rates],
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=batches())
    return trainer, rates


@pytest.mark.parametrize("kind", ["cosine", "wsd"])
@pytest.mark.parametrize("seconds_per_step", [1.0, 2.5])
def test_a_time_bound_run_ends_at_min_lr_at_the_end_of_its_budget_whatever_its_speed(
    kind: str, seconds_per_step: float
) -> None:
    module = tiny_module(schedule=kind, lr=0.01, min_lr=0.001, warmup=4, decay_fraction=0.5)
    trainer, rates = clocked_fit(module, SimulatedClock(60, seconds_per_step))
    steps = round(60 / seconds_per_step)  # 60 or 24 steps in the 60 seconds
    assert trainer.global_step == len(rates.applied) == steps  # the clock ended the run, not max_steps
    # cosine decays from the end of warmup; wsd over the last half of the time, projected at its start.
    start = 4 if kind == "cosine" else steps // 2
    stored = trainer.lr_scheduler_configs[0].scheduler.state_dict()["lr_lambdas"][0]  # the checkpoint's copy
    assert (stored["decay_start"], stored["decay_end"]) == (start, steps)
    assert rates.applied[start - 1] == pytest.approx(0.01)  # the last step at the peak
    decay = rates.applied[start - 1 :]
    assert all(later < earlier for earlier, later in pairwise(decay))
    assert rates.applied[-1] == pytest.approx(0.001)  # the floor, at the budget's last step


def test_a_time_bound_run_with_a_slow_start_reaches_the_floor_at_its_last_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # 20 s of start-up in a 60 s budget, then 1 s a step: projected at the end of warmup (4 steps in 24 s),
    # the decay would end at step 10 and the run would train its last 30 steps at the floor.
    monkeypatch.setattr(schedule_module, "REPROJECT_EVERY", 5)
    module = tiny_module(schedule="linear", lr=0.01, min_lr=0.001, warmup=4)
    trainer, rates = clocked_fit(module, SimulatedClock(60, 1.0, start_up=20.0))
    assert trainer.global_step == len(rates.applied) == 40
    stored = trainer.lr_scheduler_configs[0].scheduler.state_dict()["lr_lambdas"][0]
    assert (stored["decay_start"], stored["decay_start_seconds"], stored["decay_end"]) == (4, 24.0, 40)
    decay = rates.applied[3:]
    assert all(later < earlier for earlier, later in pairwise(decay))  # down all the way, never up
    assert rates.applied[-2] > 0.001 and rates.applied[-1] == pytest.approx(0.001)


# -- checkpoints ----------------------------------------------------------------------------------------------
def placed_checkpoint(module: TranslationModule, done: int = 6, end: int = 20) -> dict[str, Any]:
    """What a checkpoint holds of ``module``'s optimisation after ``done`` steps, its decay placed at
    ``done`` to end at ``end``, as Lightning writes it."""
    optimization = module.configure_optimizers()
    optimizer, scheduler = optimization["optimizer"], optimization["lr_scheduler"]["scheduler"]
    for step in range(done):
        if step + 1 == done:
            scheduler.lr_lambdas[0].place_decay(done, end)
        optimizer.step()
        scheduler.step()
    return {
        "pytorch-lightning_version": pl.__version__,
        "state_dict": module.state_dict(),
        "optimizer_states": [optimizer.state_dict()],
        "lr_schedulers": [scheduler.state_dict()],
    }


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("lr_lambdas[0].gamma", {"gamma": 0.5}),
        ("lr_lambdas[0].decay_start=-1", {"decay_start": -1}),
        ("lr_lambdas[0].decay_start=6.5", {"decay_start": 6.5}),
        ("lr_lambdas[0].decay_end=None", {"decay_end": None}),
        ("lr_lambdas[0].decay_end=6", {"decay_end": 6}),
        ("lr_lambdas[0].decay_start=7", {"decay_start": 7}),  # placed after the step the schedule is at
        ("lr_lambdas[0].anchor_step=5", {"anchor_step": 5}),  # projected again before the decay began
        ("lr_lambdas[0].anchor_step=20", {"anchor_step": 20}),
        ("lr_lambdas[0].anchor_progress=1.0", {"anchor_progress": 1.0}),
        ("lr_lambdas[0].decay_start_seconds=-1", {"decay_start_seconds": -1.0}),
    ],
)
def test_a_stored_decay_aiayn_would_not_write_is_refused_naming_the_field(
    field: str, change: dict[str, Any], tmp_path: Path
) -> None:
    module = tiny_module(schedule="cosine", lr=0.01, warmup=4)
    checkpoint, path = placed_checkpoint(module), tmp_path / "last.ckpt"
    check = RestoredState(tmp_path, module)
    check(copy.deepcopy(checkpoint), path)  # as written, it passes
    checkpoint["lr_schedulers"][0]["lr_lambdas"][0].update(change)
    with pytest.raises(CheckpointError) as refused:
        check(checkpoint, path)
    message = str(refused.value)
    assert "\n" not in message and str(path) in message and f"lr_schedulers[0].{field}" in message, message


@pytest.mark.parametrize(("kind", "kept"), [("cosine", (6, 20)), ("wsd", (None, None))])
def test_a_resume_keeps_the_placed_decay_with_this_runs_settings_unless_the_schedule_changes(
    kind: str, kept: tuple[int | None, int | None]
) -> None:
    checkpoint = placed_checkpoint(tiny_module(schedule="cosine", lr=0.01, warmup=4))
    resumed = tiny_module(schedule=kind, lr=0.02, min_lr=0.001, warmup=4)
    resumed.on_load_checkpoint(checkpoint)
    scheduler = resumed.configure_optimizers()["lr_scheduler"]["scheduler"]
    scheduler.load_state_dict(checkpoint["lr_schedulers"][0])  # as Lightning restores it, after the hook
    schedule = scheduler.lr_lambdas[0]
    assert (schedule.kind, schedule.lr, schedule.min_lr) == (kind, 0.02, 0.001)  # the settings: this run's
    assert (schedule.decay_start, schedule.decay_end) == kept  # the position: the checkpoint's
    assert scheduler.get_last_lr() == [schedule(6)]


# -- real runs, interrupted and resumed -----------------------------------------------------------------------
def last_checkpoint(run_dir: Path) -> dict[str, Any]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)


def logged_lr(run_dir: Path) -> list[float]:
    with open(run_dir / "csv" / "metrics.csv") as rows:
        return [float(row["train/lr"]) for row in csv.DictReader(rows) if row.get("train/lr")]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "clock", "stop", "placed"),
    [  # cosine with weight decay, 12 steps: placed at the end of warmup, stopped mid-decay
        (["optim.schedule=cosine", "optim.weight_decay=0.01", "trainer.max_steps=12"], None, 7, (3, 12)),
        # wsd bound by a 24-second budget at 2 s a step: placed by the time at step 10 (83%), stopped there
        (["optim.schedule=wsd"], (24.0, 2.0), 10, (10, 12)),
    ],
    ids=["cosine-steps", "wsd-time"],
)
def test_a_run_resumed_after_its_decay_began_ends_with_the_weights_of_an_uninterrupted_run(
    extra: list[str],
    clock: tuple[float, float] | None,
    stop: int,
    placed: tuple[int, int],
    tmp_path: Path,
    corpus_root: Path,
    cache_dir: Path,
) -> None:
    overrides = resumable_run(
        corpus_root,
        cache_dir,
        "optim.lr=0.003",
        "optim.min_lr=0.0001",
        "optim.warmup=3",
        "trainer.max_time=null",  # the simulated clock, if any, is the run's Timer
        "decoding.max_len_offset=3",
        "checkpoint.evaluate=final",
        *extra,
        eval_pairs=4,
    )

    def run(name: str, *more: str, callbacks: tuple[pl.Callback, ...] = ()) -> Path:
        run_dir = tmp_path / name
        timer = [SimulatedClock(*clock)] if clock else []
        train(compose_run_config([*overrides, *more]), run_dir, [*overrides, *more], callbacks=[*timer, *callbacks])
        return run_dir

    whole = run("whole")
    first = run("first", callbacks=(StopAtStep(stop),))
    second = run("second", f"resume={first / 'checkpoints' / 'last.ckpt'}")
    stopped, expected, actual = last_checkpoint(first), last_checkpoint(whole), last_checkpoint(second)
    assert (stopped["global_step"], expected["global_step"], actual["global_step"]) == (stop, 12, 12)
    for checkpoint in (stopped, expected, actual):
        stored = checkpoint["lr_schedulers"][0]["lr_lambdas"][0]
        assert (stored["decay_start"], stored["decay_end"]) == placed
    assert logged_lr(whole)[-1] == pytest.approx(0.0001)  # train/lr, logged every step, ends at the floor
    assert expected["state_dict"].keys() == actual["state_dict"].keys()
    for name, tensor in expected["state_dict"].items():
        assert torch.equal(tensor, actual["state_dict"][name]), name


# -- config errors --------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "shown"),
    [
        (["optim.schedule=cosine", "optim.lr=null"], "optim.lr=null must be set for optim.schedule=cosine"),
        (["optim.schedule=exponential"], "optim.schedule=exponential must be one of noam, inverse_sqrt"),
        (["optim.schedule=noam", "optim.lr=0.001"], "optim.lr=0.001 must be null for optim.schedule=noam"),
        (["optim.schedule=wsd", "optim.lr=0.001", "optim.lr_scale=2"], "optim.lr_scale=2 scales eq. 3 only"),
        (["optim.schedule=linear", "optim.lr=0.001", "optim.min_lr=0.01"], "optim.min_lr=0.01 must be a number"),
        (
            ["optim.schedule=noam", "optim.lr=null", "optim.min_lr=0.01"],
            "optim.min_lr=0.01 is the floor of the schedules linear, cosine, wsd",
        ),
        (["optim.min_lr=0.01"], "optim.min_lr=0.01 must be a number from 0 to optim.lr=0.0015"),  # the default peak
        (["optim.schedule=wsd", "optim.lr=0.001", "optim.decay_fraction=0"], "optim.decay_fraction=0 must lie"),
        (
            ["optim.schedule=cosine", "optim.lr=0.001", "trainer.max_steps=-1", "trainer.max_time=null"],
            "optim.schedule=cosine decays until the run ends: set trainer.max_steps or trainer.max_time",
        ),
    ],
)
def test_a_schedule_setting_that_cannot_work_stops_the_run_in_one_line_naming_the_key(
    overrides: list[str],
    shown: str,
    corpus_root: Path,
    cache_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    monkeypatch.chdir(tmp_path)
    assert refusal([*smoke_run(corpus_root, cache_dir), *overrides], monkeypatch, capsys).startswith(shown)
