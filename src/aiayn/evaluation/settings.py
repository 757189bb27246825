"""What ``aiayn-eval`` and ``aiayn-translate`` are asked to do, as typed, frozen settings checked where they
are made, before any model is loaded: which model translates and how (:class:`DecodeSettings`), what is
evaluated (:class:`Texts`, :class:`EvalSettings`), where a translation is read and written
(:class:`TranslateSettings`). A mistake is a :class:`~aiayn.errors.FieldError` of its field; the config
layer, which makes these from a command's config (:mod:`aiayn.config.tool_plans`), names it by its key."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiayn.errors import FieldError, whole
from aiayn.evaluation.translator import Translator, check_backend, check_translation, load_translation_models
from aiayn.files import open_plain, same_file
from aiayn.model import DEFAULT_SDPA_BACKENDS, PAPER_DECODING, DecodingOptions, sdpa_backends

if TYPE_CHECKING:
    import torch

    from aiayn.evaluation.comet import CometSettings
    from aiayn.evaluation.tuning import TuneGrid

SPLITS = ("train", "val", "test")
TUNE_SPLIT = "val"  # tune= chooses settings on the validation split, never on the test split it reports
TOKENIZED_BLEU = ("auto", True, False)
# What torch.load reads: a zip archive (torch.save's format) or a pickle (its legacy one). Neither can
# begin a file of UTF-8 text, so a file of hypotheses is never mistaken for a checkpoint.
CHECKPOINT_MAGIC = (b"PK\x03\x04", b"\x80")
COMPARED = "a checkpoint (.ckpt) or a UTF-8 file of hypotheses, one per line of the references"


def resolved_device(device: str) -> torch.device:
    """``device``: ``auto`` is the first GPU when there is one, else the CPU."""
    import torch  # here: the settings are made before the commands import the model

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError):
        raise FieldError("device", device, "is not a device; use auto, cpu, cuda or cuda:<index>") from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise FieldError("device", device, "but no CUDA GPU is visible here; use device=cpu or device=auto")
    return chosen


@dataclass(frozen=True)
class DecodeSettings:
    """Which model translates (``checkpoint``: one, or an ensemble's members) and how: by ``backend``
    (``compute_type``: the engine's arithmetic) on ``device``, with ``decoding``, ``nbest`` translations
    per line (``seed``: the draws of sampling), in batches of ``max_tokens`` source tokens, with the
    attention kernels ``sdpa_backends``."""

    checkpoint: tuple[Path, ...]
    decoding: DecodingOptions = PAPER_DECODING
    backend: str = "auto"
    compute_type: str = "default"
    device: str = "auto"
    max_tokens: int = 8192
    nbest: int = 1
    seed: int = 0
    sdpa_backends: tuple[str, ...] = DEFAULT_SDPA_BACKENDS
    torch_device: torch.device = field(init=False)  # ``device`` resolved, once

    def __post_init__(self) -> None:
        if not self.checkpoint:
            raise FieldError("checkpoint", [], "must name at least one checkpoint")
        check_backend(self.backend, self.compute_type)
        check_translation(self.decoding, self.max_tokens, self.nbest, self.seed)
        object.__setattr__(self, "sdpa_backends", sdpa_backends(self.sdpa_backends))
        if not isinstance(self.device, str):
            raise FieldError("device", self.device, "is not a device; use auto, cpu, cuda or cuda:<index>")
        object.__setattr__(self, "torch_device", resolved_device(self.device))

    def loaded(self) -> tuple[Translator, dict[str, Any]]:
        """The checkpoint(s) loaded, as a translator that decodes as these settings say, and the run's
        stored config."""
        model, tokenizer, run_config = load_translation_models(
            list(self.checkpoint), self.backend, self.torch_device, self.compute_type
        )
        translator = Translator(
            model, tokenizer, self.decoding, self.max_tokens, self.nbest, self.seed, self.sdpa_backends
        )
        return translator, run_config


@dataclass(frozen=True)
class Texts:
    """What is evaluated: the files ``source`` and ``reference`` when given, else the ``split`` (train, val
    or test) of the corpus the checkpoint's run was trained on, read from ``data_root`` (or the Hub
    dataset ``data_hub``)."""

    split: str = "test"
    source: Path | None = None
    reference: Path | None = None
    data_root: str | None = None
    data_hub: str | None = None

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise FieldError("split", self.split, "must be train, val or test")
        if (self.source is None) != (self.reference is None):
            raise ValueError("source and reference go together: set both, or neither to evaluate a split")

    @property
    def own(self) -> bool:
        """The user's own files, not a split of the corpus."""
        return self.source is not None


@dataclass(frozen=True)
class ComparedSystem:
    """``compare=``: a second system's files, and whether they are checkpoints (one, or an ensemble's
    members) rather than a file of hypotheses."""

    paths: tuple[Path, ...]
    is_checkpoint: bool

    @classmethod
    def of(cls, paths: tuple[Path, ...]) -> ComparedSystem:
        """The system of existing files ``paths``, told apart by their first bytes (a ``.ckpt``, or a
        format ``torch.load`` reads); several must all be checkpoints."""
        for path in paths:
            if not path.is_file():
                raise FieldError("compare", str(path), f"is not a file; give {COMPARED}")
        kinds = [is_checkpoint_file(path) for path in paths]
        if len(paths) > 1 and not all(kinds):
            shown = str(paths[kinds.index(False)])
            raise FieldError("compare", shown, "is not a checkpoint; a list of systems is an ensemble of checkpoints")
        return cls(paths, kinds[0])

    @property
    def shown(self) -> str | list[str]:
        """As the user named it: a path, or a list of paths."""
        return str(self.paths[0]) if len(self.paths) == 1 else [str(path) for path in self.paths]


def is_checkpoint_file(path: Path) -> bool:
    """A ``.ckpt``, or a file in a format ``torch.load`` reads; else a file of hypotheses. Not a plain file
    (a FIFO, a device) is a :class:`~aiayn.errors.DataError`: its first bytes could never come."""
    with open_plain(path, follow_links=True) as handle:
        head = handle.read(4)
    return path.suffix == ".ckpt" or head.startswith(CHECKPOINT_MAGIC)


@dataclass(frozen=True)
class EvalSettings:
    """``aiayn-eval``: the model and its decoding, the texts, the scores asked for (``tokenized_bleu``:
    also the paper's tokenized BLEU; ``auto``: for the targets the paper reports it for), a second system
    to test against (``compare``), where the files go (``output_dir``; None: the checkpoint's run
    folder), COMET beside BLEU (``comet``), and with ``tune``, a grid of decoding settings to score on the
    validation split instead."""

    decode: DecodeSettings
    texts: Texts = field(default_factory=Texts)
    tokenized_bleu: str | bool = "auto"
    compare: ComparedSystem | None = None
    output_dir: Path | None = None
    tune: TuneGrid | None = None
    comet: CometSettings | None = None

    def __post_init__(self) -> None:
        if self.tokenized_bleu not in TOKENIZED_BLEU:
            raise FieldError("tokenized_bleu", self.tokenized_bleu, "must be auto, true or false")
        if self.tune is None:
            return
        if self.comet is not None:
            raise FieldError("comet_model", self.comet.comet_model, "is for one setting; tune= ranks settings by "
                             "sacreBLEU: score the chosen one with COMET after")  # fmt: skip
        if self.compare is not None or self.decode.nbest != 1:
            name, value = ("compare", self.compare.shown) if self.compare else ("nbest", self.decode.nbest)
            allowed = "is for one setting; tune= scores each setting's 1-best: evaluate the best one with it after"
            raise FieldError(name, value, allowed)
        if not self.texts.own and self.texts.split != TUNE_SPLIT:
            raise FieldError("split", self.texts.split, f"is not the validation split; tune= chooses decoding settings "
                             f"on split={TUNE_SPLIT} (or your own source= and reference=), never on the split it is "
                             "reported on")  # fmt: skip


@dataclass(frozen=True)
class TranslateSettings:
    """``aiayn-translate``: the model and its decoding, the file read (``input``; None: stdin) and the one
    written (``output``; None: stdout), and how many lines are read before their translations are
    written (``buffer_lines``). ``output`` may not be the input file (through any path or link to it):
    opening it for writing would empty the input before it is read."""

    decode: DecodeSettings
    input: Path | None = None
    output: Path | None = None
    buffer_lines: int = 1000

    def __post_init__(self) -> None:
        if not whole(self.buffer_lines, 1):
            raise FieldError("buffer_lines", self.buffer_lines, "must be a whole number >= 1")
        if self.output is not None and self.output.is_dir():
            raise FieldError("output", str(self.output), "is a folder; give the file to write the translations to")
        if self.input is not None and self.output is not None and same_file(self.input, self.output):
            allowed = f"is the input file {self.input}; write the translations elsewhere"
            raise FieldError("output", str(self.output), allowed)
