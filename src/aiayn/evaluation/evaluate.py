"""What ``aiayn-eval`` does: a checkpoint (or an exported engine, or an ensemble of checkpoints) and a text
with its references → hypotheses (and with ``nbest`` > 1 the n best of each line), their scores and a JSON
report in an output folder; with a compared system (another checkpoint or ensemble, or a file of
hypotheses), also whether the two differ significantly (sacreBLEU's paired bootstrap). Choosing decoding
settings on the validation split is :mod:`aiayn.evaluation.tuning`'s. What to do comes as
:class:`~aiayn.evaluation.settings.EvalSettings`, which the config layer makes from the command's config."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aiayn.data.corpus import read_lines, read_parallel
from aiayn.data.stored import instantiated_from_checkpoint
from aiayn.errors import CheckpointError, FieldError, show
from aiayn.evaluation.comet import CHECKPOINT
from aiayn.evaluation.settings import ComparedSystem, EvalSettings, Texts
from aiayn.evaluation.translator import Translator, direction, load_translation_models, nbest_jsonl
from aiayn.export.ctranslate2 import EngineModel
from aiayn.files import atomic_write
from aiayn.scoring import (
    SIGNIFICANCE_LEVEL,
    PairedBootstrap,
    corpus_scores,
    paired_bootstrap,
    paired_bootstrap_segments,
)

TOKENIZED_BLEU_LANGS = ("de", "fr")  # the paper's En-De 28.4 and En-Fr 41.8 are both tokenized BLEU


@dataclass(frozen=True)
class Evaluation:
    """An evaluation's results: the JSON report (also written to ``report_file``), the hypotheses' file
    and, with a compared system, the paired bootstrap's result (of COMET's too, with ``comet=``)."""

    report: dict[str, Any]
    report_file: Path
    hypotheses_file: Path
    comparison: PairedBootstrap | None
    nbest_file: Path | None = None
    comet_comparison: PairedBootstrap | None = None


def evaluate(settings: EvalSettings) -> Evaluation:
    """Translates the texts with the model of ``settings.decode.checkpoint`` (or the ensemble of several:
    the mean of their log-probabilities), decoded as ``settings.decode`` says (the draws of sampling
    decided by its seed); scores the hypotheses against the references (sacreBLEU and chrF; the paper's
    tokenized BLEU too when ``tokenized_bleu`` is true, or ``auto`` and the target language is one the
    paper reports it for) and writes the hypotheses and the report to ``output_dir``
    (:func:`output_folder`). With ``nbest`` > 1 the n best of each line (or n samples) go to
    ``<stem>.nbest.jsonl`` as well, in ``aiayn-translate``'s format; the hypotheses and the scores are the
    first of each line, as with ``nbest=1``. A compared system is checked before anything is translated,
    then translated alike (checkpoints) and tested against this one. With ``comet``, the COMET model is
    found and loaded before anything is translated, and scores each segment (of both systems) after.

    The files are named by what defines them (every checkpoint, the texts, the settings, the compared
    system; :func:`output_digest`): another text of the same file name, other options or another
    compared system never replace them, and the same evaluation again replaces its own."""
    decode, compare, tokenized_bleu, comet = settings.decode, settings.compare, settings.tokenized_bleu, settings.comet
    scorer = comet_folder = None
    if comet is not None:  # loaded before anything is translated: a model it cannot score with is refused first
        comet_folder = comet.folder()
        scorer = comet.load(decode.torch_device, comet_folder)
    system = loaded_system(settings)
    paths, translator, decoding, nbest = system.paths, system.translator, decode.decoding, decode.nbest
    tgt_lang = (direction(system.run_config, paths[0]) or (None, None))[1]
    source, reference = system.source, system.reference
    device = decode.torch_device
    second = second_system(compare, translator, system.run_config, paths[0], reference, device) if compare else None
    wants_tokenized = tokenized_bleu is True or (tokenized_bleu == "auto" and tgt_lang in TOKENIZED_BLEU_LANGS)
    identity = {
        "checkpoint": system_identity(paths),
        "texts": system.digest,
        "settings": system.decoded,
        "nbest": nbest,
        "tokenized_bleu": tgt_lang if wants_tokenized else None,
        "compare": [system_identity(compare.paths), compare.is_checkpoint] if compare else None,
        **({"comet": file_identity(comet_folder / CHECKPOINT)} if comet_folder else {}),
    }
    searched = f"sample-seed{decode.seed}" if decoding.sample else f"beam{decoding.beam_size}-alpha{decoding.alpha}"
    stem = f"{system.stem}.{searched}.{output_digest(identity)}"

    start = time.perf_counter()
    found = translator.candidates(source)
    hypotheses = [candidates[0].text if candidates else "" for candidates in found]
    seconds = time.perf_counter() - start
    scores = corpus_scores(hypotheses, reference, tgt_lang if wants_tokenized else None)
    folder = system.folder
    folder.mkdir(parents=True, exist_ok=True)
    hyp_file = folder / f"{stem}.hyp.txt"
    atomic_write(hyp_file, "".join(line + "\n" for line in hypotheses))
    nbest_file = folder / f"{stem}.nbest.jsonl" if nbest > 1 else None
    if nbest_file is not None:
        atomic_write(nbest_file, nbest_jsonl(found, ensemble=translator.ensemble))
    report = {
        **system.described(),
        "backend": system.decoded["backend"],
        **({"compute_type": system.decoded["compute_type"]} if system.decoded["backend"] == "ctranslate2" else {}),
        "settings": system.decoded,
        "sentences": len(source),
        "decoding": decoding.to_dict(),
        **scores,
        "seconds": seconds,
        "sentences_per_s": len(source) / seconds if seconds else None,
        "hypotheses": str(hyp_file),
        "nbest": nbest,
        **({"nbest_file": str(nbest_file)} if nbest_file else {}),
    }
    test = comet_test = None
    other: list[str] = []
    labels = (system_label(paths), system_label(compare.paths) if compare else "")
    if compare is not None:
        system_paths = compare.paths
        other_file, other_settings = system_paths[0], None
        if isinstance(second, Translator):  # named after both: two runs' best.ckpt must not share one file
            other_file = folder / f"{stem}.compare-{system_name(system_paths)}.hyp.txt"
            other, other_settings = second.translate(source), settings_of(second, device)
            atomic_write(other_file, "".join(line + "\n" for line in other))
        else:
            other = list(second)
        test = paired_bootstrap([(labels[0], hypotheses), (labels[1], other)], reference)
        report["compare"] = comparison_report(test, compare, other_file, other_settings)
    report_file = folder / f"{stem}.json"
    atomic_write(report_file, json.dumps(report, indent=2) + "\n")  # BLEU's, kept should COMET fail
    if comet is not None and scorer is not None:
        ours = scorer.score(source, hypotheses, reference, comet.comet_batch_size)
        report.update(comet=ours.system, comet_model=comet.comet_model, comet_source=str(comet_folder),
                      comet_segments=ours.segments)  # fmt: skip
        if compare is not None:
            theirs = scorer.score(source, other, reference, comet.comet_batch_size)
            comet_test = paired_bootstrap_segments(
                [(labels[0], ours.segments), (labels[1], theirs.segments)], f"COMET {comet.comet_model}"
            )
            report["compare"]["comet_test"] = comet_comparison(comet_test, theirs.segments)
        atomic_write(report_file, json.dumps(report, indent=2) + "\n")
    return Evaluation(report, report_file, hyp_file, test, nbest_file, comet_test)


@dataclass(frozen=True)
class LoadedSystem:
    """The system ``aiayn-eval`` scores, loaded, and the texts it translates: its checkpoints (``paths``),
    a translator of its model(s), the stored run config, the evaluated text (``name``, ``source``,
    ``reference``, their ``digest``), how it decodes (``decoded``, :func:`settings_of`), the folder its
    files go to and the start of their names (``stem``)."""

    paths: list[Path]
    translator: Translator
    run_config: dict[str, Any]
    name: str
    source: list[str]
    reference: list[str]
    digest: str
    decoded: dict[str, Any]
    folder: Path
    stem: str

    def described(self) -> dict[str, Any]:
        """What a report says of the system and the texts."""
        return {
            "checkpoint": shown_paths(self.paths),
            "system": system_name(self.paths),
            "members": [file_identity(path) for path in self.paths],  # an ensemble's each (one model: one)
            "evaluated": self.name,
            "texts_sha256": self.digest,
        }


def loaded_system(settings: EvalSettings) -> LoadedSystem:
    """The checkpoint(s) of ``settings`` loaded (decoding as ``decoding=`` says), and the texts read."""
    translator, run_config = settings.decode.loaded()
    paths, model = list(settings.decode.checkpoint), translator.model
    name, source, reference = evaluation_texts(settings.texts, run_config, paths[0])
    engine = f".ct2-{model.arithmetic}" if isinstance(model, EngineModel) else ""
    return LoadedSystem(
        paths,
        translator,
        run_config,
        name,
        source,
        reference,
        texts_digest(source, reference),
        settings_of(translator, settings.decode.torch_device),
        output_folder(paths[0], settings.output_dir),
        f"{system_name(paths)}{engine}.{name}",
    )


def system_name(paths: Sequence[Path]) -> str:
    """What names a system's files: its checkpoint's stem (an engine folder's name), or for an ensemble
    ``ensemble<n>-<the first member's>`` (the members themselves are in the file's digest and report)."""
    first = paths[0]
    name = first.resolve().name if first.is_dir() else first.stem
    return name if len(paths) == 1 else f"ensemble{len(paths)}-{name}"


def system_label(paths: Sequence[Path]) -> str:
    """A system in the paired bootstrap and the printed summary: its checkpoint, or its members joined by +."""
    return " + ".join(str(path) for path in paths)


def shown_paths(paths: Sequence[Path]) -> str | list[str]:
    """A system in the JSON report: its checkpoint's path, or the list of its members'."""
    return str(paths[0]) if len(paths) == 1 else [str(path) for path in paths]


def system_identity(paths: Sequence[Path]) -> list[Any]:
    """:func:`file_identity` of a checkpoint, or the list of each member's for an ensemble."""
    return file_identity(paths[0]) if len(paths) == 1 else [file_identity(path) for path in paths]


def evaluation_texts(texts: Texts, run_config: dict[str, Any], checkpoint: Path) -> tuple[str, list[str], list[str]]:
    """A name for the evaluated text, its source lines and its references: the files given, or a split of
    the corpus the checkpoint's run was trained on, read from the user's ``data.root`` (or the Hub
    dataset ``data.hub``). The stored ``data`` section only says which corpus, direction and splits
    (:func:`~aiayn.data.stored.instantiated_from_checkpoint`): a shared checkpoint never makes its
    reader scan a folder or fetch a dataset it names."""
    if texts.own:
        source, reference = read_parallel(texts.source.expanduser(), texts.reference.expanduser())
        return texts.source.name, source, reference
    data = run_config.get("data") if isinstance(run_config, dict) else None
    if not isinstance(data, dict) or "_target_" not in data:
        raise CheckpointError(f"checkpoint {checkpoint} holds no data section to evaluate a split of; "
                              "give source=<file> reference=<file>")  # fmt: skip
    datamodule = instantiated_from_checkpoint(data, "data", checkpoint, root=texts.data_root, hub=texts.data_hub)
    source, reference = datamodule.split_texts(texts.split)
    return texts.split, source, reference


def output_folder(checkpoint: Path, output_dir: Path | None) -> Path:
    """``output_dir``, else ``eval/`` in the checkpoint's run folder (beside a CTranslate2 folder). A
    default ``eval`` that is a link (a copied run folder's) is refused: it may lead anywhere."""
    if output_dir:
        return output_dir.expanduser()
    run = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent
    folder = checkpoint.resolve().parent / "eval" if checkpoint.is_dir() else run / "eval"
    if folder.is_symlink():
        raise FieldError("output_dir", None, f"would be {folder}, a link; name the folder to write to")
    return folder


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
        **({"seed": translator.seed} if translator.decoding.sample else {}),  # beam search draws nothing
    }


def second_system(
    compare: ComparedSystem, first: Translator, first_run: dict[str, Any], checkpoint: Path,
    references: list[str], device: torch.device,
) -> Translator | list[str]:  # fmt: skip
    """The ``compare=`` system, checked before anything is translated: a checkpoint's (or an ensemble's)
    translator, which decodes exactly as ``first`` does (the same backend, compute type, device, decoding
    options, seed and batches; an engine folder's checkpoint is converted for the engine with its
    arithmetic) and translates in the same direction; or the file's hypotheses, one per reference."""
    paths = list(compare.paths)
    system = paths[0]
    if not compare.is_checkpoint:
        hypotheses = read_lines(system)
        if len(hypotheses) != len(references):
            lines = f"has {len(hypotheses)} lines but there are {len(references)} references"
            allowed = f"{lines}; give one hypothesis per reference"
            raise FieldError("compare", str(system), allowed)
        return hypotheses
    wanted = settings_of(first, device)
    backend, compute_type = wanted["backend"], wanted["compute_type"] or "default"
    try:
        model, tokenizer, run_config = load_translation_models(paths, backend, device, compute_type)
    except CheckpointError as error:
        raise CheckpointError(f"compare={system_label(paths)}: {error}") from None
    except FieldError as error:  # the ensemble's own checks, said of compare=
        if error.field != "checkpoint":
            raise
        raise FieldError("compare", error.value, error.allowed) from None
    first_direction, second_direction = direction(first_run, checkpoint), direction(run_config, system)
    if first_direction and second_direction and first_direction != second_direction:
        allowed = (
            f"translates {'→'.join(second_direction)}, checkpoint= {'→'.join(first_direction)}; "
            "compare systems of one direction"
        )
        raise FieldError("compare", str(system), allowed)
    second = Translator(
        model, tokenizer, first.decoding, first.max_tokens, seed=first.seed, sdpa_backends=first.sdpa_backends
    )
    if (got := settings_of(second, device)) != wanted:
        differs = ", ".join(f"{key}={show(got[key])}" for key in wanted if got[key] != wanted[key])
        raise FieldError("compare", str(system), f"would be decoded with {differs}, unlike checkpoint=")
    return second


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
    test: PairedBootstrap, compare: ComparedSystem, hypotheses: Path,
    settings: dict[str, Any] | None,
) -> dict[str, Any]:  # fmt: skip
    """The JSON report's ``compare`` section: the second system's sacreBLEU, its difference to the first
    (``checkpoint=``, the test's baseline) with the 95% interval, the p-value, and how it was decoded
    (``settings``, the first system's; null for a file of hypotheses, decoded elsewhere)."""
    baseline, other = test.systems
    system = compare.paths
    return {
        "system": shown_paths(system),
        "kind": ("ensemble" if len(system) > 1 else "checkpoint") if compare.is_checkpoint else "hypotheses",
        "members": [file_identity(path) for path in system] if compare.is_checkpoint else None,
        "hypotheses": str(hypotheses),
        "settings": settings,
        "sacrebleu": other.score,
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


def comet_comparison(test: PairedBootstrap, segments: list[float]) -> dict[str, Any]:
    """The ``compare`` section's ``comet_test``: the second system's COMET (and each segment's), the difference
    to the first with its 95% interval and the p-value of the same paired bootstrap as BLEU's."""
    baseline, other = test.systems
    return {
        "comet": other.score,
        "comet_segments": segments,
        "comet_mean": other.mean,
        "comet_ci": other.ci,
        "baseline_comet_mean": baseline.mean,
        "baseline_comet_ci": baseline.ci,
        "difference": other.difference,
        "difference_ci": list(other.difference_ci) if other.difference_ci else None,
        "p_value": other.p_value,
        "significant": other.p_value < SIGNIFICANCE_LEVEL,
        "test": "paired bootstrap resampling of the segments' mean (sacreBLEU's resamples and statistic)",
        "samples": test.samples,
        "seed": test.seed,
        "signature": test.signature,
    }


def comparison_lines(test: PairedBootstrap, metric: str, digits: int) -> list[str]:
    """Both systems' score (with the bootstrap mean ± 95% CI), the difference, its interval and p-value."""
    baseline, other = test.systems
    lines = []
    for label, system in (("checkpoint", baseline), ("compare", other)):
        scores = f"{metric} {system.score:.{digits}f}  (bootstrap μ {system.mean:.{digits}f} ± {system.ci:.{digits}f})"
        lines.append(f"{label:<10} {scores}  {system.name}")
    low_high = other.difference_ci
    interval = f"[{low_high[0]:+.{digits}f}, {low_high[1]:+.{digits}f}]" if low_high else "not computed (no fixed seed)"
    verdict = "significant" if other.p_value < SIGNIFICANCE_LEVEL else "not significant"
    lines.append(
        f"difference {other.difference:+.{digits}f} (compare − checkpoint), 95% CI {interval}, p = {other.p_value:.4f} "
        f"({verdict} at {SIGNIFICANCE_LEVEL}); paired bootstrap {test.signature}"
    )
    return lines


def summary_lines(evaluation: Evaluation) -> list[str]:
    """What ``aiayn-eval`` prints: the scores with their signatures; with a compared system, both
    systems' sacreBLEU (with sacreBLEU's bootstrap mean ± 95% CI), the difference, its interval, the
    p-value and whether that is significant; and where the files are."""
    report = evaluation.report
    lines = [
        f"sacreBLEU {report['sacrebleu']:.2f}  {report['sacrebleu_signature']}  (detokenized; compare this one)",
        f"chrF      {report['chrf']:.2f}  {report['chrf_signature']}",
    ]
    if "tokenized_bleu" in report:
        lines.append(f"tokenized BLEU {report['tokenized_bleu']:.2f}  ({report['tokenized_bleu_note']})")
    if "comet" in report:
        segments = f"(the mean of {report['sentences']} segments)"
        lines.append(f"COMET     {report['comet']:.4f}  {report['comet_model']} {segments}")
    if evaluation.comparison is not None:
        lines += comparison_lines(evaluation.comparison, "sacreBLEU", 2)
    if evaluation.comet_comparison is not None:
        lines += comparison_lines(evaluation.comet_comparison, "COMET", 4)
    lines.append(
        f"{report['sentences']} sentences in {report['seconds']:.1f} s; hypotheses: {evaluation.hypotheses_file}; "
        f"scores: {evaluation.report_file}"
    )
    if evaluation.nbest_file is not None:
        lines.append(f"{report['nbest']} best of each line (JSON lines): {evaluation.nbest_file}")
    return lines
