"""A tiny COMET model written in unbabel-comet's format, for tests that cannot download a real one: a folder
with ``hparams.yaml`` (the class), ``checkpoints/model.ckpt`` (the weights and hyper-parameters, as COMET's
Lightning checkpoints hold them) and ``encoder/`` (an XLM-R config and tokenizer that the hyper-parameters
name as ``pretrained_model``, as a real model names ``xlm-roberta-large``).

Every weight is drawn from a seeded generator in a fixed order, and the tokenizer is a unigram model over
a fixed vocabulary (no training), so the folder is the same wherever it is written: unbabel-comet's
scores of it, recorded by ``tests/assets/comet_reference.py``, are what ours must reproduce.

    python tests/helpers/tiny_comet.py <folder> <variant>
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import yaml

HIDDEN, LAYERS, HEADS, FFN = 32, 2, 4, 64
MAX_POSITIONS = 40  # XLM-R's max_position_embeddings: COMET truncates at 40 - 2 - 2 = 36 tokens
ESTIMATOR = [48, 16]
# The variants the reference covers: the hyper-parameters a real COMET model differs in (wmt22-comet-da:
# sparsemax over all layers, no layer norm, avg pooling; wmt20-comet-da: softmax and layer norm).
# sparsemax_patch: hparams.yaml says so while the checkpoint says sparsemax (unbabel-comet's fix of models
# trained with a broken sparsemax: softmax, decided by the yaml); deep: three hidden layers and a final
# activation.
VARIANTS = {
    "sparsemax": {"layer": "mix", "layer_transformation": "sparsemax", "layer_norm": False, "pool": "avg"},
    "softmax_norm": {"layer": "mix", "layer_transformation": "softmax", "layer_norm": True, "pool": "avg"},
    "layer1_cls": {"layer": 1, "layer_transformation": "softmax", "layer_norm": False, "pool": "cls"},
    "layer2_max": {"layer": 2, "layer_transformation": "softmax", "layer_norm": False, "pool": "max"},
    "sparsemax_patch": {"layer": "mix", "layer_transformation": "sparsemax", "layer_norm": False, "pool": "avg"},
    "deep": {"layer": "mix", "layer_transformation": "softmax", "layer_norm": False, "pool": "avg",
             "hidden_sizes": [48, 24, 16], "final_activation": "Sigmoid"},
}  # fmt: skip
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]  # XLM-R's first four ids
WORDS = [
    *("a", "the", "man", "woman", "dog", "child", "two", "people", "in", "on", "with", "is", "are", "of", "and"),
    *("street", "water", "red", "blue", "playing", "sitting", "ein", "eine", "der", "die", "das", "mann", "frau"),
    *("hund", "kind", "zwei", "menschen", "im", "auf", "mit", "ist", "sind", "und", "straße", "wasser", "rot"),
    *("blau", "spielt", "sitzt", "."),
]


def vocabulary() -> list[tuple[str, float]]:
    """Pieces and unigram log-probabilities: the specials, whole words after ``▁``, and single
    characters so that any text tokenizes."""
    pieces = [(piece, 0.0) for piece in SPECIALS]
    pieces += [(f"▁{word}", -2.0 - index / 100) for index, word in enumerate(WORDS)]
    characters = sorted(set("".join(WORDS)) | set("abcdefghijklmnopqrstuvwxyzäöüßABCDEFGHIJKLMNOPQRSTUVWXYZ,.!?'-"))
    pieces += [("▁", -6.0)] + [(character, -8.0) for character in characters]
    return pieces


def write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import XLMRobertaTokenizerFast

    backend = Tokenizer(models.Unigram(vocabulary(), unk_id=3))
    backend.normalizer = normalizers.Sequence([normalizers.Replace("  ", " ")])
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    tokenizer = XLMRobertaTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>",
        unk_token="<unk>", pad_token="<pad>", mask_token="<unk>", model_max_length=MAX_POSITIONS - 2,
    )  # fmt: skip
    tokenizer.save_pretrained(folder)


def encoder_config() -> dict:
    return {
        "model_type": "xlm-roberta", "architectures": ["XLMRobertaModel"], "vocab_size": len(vocabulary()),
        "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "intermediate_size": FFN, "hidden_act": "gelu", "max_position_embeddings": MAX_POSITIONS,
        "type_vocab_size": 1, "layer_norm_eps": 1e-5, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
        "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1, "initializer_range": 0.02,
    }  # fmt: skip


def shapes(variant: dict) -> dict[str, tuple[int, ...]]:
    """Every weight of unbabel-comet's RegressionMetric over this encoder, by its state-dict name."""
    vocab = len(vocabulary())
    named: dict[str, tuple[int, ...]] = {
        "encoder.model.embeddings.word_embeddings.weight": (vocab, HIDDEN),
        "encoder.model.embeddings.position_embeddings.weight": (MAX_POSITIONS, HIDDEN),
        "encoder.model.embeddings.token_type_embeddings.weight": (1, HIDDEN),
        "encoder.model.embeddings.LayerNorm.weight": (HIDDEN,),
        "encoder.model.embeddings.LayerNorm.bias": (HIDDEN,),
    }
    for layer in range(LAYERS):
        prefix = f"encoder.model.encoder.layer.{layer}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            named[f"{prefix}{name}.weight"], named[f"{prefix}{name}.bias"] = (HIDDEN, HIDDEN), (HIDDEN,)
        named[f"{prefix}intermediate.dense.weight"], named[f"{prefix}intermediate.dense.bias"] = (FFN, HIDDEN), (FFN,)
        named[f"{prefix}output.dense.weight"], named[f"{prefix}output.dense.bias"] = (HIDDEN, FFN), (HIDDEN,)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            named[f"{prefix}{norm}.weight"], named[f"{prefix}{norm}.bias"] = (HIDDEN,), (HIDDEN,)
    if variant["layer"] == "mix":
        for layer in range(LAYERS + 1):
            named[f"layerwise_attention.scalar_parameters.{layer}"] = (1,)
        named["layerwise_attention.gamma"] = (1,)
    widths = [6 * HIDDEN, *variant.get("hidden_sizes", ESTIMATOR), 1]
    for index, (inputs, outputs) in enumerate(itertools.pairwise(widths)):
        linear = f"estimator.ff.{3 * index}"  # each Linear is followed by its activation and dropout
        named[f"{linear}.weight"], named[f"{linear}.bias"] = (outputs, inputs), (outputs,)
    return named


def weights(variant: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded draws, in the order of :func:`shapes`: norms near 1, everything else small and centred."""
    generator = torch.Generator().manual_seed(seed)
    drawn = {}
    for name, shape in shapes(variant).items():
        values = torch.randn(shape, generator=generator)
        if name.endswith("LayerNorm.weight") or name.endswith("gamma"):
            drawn[name] = 1 + 0.1 * values
        elif "scalar_parameters" in name:
            drawn[name] = values  # sparsemax then keeps some layers and drops others
        else:
            drawn[name] = 0.3 * values
    return drawn


def write_tiny_comet(folder: Path, name: str = "sparsemax", seed: int = 0) -> Path:
    """The tiny COMET model ``name`` (:data:`VARIANTS`) in ``folder``; returns ``folder``."""
    from transformers import XLMRobertaConfig

    variant = VARIANTS[name]
    encoder = folder / "encoder"
    encoder.mkdir(parents=True, exist_ok=True)
    XLMRobertaConfig(**encoder_config()).save_pretrained(encoder)
    write_tokenizer(encoder)
    # "encoder": read from the model's folder by aiayn, from the working directory by unbabel-comet (the
    # reference script runs in each model's folder); a real model names a Hub id (xlm-roberta-large).
    hyper_parameters = {
        "nr_frozen_epochs": 0.3, "keep_embeddings_frozen": True, "optimizer": "AdamW", "warmup_steps": 0,
        "encoder_learning_rate": 1e-6, "learning_rate": 1.5e-5, "layerwise_decay": 0.95,
        "encoder_model": "XLM-RoBERTa", "pretrained_model": "encoder", "loss": "mse", "dropout": 0.1,
        "batch_size": 4, "train_data": [], "validation_data": [], "hidden_sizes": ESTIMATOR,
        "activations": "Tanh", "final_activation": None, **variant, "load_pretrained_weights": True,
        "local_files_only": False, "class_identifier": "regression_metric",
    }  # fmt: skip
    (folder / "checkpoints").mkdir(exist_ok=True)
    drawn = weights(variant, seed)
    if variant["layer"] == "mix":  # the buffers of unbabel-comet's layer dropout, in its state dict too
        drawn["layerwise_attention.dropout_mask"] = torch.zeros(LAYERS + 1)
        drawn["layerwise_attention.dropout_fill"] = torch.full((LAYERS + 1,), -1e20)
    drawn["encoder.model.embeddings.position_ids"] = torch.arange(MAX_POSITIONS)[None]  # older transformers kept it
    # As a Lightning checkpoint of COMET's training holds them: the weights and hyper-parameters, and the
    # loops' and callbacks' states beside them.
    state = {
        "epoch": 1, "global_step": 1000, "pytorch-lightning_version": "2.0.0", "state_dict": drawn,
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 2, "completed": 1}}}},
        "callbacks": {"EarlyStopping{'monitor': 'val_kendall', 'mode': 'max'}": {
            "wait_count": 0, "stopped_epoch": 0, "best_score": torch.tensor(0.31), "patience": 1}},
        "hparams_name": "kwargs", "hyper_parameters": hyper_parameters,
    }  # fmt: skip
    torch.save(state, folder / "checkpoints" / "model.ckpt")
    patched = {"layer_transformation": "sparsemax_patch"} if name == "sparsemax_patch" else {}
    declared = {**hyper_parameters, **patched}
    (folder / "hparams.yaml").write_text(yaml.safe_dump(declared))
    return folder


# Sources, translations and references the reference scores: short and long (past the truncation), words
# outside the vocabulary, an empty translation, identical translation and reference.
SAMPLES = [
    {"src": "two people are sitting on the street .", "mt": "zwei menschen sitzen auf der straße .",
     "ref": "zwei menschen sitzen auf der straße ."},
    {"src": "a dog is playing in the water .", "mt": "ein hund spielt im wasser .", "ref": "der hund ist im wasser ."},
    {"src": "a man with a red hat .", "mt": "eine frau mit rot .", "ref": "ein mann mit einem roten Hut ."},
    {"src": "Zebras!", "mt": "", "ref": "Zebras!"},
    {"src": " ".join(["the man and the woman are playing"] * 6), "mt": " ".join(["der mann und die frau"] * 8),
     "ref": "der mann und die frau spielen ."},
    {"src": "a child .", "mt": "ein kind ist blau und rot und blau .", "ref": "ein kind ."},
]  # fmt: skip


if __name__ == "__main__":
    write_tiny_comet(Path(sys.argv[1]), sys.argv[2])
