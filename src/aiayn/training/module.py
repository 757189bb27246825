"""The LightningModule: teacher-forced training with label smoothing, Adam + eq. 3, validation BLEU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Timer
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.enums import GradClipAlgorithmType
from torchmetrics import MeanMetric
from torchmetrics.text import SacreBLEUScore

from aiayn.model import PAPER_DECODING, DecodingOptions, Packing, Transformer, TransformerConfig, translate_ids
from aiayn.scoring import BLEU_SETTINGS
from aiayn.training.distributed import gathered_from_ranks
from aiayn.training.loss import label_smoothed_cross_entropy
from aiayn.training.schedule import (
    DECAYING,
    PAPER_OPTIM,
    Budget,
    OptimSettings,
    Schedule,
    WarmupDecaySchedule,
    lr_schedule,
    parameter_groups,
)

# What every validation and test logs, as <stage>/<name>: the smoothed loss (§5.4), the cross-entropy,
# its perplexity (Table 3) and sacreBLEU.

# The output projection runs on the real target positions of a batch, their count rounded up by
# projected_rows. Every new row count of a matrix product costs kernel selection once: on the CPU oneDNN
# builds and caches kernels for it (the real count, new at almost every step, kept adding some and pushing
# others out of the cache, and the heap fragmented around them: aiayn.machine.size_kernel_caches); on a
# GPU cuBLASLt picks an algorithm, and a CUDA graph or compiled region wants a shape it has seen.
PROJECTED_ROWS = 16  # the rounding step of small counts
PROJECTED_STEPS_PER_OCTAVE = 16  # larger counts: this many steps per doubling, each at most 1/16 of the count


def projected_rows(real: int) -> int:
    """``real`` rows rounded up to a multiple of :data:`PROJECTED_ROWS`, or of 1/16 of the power of two at
    or below ``real`` when that is larger: at most 1/16 more rows, and 16 counts per doubling (a
    25000-token batch's ~12000 target tokens take a handful of counts over a run, not hundreds)."""
    step = max(PROJECTED_ROWS, (1 << max(real.bit_length() - 1, 0)) // PROJECTED_STEPS_PER_OCTAVE)
    return -(-real // step) * step


class TranslationModule(pl.LightningModule):
    """Trains a :class:`~aiayn.model.Transformer` and evaluates it with perplexity and sacreBLEU.

    The model is the one ``model`` describes. The optimizer is Adam with ``optim``'s β1, β2, ε (§5.3),
    AdamW with ``optim.weight_decay`` > 0; its learning rate follows ``optim.schedule``
    (:func:`~aiayn.training.schedule.lr_schedule`, eq. 3 by default), stepped once per optimizer step.
    The tests translate by beam search with ``decoding`` (§6.1), and so do the validations, unless
    ``val_decoding`` gives those of a fit their own (:meth:`evaluation_decoding`). ``compile`` runs the
    model's forward through ``torch.compile`` (beam search calls it eagerly); ``packed_attention``, its
    teacher-forced encoder and encoder-decoder attention over packed sequences, without padding masks
    (for FlashAttention-2 on a GPU; :class:`~aiayn.model.Packing`). Each settings object is
    checked where it is made; the checkpoint's hyperparameters hold them as plain data, so that they
    load with ``weights_only=True``.
    """

    def __init__(
        self,
        model: TransformerConfig,
        bos_id: int,
        eos_id: int,
        optim: OptimSettings = PAPER_OPTIM,
        decoding: DecodingOptions = PAPER_DECODING,
        compile: bool = False,
        val_decoding: DecodingOptions | None = None,
        packed_attention: bool = False,
    ) -> None:
        super().__init__()
        self.optim, self.decoding = optim, decoding
        # The hyperparameters keep ``decoding`` alone: the checkpoint's decoding is the tests'.
        self.val_decoding = val_decoding or decoding
        # The loggers get the whole composed config from the run (aiayn.training.loggers), not these.
        hyperparameters = {"model": model.to_dict(), "bos_id": bos_id, "eos_id": eos_id, **optim.to_dict()}
        running = {"compile": compile, "packed_attention": packed_attention}
        self.save_hyperparameters({**hyperparameters, "decoding": decoding.to_dict(), **running}, logger=False)
        self.packed_attention = packed_attention
        self.model = Transformer(model)
        if compile:
            self.model.compile()  # in place: parameter names (and checkpoints) stay those of eager mode
        self.pad_id = self.model.cfg.pad_id
        stages = ("val", "test")
        # Token-weighted means and corpus BLEU; torchmetrics syncs their sums across DDP ranks. Its BLEU
        # applies no smoothing, which equals sacreBLEU's "exp" smoothing whenever every n-gram order has a
        # match (any real corpus); the final test scores come from sacrebleu itself, with its signature.
        self.nll = torch.nn.ModuleDict({stage: MeanMetric() for stage in stages})
        self.smoothed = torch.nn.ModuleDict({stage: MeanMetric() for stage in stages})
        self.bleu = torch.nn.ModuleDict({stage: SacreBLEUScore(**BLEU_SETTINGS) for stage in stages})
        self.detokenize: Callable[[list[list[int]]], list[str]] | None = None
        self.test_hypotheses: dict[int, str] = {}  # dataset position → detokenized hypothesis, all ranks'

    # -- loss -------------------------------------------------------------------------------------
    def loss(
        self, logits: torch.Tensor, target: torch.Tensor, smoothing: float, n_tokens: int | None = None
    ) -> tuple[torch.Tensor, int]:
        """Label-smoothed cross-entropy per real target token (§5.4); padding positions are ignored.

        ``n_tokens``, the real target tokens, is counted from ``target`` unless given (counting on a
        GPU makes the host wait for it).
        """
        if n_tokens is None:
            n_tokens = int(target.ne(self.pad_id).sum())
        total = label_smoothed_cross_entropy(logits, target, smoothing, self.pad_id)
        return total / max(n_tokens, 1), n_tokens

    def training_loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, int]:
        """The label-smoothed loss of a training batch and its real target tokens: all a training step
        computes before the backward pass (the benchmarks' bare loops call it too)."""
        logits, target = self.real_target_logits(batch)
        n_tokens = batch["target_rows"].numel()  # a shape: no wait
        return self.loss(logits, target, self.optim.label_smoothing, n_tokens)

    def real_target_logits(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced logits (N', vocab) at the batch's N real target positions and their reference ids
        (N',): padding positions get no output projection, softmax or loss. N' is
        :func:`projected_rows` of N: the extra rows repeat the first position, with the padding id
        as their reference, which the loss ignores (no loss, no gradient)."""
        rows = batch["target_rows"]
        target = batch["tgt_out"].flatten().index_select(0, rows)
        extra = projected_rows(rows.numel()) - rows.numel()
        if extra:
            rows = torch.cat([rows, rows.new_zeros(extra)])
            target = torch.cat([target, target.new_full((extra,), self.pad_id)])
        packed = Packing.of_batch(batch) if self.packed_attention else None
        return self.model(batch["src"], batch["tgt_in"], rows, packed), target

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss, n_tokens = self.training_loss(batch)
        # Not prog_bar=True: Lightning would read a progress-bar value on the host after every batch (the
        # run's progress bar reads it at the steps whose metrics are logged). The learning rate is filled
        # into a device tensor: Lightning would copy a Python float there, and the host waits for a copy.
        self.log("train/loss", loss, batch_size=n_tokens)
        lr = torch.full((), self.lr_schedulers().get_last_lr()[0], device=self.device)
        self.log("train/lr", lr, batch_size=n_tokens)
        return loss

    def setup(self, stage: str) -> None:
        # Learned positions are a table of max_positions rows (Table 3 row E) and evaluation sentences are
        # never filtered: a longer one must stop the run now, not at its first validation.
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        if self.model.cfg.positional == "learned" and datamodule is not None:
            for role in ("val", "test"):
                if role in datamodule.datasets:
                    datamodule.check_longest(role, self.model.cfg.max_positions, "model.max_positions")

    # -- evaluation -------------------------------------------------------------------------------
    def _evaluate(self, batch: dict[str, Any], stage: str) -> None:
        logits, target = self.real_target_logits(batch)
        nll, n_tokens = self.loss(logits, target, 0.0, batch["target_rows"].numel())
        smoothed, _ = self.loss(logits, target, self.optim.label_smoothing, n_tokens)
        self.nll[stage].update(nll, weight=n_tokens)
        self.smoothed[stage].update(smoothed, weight=n_tokens)
        options = self.evaluation_decoding(stage)
        hypotheses = translate_ids(self.model, batch["src"], self.hparams.bos_id, self.hparams.eos_id, options)
        text = self.detokenizer()(hypotheses)
        self.bleu[stage].update(text, [[ref] for ref in batch["references"]])
        if stage == "test":
            self.test_hypotheses.update(zip(batch["index"].tolist(), text, strict=True))

    def evaluation_decoding(self, stage: str) -> DecodingOptions:
        """How ``stage`` translates: the validations of a fit only rank checkpoints (``val_decoding``, e.g.
        greedy and cheaper); a validation of a chosen checkpoint after training is reported next to its
        test and decodes as the test does (``decoding``)."""
        fitting = self._trainer is not None and self.trainer.state.fn == TrainerFn.FITTING
        return self.val_decoding if stage == "val" and fitting else self.decoding

    def _log_evaluation(self, stage: str) -> None:
        """Logs ``<stage>/<name>`` for each of :data:`~aiayn.training.metrics.EVALUATION_METRICS`."""
        nll = self.nll[stage].compute()
        self.log(f"{stage}/loss", self.smoothed[stage].compute())
        self.log(f"{stage}/nll", nll)
        self.log(f"{stage}/ppl", torch.exp(nll))
        self.log(f"{stage}/bleu", 100 * self.bleu[stage].compute(), prog_bar=True)
        for metric in (self.nll[stage], self.smoothed[stage], self.bleu[stage]):
            metric.reset()

    def detokenizer(self) -> Callable[[list[list[int]]], list[str]]:
        """Ids → text: the data module's tokenizer, unless one was attached for use without a trainer."""
        if self.detokenize is None:
            self.detokenize = self.trainer.datamodule.tokenizer.decode
        return self.detokenize

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def on_validation_epoch_end(self) -> None:
        self._log_evaluation("val")

    def on_test_epoch_start(self) -> None:
        self.test_hypotheses = {}

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def on_test_epoch_end(self) -> None:
        self._log_evaluation("test")
        # Each DDP rank translated its share of the test set; every rank gets all hypotheses.
        shares = gathered_from_ranks(self.test_hypotheses)
        self.test_hypotheses = {i: text for share in shares for i, text in share.items()}

    # -- optimisation -----------------------------------------------------------------------------
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A resumed run trains with this run's ``optim.*`` settings, not the checkpoint's: Lightning
        restores Adam's betas, eps and weight decay and the schedule object (warmup, scale, peak ...)
        from the checkpoint after this hook, so they are replaced in it first, the learning rate of the
        step it resumes at included. Adam's moment estimates and the decay a decaying schedule placed
        are kept: they are the training state, the settings are the user's."""
        schedule = self.schedule()
        decays = [group["weight_decay"] for group in self._parameter_groups()]
        for state in checkpoint.get("lr_schedulers", []):
            if isinstance(schedule, WarmupDecaySchedule):
                for stored in state.get("lr_lambdas", []):  # one schedule object, saved once per group
                    schedule.continue_from(stored)
            state["lr_lambdas"] = [dict(vars(schedule)) for _ in state.get("lr_lambdas", [])]
            state["_last_lr"] = [base * schedule(state.get("last_epoch", 0)) for base in state.get("base_lrs", [])]
            for optimizer in checkpoint.get("optimizer_states", []):
                groups = zip(optimizer.get("param_groups", []), state["_last_lr"], decays, strict=False)
                for group, lr, decay in groups:
                    group.update(betas=self.optim.betas, eps=self.optim.eps, lr=lr, weight_decay=decay)

    def _fused_adam(self) -> bool:
        """Whether Adam may use its fused kernel, one pass over all tensors (CPU and CUDA) instead of
        five elementwise passes per parameter tensor: 5x faster at base on the CPU. With an fp16 gradient
        scaler Lightning unscales gradients (for clipping, for ``train/grad_norm``) only for unfused
        optimizers, so those runs keep the unfused one; clipping does not need it
        (:meth:`configure_gradient_clipping`)."""
        trainer = self._trainer
        if trainer is None:
            return {p.device.type for p in self.parameters()} <= {"cpu", "cuda"}
        scaled = getattr(trainer.precision_plugin, "scaler", None) is not None
        # The device the run trains on: a restored checkpoint's optimizer is checked before the module moves.
        return trainer.strategy.root_device.type in {"cpu", "cuda"} and not scaled

    def schedule(self) -> Schedule:
        """This run's learning rate by step (``optim.schedule``; eq. 3 by default, §5.3)."""
        return lr_schedule(self.optim, self.model.cfg.d_model)

    def _parameter_groups(self) -> list[dict[str, Any]]:
        """Adam's one group (the paper's), or AdamW's decayed and undecayed groups with ``optim.weight_decay``."""
        if self.optim.weight_decay == 0:
            return [{"params": list(self.parameters()), "weight_decay": 0}]
        return parameter_groups(self, self.optim.weight_decay)

    def _budget(self) -> Budget:
        """The run's limits and, under ``trainer.max_time``, the time trained so far by the clock of
        Lightning's ``Timer``, the callback that ends the run at that time (its clock continues across
        resumes; a test may bring a Timer of its own)."""
        trainer = self.trainer
        max_steps = trainer.max_steps if trainer.max_steps > 0 else None
        timer = next((callback for callback in trainer.callbacks if isinstance(callback, Timer)), None)
        remaining = timer.time_remaining() if timer is not None else None
        if timer is None or remaining is None:
            return Budget(max_steps)
        elapsed = timer.time_elapsed()
        return Budget(max_steps, elapsed, elapsed + remaining)

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        """Steps the schedule after each optimizer step; a decaying one first fixes its decay in steps
        when the decay phase begins (:meth:`~aiayn.training.schedule.WarmupDecaySchedule.place_decay`)
        and, under a time limit, projects its end again every few steps
        (:meth:`~aiayn.training.schedule.WarmupDecaySchedule.reproject`). Every DDP rank places the same
        decay: under a time limit rank 0's clock decides, as it decides when Lightning's ``Timer`` stops
        the run; steps are the same on every rank."""
        schedule, done = scheduler.lr_lambdas[0], scheduler.last_epoch + 1  # the steps done, as the schedule counts
        if isinstance(schedule, WarmupDecaySchedule) and schedule.kind in DECAYING:
            if schedule.decay_start is None:
                budget = self._budget()
                end = budget.end(done) if schedule.decay_due(done, budget) else None
                if budget.seconds is not None:
                    end = self.trainer.strategy.broadcast(end)
                if end is not None:
                    schedule.place_decay(done, end, budget.elapsed if budget.seconds is not None else None)
            elif schedule.reproject_due(done, self._budget):
                end = self._budget().end(done, schedule.rate_since())
                schedule.reproject(done, self.trainer.strategy.broadcast(end))
        scheduler.step()

    def configure_optimizers(self) -> dict[str, Any]:
        # lr=1.0: the schedule's value is the learning rate itself (eq. 3). AdamW decays each weight by
        # lr * weight_decay * weight per step, apart from the gradient's update (decoupled weight decay).
        adam = torch.optim.Adam if self.optim.weight_decay == 0 else torch.optim.AdamW
        # Not fused: foreach, a few kernels over all tensors rather than ~10 per tensor. torch picks foreach
        # by itself only when neither switch is given.
        fused = self._fused_adam()
        groups = self._parameter_groups()
        optimizer = adam(groups, lr=1.0, betas=self.optim.betas, eps=self.optim.eps, fused=fused, foreach=not fused)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.schedule())
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """``trainer.gradient_clip_val`` as Lightning's own clipping applies it (the global norm, or each
        value with ``gradient_clip_algorithm=value``), on the device: the gradients are scaled by
        min(1, max_norm / norm) as a tensor, nothing is read on the host. Lightning's path goes through its
        autocast plugin, which refuses to clip for a fused optimizer; this one keeps Adam fused."""
        if not gradient_clip_val:
            return
        parameters = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            torch.nn.utils.clip_grad_value_(parameters, gradient_clip_val)
        else:
            torch.nn.utils.clip_grad_norm_(parameters, gradient_clip_val)
