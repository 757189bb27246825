"""``aiayn-eval``: a checkpoint + a data split → hypotheses and their scores; with ``compare=``, also a
second system (another checkpoint, or a file of hypotheses) on the same references, and whether the two
differ significantly (sacreBLEU's paired bootstrap). See conf/eval.yaml."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from aiayn.cli.common import reported_as_usage_errors, reported_hydra_errors, required_checkpoint, resolve_device
from aiayn.config.build import decoding_options
from aiayn.config.compose import config_dir
from aiayn.data.corpus import read_lines, read_parallel
from aiayn.data.stored import instantiated_from_checkpoint
from aiayn.errors import CheckpointError, ConfigError, show
from aiayn.evaluation.translator import Translator, load_translation_model
from aiayn.export.ctranslate2 import EngineModel
from aiayn.files import atomic_write
from aiayn.scoring import SIGNIFICANCE_LEVEL, PairedBootstrap, corpus_scores, paired_bootstrap

TOKENIZED_BLEU_LANGS = ("de", "fr")  # the paper's En-De 28.4 and En-Fr 41.8 are both tokenized BLEU
# What torch.load reads: a zip archive (torch.save's format) or a pickle (its legacy one). Neither can
# begin a file of UTF-8 text, so a file of hypotheses is never mistaken for a checkpoint.
CHECKPOINT_MAGIC = (b"PK\x03\x04", b"\x80")


def evaluation_texts(cfg: DictConfig, run_config: dict[str, Any], checkpoint: Path) -> tuple[str, list[str], list[str]]:
    """A name for the evaluated text, its source lines and its references: the files given, or a split of
    the corpus the checkpoint's run was trained on, read from the user's ``data.root`` (or the Hub
    dataset ``data.hub``). The stored ``data`` section only says which corpus, direction and splits
    (:func:`~aiayn.data.stored.instantiated_from_checkpoint`): a shared checkpoint never makes its
    reader scan a folder or fetch a dataset it names."""
    if cfg.source or cfg.reference:
        if not (cfg.source and cfg.reference):
            raise ValueError("source and reference go together: set both, or neither to evaluate a split")
        source, reference = read_parallel(Path(cfg.source).expanduser(), Path(cfg.reference).expanduser())
        return Path(cfg.source).name, source, reference
    data = run_config.get("data") if isinstance(run_config, dict) else None
    if not isinstance(data, dict) or "_target_" not in data:
        raise CheckpointError(f"checkpoint {checkpoint} holds no data section to evaluate a split of; "
                              "give source=<file> reference=<file>")  # fmt: skip
    datamodule = instantiated_from_checkpoint(data, "data", checkpoint, root=cfg.data.root, hub=cfg.data.hub)
    source, reference = datamodule.split_texts(cfg.split)
    return cfg.split, source, reference


def checked_settings(cfg: DictConfig) -> None:
    """The settings that name files and texts are strings, before any model is loaded."""
    for key in ("split", "source", "reference", "output_dir", "data.root", "data.hub"):
        value = OmegaConf.select(cfg, key)
        if value is not None and not (isinstance(value, str) and value.strip()):
            allowed = "must be train, val or test" if key == "split" else "must be a path or a name (or null)"
            raise ConfigError(key, value, allowed)


def output_folder(cfg: DictConfig, checkpoint: Path) -> Path:
    """``output_dir``, else ``eval/`` in the checkpoint's run folder (beside a CTranslate2 folder). A
    default ``eval`` that is a link (a copied run folder's) is refused: it may lead anywhere."""
    if cfg.output_dir:
        return Path(cfg.output_dir).expanduser()
    run = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent
    folder = checkpoint.resolve().parent / "eval" if checkpoint.is_dir() else run / "eval"
    if folder.is_symlink():
        raise ConfigError("output_dir", None, f"would be {folder}, a link; name the folder to write to")
    return folder


def compared_system(value: Any) -> tuple[Path, bool] | None:
    """``compare=``: None, or an existing file and whether it is a checkpoint (a ``.ckpt``, or a file in
    a format ``torch.load`` reads) rather than a file of hypotheses. Checked before any model is loaded."""
    if value is None:
        return None
    allowed = "must be a checkpoint (.ckpt) or a UTF-8 file of hypotheses, one per line of the references"
    if not isinstance(value, str) or not value:
        raise ConfigError("compare", value, allowed)
    path = Path(value)
    if not path.is_file():
        raise ConfigError("compare", value, f"is not a file; it {allowed.removeprefix('must ')}")
    with path.open("rb") as handle:
        head = handle.read(4)
    return path, path.suffix == ".ckpt" or head.startswith(CHECKPOINT_MAGIC)


def settings_of(translator: Translator, device: torch.device) -> dict[str, Any]:
    """How ``translator`` decodes on ``device``: what the JSON report records for each system, and what
    two compared systems must share."""
    model = translator.model
    engine = isinstance(model, EngineModel)
    return {
        "backend": "ctranslate2" if engine else "aiayn",
        "compute_type": model.arithmetic if engine else None,
        "device": str(device),
        "decoding": translator.decoding.to_dict(),
        "max_tokens": translator.max_tokens,
    }


def second_system(
    compare: tuple[Path, bool], first: Translator, first_run: dict[str, Any], checkpoint: Path,
    references: list[str], cfg: DictConfig,
) -> Translator | list[str]:  # fmt: skip
    """The ``compare=`` system, checked before anything is translated: a checkpoint's translator, which
    decodes exactly as ``first`` does (the same backend, compute type, device, decoding options and
    batches; an engine folder's checkpoint is converted for the engine with its arithmetic) and
    translates in the same direction; or the file's hypotheses, one per reference."""
    system, is_checkpoint = compare
    if not is_checkpoint:
        hypotheses = read_lines(system)
        if len(hypotheses) != len(references):
            lines = f"has {len(hypotheses)} lines but there are {len(references)} references"
            allowed = f"{lines}; give one hypothesis per reference"
            raise ConfigError("compare", str(system), allowed)
        return hypotheses
    device = resolve_device(cfg.device)
    wanted = settings_of(first, device)
    backend, compute_type = wanted["backend"], wanted["compute_type"] or "default"
    try:
        model, tokenizer, run_config = load_translation_model(system, backend, device, compute_type)
    except CheckpointError as error:
        raise CheckpointError(f"compare={system}: {error}") from None
    first_direction, second_direction = direction(first_run, checkpoint), direction(run_config, system)
    if first_direction and second_direction and first_direction != second_direction:
        allowed = (
            f"translates {'→'.join(second_direction)}, checkpoint= {'→'.join(first_direction)}; "
            "compare systems of one direction"
        )
        raise ConfigError("compare", str(system), allowed)
    second = Translator(model, tokenizer, first.decoding, max_tokens=first.max_tokens)
    if (got := settings_of(second, device)) != wanted:
        differs = ", ".join(f"{key}={show(got[key])}" for key in wanted if got[key] != wanted[key])
        raise ConfigError("compare", str(system), f"would be decoded with {differs}, unlike checkpoint=")
    return second


def direction(run_config: dict[str, Any], checkpoint: Path) -> tuple[str, str] | None:
    """(source language, target language) of a checkpoint's run, when its config says; a stored
    language that is not a string is a :class:`CheckpointError` naming it."""
    data = run_config.get("data") if isinstance(run_config, dict) else None
    if not isinstance(data, dict) or data.get("src_lang") is None or data.get("tgt_lang") is None:
        return None
    for key in ("src_lang", "tgt_lang"):
        if not isinstance(data[key], str) or not data[key].strip():
            raise CheckpointError(
                f"checkpoint {checkpoint}: its stored data.{key}={show(data[key])} is not a language code; "
                "a checkpoint aiayn-train wrote holds one (en, de, ...)"
            )
    return data["src_lang"], data["tgt_lang"]


def texts_digest(source: Sequence[str], reference: Sequence[str]) -> str:
    """SHA-256 of the evaluated text and its references, line by line (a line's length goes first, so
    that the line boundaries count)."""
    digest = hashlib.sha256()
    for lines in (source, reference):
        digest.update(f"{len(lines)}\n".encode())
        for line in lines:
            encoded = line.encode("utf-8", "surrogatepass")
            digest.update(f"{len(encoded)}:".encode() + encoded)
    return digest.hexdigest()


def file_identity(path: Path) -> list[Any]:
    """The resolved path, size and modification time of a checkpoint (of each file of a folder): a
    checkpoint written again (a newer best.ckpt) is another system."""
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    return [str(path.resolve()), *([f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files if f.is_file())]


def output_digest(identity: dict[str, Any]) -> str:
    """A short name for everything that defines an evaluation's outputs: the checkpoint, the texts,
    how both systems decode, the scores asked for and the compared system. Two evaluations that
    differ in any of these write different files; the same evaluation again replaces its own."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:10]


def comparison_report(
    test: PairedBootstrap, system: Path, is_checkpoint: bool, hypotheses: Path, settings: dict[str, Any] | None
) -> dict[str, Any]:
    """The JSON report's ``compare`` section: the second system's sacreBLEU, its difference to the first
    (``checkpoint=``, the test's baseline) with the 95% interval, the p-value, and how it was decoded
    (``settings``, the first system's; null for a file of hypotheses, decoded elsewhere)."""
    baseline, other = test.systems
    return {
        "system": str(system),
        "kind": "checkpoint" if is_checkpoint else "hypotheses",
        "hypotheses": str(hypotheses),
        "settings": settings,
        "sacrebleu": other.bleu,
        "sacrebleu_mean": other.mean,
        "sacrebleu_ci": other.ci,
        "baseline_sacrebleu_mean": baseline.mean,
        "baseline_sacrebleu_ci": baseline.ci,
        "difference": other.difference,  # compare= minus checkpoint=
        "difference_ci": list(other.difference_ci) if other.difference_ci else None,
        "p_value": other.p_value,
        "significant": other.p_value < SIGNIFICANCE_LEVEL,
        "test": "paired bootstrap resampling (sacreBLEU --paired-bs)",
        "samples": test.samples,
        "seed": test.seed,  # null: SACREBLEU_SEED fixes none (none or 0): not repeatable
        "signature": test.signature,
    }


def print_comparison(test: PairedBootstrap) -> None:
    """Both systems' sacreBLEU (with sacreBLEU's bootstrap mean ± 95% CI), the difference, its interval
    and the p-value, and whether that is significant."""
    baseline, other = test.systems
    for label, system in (("checkpoint", baseline), ("compare", other)):
        scores = f"sacreBLEU {system.bleu:.2f}  (bootstrap μ {system.mean:.2f} ± {system.ci:.2f})"
        print(f"{label:<10} {scores}  {system.name}")
    low_high = other.difference_ci
    interval = f"[{low_high[0]:+.2f}, {low_high[1]:+.2f}]" if low_high else "not computed (no fixed seed)"
    verdict = "significant" if other.p_value < SIGNIFICANCE_LEVEL else "not significant"
    print(
        f"difference {other.difference:+.2f} (compare − checkpoint), 95% CI {interval}, p = {other.p_value:.4f} "
        f"({verdict} at {SIGNIFICANCE_LEVEL}); paired bootstrap {test.signature}"
    )


def main() -> None:
    """The console script: :func:`run`, with Hydra's own errors (an unknown key) reported in one line."""
    with reported_hydra_errors("aiayn-eval"):
        run()


@hydra.main(config_path=config_dir(), config_name="eval", version_base="1.3")
def run(cfg: DictConfig) -> None:
    with reported_as_usage_errors("aiayn-eval"):
        checkpoint = required_checkpoint(cfg.checkpoint)
        checked_settings(cfg)
        if cfg.tokenized_bleu not in ("auto", True, False):
            raise ConfigError("tokenized_bleu", cfg.tokenized_bleu, "must be auto, true or false")
        compare = compared_system(cfg.compare)
        decoding = decoding_options(cfg.decoding)
        device = resolve_device(cfg.device)
        model, tokenizer, run_config = load_translation_model(checkpoint, cfg.backend, device, cfg.compute_type)
        translator = Translator(model, tokenizer, decoding, max_tokens=cfg.max_tokens)
        tgt_lang = (direction(run_config, checkpoint) or (None, None))[1]
        name, source, reference = evaluation_texts(cfg, run_config, checkpoint)
        second = second_system(compare, translator, run_config, checkpoint, reference, cfg) if compare else None
        wants_tokenized = cfg.tokenized_bleu is True or (
            cfg.tokenized_bleu == "auto" and tgt_lang in TOKENIZED_BLEU_LANGS
        )
        settings = settings_of(translator, device)
        texts = texts_digest(source, reference)
        identity = {
            "checkpoint": file_identity(checkpoint),
            "texts": texts,
            "settings": settings,
            "tokenized_bleu": tgt_lang if wants_tokenized else None,
            "compare": [*file_identity(compare[0]), compare[1]] if compare else None,
        }
        folder = output_folder(cfg, checkpoint)
        # Named by what defines them (identity): another text of the same file name, other options or
        # another compared system never replace these files.
        engine = f".ct2-{model.arithmetic}" if isinstance(model, EngineModel) else ""
        system = checkpoint.resolve().name if checkpoint.is_dir() else checkpoint.stem
        stem = f"{system}{engine}.{name}.beam{decoding.beam_size}-alpha{decoding.alpha}.{output_digest(identity)}"

        start = time.perf_counter()
        hypotheses = translator.translate(source)
        seconds = time.perf_counter() - start
        scores = corpus_scores(hypotheses, reference, tgt_lang if wants_tokenized else None)
        folder.mkdir(parents=True, exist_ok=True)
        hyp_file = folder / f"{stem}.hyp.txt"
        atomic_write(hyp_file, "".join(line + "\n" for line in hypotheses))
        report = {
            "checkpoint": str(checkpoint),
            "evaluated": name,
            "texts_sha256": texts,
            "backend": settings["backend"],
            **({"compute_type": model.arithmetic} if engine else {}),
            "settings": settings,
            "sentences": len(source),
            "decoding": decoding.to_dict(),
            **scores,
            "seconds": seconds,
            "sentences_per_s": len(source) / seconds if seconds else None,
            "hypotheses": str(hyp_file),
        }
        test = None
        if compare is not None:
            system_path, is_checkpoint = compare
            other, other_file, other_settings = second, system_path, None
            if isinstance(second, Translator):  # named after both: two runs' best.ckpt must not share one file
                other_file = folder / f"{stem}.compare-{system_path.stem}.hyp.txt"
                other, other_settings = second.translate(source), settings_of(second, device)
                atomic_write(other_file, "".join(line + "\n" for line in other))
            test = paired_bootstrap([(str(checkpoint), hypotheses), (str(system_path), other)], reference)
            report["compare"] = comparison_report(test, system_path, is_checkpoint, other_file, other_settings)
        atomic_write(folder / f"{stem}.json", json.dumps(report, indent=2) + "\n")
        print(f"sacreBLEU {scores['sacrebleu']:.2f}  {scores['sacrebleu_signature']}  (detokenized; compare this one)")
        print(f"chrF      {scores['chrf']:.2f}  {scores['chrf_signature']}")
        if "tokenized_bleu" in scores:
            print(f"tokenized BLEU {scores['tokenized_bleu']:.2f}  ({scores['tokenized_bleu_note']})")
        if test is not None:
            print_comparison(test)
        print(
            f"{len(source)} sentences in {seconds:.1f} s; hypotheses: {hyp_file}; scores: {folder / (stem + '.json')}"
        )


if __name__ == "__main__":
    main()
