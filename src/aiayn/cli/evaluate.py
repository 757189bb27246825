"""``aiayn-eval``: a checkpoint + a data split → hypotheses and their scores; with ``compare=``, also a
second system (another checkpoint, or a file of hypotheses) on the same references, and whether the two
differ significantly (sacreBLEU's paired bootstrap). See conf/eval.yaml."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from aiayn.cli.common import reported_as_usage_errors, reported_hydra_errors, required_checkpoint, resolve_device
from aiayn.config.build import decoding_options, instantiated_from_checkpoint
from aiayn.config.compose import config_dir
from aiayn.data.corpus import read_lines, read_parallel
from aiayn.errors import CheckpointError, ConfigError
from aiayn.evaluation.translator import Translator, load_translation_model
from aiayn.export.ctranslate2 import EngineModel
from aiayn.files import atomic_write
from aiayn.model import DecodingOptions
from aiayn.scoring import SIGNIFICANCE_LEVEL, PairedBootstrap, corpus_scores, paired_bootstrap
from aiayn.training.checkpoints import load_model

TOKENIZED_BLEU_LANGS = ("de", "fr")  # the paper's En-De 28.4 and En-Fr 41.8 are both tokenized BLEU
# What torch.load reads: a zip archive (torch.save's format) or a pickle (its legacy one). Neither can
# begin a file of UTF-8 text, so a file of hypotheses is never mistaken for a checkpoint.
CHECKPOINT_MAGIC = (b"PK\x03\x04", b"\x80")


def evaluation_texts(cfg: DictConfig, run_config: dict[str, Any], checkpoint: Path) -> tuple[str, list[str], list[str]]:
    """A name for the evaluated text, its source lines and its references: the files given, or a split of
    the corpus the checkpoint's run was trained on (its stored ``data`` section, built only from aiayn's
    own classes)."""
    if cfg.source or cfg.reference:
        if not (cfg.source and cfg.reference):
            raise ValueError("source and reference go together: set both, or neither to evaluate a split")
        source, reference = read_parallel(Path(cfg.source), Path(cfg.reference))
        return Path(cfg.source).name, source, reference
    data = run_config.get("data") if isinstance(run_config, dict) else None
    if not isinstance(data, dict) or "_target_" not in data:
        raise CheckpointError(f"checkpoint {checkpoint} holds no data section to evaluate a split of; "
                              "give source=<file> reference=<file>")  # fmt: skip
    # Where the data is read from and cached is the user's to say, not a shared checkpoint's.
    data = {**data, "cache_dir": cfg.data.cache_dir}
    if cfg.data.root is not None:
        data["root"] = cfg.data.root
    if isinstance(data.get("root"), str) and not Path(data["root"]).expanduser().is_dir():
        raise ConfigError(
            "data.root", data["root"], "(from the checkpoint's run) is not a folder; set data.root=<corpus>"
        )
    source, reference = instantiated_from_checkpoint(data, "data", checkpoint).split_texts(cfg.split)
    return cfg.split, source, reference


def output_folder(cfg: DictConfig, checkpoint: Path) -> Path:
    if cfg.output_dir:
        return Path(cfg.output_dir)
    run = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent
    if checkpoint.is_dir():  # a CTranslate2 folder: beside it, not inside the model
        return checkpoint.resolve().parent / "eval"
    return run / "eval"


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


def second_system(
    compare: tuple[Path, bool], first_run: dict[str, Any], references: list[str], decoding: DecodingOptions,
    cfg: DictConfig,
) -> Translator | list[str]:  # fmt: skip
    """The ``compare=`` system, checked before anything is translated: a checkpoint's translator (same
    decoding, batching and device as the first; same translation direction), or the file's hypotheses,
    one per reference."""
    system, is_checkpoint = compare
    if is_checkpoint:
        try:
            model, tokenizer, run_config = load_model(system, resolve_device(cfg.device))
        except CheckpointError as error:
            raise CheckpointError(f"compare={system}: {error}") from None
        first, second = direction(first_run), direction(run_config)
        if first and second and first != second:
            allowed = f"translates {'→'.join(second)}, checkpoint= {'→'.join(first)}; compare systems of one direction"
            raise ConfigError("compare", str(system), allowed)
        return Translator(model, tokenizer, decoding, max_tokens=cfg.max_tokens)
    hypotheses = read_lines(system)
    if len(hypotheses) != len(references):
        allowed = (
            f"has {len(hypotheses)} lines but there are {len(references)} references; give one hypothesis per reference"
        )
        raise ConfigError("compare", str(system), allowed)
    return hypotheses


def direction(run_config: dict[str, Any]) -> tuple[str, str] | None:
    """(source language, target language) of a checkpoint's run, when its config says."""
    data = run_config.get("data") if isinstance(run_config, dict) else None
    langs = (data.get("src_lang"), data.get("tgt_lang")) if isinstance(data, dict) else (None, None)
    return langs if None not in langs else None


def comparison_report(test: PairedBootstrap, system: Path, is_checkpoint: bool, hypotheses: Path) -> dict[str, Any]:
    """The JSON report's ``compare`` section: the second system's sacreBLEU, its difference to the first
    (``checkpoint=``, the test's baseline) with the 95% interval, and the p-value."""
    baseline, other = test.systems
    return {
        "system": str(system),
        "kind": "checkpoint" if is_checkpoint else "hypotheses",
        "hypotheses": str(hypotheses),
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
        if cfg.tokenized_bleu not in ("auto", True, False):
            raise ConfigError("tokenized_bleu", cfg.tokenized_bleu, "must be auto, true or false")
        compare = compared_system(cfg.compare)
        model, tokenizer, run_config = load_translation_model(
            checkpoint, cfg.backend, resolve_device(cfg.device), cfg.compute_type
        )
        name, source, reference = evaluation_texts(cfg, run_config, checkpoint)
        decoding = decoding_options(cfg.decoding)
        second = second_system(compare, run_config, reference, decoding, cfg) if compare else None
        translator = Translator(model, tokenizer, decoding, max_tokens=cfg.max_tokens)
        start = time.perf_counter()
        hypotheses = translator.translate(source)
        seconds = time.perf_counter() - start

        tgt_lang = (direction(run_config) or (None, None))[1]
        wants_tokenized = cfg.tokenized_bleu is True or (
            cfg.tokenized_bleu == "auto" and tgt_lang in TOKENIZED_BLEU_LANGS
        )
        scores = corpus_scores(hypotheses, reference, tgt_lang if wants_tokenized else None)
        folder = output_folder(cfg, checkpoint)
        folder.mkdir(parents=True, exist_ok=True)
        # The engine's results never replace ours, nor those of another arithmetic or exported folder.
        engine = f".ct2-{model.arithmetic}" if isinstance(model, EngineModel) else ""
        system = checkpoint.resolve().name if checkpoint.is_dir() else checkpoint.stem
        stem = f"{system}{engine}.{name}.beam{decoding.beam_size}-alpha{decoding.alpha}"
        hyp_file = folder / f"{stem}.hyp.txt"
        atomic_write(hyp_file, "".join(line + "\n" for line in hypotheses))
        report = {
            "checkpoint": str(checkpoint),
            "evaluated": name,
            "backend": "ctranslate2" if engine else "aiayn",
            **({"compute_type": model.arithmetic} if engine else {}),
            "sentences": len(source),
            "decoding": decoding.to_dict(),
            **scores,
            "seconds": seconds,
            "sentences_per_s": len(source) / seconds if seconds else None,
            "hypotheses": str(hyp_file),
        }
        test = None
        if compare is not None:
            system, is_checkpoint = compare
            other, other_file = second, system
            if isinstance(second, Translator):  # named after both: two runs' best.ckpt must not share one file
                other, other_file = second.translate(source), folder / f"{stem}.compare-{system.stem}.hyp.txt"
                atomic_write(other_file, "".join(line + "\n" for line in other))
            test = paired_bootstrap([(str(checkpoint), hypotheses), (str(system), other)], reference)
            report["compare"] = comparison_report(test, system, is_checkpoint, other_file)
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
