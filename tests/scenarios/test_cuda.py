"""What only a CUDA GPU can check: mixed-precision training steps, SDPA's fused kernels, beam search and
the exported CTranslate2 engine on the GPU. Skipped without one; ``benchmarks/gpu_check.sh`` runs them."""

from __future__ import annotations

import csv
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from aiayn.data.corpus import read_lines
from aiayn.data.tokenizer import Tokenizer
from aiayn.model import DecodingOptions, Transformer, TransformerConfig, beam_search
from helpers.extras import dev_extra
from helpers.runs import SMOKE_RUN_EXTRA, smoke_run

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


def test_sdpa_takes_a_fused_kernel_on_the_gpu() -> None:
    """Restricted to one fused kernel, SDPA raises when it cannot use it: flash attention for the
    unpadded (and causal) batches, memory-efficient attention for a padded one."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = sharp_model(100).cuda().to(torch.bfloat16)
    src = torch.randint(4, 100, (8, 20), device="cuda")
    tgt = torch.randint(4, 100, (8, 15), device="cuda")
    with torch.no_grad():
        reference = model(src, tgt)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            flash = model(src, tgt)
        padded = src.clone()
        padded[:4, 12:] = 0
        padded_reference = model(padded, tgt)
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            efficient = model(padded, tgt)
    assert (flash.float() - reference.float()).abs().max() < 0.1
    assert (efficient.float() - padded_reference.float()).abs().max() < 0.1


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
