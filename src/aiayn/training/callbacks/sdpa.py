"""Which kernels scaled dot-product attention may run in a fit, validation or test: the run's choice
(``sdpa_backends``), not PyTorch's default of the day. PyTorch ≥ 2.10 prefers cuDNN's attention on Hopper
when its cuDNN is new enough, and cuDNN builds an execution graph for every new batch shape
(:data:`aiayn.model.attention.DEFAULT_SDPA_BACKENDS` says why the default leaves it out)."""

from __future__ import annotations

from collections.abc import Sequence

import pytorch_lightning as pl

from aiayn.model import sdpa_backends, use_sdpa_backends


class SdpaBackends(pl.Callback):
    """Allows SDPA the kernels ``backends`` names (:func:`aiayn.model.use_sdpa_backends`, process-wide)
    whenever the trainer sets up a fit, a validation, a test or a prediction, on any device: the switches
    are torch's, and a CPU runs its own kernels among those allowed."""

    def __init__(self, backends: Sequence[str]) -> None:
        self.backends = sdpa_backends(backends)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        use_sdpa_backends(self.backends)
