"""Gradient clipping (``trainer.gradient_clip_val``) keeps Adam fused, in fp32 and under bf16 autocast (where
Lightning's own clipping refuses a fused optimizer), and clips as Lightning's does: a run through a real
Trainer ends with the parameters, bit for bit, of the reference, Lightning's clipping of the same
gradients, and far from those of an unclipped run. An Adam that is not fused is foreach."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.utilities.enums import GradClipAlgorithmType
from torch.utils.data import DataLoader

from aiayn.model import TransformerConfig
from aiayn.training.module import TranslationModule
from aiayn.training.schedule import OptimSettings
from helpers.batches import ragged_batch

VOCAB, STEPS, CLIP = 50, 5, 0.05
# Batches of different shapes and contents (ragged_batch draws its ids from lengths and a fixed seed).
BATCHES = [ragged_batch([(6 + i, 5), (4, 7 - i), (9 - i, 3 + i)], VOCAB) for i in range(STEPS)]


class ReferenceClipping(TranslationModule):
    """Lightning's clipping (its precision plugins' common code), without the check by which its autocast
    plugin refuses fused optimizers."""

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        algorithm = GradClipAlgorithmType(gradient_clip_algorithm or "norm")  # Lightning's default, as it fills it in
        Precision.clip_gradients(self.trainer.precision_plugin, optimizer, gradient_clip_val, algorithm)


class LightningClipping(TranslationModule):
    """Lightning's clipping as Lightning calls it."""

    configure_gradient_clipping = pl.LightningModule.configure_gradient_clipping


def trained(cls: type[TranslationModule], clip: float | None, precision: str) -> TranslationModule:
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=VOCAB, n_layers=2, d_model=32, d_ff=64, n_heads=4, d_k=8, d_v=8, dropout=0.0)
    module = cls(config, bos_id=2, eos_id=3, optim=OptimSettings(schedule="inverse_sqrt", lr=0.01, warmup=2))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        gradient_clip_val=clip,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(module, train_dataloaders=DataLoader(BATCHES, batch_size=None))
    assert trainer.global_step == STEPS
    return module


def flat(module: TranslationModule) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_clipped_training_keeps_fused_adam_and_ends_where_lightnings_clipping_does(precision: str) -> None:
    ours = trained(TranslationModule, CLIP, precision)
    reference = trained(ReferenceClipping, CLIP, precision)
    unclipped = trained(TranslationModule, None, precision)
    assert ours.optimizers().optimizer.defaults["fused"] is True
    assert torch.equal(flat(ours), flat(reference))
    # The clip binds (the gradients' norm is far above 0.05): without it the run ends elsewhere.
    assert (flat(unclipped) - flat(ours)).abs().max().item() > 1e-3


def test_lightnings_own_clipping_would_refuse_fused_adam_under_autocast() -> None:
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        trained(LightningClipping, CLIP, "bf16-mixed")


def test_adam_that_cannot_be_fused_is_foreach() -> None:
    module = TranslationModule(  # on a device without the fused kernel
        TransformerConfig(vocab_size=VOCAB, n_layers=1, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8),
        bos_id=2,
        eos_id=3,
    ).to("meta")
    optimizer = module.configure_optimizers()["optimizer"]
    assert (optimizer.defaults["fused"], optimizer.defaults["foreach"]) == (False, True)
