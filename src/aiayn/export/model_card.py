"""The model card (``README.md``) of every exported folder, as the Hugging Face Hub reads it: metadata
(languages, license, dataset, the run's test scores as ``model-index`` results) made with
``huggingface_hub``'s card API, and a page saying what the model is, how it scored, with which decoding,
how it was trained, how to load it and what to cite.

What the card says of the model and its corpus comes from the checkpoint (its provenance record); what
it says of scores and training comes from the run's ``results.json`` where the caller found one (else it
says so). The checkpoint is shared data: a value it holds that is not what aiayn writes (a language that
is no language code) is left out, never copied into the page."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from aiayn.extras import require

CARD_FILE = "README.md"
LANGUAGE = re.compile(r"[a-z]{2,3}(-[A-Za-z0-9]{2,8})?")  # en, de, pt-BR: what a Hub card's language takes
CORPORA = {"Multi30kDataModule": "multi30k", "WMT14DataModule": "wmt14", "TextDataModule": "your own text"}
PAPER_BIBTEX = """@inproceedings{vaswani2017attention,
  title     = {Attention Is All You Need},
  author    = {Vaswani, Ashish and Shazeer, Noam and Parmar, Niki and Uszkoreit, Jakob and Jones, Llion and
               Gomez, Aidan N. and Kaiser, {\\L}ukasz and Polosukhin, Illia},
  booktitle = {Advances in Neural Information Processing Systems 30},
  pages     = {5998--6008},
  year      = {2017}
}"""


def stored(section: Any, key: str) -> Any:
    return section.get(key) if isinstance(section, Mapping) else None


def card_facts(record: Mapping[str, Any]) -> dict[str, Any]:
    """What the provenance record (:func:`~aiayn.export.checkpoint.provenance`) tells a card: the languages
    (codes only), the corpus and the decoding of the run's tests."""
    run = record.get("run_config")
    data = stored(run, "data")
    languages = [stored(data, key) for key in ("src_lang", "tgt_lang")]
    target = stored(data, "_target_")
    corpus = CORPORA.get(target.rsplit(".", 1)[-1]) if isinstance(target, str) else None
    decoding = stored(run, "decoding")
    return {
        "languages": [lang for lang in languages if isinstance(lang, str) and LANGUAGE.fullmatch(lang)],
        "corpus": corpus,
        "decoding": {k: v for k, v in decoding.items() if isinstance(v, int | float | str)} if decoding else {},
    }


def model_card(record: Mapping[str, Any], target: str, scores: Mapping[str, Any] | None) -> str:
    """The card of a folder exported as ``target`` (``hf`` or ``ctranslate2``) from the checkpoint that
    ``record`` describes; ``scores``: what its run's ``results.json`` says of that checkpoint
    (:class:`~aiayn.experiments.results.CheckpointScores`' fields), or None."""
    hub = require("huggingface_hub", "export", "huggingface_hub (the model card of aiayn-export)")
    facts = card_facts(record)
    model, languages, corpus = record["model"], facts["languages"], facts["corpus"]
    direction = " → ".join(languages) if len(languages) == 2 else "a translation direction the checkpoint does not name"
    scored = scores is not None and scores.get("bleu") is not None
    results = []
    if scored and corpus:
        split = scores.get("test_split") or "test"
        for metric, value in (("bleu", scores["bleu"]), ("chrf", scores.get("chrf"))):
            if value is not None:
                results.append(
                    hub.EvalResult("translation", corpus, corpus, metric, round(value, 2), dataset_split=split)
                )
    data = hub.ModelCardData(
        language=languages or None,
        license="mit",
        library_name="transformers" if target == "hf" else "ctranslate2",
        pipeline_tag="translation",
        tags=["translation", "transformer", "aiayn"],
        datasets=[corpus] if corpus and corpus in CORPORA.values() and corpus != "your own text" else None,
        metrics=["bleu", "chrf"],
        model_name=f"aiayn-transformer-{'-'.join(languages) or 'mt'}",
        eval_results=results or None,
    )
    body = [
        f"# A Transformer for {direction}",
        "",
        "The encoder-decoder Transformer of Vaswani et al. (2017), trained with "
        f"aiayn on {corpus or 'a corpus the checkpoint does not name'}, "
        f"exported by `aiayn-export format={target}`.",
        "",
        "## Results",
        "",
        *score_lines(scores, facts["decoding"]),
        "",
        "## Model",
        "",
        f"{model.get('encoder_layers') or model.get('n_layers')} encoder and "
        f"{model.get('decoder_layers') or model.get('n_layers')} decoder layers, d_model {model.get('d_model')}, d_ff "
        f"{model.get('d_ff')}, {model.get('n_heads')} heads, {model.get('positional')} positions, "
        f"{'pre' if model.get('norm_first') else 'post'}-LN, vocabulary {model.get('vocab_size')}"
        + (f"; {scores['params']:,} parameters." if scores else "."),
        "",
        "## Training",
        "",
        *training_lines(record, scores),
        "",
        "## How to load it",
        "",
        *loading_lines(target),
        "",
        "## Citation",
        "",
        "```bibtex",
        PAPER_BIBTEX,
        "```",
    ]
    return str(hub.ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body) + "\n"))


def score_lines(scores: Mapping[str, Any] | None, decoding: Mapping[str, Any]) -> list[str]:
    """The test scores with sacreBLEU's signature and the decoding they were made with, or why there are none."""
    if scores is None:
        return ["Not recorded: the checkpoint was exported from outside its run folder (no `results.json`). "
                "Score it with `aiayn-eval checkpoint=<this folder>`."]  # fmt: skip
    if scores.get("bleu") is None:
        return ["Its run did not test this checkpoint (a step or last checkpoint). "
                "Score it with `aiayn-eval checkpoint=<this folder>`."]  # fmt: skip
    sentences = f" ({scores['test_sentences']} sentences)" if scores.get("test_sentences") else ""
    lines = [
        "| split | sacreBLEU | chrF |",
        "|---|---|---|",
        f"| {scores.get('test_split') or 'test'}{sentences} | {scores['bleu']:.2f} | "
        + (f"{scores['chrf']:.2f} |" if scores.get("chrf") is not None else "- |"),
        "",
        f"sacreBLEU signature: `{scores.get('signature') or 'not recorded'}`.",
    ]
    if decoding:
        lines += ["", "Decoding: " + ", ".join(f"{key}={value}" for key, value in decoding.items()) + "."]
    return lines


def training_lines(record: Mapping[str, Any], scores: Mapping[str, Any] | None) -> list[str]:
    """Steps, tokens, time and training compute (≈ 6 FLOPs per parameter per token), as far as recorded."""
    lines = [
        f"Exported from checkpoint step {record.get('global_step')} (SHA-256 `{record.get('checkpoint_sha256')}`)."
    ]
    if scores:
        tokens, minutes = scores.get("train_tokens"), (scores.get("wall_s") or 0) / 60
        lines.append(f"The run trained {scores['steps']} steps" + (f" on {tokens:,} tokens" if tokens else "")
                     + (f" in {minutes:.1f} minutes" if minutes else "") + ".")  # fmt: skip
        if tokens:
            lines.append(f"Training compute ≈ {6 * scores['params'] * tokens:.2e} FLOPs (6 × parameters × tokens).")
    return lines


def loading_lines(target: str) -> list[str]:
    """How to translate with the folder: ``transformers`` for ``hf``; for ``ctranslate2`` the engine's
    use (:data:`~aiayn.export.ctranslate2.USAGE`: which pieces the source takes)."""
    if target == "hf":
        return [
            "```python",
            "from transformers import MarianMTModel, MarianTokenizer",
            "",
            'folder = "path/to/this/folder"',
            "tokenizer = MarianTokenizer.from_pretrained(folder)",
            "model = MarianMTModel.from_pretrained(folder)  # its generation settings: beam 4, α = 0.6 (power)",
            'batch = tokenizer(["A man is riding a bike."], return_tensors="pt")',
            "print(tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True))",
            "```",
        ]
    from aiayn.export.ctranslate2 import USAGE

    return [USAGE.strip()]
