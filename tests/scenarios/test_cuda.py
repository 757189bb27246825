"""What only a CUDA GPU can check: mixed-precision training steps, training steps that never make the host
wait, SDPA's fused kernels, beam search and the exported CTranslate2 engine on the GPU. Skipped without
one; ``benchmarks/gpu_check.sh`` runs them."""

from __future__ import annotations

import csv
import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from aiayn.config.compose import compose_run_config
from aiayn.data.corpus import read_lines
from aiayn.data.tokenizer import Tokenizer
from aiayn.experiments.run import train
from aiayn.model import DecodingOptions, Packing, Transformer, TransformerConfig, beam_search
from helpers.extras import dev_extra
from helpers.runs import SMOKE_RUN_EXTRA, resumable_run, smoke_run

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def sharp_model(vocab_size: int, seed: int = 0) -> Transformer:
    """A random model with decided predictions (scaled-up weights), so that float noise decides no tie."""
    torch.manual_seed(seed)
    cfg = TransformerConfig(vocab_size=vocab_size, n_layers=2, d_model=64, d_ff=128, n_heads=4, d_k=16, d_v=16)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        model.src_embed.weight.mul_(4.0)
    return model


@pytest.fixture(autouse=True)
def exact_matmuls() -> Iterator[None]:
    """No TF32: the comparisons below are between float32 computations."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def validation_losses(run_dir: Path) -> list[float]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return [float(row["val/loss"]) for row in csv.DictReader(f) if row.get("val/loss")]


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_training_steps_learn_as_the_cpu_run_does(
    precision: str, corpus_root: Path, cache_dir: Path, smoke_run_dir: Path, tmp_path: Path
) -> None:
    """The session's smoke run (fp32, CPU) again on the GPU in mixed precision. The tiny model has no
    dropout, so only rounding (and, in fp16, the first steps the gradient scaler skips, at warm-up's
    smallest learning rates) can part the two: each validation loss lies within 0.3 of the CPU run's,
    which fell from the untrained ln(1000) = 6.9 to about 5.1."""
    overrides = ["hardware=gpu", f"trainer.precision={precision}", "data.num_workers=0", *SMOKE_RUN_EXTRA]
    command = ["aiayn-train", *smoke_run(corpus_root, cache_dir, *overrides), f"hydra.run.dir={tmp_path}/run"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["steps"] == 12 and results["skipped_steps"] == 0
    on_gpu, on_cpu = validation_losses(tmp_path / "run"), validation_losses(smoke_run_dir)
    assert len(on_gpu) == len(on_cpu) == 3  # after steps 6 and 12, and of the evaluated checkpoint
    assert max(abs(gpu - cpu) for gpu, cpu in zip(on_gpu, on_cpu, strict=True)) < 0.3, (on_gpu, on_cpu)
    if precision == "16-mixed":
        assert results["overflow_steps"] < 12  # the gradient scaler skipped at most a few


def packing(lengths: torch.Tensor, width: int) -> Packing:
    """The packing of a right-padded batch of ``width`` with these real lengths, as the collator makes it."""
    rows = (torch.arange(width, device=lengths.device) < lengths[:, None]).flatten().nonzero().squeeze(1)
    return Packing(rows, torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]), int(lengths.min()))


def attention_calls(model: Transformer, src: torch.Tensor, tgt: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """The three attentions of §3.2.3 as training calls them: encoder self-attention and encoder-decoder
    attention with the source padding mask, the decoder's masked self-attention causal and unmasked."""
    padding = src.eq(0)
    x, y = model._embed(model.src_embed, src), model._embed(model.tgt_embed, tgt)
    memory = model.encoder[0](x, padding)
    source, target = packing(src.ne(0).sum(1), src.size(1)), packing(tgt.ne(0).sum(1), tgt.size(1))
    return {
        "encoder": lambda: model.encoder[0].self_attn(x, key_padding_mask=padding),
        "cross": lambda: model.decoder[0].cross_attn(y, memory, key_padding_mask=padding),
        "encoder packed": lambda: model.encoder[0].self_attn(x, packed=(source, source)),
        "cross packed": lambda: model.decoder[0].cross_attn(y, memory, packed=(target, source)),
        "decoder": lambda: model.decoder[0].self_attn(y, causal=True),
    }


@pytest.mark.parametrize(
    ("kind", "kernel", "refused"),
    [("encoder", "EFFICIENT_ATTENTION", "FLASH_ATTENTION"), ("cross", "EFFICIENT_ATTENTION", "FLASH_ATTENTION"),
     ("encoder packed", "FLASH_ATTENTION", None), ("cross packed", "FLASH_ATTENTION", None),
     ("decoder", "FLASH_ATTENTION", None)],
)  # fmt: skip
def test_each_attention_takes_a_fused_kernel_on_the_gpu(kind: str, kernel: str, refused: str | None) -> None:
    """Restricted to one kernel, SDPA raises when it cannot use it. The decoder's causal self-attention
    takes FlashAttention; attention under a padding mask (every batch passes one: asking whether a batch
    has padding would make the host wait) takes memory-efficient attention, which FlashAttention refuses;
    over packed sequences (model.packed_attention) encoder and encoder-decoder attention take FlashAttention.
    In bf16 the fused kernel is about as exact as the math kernel: each is off the float32 result by the
    rounding of bf16 (an absolute bound would not say that: outputs reach ±7, where bf16's step is 1/32)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = sharp_model(100).cuda()
    src = torch.randint(4, 100, (8, 20), device="cuda")
    src[:4, 12:] = 0
    tgt = torch.randint(4, 100, (8, 15), device="cuda")
    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
        exact = attention_calls(model, src, tgt)[kind]()
    model.to(torch.bfloat16)
    with torch.no_grad():
        call = attention_calls(model, src, tgt)[kind]
        with sdpa_kernel([SDPBackend.MATH]):
            rounded = call()
        with sdpa_kernel([getattr(SDPBackend, kernel)]):
            fused = call()
        if refused is not None:
            with sdpa_kernel([getattr(SDPBackend, refused)]), pytest.raises(RuntimeError):
                call()
    fused_error, math_error = ((out.float() - exact).abs().max().item() for out in (fused, rounded))
    assert 0 < fused_error <= 2 * math_error + 0.01, (fused_error, math_error)


def attention_kind(options: dict[str, Any]) -> str:
    """Causal (the decoder's self-attention in training), masked (encoder self-attention and encoder-decoder
    attention under the source padding mask) or unmasked (cached self-attention in decoding)."""
    if options.get("is_causal"):
        return "causal"
    return "masked" if options.get("attn_mask") is not None else "unmasked"


class KernelChoices(pl.Callback):
    """SDPA's choice of kernel (``torch._fused_sdp_choice``, what ``F.scaled_dot_product_attention`` asks
    itself) for every attention of a run, on the query, key, value and mask the model passes, by phase
    (training, or validation: its teacher-forced loss and its decoding) and :func:`attention_kind`."""

    def __init__(self) -> None:
        self.phase = "setup"
        self.seen: dict[tuple[str, str], set[str]] = {}

    def on_train_batch_start(self, *args: Any) -> None:
        self.phase = "training"

    def on_validation_start(self, *args: Any) -> None:
        self.phase = "validation"

    def recording(self, sdpa: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        from torch.nn.attention import SDPBackend

        names = {backend.value: name for name, backend in SDPBackend.__members__.items()}

        def recorded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> torch.Tensor:
            choice = names[torch._fused_sdp_choice(q, k, v, **options)]
            self.seen.setdefault((self.phase, attention_kind(options)), set()).add(choice)
            return sdpa(q, k, v, **options)

        return recorded


def test_by_default_training_and_decoding_take_flash_or_memory_efficient_attention_never_cudnns(
    corpus_root: Path, cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's default choice (sdpa_backends), with whatever PyTorch would prefer (cuDNN's attention on
    Hopper with a new cuDNN): allowed again here before the run, the run's setup must rule it out. Training
    as hardware=gpu does (bf16 autocast, 8 heads of 64, as model=base) with attention dropout: the causal
    decoder self-attention takes FlashAttention, the attentions under a padding mask memory-efficient
    attention; the validations (their loss, and greedy decoding with a key/value cache) take one of the two."""
    import aiayn.model.attention as attention

    torch.backends.cuda.enable_cudnn_sdp(True)
    choices = KernelChoices()
    monkeypatch.setattr(
        attention, "scaled_dot_product_attention", choices.recording(attention.scaled_dot_product_attention)
    )
    base_heads = ("model.d_model=512", "model.n_heads=8", "model.d_k=64", "model.d_v=64", "model.attn_dropout=0.1")
    extra = ("hardware=gpu", "data.num_workers=0", "trainer.max_steps=3", "checkpoint.every_steps=3", *base_heads)
    overrides = resumable_run(corpus_root, cache_dir, *extra, pairs=200, eval_pairs=8, deterministic=False)
    results = train(compose_run_config(overrides), tmp_path / "run", overrides, callbacks=[choices])
    assert results["steps"] == 3 and not torch.backends.cuda.cudnn_sdp_enabled()
    assert choices.seen[("training", "causal")] == {"FLASH_ATTENTION"}
    assert choices.seen[("training", "masked")] == {"EFFICIENT_ATTENTION"}
    validation = set().union(*(kernels for (phase, _), kernels in choices.seen.items() if phase == "validation"))
    assert validation and validation <= {"FLASH_ATTENTION", "EFFICIENT_ATTENTION"}, choices.seen


@pytest.mark.parametrize("packed", [False, True])
def test_steady_state_training_steps_never_make_the_host_wait(
    corpus_root: Path, cache_dir: Path, tmp_path: Path, packed: bool
) -> None:
    """``torch.cuda.set_sync_debug_mode("error")`` through every training step whose metrics are not
    logged, after the first two: any operation that makes the host wait for the GPU raises (the CPU
    test, tests/training/test_host_syncs.py, counts the reads that would); also with attention over
    packed sequences, whose layout comes with the batch."""
    steps, log_every = 12, 4

    class NoSyncs(pl.Callback):
        checked = 0

        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            step = trainer.global_step + 1
            if step > 2 and step % log_every:
                torch.cuda.set_sync_debug_mode("error")
                self.checked += 1

        def on_train_batch_end(self, *args: Any) -> None:
            torch.cuda.set_sync_debug_mode(0)

    extra = ("hardware=gpu", "data.num_workers=0", f"trainer.max_steps={steps}", f"checkpoint.every_steps={steps}",
             f"model.packed_attention={str(packed).lower()}")  # fmt: skip
    overrides = resumable_run(corpus_root, cache_dir, *extra, pairs=500, eval_pairs=4, log_every=log_every,
                              deterministic=False)  # fmt: skip
    checker = NoSyncs()
    try:
        results = train(compose_run_config(overrides), tmp_path / "run", overrides, callbacks=[checker])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    unlogged = [step for step in range(3, steps + 1) if step % log_every]  # 3, 5, 6, 7, 9, 10, 11
    assert results["steps"] == steps and checker.checked == len(unlogged) == 7


def test_cached_beam_search_equals_recomputing_on_the_gpu() -> None:
    model = sharp_model(60).cuda()
    src = torch.randint(4, 60, (16, 12), device="cuda")
    src[:8, 9:] = 0
    src[torch.arange(16), src.ne(0).sum(dim=1) - 1] = 3
    options = DecodingOptions(beam_size=4, alpha=0.6, max_len_offset=10)
    cached = beam_search(model, src, 2, 3, options)
    recomputed = beam_search(model, src, 2, 3, options, use_cache=False)
    assert [h.tokens for h in cached] == [h.tokens for h in recomputed]
    assert [h.score for h in cached] == pytest.approx([h.score for h in recomputed], abs=1e-4)


def test_the_exported_engine_translates_on_cuda_as_ours(corpus_root: Path, tmp_path: Path) -> None:
    dev_extra("ctranslate2")
    from aiayn.evaluation.translator import Translator
    from aiayn.export.ctranslate2 import engine_of

    lines = read_lines(corpus_root / "train.en")
    tokenizer = Tokenizer.train(lines, 200, tmp_path / "spm.model")
    model = sharp_model(tokenizer.vocab_size).cuda()
    greedy = DecodingOptions(beam_size=1, max_len_offset=10)
    ours = Translator(model, tokenizer, greedy).translate(lines[:100])
    engine = engine_of(model, tokenizer, {}, device="cuda", compute_type="float32")
    assert Translator(engine, tokenizer, greedy).translate(lines[:100]) == ours
    half = engine_of(model, tokenizer, {}, device="cuda", compute_type="float16")
    in_half = Translator(half, tokenizer, greedy).translate(lines[:100])
    assert sum(a == b for a, b in zip(in_half, ours, strict=True)) >= 80
