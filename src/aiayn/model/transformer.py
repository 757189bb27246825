"""The encoder-decoder Transformer of §3 (Figure 1)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from aiayn.model.attention import Packing
from aiayn.model.components import build
from aiayn.model.config import TransformerConfig
from aiayn.model.dropout import Dropout
from aiayn.model.layers import DecoderLayer, EncoderLayer, norm


@dataclass
class DecoderState:
    """Key/value caches of incremental decoding, one dict per decoder layer, and the decoded length."""

    layers: list[dict[str, dict[str, torch.Tensor]]]
    length: int = 0

    def select(self, rows: torch.Tensor, cross: bool = True) -> None:
        """Keep (and reorder) the batch rows ``rows`` of every cache, as beam search does after each step.

        ``cross=False`` leaves the encoder-decoder caches alone: they only depend on the sentence, so
        reordering beams within their sentences does not change them.
        """
        for layer in self.layers:
            for kind, cache in layer.items():
                if cross or kind == "self":
                    for name, tensor in cache.items():
                        cache[name] = tensor.index_select(0, rows)


class Transformer(nn.Module):
    """Encoder and decoder stacks of ``n_layers`` each (or ``encoder_layers`` and ``decoder_layers``),
    with embeddings and the pre-softmax projection.

    With ``share_embeddings`` one matrix serves as source embedding, target embedding and the
    pre-softmax linear layer (§3.4), which needs a joint source-target vocabulary. Attention,
    feed-forward, normalisation and positions are the components ``cfg`` names (the paper's by default,
    :mod:`aiayn.model.components`).
    """

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.embed_scale = math.sqrt(d)  # §3.4: embeddings are multiplied by sqrt(d_model)
        self.src_embed = nn.Embedding(cfg.vocab_size, d, padding_idx=cfg.pad_id)
        if cfg.share_embeddings:
            self.tgt_embed = self.src_embed
        else:
            self.tgt_embed = nn.Embedding(cfg.vocab_size, d, padding_idx=cfg.pad_id)
        self.output_proj = nn.Linear(d, cfg.vocab_size, bias=False)
        if cfg.share_embeddings:
            self.output_proj.weight = self.src_embed.weight

        # One for the model: added to the embeddings (§3.5), or acting inside every self-attention.
        self.positions = build(
            "positional",
            cfg.positional_spec,
            d_model=d,
            n_heads=cfg.n_heads,
            d_k=cfg.d_k,
            max_positions=cfg.max_positions,
        )
        self.embed_dropout = Dropout(cfg.dropout)  # §5.4: dropout on embeddings + positions

        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_depth))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_depth))
        # Pre-LN stacks leave their output un-normalised; the usual final normalisation closes them.
        self.encoder_norm = norm(cfg) if cfg.norm_first else nn.Identity()
        self.decoder_norm = norm(cfg) if cfg.norm_first else nn.Identity()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform projections, zero biases, embeddings N(0, d_model^-0.5); a positional
        component's parameters as it initialised them.

        With that embedding scale the shared matrix gives inputs of unit variance after the sqrt(d_model)
        factor and, used as the output projection, logits of about unit variance: the initial softmax
        is near uniform and the first loss is close to log(vocab_size).
        """
        for name, param in self.named_parameters():
            if "embed" in name or name.startswith("positions."):  # positions initialise their own
                continue
            if param.dim() > 1:
                nn.init.xavier_uniform_(param)
            elif name.endswith("bias"):
                nn.init.zeros_(param)
        for embedding in {self.src_embed, self.tgt_embed}:
            nn.init.normal_(embedding.weight, std=self.cfg.d_model**-0.5)
            with torch.no_grad():
                embedding.weight[self.cfg.pad_id].zero_()
        if not self.cfg.share_embeddings:
            nn.init.normal_(self.output_proj.weight, std=self.cfg.d_model**-0.5)

    def _embed(self, embedding: nn.Embedding, tokens: torch.Tensor, offset: int = 0) -> torch.Tensor:
        x = embedding(tokens) * self.embed_scale  # (B, T, d_model)
        positions = self.positions.embed(tokens.size(1), offset)
        if positions is not None:
            x = x + positions
        return self.embed_dropout(x)

    def encode(self, src: torch.Tensor, source: Packing | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Source ids (B, S) → encoder output (B, S, d_model) and the source padding mask (B, S).
        ``source``: self-attention over the packed source sequences (:class:`Packing`) instead."""
        # Always the mask, also for a batch without padding: asking whether it has any would make the host
        # wait for the device (and break a compiled graph in two). SDPA picks the same kernel on the CPU;
        # a GPU's FlashAttention takes no mask, so the rare batch of equal lengths moves to another kernel.
        src_padding = src.eq(self.cfg.pad_id)
        x = self._embed(self.src_embed, src)
        for layer in self.encoder:
            x = layer(x, src_padding, source, self.positions)
        return self.encoder_norm(x), src_padding

    def decode(
        self,
        tgt_in: torch.Tensor,
        memory: torch.Tensor,
        src_padding: torch.Tensor | None,
        state: DecoderState | None = None,
        last_only: bool = False,
        rows: torch.Tensor | None = None,
        packed: tuple[Packing, Packing] | None = None,
    ) -> torch.Tensor:
        """Shifted target ids (B, T) → logits (B, T, vocab), or (B, 1, vocab) for the last position only.

        With ``state``, ``tgt_in`` holds only the next position (B, 1): earlier positions are read from
        the key/value caches in ``state``, which this call extends. ``last_only`` skips the output
        projection of earlier positions, which decoding without a cache does not need. ``rows`` (N,)
        picks positions of the flattened (B * T) ones and gives their logits only, (N, vocab): training
        projects the real target positions, not the padding (the projection to the vocabulary and the
        softmax are the largest position-wise work of a step). ``packed`` (the target's and the source's
        :class:`Packing`): encoder-decoder attention over packed sequences instead of under ``src_padding``.
        """
        offset = state.length if state is not None else 0
        x = self._embed(self.tgt_embed, tgt_in, offset)
        for i, layer in enumerate(self.decoder):
            x = layer(x, memory, src_padding, state.layers[i] if state is not None else None, packed, self.positions)
        if state is not None:
            state.length += tgt_in.size(1)
        if last_only:
            x = x[:, -1:]
        if rows is not None:
            x = x.flatten(0, 1).index_select(0, rows)
        return self.output_proj(self.decoder_norm(x))

    def init_state(self) -> DecoderState:
        """An empty incremental-decoding state for :meth:`decode`."""
        return DecoderState(layers=[{} for _ in self.decoder])

    @torch.no_grad()
    def attention_maps(self, src: torch.Tensor, tgt_in: torch.Tensor) -> dict[str, torch.Tensor]:
        """Attention weights of one teacher-forced pass, each (n_layers, B, n_heads, queries, keys), for
        ``encoder_self``, ``decoder_self`` and ``cross`` attention (§3.2.3), in eval mode (no dropout). An
        attention component records its weights when it has a ``recorded`` attribute (None, or a list it
        appends each pass's weights to, as :class:`~aiayn.model.attention.MultiHeadAttention` does); a
        kind whose modules do not is left out."""
        kinds = {
            "encoder_self": [layer.self_attn for layer in self.encoder],
            "decoder_self": [layer.self_attn for layer in self.decoder],
            "cross": [layer.cross_attn for layer in self.decoder],
        }
        kinds = {kind: layers for kind, layers in kinds.items() if all(hasattr(m, "recorded") for m in layers)}
        modules = [module for layers in kinds.values() for module in layers]
        was_training = self.training
        self.eval()
        for module in modules:
            module.recorded = []
        try:
            self(src, tgt_in)
            return {kind: torch.stack([m.recorded[0] for m in layers]) for kind, layers in kinds.items()}
        finally:
            for module in modules:
                module.recorded = None
            self.train(was_training)

    def forward(
        self,
        src: torch.Tensor,
        tgt_in: torch.Tensor,
        rows: torch.Tensor | None = None,
        packed: tuple[Packing, Packing] | None = None,
    ) -> torch.Tensor:
        """Teacher-forced logits (B, T, vocab), or (N, vocab) at the flattened positions ``rows``.
        ``packed`` (the target's and the source's :class:`Packing`): the encoder's self-attention and the
        encoder-decoder attention run over packed sequences, without padding masks."""
        memory, src_padding = self.encode(src, packed[1] if packed is not None else None)
        return self.decode(tgt_in, memory, src_padding, rows=rows, packed=packed)
