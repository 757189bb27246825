"""The learning-rate schedule of eq. 3 and the optimizer it drives (§5.3)."""

from __future__ import annotations

import math
import re

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins import MixedPrecision

from aiayn.model import TransformerConfig
from aiayn.training.module import TranslationModule
from aiayn.training.schedule import NoamSchedule


def lr_at(schedule: NoamSchedule, step: int) -> float:
    """Learning rate of optimizer step ``step`` (1-based); LambdaLR passes step - 1."""
    return schedule(step - 1)


def test_step_4000_of_base_gives_the_papers_value() -> None:
    assert lr_at(NoamSchedule(512, 4000), 4000) == pytest.approx(6.99e-4, abs=5e-7)


def test_warmup_branch_is_linear_and_decay_branch_inverse_square_root() -> None:
    schedule = NoamSchedule(512, warmup=4000)
    assert lr_at(schedule, 2000) == pytest.approx(lr_at(schedule, 1000) * 2)
    assert lr_at(schedule, 1) == pytest.approx(512**-0.5 * 4000**-1.5)
    assert lr_at(schedule, 16000) == pytest.approx(lr_at(schedule, 4000) / 2)
    assert lr_at(schedule, 100000) == pytest.approx(512**-0.5 / math.sqrt(100000))
    assert max(range(1, 10000), key=lambda s: lr_at(schedule, s)) == 4000


def test_scale_and_warmup_are_configurable() -> None:
    assert lr_at(NoamSchedule(256, 400, scale=2.0), 400) == pytest.approx(2 * 256**-0.5 * 400**-0.5)


@pytest.mark.parametrize("bad", [(0, 4000, 1.0), (512, 0, 1.0), (512, 4000, 0.0)])
def test_rejects_non_positive_settings(bad: tuple[int, int, float]) -> None:
    d_model, warmup, scale = bad
    expected = f"NoamSchedule needs positive d_model, warmup and scale, got {d_model}, {warmup}, {scale}"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        NoamSchedule(*bad)


def tiny_module() -> TranslationModule:
    model = TransformerConfig(vocab_size=50, n_layers=1, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8)
    return TranslationModule(model=model, bos_id=2, eos_id=3)


def test_adam_has_the_papers_settings_and_is_fused_unless_lightning_must_unscale_gradients() -> None:
    module = tiny_module()
    optimizer = module.configure_optimizers()["optimizer"]
    assert optimizer.defaults["betas"] == (0.9, 0.98) and optimizer.defaults["eps"] == 1e-9  # §5.3
    assert optimizer.defaults["fused"] is True

    def fused_under(**trainer_options: object) -> bool:
        module = tiny_module()
        module.trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, **trainer_options)
        return module.configure_optimizers()["optimizer"].defaults["fused"]

    assert fused_under()
    assert fused_under(gradient_clip_val=1.0)
    assert fused_under(precision="bf16-mixed")
    # Lightning unscales fp16 gradients (for clipping, for train/grad_norm) only for unfused optimizers.
    assert not fused_under(plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))])
