"""``aiayn-eval``: a checkpoint + a data split → hypotheses and their scores; see conf/eval.yaml."""

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
from aiayn.data.corpus import read_parallel
from aiayn.errors import CheckpointError, ConfigError
from aiayn.evaluation.translator import Translator
from aiayn.files import atomic_write
from aiayn.scoring import corpus_scores
from aiayn.training.checkpoints import load_model


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
    return run / "eval"


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
        model, tokenizer, run_config = load_model(checkpoint, resolve_device(cfg.device))
        name, source, reference = evaluation_texts(cfg, run_config, checkpoint)
        decoding = decoding_options(cfg.decoding)
        translator = Translator(model, tokenizer, decoding, max_tokens=cfg.max_tokens)
        start = time.perf_counter()
        hypotheses = translator.translate(source)
        seconds = time.perf_counter() - start

        tgt_lang = run_config["data"].get("tgt_lang")
        wants_tokenized = cfg.tokenized_bleu is True or (cfg.tokenized_bleu == "auto" and tgt_lang == "de")
        scores = corpus_scores(hypotheses, reference, tgt_lang if wants_tokenized else None)
        folder = output_folder(cfg, checkpoint)
        folder.mkdir(parents=True, exist_ok=True)
        stem = f"{checkpoint.stem}.{name}.beam{decoding.beam_size}-alpha{decoding.alpha}"
        hyp_file = folder / f"{stem}.hyp.txt"
        atomic_write(hyp_file, "".join(line + "\n" for line in hypotheses))
        report = {
            "checkpoint": str(checkpoint),
            "evaluated": name,
            "sentences": len(source),
            "decoding": decoding.to_dict(),
            **scores,
            "seconds": seconds,
            "sentences_per_s": len(source) / seconds if seconds else None,
            "hypotheses": str(hyp_file),
        }
        atomic_write(folder / f"{stem}.json", json.dumps(report, indent=2) + "\n")
        print(f"sacreBLEU {scores['sacrebleu']:.2f}  {scores['sacrebleu_signature']}  (detokenized; compare this one)")
        print(f"chrF      {scores['chrf']:.2f}  {scores['chrf_signature']}")
        if "tokenized_bleu" in scores:
            print(f"tokenized BLEU {scores['tokenized_bleu']:.2f}  ({scores['tokenized_bleu_note']})")
        print(
            f"{len(source)} sentences in {seconds:.1f} s; hypotheses: {hyp_file}; scores: {folder / (stem + '.json')}"
        )


if __name__ == "__main__":
    main()
