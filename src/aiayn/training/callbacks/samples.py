"""What each validation shows on the dashboards beyond scalars: sample translations and attention maps."""

from __future__ import annotations

import functools
import unicodedata
from typing import Any

import numpy as np
import pytorch_lightning as pl
from PIL import Image, ImageDraw, ImageFont
from pytorch_lightning.loggers import TensorBoardLogger, WandbLogger

from aiayn.data.dataset import Collator
from aiayn.errors import FieldError, whole
from aiayn.model import translate_ids

SAMPLE_COLUMNS = ["source", "reference", "hypothesis"]
ATTENTION_MAX_TOKENS = 32  # the attention sentence: the first validation pair this short on both sides


class ValidationSamples(pl.Callback):
    """After each validation of a fit, on rank 0, logs to the W&B and TensorBoard loggers:

    - ``val/samples``: a table of the first ``n_samples`` validation sentences (source, reference,
      hypothesis), translated as the validation translates (``val_decoding`` while training);
    - ``attention/<kind>/layer_<i>``: for one fixed validation pair, teacher-forced on its reference,
      one heat map per head of encoder self-, decoder self- and encoder-decoder (``cross``) attention in
      every layer, queries as rows and keys as columns, labelled with their subword pieces; at the
      first and then every ``attention_every``-th validation (0: never).

    The same sentences at every validation let the dashboard's step slider show how they evolve.
    """

    def __init__(self, n_samples: int = 8, attention_every: int = 1) -> None:
        for key, value in (("n_samples", n_samples), ("attention_every", attention_every)):
            if not whole(value, 0):
                raise FieldError(key, value, "must be a whole number >= 0")
        self.n_samples = n_samples
        self.attention_every = attention_every
        self.validations = 0

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loggers = [logger for logger in trainer.loggers if takes_media(logger)]
        if trainer.sanity_checking or trainer.state.fn != "fit" or not trainer.is_global_zero or not loggers:
            return
        self.validations += 1
        datamodule = trainer.datamodule
        tokenizer = datamodule.tokenizer
        collate = Collator(tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, datamodule.references["val"])
        rows = self.sample_rows(pl_module, datamodule.datasets["val"], collate, tokenizer)
        images = {}
        if self.attention_every and (self.validations - 1) % self.attention_every == 0:
            images = self.attention_images(pl_module, datamodule.datasets["val"], collate, tokenizer)
        # The step Lightning logs this validation's metrics at (optimizer steps before its last batch),
        # so that the media sit at the same point of the dashboard's x-axis as val/bleu.
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        for logger in loggers:
            log_media(logger, rows, images, step)

    def sample_rows(
        self, pl_module: pl.LightningModule, dataset: Any, collate: Collator, tokenizer: Any
    ) -> list[list[str]]:
        """Source, reference and hypothesis of the first ``n_samples`` validation pairs."""
        items = [dataset[i] for i in range(min(self.n_samples, len(dataset)))]
        if not items:
            return []
        batch = collate(items)
        src, hp = batch["src"].to(pl_module.device), pl_module.hparams
        hypotheses = translate_ids(pl_module.model, src, hp.bos_id, hp.eos_id, pl_module.evaluation_decoding("val"))
        sources = tokenizer.decode([src for _, src, _ in items])
        return [list(row) for row in zip(sources, batch["references"], tokenizer.decode(hypotheses), strict=True)]

    def attention_images(
        self, pl_module: pl.LightningModule, dataset: Any, collate: Collator, tokenizer: Any
    ) -> dict[str, list[Image.Image]]:
        """``attention/<kind>/layer_<i>`` → one heat map per head, for the fixed attention pair."""
        if not len(dataset):
            return {}
        pair = collate([dataset[attention_sentence(dataset)]])
        src, tgt_in = pair["src"].to(pl_module.device), pair["tgt_in"].to(pl_module.device)
        src_pieces, tgt_pieces = (pieces(tokenizer, pair[side][0].tolist()) for side in ("src", "tgt_in"))
        axes = {
            "encoder_self": (src_pieces, src_pieces),
            "decoder_self": (tgt_pieces, tgt_pieces),
            "cross": (tgt_pieces, src_pieces),
        }
        images = {}
        for kind, weights in pl_module.model.attention_maps(src, tgt_in).items():
            queries, keys = axes[kind]
            for layer, heads in enumerate(weights[:, 0].float().cpu().numpy(), start=1):
                images[f"attention/{kind}/layer_{layer}"] = [attention_image(w, queries, keys) for w in heads]
        return images


def takes_media(logger: object) -> bool:
    """Whether a logger shows tables and images: W&B (unless disabled) and TensorBoard."""
    if isinstance(logger, WandbLogger):
        return getattr(logger, "mode", "online") != "disabled"
    return isinstance(logger, TensorBoardLogger)


def attention_sentence(dataset: Any) -> int:
    """Position of the fixed attention-map pair: the first short one, else the shortest."""
    sizes = dataset.padded_lengths().max(axis=1)
    short = np.flatnonzero(sizes <= ATTENTION_MAX_TOKENS)
    return int(short[0]) if len(short) else int(np.argmin(sizes))


def pieces(tokenizer: Any, ids: list[int]) -> list[str]:
    return [tokenizer.sp.id_to_piece(i) for i in ids]


@functools.cache
def label_font(size: int) -> tuple[ImageFont.FreeTypeFont, bool]:
    """DejaVu Sans where installed (it has accented letters and sentencepiece's ▁), else Pillow's own
    font, which has ASCII only; and whether it is the former."""
    try:
        return ImageFont.truetype("DejaVuSans.ttf", size), True
    except OSError:
        return ImageFont.load_default(size=size), False


def ascii_label(piece: str) -> str:
    """A piece in ASCII: ▁ (word start) as _, accents dropped (ä → a), other letters as ?."""
    folded = unicodedata.normalize("NFKD", piece.replace("\u2581", "_"))
    return "".join(c if c.isascii() else "?" for c in folded if not unicodedata.combining(c))


def log_media(
    logger: WandbLogger | TensorBoardLogger, rows: list[list[str]], images: dict[str, list[Image.Image]], step: int
) -> None:
    """Sends the sample table and the attention images to one logger, all at ``step``."""
    if isinstance(logger, WandbLogger):
        import wandb

        media: dict[str, Any] = {}
        if rows:
            media["val/samples"] = wandb.Table(columns=SAMPLE_COLUMNS, data=rows)
        for key, heads in images.items():
            media[key] = [wandb.Image(image, caption=f"head {h}") for h, image in enumerate(heads, start=1)]
        if media:
            logger.log_metrics(media, step=step)
        return
    writer = logger.experiment
    if rows:
        header = "| " + " | ".join(SAMPLE_COLUMNS) + " |\n|" + " --- |" * len(SAMPLE_COLUMNS) + "\n"
        body = "".join("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |\n" for row in rows)
        writer.add_text("val/samples", header + body, step)
    for key, heads in images.items():
        for h, image in enumerate(heads, start=1):
            writer.add_image(f"{key}/head_{h}", np.asarray(image), step, dataformats="HWC")


# White for no attention to dark blue for all of it: one hue, so darker always means more.
_LOW, _HIGH = np.array([255.0, 255.0, 255.0]), np.array([8.0, 48.0, 107.0])


def attention_image(weights: np.ndarray, queries: list[str], keys: list[str], cell: int = 14) -> Image.Image:
    """A heat map of attention weights (queries × keys, each row summing to 1) with the query pieces on
    the left and the key pieces, written upwards, on top."""
    font, full = label_font(cell - 3)
    if not full:
        queries, keys = [ascii_label(p) for p in queries], [ascii_label(p) for p in keys]
    left = int(max(font.getlength(piece) for piece in queries)) + 6
    top = int(max(font.getlength(piece) for piece in keys)) + 6
    colours = (_LOW + np.clip(weights, 0.0, 1.0)[..., None] * (_HIGH - _LOW)).astype(np.uint8)
    heat = colours.repeat(cell, axis=0).repeat(cell, axis=1)
    image = Image.new("RGB", (left + heat.shape[1], top + heat.shape[0]), "white")
    image.paste(Image.fromarray(heat), (left, top))
    draw = ImageDraw.Draw(image)
    for row, piece in enumerate(queries):
        draw.text((left - 3, top + row * cell + cell / 2), piece, fill="black", font=font, anchor="rm")
    # The key labels are drawn as rows of a strip that is then turned a quarter to the left.
    strip = Image.new("RGB", (top, heat.shape[1]), "white")
    strip_draw = ImageDraw.Draw(strip)
    for column, piece in enumerate(keys):
        strip_draw.text((3, column * cell + cell / 2), piece, fill="black", font=font, anchor="lm")
    image.paste(strip.rotate(90, expand=True), (left, 0))
    return image
