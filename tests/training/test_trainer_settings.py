"""The trainer section's settings aiayn interprets, checked in the training layer: a value that cannot
work is a FieldError naming the field (the config layer names it trainer.<field>); the rest pass through."""

from __future__ import annotations

from typing import Any

import pytest

from aiayn.errors import FieldError
from aiayn.training.trainer_settings import TrainerSettings


@pytest.mark.parametrize(
    ("setting", "value"),
    [("precision", "fp8"), ("max_steps", 0), ("max_epochs", 2.5), ("accumulate_grad_batches", 0),
     ("log_every_n_steps", -1), ("check_val_every_n_epoch", 0), ("val_check_interval", 1.5),
     ("gradient_clip_val", -1.0), ("devices", 0), ("devices", 10**6), ("num_nodes", 0), ("accelerator", "gpu")],
)  # fmt: skip
def test_a_setting_that_cannot_work_is_refused_naming_its_field(setting: str, value: Any) -> None:
    with pytest.raises(FieldError) as refused:
        TrainerSettings.of({"accelerator": "cpu", setting: value})
    assert refused.value.field == setting and "\n" not in str(refused.value)


def test_only_its_own_keys_are_read_and_the_world_size_is_counted() -> None:
    settings = TrainerSettings.of({"accelerator": "cpu", "devices": 1, "num_nodes": 3, "enable_progress_bar": False})
    assert settings.num_nodes == 3 and settings.world_size == 3 and settings.accumulate_grad_batches == 1
    assert TrainerSettings.of({"accelerator": "cpu", "devices": "auto"}).world_size == 1
