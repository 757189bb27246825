"""Our Transformer as a Hugging Face ``MarianMTModel``: the same network, weight for weight.

Marian is the paper's model family: post-LN layers (§3.1), ReLU feed-forward networks (§3.3), one
matrix shared by both embeddings and the pre-softmax projection, embeddings scaled by sqrt(d_model)
(§3.4) and fixed sinusoids (§3.5). Two differences are bridged here:

- Marian lays the sinusoids out as [sin of every frequency | cos of every frequency], ours interleave
  them (sin, cos per frequency; :func:`aiayn.model.positional.sinusoidal_table`). Permuting the model
  dimension the same way in every weight that reads or writes it gives an equivalent network whose
  position table is Marian's own: it is what :data:`MODEL_DIM_ORDER` does.
- Self-attention fuses Q, K and V in one projection (``qkv_proj``), encoder-decoder attention K and V
  (``kv_proj``); Marian keeps them apart.

A variant Marian cannot represent (rotary or learned positions, pre-LN, d_k ≠ d_model / h, separate
embeddings) is refused by :func:`~aiayn.export.folder.check_exportable` with one line naming the setting.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from aiayn.export.folder import check_decoding, check_exportable, length_groups, write_companions
from aiayn.extras import require
from aiayn.model import DecodingOptions, Hypothesis, Transformer, TransformerConfig, length_penalty
from aiayn.model.positional import sinusoidal_table


def model_dim_order(d_model: int) -> torch.Tensor:
    """Our model dimensions in Marian's order: the even ones (sines), then the odd ones (cosines)."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def import_transformers() -> Any:
    return require("transformers", "export", "Hugging Face transformers (format=hf)")


def marian_config(cfg: TransformerConfig) -> Any:
    """The ``MarianConfig`` of ``cfg``'s sizes, with our special ids (:mod:`aiayn.data.tokenizer`'s);
    decoding starts from BOS, as ours does. A variant Marian cannot represent is a FieldError."""
    from transformers import MarianConfig

    check_exportable(cfg, "hf")
    return MarianConfig(
        vocab_size=cfg.vocab_size,
        decoder_vocab_size=cfg.vocab_size,
        d_model=cfg.d_model,
        encoder_layers=cfg.encoder_depth,
        decoder_layers=cfg.decoder_depth,
        encoder_attention_heads=cfg.n_heads,
        decoder_attention_heads=cfg.n_heads,
        encoder_ffn_dim=cfg.d_ff,
        decoder_ffn_dim=cfg.d_ff,
        activation_function="relu",
        max_position_embeddings=cfg.max_positions,
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
        dropout=cfg.dropout,
        attention_dropout=cfg.attn_dropout,
        activation_dropout=cfg.activation_dropout,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=BOS_ID,
        decoder_start_token_id=BOS_ID,
        forced_eos_token_id=EOS_ID,  # at the length limit EOS is forced, as our beam search does
    )


def marian_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """``model``'s weights under MarianMTModel's names, in Marian's order of the model dimension."""
    cfg = model.cfg
    check_exportable(cfg, "hf")  # our names and shapes below are those of a model Marian can be
    order = model_dim_order(cfg.d_model)
    d = cfg.d_model
    ours = {name: tensor.detach().float().cpu() for name, tensor in model.state_dict().items()}

    def reads(weight: torch.Tensor) -> torch.Tensor:  # a projection from the model dimension
        return weight[:, order].contiguous()

    def writes(tensor: torch.Tensor) -> torch.Tensor:  # a projection into it (weight rows, or a bias), a norm
        return tensor[order].contiguous()

    out: dict[str, torch.Tensor] = {}
    embedding = reads(ours["src_embed.weight"])
    for name in ("model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
                 "lm_head.weight"):  # fmt: skip
        out[name] = embedding
    out["final_logits_bias"] = torch.zeros(1, cfg.vocab_size)
    positions = sinusoidal_table(cfg.max_positions, d)[:, order].contiguous()
    out["model.encoder.embed_positions.weight"] = positions
    out["model.decoder.embed_positions.weight"] = positions.clone()

    def attention(ours_prefix: str, marian_prefix: str, fused: bool) -> None:
        if fused:
            weight, bias = ours[f"{ours_prefix}.qkv_proj.weight"], ours[f"{ours_prefix}.qkv_proj.bias"]
        else:
            weight = torch.cat([ours[f"{ours_prefix}.q_proj.weight"], ours[f"{ours_prefix}.kv_proj.weight"]])
            bias = torch.cat([ours[f"{ours_prefix}.q_proj.bias"], ours[f"{ours_prefix}.kv_proj.bias"]])
        for letter, w, b in zip("qkv", weight.split(d), bias.split(d), strict=True):
            out[f"{marian_prefix}.{letter}_proj.weight"] = reads(w)
            out[f"{marian_prefix}.{letter}_proj.bias"] = b.contiguous()
        out[f"{marian_prefix}.out_proj.weight"] = writes(ours[f"{ours_prefix}.out_proj.weight"])
        out[f"{marian_prefix}.out_proj.bias"] = writes(ours[f"{ours_prefix}.out_proj.bias"])

    def norm(ours_prefix: str, marian_prefix: str) -> None:
        for part in ("weight", "bias"):
            out[f"{marian_prefix}.{part}"] = writes(ours[f"{ours_prefix}.norm.{part}"])

    def feed_forward(ours_prefix: str, marian_prefix: str) -> None:
        out[f"{marian_prefix}.fc1.weight"] = reads(ours[f"{ours_prefix}.ffn.w1.weight"])
        out[f"{marian_prefix}.fc1.bias"] = ours[f"{ours_prefix}.ffn.w1.bias"]
        out[f"{marian_prefix}.fc2.weight"] = writes(ours[f"{ours_prefix}.ffn.w2.weight"])
        out[f"{marian_prefix}.fc2.bias"] = writes(ours[f"{ours_prefix}.ffn.w2.bias"])

    for i in range(cfg.encoder_depth):  # as deep as the decoder (check_exportable)
        src, dst = f"encoder.{i}", f"model.encoder.layers.{i}"
        attention(f"{src}.self_attn", f"{dst}.self_attn", fused=True)
        norm(f"{src}.attn_block", f"{dst}.self_attn_layer_norm")
        feed_forward(src, dst)
        norm(f"{src}.ffn_block", f"{dst}.final_layer_norm")
        src, dst = f"decoder.{i}", f"model.decoder.layers.{i}"
        attention(f"{src}.self_attn", f"{dst}.self_attn", fused=True)
        norm(f"{src}.self_block", f"{dst}.self_attn_layer_norm")
        attention(f"{src}.cross_attn", f"{dst}.encoder_attn", fused=False)
        norm(f"{src}.cross_block", f"{dst}.encoder_attn_layer_norm")
        feed_forward(src, dst)
        norm(f"{src}.ffn_block", f"{dst}.final_layer_norm")
    return out


def to_marian(model: Transformer) -> Any:
    """A ``MarianMTModel`` (eval mode) that computes what ``model`` computes."""
    from transformers import MarianMTModel

    hf = MarianMTModel(marian_config(model.cfg))
    weights = marian_state_dict(model)
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    if unexpected or missing:
        raise RuntimeError(f"MarianMTModel weights do not match: missing {missing}, unexpected {unexpected}")
    hf.generation_config.num_beams = 4  # §6.1, with α = 0.6 in decoding.length_penalty=power (generate_search)
    hf.generation_config.length_penalty = 0.6
    hf.generation_config.early_stopping = "never"  # a sentence ends when no live beam can win, as in ours
    hf.generation_config.suppress_tokens = [PAD_ID, BOS_ID]  # never generated, as in our beam search
    hf.generation_config.max_length = model.cfg.max_positions
    return hf.eval()


@torch.no_grad()
def generate_search(
    hf: Any, rows: list[list[int]], options: DecodingOptions, tokenizer: Tokenizer, nbest: int = 1
) -> list[list[Hypothesis]]:
    """``generate``'s ``nbest`` best hypotheses of each source (ids without EOS), best first, with our
    options, as :func:`aiayn.model.nbest_search` gives them (tokens without BOS and EOS, score, log P).

    Mapped: ``beam_size`` → ``num_beams``; ``nbest`` → ``num_return_sequences``; ``alpha`` under
    ``power`` → ``length_penalty``: generate's score is log P / |Y|^α with |Y| the tokens generated after
    the decoder start token (BOS), EOS included, which is ours; ``early_stopping="never"``: a sentence ends
    when no live beam can still win, at most ``max_length`` long, which is ours (generate's default
    stops sooner by a guess); ``min_len`` → ``min_new_tokens``; ``no_repeat_ngram`` →
    ``no_repeat_ngram_size``. Like ours, generate bans tokens after the log-softmax. Refused
    (:func:`~aiayn.export.folder.check_decoding`): GNMT's penalty with α > 0, and sampling.

    ``generate`` takes one length limit per call, so sources go in groups of one length, each allowed
    (source tokens + EOS) + ``max_len_offset`` tokens before the EOS that ``forced_eos_token_id`` puts at
    the limit, as our beam search does (but with probability 1, where ours adds EOS's log-probability).
    Scores are recomputed by one teacher-forced pass: log P of the tokens and EOS, as ours (where the
    limit forces EOS, generate's own score leaves its term out), over the penalty (none for one beam).
    """
    check_decoding(options, nbest, "Hugging Face generate")
    device = next(hf.parameters()).device
    beam = options.beam_size > 1
    alpha = options.alpha if beam else 0.0
    out: list[list[Hypothesis]] = [[] for _ in rows]
    for limit, members in length_groups(rows, options, hf.config.max_position_embeddings):
        src = torch.tensor([rows[i] + [tokenizer.eos_id] for i in members], device=device)
        found = hf.generate(
            input_ids=src,
            num_beams=options.beam_size,
            num_return_sequences=nbest,
            **({"length_penalty": alpha, "early_stopping": "never"} if beam else {}),
            max_new_tokens=limit + 1,  # the last one is the forced EOS
            max_length=None,
            min_new_tokens=min(options.min_len, limit),
            no_repeat_ngram_size=options.no_repeat_ngram,
            do_sample=False,
        )
        generated = found[:, 1:]  # (B * nbest, T): after BOS, padded after EOS
        lengths = generated.ne(tokenizer.eos_id).cumprod(dim=1).sum(dim=1)  # tokens before EOS
        # log P(tokens + EOS) by teacher forcing, as ours counts it (generate's forced EOS has probability 1)
        logits = hf(input_ids=src.repeat_interleave(nbest, dim=0), decoder_input_ids=found[:, :-1]).logits
        chosen = logits.float().log_softmax(dim=-1).gather(2, generated[:, :, None]).squeeze(2)
        within = torch.arange(generated.size(1), device=device)[None, :] <= lengths[:, None]  # EOS included
        log_probs = chosen.masked_fill(~within, 0.0).sum(dim=1)
        scores = (log_probs / length_penalty(lengths.double() + 1.0, alpha, "power")).tolist()
        log_probs = log_probs.tolist()
        for r, (row, length) in enumerate(zip(generated.tolist(), lengths.tolist(), strict=True)):
            out[members[r // nbest]].append(Hypothesis(row[:length], scores[r], log_probs[r]))
    return out


def generate_ids(hf: Any, rows: list[list[int]], options: DecodingOptions, tokenizer: Tokenizer) -> list[list[int]]:
    """``generate``'s best hypothesis of each source (ids without EOS), without EOS (:func:`generate_search`)."""
    return [found[0].tokens for found in generate_search(hf, rows, options, tokenizer)]


def save_tokenizer(tokenizer: Tokenizer, folder: Path) -> None:
    """``MarianTokenizer`` files from our joint sentencepiece model: one model for both sides
    (``source.spm``, ``target.spm``) and ``vocab.json``, whose ids are the sentencepiece ids."""
    from transformers import MarianTokenizer

    model = tokenizer.to_bytes()
    for name in ("source.spm", "target.spm"):
        (folder / name).write_bytes(model)
    sp = tokenizer.sp
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    pieces = {i: sp.id_to_piece(i) for i in (tokenizer.pad_id, tokenizer.unk_id, tokenizer.eos_id)}
    hf_tokenizer = MarianTokenizer(
        str(folder / "source.spm"),
        str(folder / "target.spm"),
        str(folder / "vocab.json"),
        pad_token=pieces[tokenizer.pad_id],
        unk_token=pieces[tokenizer.unk_id],
        eos_token=pieces[tokenizer.eos_id],
        separate_vocabs=False,
        model_max_length=1 << 30,
    )
    hf_tokenizer.save_pretrained(str(folder))


def save_marian(model: Transformer, tokenizer: Tokenizer, folder: Path, provenance: dict[str, Any]) -> None:
    """Write a ``from_pretrained`` folder: config, safetensors weights, generation settings (the
    paper's beam 4, α = 0.6 as our ``power`` penalty), the tokenizer files and
    :func:`~aiayn.export.folder.write_companions`'s."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    hf = to_marian(model)
    hf.save_pretrained(str(folder))
    save_tokenizer(tokenizer, folder)
    write_companions(folder, tokenizer, provenance)
