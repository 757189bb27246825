"""Our Transformer as a CTranslate2 model, and translation through that engine.

CTranslate2's converter for Hugging Face Marian folders assumes Marian's own vocabulary conventions:
``<pad>`` is the last token (it drops the last row of the embeddings) and the decoder starts from a zero
vector instead of a token's embedding. Our models start decoding from BOS's embedding, with PAD first,
so :func:`convert` fills CTranslate2's own ``TransformerSpec`` from the checkpoint's weights instead,
through the engine's converter base class (its validation, quantization and file format). The spec
takes our layout as it is: the fused Q/K/V projection, our position table, pre-LN or post-LN.

The engine appends EOS to every source itself (``add_source_eos`` in its ``config.json``, as for
CTranslate2's fairseq and Marian conversions): give it the sentencepiece pieces without ``</s>``. The
pieces of a Hugging Face tokenizer end in ``</s>``, which the engine would double, and that changes the
translations; the folder's README.md, its model card, says so where a user looks (:data:`USAGE`).

:meth:`EngineModel.search` decodes token ids with the engine, with our decoding options (see its
docstring for what maps to what, and what is refused).
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
    TOKENIZER_BYTES,
    TOKENIZER_FILE,
    check_decoding,
    check_exportable,
    check_plain_files,
    length_groups,
    read_provenance,
    write_companions,
)
from aiayn.extras import require
from aiayn.files import read_plain_file
from aiayn.machine import available_cpus
from aiayn.model import DecodingOptions, Hypothesis, Transformer, TransformerConfig, length_penalty

QUANTIZATIONS = ("float32", "int8", "int8_float16", "int8_float32", "float16", "bfloat16", "int8_bfloat16")
MODEL_FILE = "model.bin"
EOS = "</s>"  # our EOS piece (aiayn.data.tokenizer), the engine's end token
# EngineModel.search: a sentence ends once PATIENCE × beam size hypotheses have (the engine's default is 1).
# Beam 4, power penalty, the tiny test model, 400 sentences: the best lines of ours in 395 (α = 0.6) and 394
# (α = 1) sentences with 1, in all with 2; the 3 best of ours in 344 and 317 with 1, 399 with 2; 1.2-1.6x the time.
PATIENCE = 2
NBEST_ALPHA = 1e-6  # |Y|^1e-6 for α = 0 with n-best: under 1e-5 of a score, but no early stop
USAGE = """**Give the engine the source's sentencepiece pieces without `</s>`.** The engine appends `</s>` itself
(`"add_source_eos": true` in config.json). The pieces of a Hugging Face tokenizer end in `</s>`, as in
CTranslate2's guide for Hugging Face Marian models: drop that last `</s>`, or the source ends in two and
the translations are not the model's (`aiayn-translate` gives the model's).

```python
import ctranslate2, sentencepiece as spm

folder = "path/to/this/folder"
translator = ctranslate2.Translator(folder, device="cpu")
sp = spm.SentencePieceProcessor(model_file=f"{folder}/sentencepiece.model")
source = sp.encode("A man is riding a bike.", out_type=str)  # no "</s>": the engine adds it
result = translator.translate_batch(
    [source], beam_size=4, length_penalty=0.6, return_end_token=True, patience=2,
    max_decoding_length=len(source) + 51,
)
print(sp.decode([piece for piece in result[0].hypotheses[0] if piece != "</s>"]))
```

These settings are aiayn-translate's with `decoding.length_penalty=power` (beam 4, α = 0.6, at most
source length + 50 tokens before `</s>`): the score is log P / |Y|^α, where |Y| counts `</s>` only with
`return_end_token=True`; with `patience=2` a sentence ends once 8 hypotheses have, not 4, so that one
ended early rarely wins over a better one still searched. aiayn's default penalty, GNMT's
((5 + |Y|) / 6)^α, has no CTranslate2 equivalent. `aiayn.json` records the source checkpoint, the model
and the run's config; `sentencepiece.model` is the model's tokenizer. See aiayn's docs/decoding.md, "Use
the model elsewhere".
"""


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
        (cfg.encoder_depth, cfg.decoder_depth),
        cfg.n_heads,
        pre_norm=cfg.norm_first,
        activation=common_spec.Activation.RELU,
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
    tokenizer and provenance beside it: what :class:`EngineModel` loads (aiayn-export adds the model card,
    whose :data:`USAGE` says which source pieces the engine takes)."""
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
        check_plain_files(self.folder)
        self.provenance = read_provenance(self.folder)
        try:
            self.cfg = TransformerConfig(**self.provenance["model"])
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"{self.folder}: its {PROVENANCE_FILE} has a model section aiayn cannot read ({error})"
            ) from None
        try:
            self.tokenizer = Tokenizer.from_bytes(read_plain_file(self.folder / TOKENIZER_FILE, TOKENIZER_BYTES))
        except (OSError, RuntimeError) as error:  # missing, not a plain file, or not a sentencepiece model
            raise ValueError(f"{self.folder}: its {TOKENIZER_FILE} cannot be read ({first_line(error)})") from None
        self.pieces = vocabulary(self.tokenizer)
        if self.cfg.vocab_size != len(self.pieces) or self.pieces[EOS_ID] != EOS:
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

    def search(
        self, rows: list[list[int]], options: DecodingOptions, nbest: int = 1, seed: int = 0
    ) -> list[list[Hypothesis]]:
        """The ``nbest`` best hypotheses of each source (ids without EOS), best first, by the engine's
        beam search (greedy for one beam), as :func:`aiayn.model.nbest_search` gives them: tokens without
        BOS and EOS, ``score`` the engine's (``return_scores``: log P / |Y|^α) and ``log_prob`` log P
        (that score times |Y|^α; the engine's translator returns no log-probability of its own).

        Mapped: ``beam_size``; ``nbest`` → ``num_hypotheses``; ``alpha`` under ``power`` →
        ``length_penalty`` with ``return_end_token``, so that |Y| counts EOS as ours does (no penalty
        with one beam, as ours); ``min_len`` → ``min_decoding_length``; ``no_repeat_ngram`` →
        ``no_repeat_ngram_size``; ``max_len_offset`` → ``max_decoding_length``, one per group of one
        source length. Refused (:func:`check_options`): GNMT's penalty with α > 0, and sampling, so
        ``seed`` (accepted as :func:`aiayn.model.search` takes it) decides nothing here.

        Where ours and the engine differ (docs/decoding.md): the engine stops a sentence once
        :data:`PATIENCE` × beam size hypotheses have ended (ours: once no live beam can still win); it
        bans tokens (PAD, BOS, EOS before ``min_len``, repeated n-grams) before the softmax, so the
        other tokens' log-probabilities rise where ours keep theirs; and it cuts a hypothesis at the
        length limit without EOS, where ours ends it with EOS: such a hypothesis gets EOS's
        log-probability here (the engine's ``score_batch``), so that its score is ours.
        """
        check_options(options, nbest)
        groups = list(length_groups(rows, options, self.cfg.max_positions))
        alpha = options.alpha if options.beam_size > 1 else 0.0  # one beam: the arg-max, as ours
        # With no penalty the engine stops once its best hypothesis has ended: right for the best,
        # not for the next ones. A negligible exponent makes it count ended hypotheses instead.
        engine_alpha = alpha if alpha > 0 or nbest == 1 else NBEST_ALPHA
        # Every group is queued at once: the engine's workers take them in parallel.
        pending = [
            self.engine.translate_batch(
                [[self.pieces[t] for t in rows[i]] for i in members],
                beam_size=options.beam_size,
                patience=PATIENCE,
                num_hypotheses=nbest,
                length_penalty=engine_alpha,
                return_end_token=True,  # EOS counts in |Y|, as in ours
                return_scores=True,
                max_decoding_length=limit,
                min_decoding_length=min(options.min_len, limit),  # the engine wants min <= max
                no_repeat_ngram_size=options.no_repeat_ngram,
                max_input_length=0,
                suppress_sequences=self.never,
                asynchronous=True,
            )
            for limit, members in groups
        ]
        found: list[list[tuple[list[str], float]]] = [[] for _ in rows]
        for (_, members), results in zip(groups, pending, strict=True):
            for i, result in zip(members, results, strict=True):
                done = result.result()
                found[i] = list(zip(done.hypotheses, done.scores, strict=True))
        # A hypothesis cut at the length limit has no EOS, which ours would end it with: EOS's term is added.
        cut = [(i, n) for i, pairs in enumerate(found) for n, (pieces, _) in enumerate(pairs) if pieces[-1:] != [EOS]]
        sources = [[self.pieces[t] for t in rows[i]] for i, _ in cut]
        ends = self.engine.score_batch(sources, [found[i][n][0] for i, n in cut], max_input_length=0) if cut else []
        eos_log_prob = {place: result.log_probs[-1] for place, result in zip(cut, ends, strict=True)}
        out: list[list[Hypothesis]] = []
        for i, pairs in enumerate(found):
            out.append([])
            for n, (pieces, score) in enumerate(pairs):
                tokens = [self.tokenizer.sp.piece_to_id(piece) for piece in pieces if piece != EOS]
                # log P: the engine's score times the penalty it divided by (|Y| with EOS, if any, as it counts)
                log_prob = score * length_penalty(float(len(pieces)), engine_alpha, "power")
                log_prob += eos_log_prob.get((i, n), 0.0)
                out[i].append(
                    Hypothesis(tokens, log_prob / length_penalty(len(tokens) + 1.0, alpha, "power"), log_prob)
                )
        return out


def check_options(options: DecodingOptions, nbest: int = 1) -> None:
    """What :meth:`EngineModel.search` refuses, in one line, before any work (:func:`check_decoding`): GNMT's
    penalty with α > 0 and sampling. The engine's sampler draws from a generator per worker thread,
    seeded once when the thread first samples: a sentence's draws depend on its batch, on the worker
    that decodes it and on what that worker drew before, and a later seed reaches no running worker."""
    check_decoding(options, nbest, "CTranslate2")


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
