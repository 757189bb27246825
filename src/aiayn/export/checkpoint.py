"""A checkpoint of aiayn-train or aiayn-average → an exported model folder (``aiayn-export``)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from aiayn.errors import FieldError, whole
from aiayn.export import ctranslate2, marian
from aiayn.export.folder import FORMATS, PROVENANCE_FILE, check_exportable, read_provenance, write_folder
from aiayn.export.hub import check_push, push_folder
from aiayn.export.model_card import CARD_FILE, model_card
from aiayn.extras import require
from aiayn.model import Transformer
from aiayn.training.checkpoints import load_checkpoint, model_from_checkpoint


def provenance(
    path: Path, checkpoint: dict[str, Any], model: Transformer, run_config: dict[str, Any], target: str
) -> dict[str, Any]:
    """What an exported folder records of its source: the checkpoint (path, SHA-256, step, the checkpoints
    an average was made of), the model's hyperparameters and the run's config (its corpus and
    direction, which aiayn-eval reads)."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return {
        "format": target,
        "exported_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "checkpoint": str(Path(path).resolve()),
        "checkpoint_sha256": digest.hexdigest(),
        "global_step": checkpoint.get("global_step") if whole(checkpoint.get("global_step"), 0) else None,
        "averaged_from": averaged_from(checkpoint.get("averaged_from")),
        "model": model.cfg.to_dict(),
        "run_config": run_config,
    }


def averaged_from(sources: Any) -> list[dict[str, Any]] | None:
    """The checkpoints an average was made of, as ``aiayn-average`` records them (a path and a step
    each); anything else a checkpoint holds there is not recorded (it goes into a JSON file)."""

    def recorded(source: Any) -> bool:
        step = source.get("global_step") if isinstance(source, dict) else None
        return isinstance(source, dict) and isinstance(source.get("path"), str) and (step is None or whole(step, 0))

    if not isinstance(sources, list) or not all(map(recorded, sources)):
        return None
    return [{"path": s["path"], "global_step": s.get("global_step")} for s in sources]


@dataclass(frozen=True)
class ExportSettings:
    """``aiayn-export``: the ``checkpoint`` whose model is written to the new folder ``output`` as
    ``format`` (``hf``: a MarianMTModel folder; ``ctranslate2``: a CTranslate2 model with weights in
    ``quantization``), then, with ``push_to``, uploaded to that Hub repository."""

    checkpoint: Path
    format: str
    output: Path
    quantization: str = "float32"
    push_to: str | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise FieldError("format", self.format, f"must be one of {', '.join(FORMATS)}")
        if self.format == "hf" and self.quantization != "float32":
            raise FieldError("quantization", self.quantization, "is for format=ctranslate2; format=hf writes float32 "
                             "weights")  # fmt: skip
        if self.format == "ctranslate2" and self.quantization not in ctranslate2.QUANTIZATIONS:
            allowed = f"must be one of {', '.join(ctranslate2.QUANTIZATIONS)}"
            raise FieldError("quantization", self.quantization, allowed)
        if self.push_to is not None:
            check_push(self.push_to)


def export_checkpoint(settings: ExportSettings, scores: Mapping[str, Any] | None = None) -> str | None:
    """Write the checkpoint's model as ``settings`` say, with its model card (``README.md``), which shows
    ``scores``, what its run's ``results.json`` says of it (None: not known), and push the folder where
    ``settings.push_to`` says (the commit's URL is returned; None without a push). A model variant the
    format cannot represent is a :class:`~aiayn.errors.FieldError` naming the model's setting, raised
    before anything is written."""
    path, target = Path(settings.checkpoint), settings.format
    if path.is_dir() and (path / PROVENANCE_FILE).is_file():
        source = read_provenance(path).get("checkpoint")
        raise FieldError("checkpoint", str(path), f"is an exported model; export from its checkpoint ({source})")
    # A missing library is said before the checkpoint is read and before any folder is made.
    if target == "hf":
        marian.import_transformers()
    else:
        ctranslate2.import_ctranslate2()
    require("huggingface_hub", "export", "huggingface_hub (the model card of aiayn-export)")
    checkpoint = load_checkpoint(path)
    model, tokenizer, run_config = model_from_checkpoint(checkpoint, path)
    check_exportable(model.cfg, target)
    record = provenance(path, checkpoint, model, run_config, target)

    def write(folder: Path) -> None:
        if target == "hf":
            marian.save_marian(model, tokenizer, folder, record)
        else:
            ctranslate2.convert(model, tokenizer, folder, settings.quantization, record)
        (folder / CARD_FILE).write_text(model_card(record, target, scores), encoding="utf-8")

    write_folder(settings.output, write)
    if settings.push_to is None:
        return None
    return push_folder(settings.output, settings.push_to, f"aiayn-export format={target} of {path.name}")
