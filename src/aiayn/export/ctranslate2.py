"""Our Transformer as a CTranslate2 model, and translation through that engine.

CTranslate2's converter for Hugging Face Marian folders assumes Marian's own vocabulary conventions:
``<pad>`` is the last token (it drops the last row of the embeddings) and the decoder starts from a zero
vector instead of a token's embedding. Our models start decoding from BOS's embedding, with PAD first,
so :func:`convert` fills CTranslate2's own ``TransformerSpec`` from the checkpoint's weights instead,
through the engine's converter base class (its validation, quantization and file format). The spec
takes our layout as it is: the fused Q/K/V projection, our position table, pre-LN or post-LN.

:class:`EngineModel` translates token ids with the engine's beam search, with our decoding options:
beam size, length penalty α, and at most source length + ``max_len_offset`` tokens before EOS (the
engine takes one length limit per call, so sentences go in groups of one source length).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer
from aiayn.errors import first_line
from aiayn.export.folder import (
    PROVENANCE_FILE,
    TOKENIZER_FILE,
    check_exportable,
    length_groups,
    read_provenance,
    write_companions,
)
from aiayn.extras import require
from aiayn.machine import available_cpus
from aiayn.model import DecodingOptions, Transformer, TransformerConfig

QUANTIZATIONS = ("float32", "int8", "int8_float16", "int8_float32", "float16", "bfloat16", "int8_bfloat16")
MODEL_FILE = "model.bin"


def import_ctranslate2() -> Any:
    return require("ctranslate2", "export", "CTranslate2 (format=ctranslate2, backend=ctranslate2)")


def vocabulary(tokenizer: Tokenizer) -> list[str]:
    """The pieces of ``tokenizer``, by id (PAD, UNK, BOS and EOS at :mod:`aiayn.data.tokenizer`'s ids)."""
    return [tokenizer.sp.id_to_piece(i) for i in range(tokenizer.sp.get_piece_size())]


def transformer_spec(model: Transformer, pieces: list[str]) -> Any:
    """CTranslate2's ``TransformerSpec`` holding ``model``'s weights (float32 numpy arrays), whose
    vocabulary is ``pieces`` (:func:`vocabulary`)."""
    import_ctranslate2()
    from ctranslate2.specs import common_spec
    from ctranslate2.specs.transformer_spec import TransformerSpec

    cfg = model.cfg
    check_exportable(cfg, "ctranslate2")
    weights = {name: tensor.detach().float().cpu().numpy() for name, tensor in model.state_dict().items()}
    spec = TransformerSpec.from_config(
        cfg.n_layers, cfg.n_heads, pre_norm=cfg.norm_first, activation=common_spec.Activation.RELU
    )

    def linear(target: Any, name: str) -> None:
        target.weight = weights[f"{name}.weight"]
        if f"{name}.bias" in weights:
            target.bias = weights[f"{name}.bias"]

    def norm(target: Any, name: str) -> None:
        target.gamma, target.beta = weights[f"{name}.weight"], weights[f"{name}.bias"]

    if cfg.positional == "sinusoidal":
        positions = model.positions.table[: cfg.max_positions].float().cpu().numpy()
    else:
        positions = weights["positions.embedding.weight"]
    embedding = weights["src_embed.weight"]
    for stack in (spec.encoder, spec.decoder):
        stack.scale_embeddings = True  # §3.4: sqrt(d_model)
        stack.position_encodings.encodings = positions
    spec.encoder.embeddings[0].weight = embedding
    spec.decoder.embeddings.weight = embedding
    spec.decoder.projection.weight = embedding  # §3.4: the pre-softmax projection is the embedding
    if cfg.norm_first:
        norm(spec.encoder.layer_norm, "encoder_norm")
        norm(spec.decoder.layer_norm, "decoder_norm")

    def self_attention(target: Any, layer: str, block: str) -> None:
        linear(target.linear[0], f"{layer}.self_attn.qkv_proj")  # CTranslate2 fuses Q, K, V as we do
        linear(target.linear[1], f"{layer}.self_attn.out_proj")
        norm(target.layer_norm, f"{layer}.{block}.norm")

    def feed_forward(target: Any, layer: str) -> None:
        linear(target.linear_0, f"{layer}.ffn.w1")
        linear(target.linear_1, f"{layer}.ffn.w2")
        norm(target.layer_norm, f"{layer}.ffn_block.norm")

    for i, layer in enumerate(spec.encoder.layer):
        self_attention(layer.self_attention, f"encoder.{i}", "attn_block")
        feed_forward(layer.ffn, f"encoder.{i}")
    for i, layer in enumerate(spec.decoder.layer):
        self_attention(layer.self_attention, f"decoder.{i}", "self_block")
        linear(layer.attention.linear[0], f"decoder.{i}.cross_attn.q_proj")
        linear(layer.attention.linear[1], f"decoder.{i}.cross_attn.kv_proj")
        linear(layer.attention.linear[2], f"decoder.{i}.cross_attn.out_proj")
        norm(layer.attention.layer_norm, f"decoder.{i}.cross_block.norm")
        feed_forward(layer.ffn, f"decoder.{i}")

    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    spec.config.unk_token = pieces[UNK_ID]
    spec.config.bos_token = spec.config.decoder_start_token = pieces[BOS_ID]
    spec.config.eos_token = pieces[EOS_ID]
    spec.config.add_source_eos = True  # our sources end with EOS (data.dataset.Collator)
    spec.config.layer_norm_epsilon = 1e-5  # torch.nn.LayerNorm's
    return spec


def write_engine_model(model: Transformer, pieces: list[str], folder: Path, quantization: str) -> None:
    """The CTranslate2 model files of ``model`` (``model.bin``, ``config.json``, the vocabulary) in
    ``folder``, weights stored as ``quantization``."""
    ctranslate2 = import_ctranslate2()

    class SpecConverter(ctranslate2.converters.Converter):
        def _load(self) -> Any:
            return transformer_spec(model, pieces)

    SpecConverter().convert(str(folder), quantization=quantization, force=True)


def convert(
    model: Transformer, tokenizer: Tokenizer, folder: Path, quantization: str, provenance: dict[str, Any]
) -> None:
    """Write a CTranslate2 model folder of ``model`` (weights stored as ``quantization``), with our
    tokenizer and provenance beside it: what :class:`EngineModel` loads."""
    write_engine_model(model, vocabulary(tokenizer), folder, quantization)
    write_companions(folder, tokenizer, {**provenance, "quantization": quantization})


def is_engine_folder(path: Path) -> bool:
    """``path`` is a folder with a CTranslate2 model in it."""
    return path.is_dir() and (path / MODEL_FILE).is_file()


class EngineModel:
    """A CTranslate2 model folder written by :func:`convert`, loaded for translation.

    ``compute_type`` is CTranslate2's (``default``: as the weights are stored; ``int8``, ``float32``, ...),
    ``threads`` the CPU threads it decodes with (default: the CPUs this process may use).
    """

    def __init__(
        self,
        folder: Path,
        device: str | torch.device = "cpu",
        compute_type: str = "default",
        threads: int | None = None,
    ) -> None:
        ctranslate2 = import_ctranslate2()
        self.folder, self.compute_type = Path(folder), compute_type
        self.provenance = read_provenance(self.folder)
        try:
            self.cfg = TransformerConfig(**self.provenance["model"])
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"{self.folder}: its {PROVENANCE_FILE} has a model section aiayn cannot read ({error})"
            ) from None
        try:
            self.tokenizer = Tokenizer(self.folder / TOKENIZER_FILE)
        except (OSError, RuntimeError) as error:  # missing, or not a sentencepiece model
            raise ValueError(f"{self.folder}: its {TOKENIZER_FILE} cannot be read ({first_line(error)})") from None
        self.pieces = vocabulary(self.tokenizer)
        if self.cfg.vocab_size != len(self.pieces) or self.pieces[EOS_ID] != "</s>":
            raise ValueError(f"{self.folder}: its {TOKENIZER_FILE} is not the model's tokenizer; export it again")
        self.never = [[self.pieces[PAD_ID]], [self.pieces[BOS_ID]]]  # as in our beam search
        device = torch.device(device)
        # On the CPU, one worker per core, each one thread: the equal-length groups below are small
        # batches, which a core each decodes faster than all cores one after another (RESULTS.md).
        workers = (threads or available_cpus()) if device.type == "cpu" else 1
        torch_threads = torch.get_num_threads()  # the engine sets the OpenMP threads both libraries share
        try:
            self.engine = ctranslate2.Translator(
                str(self.folder),
                device=device.type,
                device_index=device.index or 0,
                compute_type=compute_type,
                inter_threads=workers,
                intra_threads=1,
            )
        except (ValueError, RuntimeError) as error:  # a truncated model.bin, a compute type or device it lacks
            raise ValueError(
                f"CTranslate2 cannot load {self.folder} on {device} with compute_type={compute_type} "
                f"({first_line(error)})"
            ) from None
        finally:
            torch.set_num_threads(torch_threads)

    @property
    def arithmetic(self) -> str:
        """What the engine computes in: the compute type asked for, else the weights' stored type."""
        stored = self.provenance.get("quantization")
        return self.compute_type if self.compute_type != "default" else stored if isinstance(stored, str) else "default"

    @property
    def run_config(self) -> dict[str, Any]:
        """The source run's config, as :data:`PROVENANCE_FILE` has it (empty when it has none)."""
        config = self.provenance.get("run_config")
        return config if isinstance(config, dict) else {}

    def translate_ids(self, rows: list[list[int]], options: DecodingOptions) -> list[list[int]]:
        """The best hypothesis of each source (ids without EOS), without EOS, as our beam search returns."""
        groups = list(length_groups(rows, options, self.cfg.max_positions))
        # Every group is queued at once: the engine's workers take them in parallel.
        pending = [
            self.engine.translate_batch(
                [[self.pieces[t] for t in rows[i]] for i in members],
                beam_size=options.beam_size,
                length_penalty=options.alpha if options.beam_size > 1 else 0.0,
                max_decoding_length=limit,
                max_input_length=0,
                min_decoding_length=0,
                suppress_sequences=self.never,
                asynchronous=True,
            )
            for limit, members in groups
        ]
        out: list[list[int]] = [[] for _ in rows]
        for (_, members), results in zip(groups, pending, strict=True):
            for i, result in zip(members, results, strict=True):
                out[i] = [self.tokenizer.sp.piece_to_id(piece) for piece in result.result().hypotheses[0]]
        return out


def engine_of(
    model: Transformer,
    tokenizer: Tokenizer,
    run_config: dict[str, Any],
    device: str | torch.device = "cpu",
    compute_type: str = "default",
) -> EngineModel:
    """``model`` converted on the fly (float32 weights, in a temporary folder) and loaded in the engine,
    which quantizes as ``compute_type`` says."""
    with tempfile.TemporaryDirectory(prefix="aiayn-ct2-") as tmp:
        folder = Path(tmp) / "model"
        convert(model, tokenizer, folder, "float32", {"model": model.cfg.to_dict(), "run_config": run_config})
        return EngineModel(folder, device, compute_type)
