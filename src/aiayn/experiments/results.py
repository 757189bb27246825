"""``results.json``, what a finished run reports: its one schema (:class:`RunResults`), which
:mod:`aiayn.experiments.run` writes and :mod:`aiayn.experiments.report` reads, with the words its fields
take. Plain data: the report imports it without Lightning."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from aiayn.errors import DataError
from aiayn.training.metrics import EVALUATED_CHECKPOINTS

RESULTS_FILE = "results.json"
# "evaluated" is one of EVALUATED_CHECKPOINTS, the checkpoint val_* and test_* are of; "answer"
# (aiayn.experiments.run.run_answer) the tested checkpoint the run answers with: the evaluated one by its
# name, or the average or the EMA of the weights.
ANSWERS = (*EVALUATED_CHECKPOINTS, "averaged", "ema")


@dataclass
class RunResults:
    """``results.json``: what a finished run reports, each field once. The test fields are absent for a
    corpus without a test split, the averaged ones when fewer than two checkpoints were averaged, the EMA's
    when the run kept none (``ema.decay``)."""

    params: int
    val_bleu: float  # val_* and test_* are the evaluated checkpoint's
    val_ppl: float
    val_loss: float
    best_val_bleu: float | None  # the best validation BLEU of the run (best.ckpt's), when it monitors val/bleu
    best_score: float | None  # the best value of checkpoint.monitor (best.ckpt's): what Hydra's sweepers optimise
    decoding: dict[str, Any]  # the tests' and the final validation's (val_* are reported next to test_*)
    val_decoding: dict[str, Any]  # the validations' while training, which ranked the checkpoints (best_*)
    steps: int
    epochs: int
    train_tokens: int  # real source + target tokens of the whole run, all ranks, resumed parts included
    train_tokens_per_s: float
    evaluated: str  # checkpoint.evaluate: "best" or "final"
    evaluated_checkpoint: str  # relative to the run folder, unless it lies in the folder of a resumed run
    best_checkpoint: str
    resumed_from: str | None
    test: dict[str, Any]  # test_bleu, test_chrf, test_ppl, test_split, test_sentences, sacrebleu_signature
    averaged: dict[str, Any]  # test_bleu_averaged, test_chrf_averaged, val_bleu_averaged, averaged_checkpoints
    ema: dict[str, Any]  # test_bleu_ema, test_chrf_ema, val_bleu_ema (aiayn.training.callbacks.ema)
    answer: dict[str, Any]  # answer (checkpoint.answer, resolved), answer_checkpoint, answer_test_bleu, _chrf
    batch: dict[str, Any]  # the effective batch (aiayn.training.batching)
    data: dict[str, int]  # pairs kept and dropped, by reason (aiayn.data.datamodule)
    data_cache: str  # the data's cache entry: corpus content, direction and vocabulary (what aiayn-report keys by)
    skipped_steps: int  # non-finite loss or gradients (aiayn.training.callbacks.faults)
    overflow_steps: int  # fp16 steps the gradient scaler skipped
    wall_s: float
    overrides: list[str]  # the command line's, which define the run
    versions: dict[str, str | None]  # aiayn's and the libraries' that decide the numbers (run_info.SOFTWARE)

    def to_dict(self) -> dict[str, Any]:
        """The fields in order, with the test, averaged and EMA scores' own keys in place of the groups."""
        flat: dict[str, Any] = {}
        for key, value in asdict(self).items():
            flat.update(value if key in ("test", "averaged", "ema", "answer") else {key: value})
        return flat


# The tested checkpoints of a run folder besides the evaluated one, and the suffix of their scores' keys.
TESTED_CHECKPOINTS = {"checkpoints/averaged.ckpt": "_averaged", "checkpoints/ema.ckpt": "_ema"}


@dataclass(frozen=True)
class CheckpointScores:
    """What a run's ``results.json`` says of one of its checkpoints: its test sacreBLEU and chrF (None when
    the run did not test it) with sacreBLEU's signature and the test split, and the run's training."""

    bleu: float | None
    chrf: float | None
    signature: str | None
    test_split: str | None
    test_sentences: int | None
    params: int
    steps: int
    train_tokens: int | None
    wall_s: float | None


def checkpoint_scores(checkpoint: Path) -> CheckpointScores | None:
    """The scores of ``checkpoint`` (``<run>/checkpoints/<name>.ckpt``) in its run's ``results.json``, read
    as untrusted (a plain file, each field checked); None for a checkpoint outside a run folder, a run
    without results, or a file that is not as aiayn-train writes it (a copied or damaged folder)."""
    from aiayn.experiments.report.records import field_of, is_text, number_in, optional, read_record, whole_in

    if checkpoint.parent.name != "checkpoints" or checkpoint.is_dir():
        return None
    path = checkpoint.parent.parent / RESULTS_FILE
    name = f"checkpoints/{checkpoint.name}"
    try:
        results = read_record(path)
        evaluated = field_of(results, "evaluated_checkpoint", path, lambda v: is_text(v, 4096), "a path", None)
        suffix = "" if name == evaluated else TESTED_CHECKPOINTS.get(name)
        score = optional(number_in(0, 100))
        found = {
            key: field_of(results, key, path, *check, None)
            for key, check in {
                "sacrebleu_signature": (optional(lambda v: is_text(v, 1000)), "a sacreBLEU signature"),
                "test_split": (optional(lambda v: is_text(v, 200)), "a split's name"),
                "test_sentences": (optional(whole_in(1, 10**9)), "a number of sentences"),
                "train_tokens": (optional(whole_in(0, 10**15)), "a number of tokens"),
                "wall_s": (optional(number_in(0, 1e10)), "seconds"),
            }.items()
        }
        return CheckpointScores(
            bleu=field_of(results, f"test_bleu{suffix}", path, score, "a BLEU score", None)
            if suffix is not None
            else None,
            chrf=field_of(results, f"test_chrf{suffix}", path, score, "a chrF score", None)
            if suffix is not None
            else None,
            signature=found["sacrebleu_signature"],
            test_split=found["test_split"],
            test_sentences=found["test_sentences"],
            params=field_of(results, "params", path, whole_in(0, 10**13), "a number of parameters"),
            steps=field_of(results, "steps", path, whole_in(0, 10**12), "a number of steps"),
            train_tokens=found["train_tokens"],
            wall_s=found["wall_s"],
        )
    except (DataError, FileNotFoundError):
        return None
