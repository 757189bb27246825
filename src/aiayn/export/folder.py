"""What every exported model folder holds besides its weights, which model variants each target takes,
and how a folder is written: whole or not at all, never over another one."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from itertools import groupby
from pathlib import Path
from typing import Any

from aiayn.data.tokenizer import Tokenizer
from aiayn.errors import DataError, FieldError, first_line, nesting
from aiayn.files import atomic_folder, holds_files, read_plain_file
from aiayn.model import DecodingOptions, TransformerConfig
from aiayn.model.components import describe, is_paper

PROVENANCE_FILE = "aiayn.json"  # the source checkpoint, the model's hyperparameters and the run's config
PROVENANCE_BYTES = 1 << 20  # what aiayn-export writes there is kilobytes ...
PROVENANCE_DEPTH = 32  # ... of a run's config, a few levels deep
TOKENIZER_FILE = "sentencepiece.model"  # our joint BPE model, as aiayn.data.tokenizer reads it
TOKENIZER_BYTES = 64 << 20  # a sentencepiece model of a 250k-piece vocabulary is a few megabytes
FORMATS = ("hf", "ctranslate2")


def check_exportable(cfg: TransformerConfig, target: str) -> None:
    """Raise a :class:`~aiayn.errors.FieldError` naming the first model setting ``target`` cannot represent.

    ``hf`` is ``MarianMTModel``: post-LN, fixed sinusoids, one shared embedding matrix, d_k = d_model / h.
    ``ctranslate2`` is CTranslate2's ``TransformerSpec``, which also takes learned positions and pre-LN;
    neither has our rotary attention, position biases or a model without positions, and both take the
    paper's components only (multi-head attention with a key/value head per head, the ReLU network,
    LayerNorm) in stacks of one depth.
    """
    engine = "MarianMTModel" if target == "hf" else "CTranslate2's TransformerSpec"
    why = f"cannot be exported to format={target}: {engine}"
    allowed_positions = ("sinusoidal",) if target == "hf" else ("sinusoidal", "learned")
    if cfg.positional_name not in allowed_positions:
        allowed = f"{why} has {' or '.join(allowed_positions)} positions"
        raise FieldError("positional", describe(cfg.positional), allowed)
    for kind in ("attention", "feed_forward", "norm"):
        if not is_paper(kind, getattr(cfg, kind)):
            raise FieldError(kind, describe(getattr(cfg, kind)), f"{why} has the paper's {kind.replace('_', '-')} only")
    if cfg.encoder_depth != cfg.decoder_depth:
        field = "decoder_layers" if cfg.decoder_layers is not None else "encoder_layers"
        raise FieldError(field, getattr(cfg, field), f"{why} has stacks of one depth")
    if cfg.norm_first and target == "hf":
        raise FieldError("norm_first", cfg.norm_first, f"{why} is post-LN (the paper's §3.1) only")
    if not cfg.share_embeddings:
        raise FieldError("share_embeddings", cfg.share_embeddings, f"{why} is exported with shared embeddings")
    if cfg.d_k * cfg.n_heads != cfg.d_model:
        raise FieldError("d_k", cfg.d_k, f"{why} needs d_k = d_model / n_heads = {cfg.d_model / cfg.n_heads:g}")
    if cfg.d_v != cfg.d_k:
        raise FieldError("d_v", cfg.d_v, f"{why} needs d_v = d_k = {cfg.d_k}")


def length_groups(
    rows: list[list[int]], options: DecodingOptions, max_positions: int
) -> Iterator[tuple[int, list[int]]]:
    """The indices of ``rows`` (source ids without EOS) in groups of one length, shortest first, each with
    the most tokens a translation may have before EOS: source tokens + EOS + ``options.max_len_offset``,
    at most what the decoder's position table holds, as in :func:`aiayn.model.beam_search`. For engines
    that take one length limit per call (``generate``, CTranslate2)."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    for length, group in groupby(order, key=lambda i: len(rows[i])):
        yield min(length + 1 + options.max_len_offset, max_positions - 1), list(group)


def check_decoding(options: DecodingOptions, nbest: int, engine: str) -> None:
    """Refuse, in one line naming the key, the decoding options ``engine`` (CTranslate2, ``generate``)
    cannot run as our search does: GNMT's length penalty with α > 0 (theirs is ``power``, log P / |Y|^α)
    and sampling (their draws depend on the batch, and for CTranslate2 on its threads, not only on
    ``seed`` and the sentence as ours, :mod:`aiayn.model.sampling`); ``nbest`` beyond the beam."""
    if options.mbr:
        raise FieldError("mbr", options.mbr, f"is not decoded through {engine}: MBR decoding runs with backend=aiayn")
    if options.sample:
        raise FieldError(
            "sample", True, f"is not reproducible through {engine} (its draws depend on the batch, "
            "not only on seed= and the sentence); sample with backend=aiayn",
        )  # fmt: skip
    if options.length_penalty == "gnmt" and options.alpha > 0 and options.beam_size > 1:
        raise FieldError(
            "length_penalty", "gnmt", f"with alpha={options.alpha:g} has no {engine} equivalent: "
            "use length_penalty=power (log P / |Y|^α, the engine's) or backend=aiayn",
        )  # fmt: skip
    options.check_nbest(nbest)


def write_companions(folder: Path, tokenizer: Tokenizer, provenance: dict[str, Any]) -> None:
    """Our tokenizer and :data:`PROVENANCE_FILE`: what aiayn-translate and aiayn-eval read from a folder."""
    (folder / TOKENIZER_FILE).write_bytes(tokenizer.to_bytes())
    text = json.dumps(provenance, indent=2, default=str) + "\n"
    (folder / PROVENANCE_FILE).write_text(text, encoding="utf-8")


def read_provenance(folder: Path) -> dict[str, Any]:
    """The :data:`PROVENANCE_FILE` of an exported folder (plain JSON: reading it runs nothing), read as
    untrusted: a plain file of at most :data:`PROVENANCE_BYTES`, or a ``ValueError`` in one line."""
    path = folder / PROVENANCE_FILE
    try:
        provenance = json.loads(read_plain_file(path, PROVENANCE_BYTES).decode("utf-8"))
    except FileNotFoundError:
        raise ValueError(
            f"{folder} has no {PROVENANCE_FILE}: it is not a model folder written by aiayn-export"
        ) from None
    except DataError as error:
        raise ValueError(f"{error}; export the model again") from None
    except (ValueError, RecursionError) as error:  # not UTF-8, not JSON, nested deeper than Python parses
        raise ValueError(f"{path} is not JSON ({first_line(error)}); export the model again") from None
    if not isinstance(provenance, dict) or not isinstance(provenance.get("model"), dict):
        raise ValueError(f"{path} has no model section; export the model again")
    if nesting(provenance) > PROVENANCE_DEPTH:
        raise ValueError(f"{path} is nested deeper than {PROVENANCE_DEPTH} levels; export the model again")
    return provenance


def check_plain_files(folder: Path) -> None:
    """A ``ValueError`` naming the first entry of the exported ``folder`` that is a link, a FIFO, a device
    or a socket: an engine reads the folder's files itself, and would follow a link anywhere or wait on
    a FIFO forever."""
    for entry in sorted(os.scandir(folder), key=lambda entry: entry.name):
        if entry.is_symlink() or not (entry.is_file(follow_symlinks=False) or entry.is_dir(follow_symlinks=False)):
            what = "a link" if entry.is_symlink() else "not a plain file"
            raise ValueError(f"{entry.path}: is {what}; an exported folder holds only plain files: export it again")


def write_folder(output: Path, write: Callable[[Path], None]) -> None:
    """Run ``write(folder)`` on a new folder that becomes ``output`` only when it is whole
    (:func:`aiayn.files.atomic_folder`): an export never mixes its files with another model's, and a
    failed or interrupted one leaves no ``output`` behind."""
    output = Path(output)
    if holds_files(output):
        raise FieldError("output", str(output), "already exists and is not empty; give a new folder")
    atomic_folder(output, write)
