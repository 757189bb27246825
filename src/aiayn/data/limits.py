"""The data module's sizes, counts and limits, checked before anything is read, and what they imply for
the loaders: the number of loader workers, and whether a validation interval fits in an epoch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiayn.errors import FieldError, is_number, whole
from aiayn.machine import available_cpus

if TYPE_CHECKING:
    import pytorch_lightning as pl


def check_validation_interval(trainer: pl.Trainer, batches: int) -> None:
    """A validation interval of whole batches must fit in an epoch of ``batches`` when validations follow
    the epochs (Lightning refuses it with a traceback once the loader exists: here, the key and the fix)."""
    interval = trainer.val_check_interval
    if isinstance(interval, int) and trainer.check_val_every_n_epoch is not None and interval > batches:
        raise FieldError(
            "val_check_interval",
            interval,
            f"is more than an epoch's {batches} training batches: give a fraction of an epoch (1.0: at its end), "
            "or every_steps=N to validate every N optimizer steps across epochs",
        )


def check_sizes(
    *,
    tokenizer_sample: int,
    encode_workers: int | None,
    max_tokens: int,
    eval_max_tokens: int | None,
    max_len: int,
    max_len_ratio: float | None,
    num_workers: int | None,
    prefetch_factor: int | None,
    batch_shapes: int | None,
    train_limit: int | None,
    eval_limit: int | None,
) -> None:
    """The data module's sizes, counts and limits, each a :class:`~aiayn.errors.FieldError` naming its field
    (the config layer names the ``data.*`` key); among them, the token budget against the longest sentence
    training keeps."""
    counts = (
        ("tokenizer_sample", tokenizer_sample, 1, False),
        ("num_workers", num_workers, 0, True),
        ("prefetch_factor", prefetch_factor, 1, True),
        ("batch_shapes", batch_shapes, 1, True),
        ("encode_workers", encode_workers, 1, True),
        ("train_limit", train_limit, 1, True),
        ("eval_limit", eval_limit, 1, True),
    )
    for key, value, minimum, null in counts:
        if not (null and value is None) and not whole(value, minimum):
            raise FieldError(key, value, f"must be a whole number >= {minimum}{' or null' if null else ''}")
    if max_len_ratio is not None and not (is_number(max_len_ratio) and max_len_ratio >= 1):
        raise FieldError("max_len_ratio", max_len_ratio, "must be a number >= 1 (or null: no ratio filter)")
    for key, value in (("max_tokens", max_tokens), ("max_len", max_len)):
        if not whole(value, 1):
            raise FieldError(key, value, "must be a whole number of tokens >= 1")
    if eval_max_tokens is not None and not whole(eval_max_tokens, 1):
        raise FieldError("eval_max_tokens", eval_max_tokens, "must be a whole number of tokens >= 1 (or null)")
    # A kept pair has at most max_len tokens per side, its end-of-sentence token included.
    if max_tokens < max_len:
        raise FieldError(
            "max_tokens",
            max_tokens,
            f"is smaller than the longest sentence training keeps ({{max_len}}={max_len} tokens); "
            "raise {max_tokens} or lower {max_len}",
        )


def loader_workers(processes: int) -> int:
    """Loader workers per training process when ``data.num_workers`` is null: half the CPUs each of the
    ``processes`` on this machine may use (the other half runs the process itself and its CUDA threads),
    at most 8. A vectorised collate makes a 25000-token batch in a few ms, so 8 feed any one GPU."""
    return min(8, available_cpus() // max(processes, 1) // 2)
