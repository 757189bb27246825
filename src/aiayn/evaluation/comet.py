"""COMET (Rei et al., 2020): a learned metric that scores a translation against its source and reference.
``aiayn-eval comet.model=...`` reports it beside BLEU, with the same paired test when two systems are
compared; ``aiayn-report --comet`` adds it to a report.

The reference implementation, unbabel-comet, cannot be installed beside this package: it pins numpy<2,
torchmetrics<0.11 and protobuf<5 (W&B needs >=5). So its scoring of the reference-based models
(``class_identifier: regression_metric``: wmt20-comet-da, wmt22-comet-da and models trained like them) is
done here, over transformers' XLM-R: the sentence embedding of each of source, translation and reference
(a learned mix of the encoder's layers, then pooling), then a feed-forward estimator over
``[t, r, t*r, |t-r|, t*s, |t-s|]``. ``tests/evaluation/test_comet.py`` checks our scores equal
unbabel-comet's own on models of every layer, mix and pooling setting it supports
(``tests/assets/comet_reference.json``).

A COMET model is untrusted input like any checkpoint: its weights are read with ``weights_only`` (a
pickle that would run code is refused); its hyper-parameters choose among known settings only, its
encoder is a Hub id or a folder inside the model's, and its weights must have the shapes the
hyper-parameters make before anything of their size is built; nothing is downloaded unless
``download`` is true: a Hub id (the model's, its encoder's) is read from the Hugging Face cache."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from aiayn.errors import FieldError, first_line, whole
from aiayn.extras import require, require_installed

WHAT = "COMET's encoder (transformers)"
CHECKPOINT = Path("checkpoints") / "model.ckpt"  # where unbabel-comet's models keep their weights
HPARAMS = "hparams.yaml"  # ... and the class they are
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
ENCODER_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # an encoder may be a bare name: xlm-roberta-large
SUPPORTED_CLASS = "regression_metric"  # reference-based COMET; the reference-free kinds need no reference
SUPPORTED_ENCODER = "XLM-RoBERTa"
# unbabel-comet maps "sparsemax_patch" (its fix of models trained with a broken sparsemax) to softmax.
TRANSFORMS = {"softmax": "softmax", "sparsemax_patch": "softmax", "sparsemax": "sparsemax"}
POOLS = ("avg", "max", "cls")
# unbabel-comet builds an activation as getattr(torch.nn, name.title()): the names that can give one.
ACTIVATIONS = ("Tanh", "Sigmoid", "Softplus", "Softsign", "Tanhshrink", "Hardtanh", "Hardsigmoid", "Hardswish", "Mish")
# RegressionMetric's defaults, which unbabel-comet uses for a hyper-parameter its checkpoint lacks.
DEFAULTS = {
    "encoder_model": "XLM-RoBERTa", "pretrained_model": "xlm-roberta-large", "pool": "avg", "layer": "mix",
    "layer_transformation": "softmax", "layer_norm": True, "hidden_sizes": [3072, 1024], "activations": "Tanh",
    "final_activation": None,
}  # fmt: skip
DOWNLOAD = "comet.download=true (aiayn-report: --comet-download)"  # the one setting that may download


@dataclass(frozen=True)
class CometSettings:
    """Which COMET model scores (``comet_model``: a folder of unbabel-comet's format, its
    ``checkpoints/model.ckpt``, or a Hugging Face id such as ``Unbabel/wmt22-comet-da``), whether a Hub id
    may be downloaded when it is not in the cache (``comet_download``), and how many segments a batch
    holds (``comet_batch_size``)."""

    comet_model: str
    comet_download: bool = False
    comet_batch_size: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.comet_model, str) or not self.comet_model:
            raise FieldError("comet_model", self.comet_model, "must be a COMET model: a folder or a Hub id")
        if not isinstance(self.comet_download, bool):
            raise FieldError("comet_download", self.comet_download, "must be true or false")
        if not whole(self.comet_batch_size, 1):
            raise FieldError("comet_batch_size", self.comet_batch_size, "must be a whole number >= 1")

    def refuse(self, allowed: str) -> FieldError:
        return FieldError("comet_model", self.comet_model, allowed)

    def folder(self) -> Path:
        """The model's folder, resolved: a local folder (or its ``checkpoints/model.ckpt``), else the Hub
        id's snapshot in the Hugging Face cache (fetched only with ``comet_download``: its class and
        checkpoint files alone)."""
        require_installed("transformers", "comet", WHAT)  # before any work: the extra's libraries are there
        require_installed("entmax", "comet", "entmax (COMET's sparsemax)")
        path = Path(self.comet_model).expanduser()
        if path.exists():
            path = path.resolve()
            if path.is_file():
                if path.parts[-2:] != CHECKPOINT.parts:
                    raise self.refuse(f"is a file; give the model's folder (with {CHECKPOINT} and {HPARAMS})")
                path = path.parents[1]
            if not (path / CHECKPOINT).is_file() or not (path / HPARAMS).is_file():
                raise self.refuse(f"is not a COMET model folder: it needs {CHECKPOINT} and {HPARAMS} "
                                  "(as unbabel-comet's models hold them)")  # fmt: skip
            return path
        if not HUB_ID.fullmatch(self.comet_model):
            raise self.refuse("is neither a folder nor a Hub id like Unbabel/wmt22-comet-da")
        hub = require("huggingface_hub", "comet", "huggingface_hub (COMET models from the Hub)")
        wanted = [HPARAMS, CHECKPOINT.as_posix()]
        try:
            with hub_offline(not self.comet_download):
                found = hub.snapshot_download(
                    self.comet_model, local_files_only=not self.comet_download, allow_patterns=wanted
                )
        except (hub.errors.LocalEntryNotFoundError, hub.errors.HfHubHTTPError, OSError, ValueError) as error:
            if not self.comet_download:
                raise self.refuse(f"is not in the Hugging Face cache: download it with {DOWNLOAD}, "
                                  "or name a local folder") from None  # fmt: skip
            raise self.refuse(f"could not be fetched from the Hub: {first_line(error.__cause__ or error)}") from None
        return CometSettings(found, comet_batch_size=self.comet_batch_size).folder()

    def load(self, device: torch.device, folder: Path | None = None) -> Comet:
        """The model of ``folder`` (:meth:`folder` when not given), ready to score on ``device``."""
        return Comet.load(folder or self.folder(), self, device)


@contextmanager
def hub_offline(offline: bool) -> Iterator[None]:
    """huggingface_hub's offline mode (what ``HF_HUB_OFFLINE=1`` sets) while a model is read from the cache
    only: a cache-only lookup alone still lets the library ask the Hub for things of its own (the list
    it names its user-agent from); offline, no request leaves this machine."""
    if not offline:
        yield
        return
    constants = require("huggingface_hub", "comet", "huggingface_hub (COMET models from the Hub)").constants
    before, constants.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE, True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before


@dataclass(frozen=True)
class CometScores:
    """A system's COMET: each segment's score and their mean, the system score unbabel-comet reports."""

    segments: list[float]

    @property
    def system(self) -> float:
        return sum(self.segments) / len(self.segments) if self.segments else float("nan")


class LayerMix(torch.nn.Module):
    """unbabel-comet's ``LayerwiseAttention`` at inference: ``gamma * sum_k w_k * h_k`` over the encoder's
    layers (embeddings included), ``w = softmax(s)`` or ``sparsemax(s)`` of learned scalars ``s``; with
    ``layer_norm``, each layer normalised first over the sentence's unmasked positions and features."""

    def __init__(self, layers: int, transform: str, layer_norm: bool) -> None:
        super().__init__()
        self.scalar_parameters = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(1)) for _ in range(layers))
        self.gamma = torch.nn.Parameter(torch.ones(1))
        self.transform, self.layer_norm = transform, layer_norm

    def forward(self, hidden: tuple[torch.Tensor, ...], mask: torch.Tensor) -> torch.Tensor:
        scalars = torch.cat(list(self.scalar_parameters))
        if self.transform == "sparsemax":
            weights = require("entmax", "comet", "entmax (COMET's sparsemax)").sparsemax(scalars, dim=0)
        else:
            weights = torch.softmax(scalars, dim=0)
        if self.layer_norm:
            hidden = tuple(masked_layer_norm(layer, mask.float()) for layer in hidden)
        return self.gamma * sum(weight * layer for weight, layer in zip(weights.split(1), hidden, strict=True))


def masked_layer_norm(layer: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One mean and variance per sentence over its unmasked positions and all features (no affine)."""
    batch, _, width = layer.shape
    broadcast = mask.unsqueeze(-1)
    counted = mask.sum(1) * width
    masked = layer * broadcast
    mean = (masked.view(batch, -1).sum(1) / counted).view(batch, 1, 1)
    variance = (((masked - mean) * broadcast) ** 2).view(batch, -1).sum(1) / counted
    return (layer - mean) / torch.sqrt(variance + 1e-12).view(batch, 1, 1)


class Comet(torch.nn.Module):
    """A reference-based COMET model (unbabel-comet's ``RegressionMetric``) at inference."""

    def __init__(self, hparams: dict[str, Any], encoder: torch.nn.Module, tokenizer: Any) -> None:
        super().__init__()
        self.tokenizer, self.encoder = tokenizer, encoder
        self.layer, self.pool = hparams["layer"], hparams["pool"]
        layers = encoder.config.num_hidden_layers + 1
        self.layerwise_attention = (
            LayerMix(layers, TRANSFORMS[hparams["layer_transformation"]], hparams["layer_norm"])
            if self.layer == "mix"
            else None
        )
        widths = [6 * encoder.config.hidden_size, *hparams["hidden_sizes"]]
        modules: list[torch.nn.Module] = []
        for inputs, outputs in itertools.pairwise(widths):
            modules += [torch.nn.Linear(inputs, outputs), activation(hparams["activations"]), torch.nn.Dropout()]
        modules.append(torch.nn.Linear(widths[-1], 1))
        if hparams["final_activation"] is not None:
            modules.append(activation(hparams["final_activation"]))
        self.estimator = torch.nn.Sequential(*modules)
        # unbabel-comet's max_positions is the encoder's positions less two (XLM-R's offset), and it
        # truncates each text at max_positions - 2.
        self.max_length = encoder.config.max_position_embeddings - 4

    @classmethod
    def load(cls, folder: Path, settings: CometSettings, device: torch.device) -> Comet:
        """The model of an unbabel-comet folder, read as unbabel-comet reads it: the class from
        ``hparams.yaml``, the hyper-parameters and weights from ``checkpoints/model.ckpt``, the encoder's
        config and tokenizer by the name the hyper-parameters give (a folder inside the model's, or a
        Hub id in the cache). The weights' shapes are checked on the meta device before the model is built."""
        transformers = require("transformers", "comet", WHAT)
        folder = folder.resolve()
        declared = yaml.safe_load((folder / HPARAMS).read_text(encoding="utf-8"))
        if not isinstance(declared, dict):
            raise settings.refuse(f"has a {HPARAMS} that is not a mapping")
        try:
            stored = torch.load(folder / CHECKPOINT, map_location="cpu", weights_only=True, mmap=True)
        except Exception as error:  # any reason a checkpoint cannot be read safely gets the same answer
            raise settings.refuse(f"has a checkpoint that cannot be read safely: {first_line(error)}") from None
        if not isinstance(stored, dict) or not isinstance(stored.get("state_dict"), dict):
            raise settings.refuse(f"has no state_dict in its {CHECKPOINT}")
        hparams = checked_hparams(settings, declared, stored.get("hyper_parameters"))
        encoder = encoder_name(settings, hparams["pretrained_model"], folder)
        local = {"local_files_only": not settings.comet_download, "trust_remote_code": False}
        try:
            with hub_offline(not settings.comet_download):
                config = transformers.XLMRobertaConfig.from_pretrained(encoder, **local)
                tokenizer = transformers.XLMRobertaTokenizerFast.from_pretrained(encoder, **local)
        except (OSError, ValueError):
            raise settings.refuse(f"names the encoder {encoder}, whose config and tokenizer are not in the Hugging "
                                  f"Face cache: {DOWNLOAD} fetches them (not its weights: the COMET checkpoint "
                                  "holds them)") from None  # fmt: skip
        if hparams["layer"] != "mix" and hparams["layer"] > config.num_hidden_layers:
            raise settings.refuse(f"has layer={hparams['layer']}, but its encoder has {config.num_hidden_layers} "
                                  "layers (0: the embeddings)")  # fmt: skip
        weights = {comet_key(key): value for key, value in stored["state_dict"].items()}
        with torch.device("meta"):  # the shapes the hyper-parameters make, allocating nothing
            expected = cls(hparams, transformers.XLMRobertaModel(config, add_pooling_layer=False), tokenizer)
        for key, value in expected.state_dict().items():
            if key not in weights:
                raise settings.refuse(f"has no weights for {key}")
            if not isinstance(weights[key], torch.Tensor) or weights[key].shape != value.shape:
                shape = tuple(getattr(weights[key], "shape", ()))
                raise settings.refuse(f"has weights of shape {shape} for {key}; its settings make {tuple(value.shape)}")
        model = cls(hparams, transformers.XLMRobertaModel(config, add_pooling_layer=False), tokenizer)
        model.load_state_dict({key: weights[key] for key in model.state_dict()})
        return model.to(device).eval()

    def sentence_embeddings(self, texts: list[str]) -> torch.Tensor:
        """Each text's embedding: its tokens' states (mixed over layers, or one layer), pooled."""
        device = self.estimator[0].weight.device
        batch = self.tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=self.max_length)
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        hidden = self.encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        states = self.layerwise_attention(hidden, mask) if self.layerwise_attention else hidden[self.layer]
        padding = ids.eq(self.tokenizer.pad_token_id).unsqueeze(-1)
        if self.pool == "cls":
            return states[:, 0]
        if self.pool == "max":
            return states.masked_fill(padding, float("-inf")).max(dim=1).values
        return states.masked_fill(padding, 0.0).sum(1) / mask.sum(1, keepdim=True).float()

    @torch.inference_mode()
    def score(self, sources: list[str], translations: list[str], references: list[str], batch_size: int) -> CometScores:
        """Each segment's COMET, in batches of similar length (less padding; the order is restored)."""
        if not len(sources) == len(translations) == len(references):
            raise ValueError(f"{len(sources)} sources, {len(translations)} translations, {len(references)} references")
        order = sorted(range(len(sources)), key=lambda index: len(sources[index]))
        columns = (sources, translations, references)
        scores = [0.0] * len(order)
        for start in range(0, len(order), batch_size):
            chosen = order[start : start + batch_size]
            s, t, r = (self.sentence_embeddings([texts[i] for i in chosen]) for texts in columns)
            features = torch.cat((t, r, t * r, (t - r).abs(), t * s, (t - s).abs()), dim=1)
            for index, value in zip(chosen, self.estimator(features).view(-1).tolist(), strict=True):
                scores[index] = value
        return CometScores(scores)


def comet_key(key: str) -> str:
    """unbabel-comet's state-dict name of a weight as this module names it."""
    return key.replace("encoder.model.", "encoder.", 1).replace("estimator.ff.", "estimator.", 1)


def activation(name: str) -> torch.nn.Module:
    """unbabel-comet's activation ``name`` (one of :data:`ACTIVATIONS`, checked by :func:`checked_hparams`)."""
    return getattr(torch.nn, name.title())()


def encoder_name(settings: CometSettings, pretrained: str, folder: Path) -> str:
    """Where the encoder's config and tokenizer are read: a folder inside the model's (a relative name is
    read from the model's folder), else a Hub id; never a folder elsewhere on this machine."""
    inside = (folder / pretrained).resolve()
    if inside.is_dir():
        if not inside.is_relative_to(folder):
            raise settings.refuse(f"names the encoder folder {pretrained}, outside the model's folder")
        return str(inside)
    if Path(pretrained).is_absolute() or not ENCODER_ID.fullmatch(pretrained):
        raise settings.refuse(f"names the encoder {pretrained}: neither a folder inside the model's nor a Hub id")
    return pretrained


def checked_hparams(settings: CometSettings, declared: dict[str, Any], stored: Any) -> dict[str, Any]:
    """The hyper-parameters as unbabel-comet takes them (the checkpoint's over RegressionMetric's defaults;
    the class, and the ``sparsemax_patch`` fix, from ``hparams.yaml``), checked to be ones this module
    honours; else the one line saying which it cannot."""
    hparams = {**DEFAULTS, **(stored if isinstance(stored, dict) else {})}
    if declared.get("layer_transformation") == "sparsemax_patch":
        hparams["layer_transformation"] = "softmax"

    def refuse(key: str, allowed: str) -> FieldError:
        value = declared.get(key) if key == "class_identifier" else hparams.get(key)
        return settings.refuse(f"has {key}={value!r}; {allowed}")

    if declared.get("class_identifier") != SUPPORTED_CLASS:
        raise refuse("class_identifier", f"only {SUPPORTED_CLASS} (reference-based COMET such as "
                     "Unbabel/wmt22-comet-da) is supported")  # fmt: skip
    if hparams["encoder_model"] != SUPPORTED_ENCODER:
        raise refuse("encoder_model", f"only {SUPPORTED_ENCODER} encoders are supported")
    if not isinstance(hparams["pretrained_model"], str) or not hparams["pretrained_model"]:
        raise refuse("pretrained_model", "it must name the encoder (a folder or a Hub id)")
    layer = hparams["layer"]
    if layer != "mix" and not whole(layer, 0):
        raise refuse("layer", "it must be mix or a layer's index")
    if layer == "mix" and hparams["layer_transformation"] not in TRANSFORMS:
        raise refuse("layer_transformation", f"it must be one of {', '.join(TRANSFORMS)}")
    if not isinstance(hparams["layer_norm"], bool):
        raise refuse("layer_norm", "it must be true or false")
    if hparams["pool"] not in POOLS:
        raise refuse("pool", f"it must be one of {', '.join(POOLS)}")
    sizes = hparams["hidden_sizes"]
    if not isinstance(sizes, list) or not sizes or not all(whole(size, 1) for size in sizes):
        raise refuse("hidden_sizes", "it must be a list of layer widths")
    if str(hparams["activations"]).title() not in ACTIVATIONS:  # as unbabel-comet reads it: tanh is Tanh
        raise refuse("activations", f"it must be one of {', '.join(ACTIVATIONS)}")
    final = hparams["final_activation"]
    if final is not None and str(final).title() not in ACTIVATIONS:
        raise refuse("final_activation", f"it must be null or one of {', '.join(ACTIVATIONS)}")
    return hparams
