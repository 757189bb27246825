"""Beam-search speed: our cached search against recomputing the prefix, Hugging Face `generate` and
CTranslate2, on random weights or on a trained checkpoint's real translations.

Without `--checkpoint`: ours (cached and recomputing) and `generate` decode the same random source
batches with beam 4 on models of the same size (the default `small`: 3+3 layers, d_model 256, 4 heads,
d_ff 1024, 8000-token shared vocabulary, random weights).
EOS is made (almost) impossible until the length limit in every contestant, so each one runs exactly the
same number of decoder steps per sentence. Contestants alternate, in this one process, after a warm-up.

With `--checkpoint` (a .ckpt of aiayn-train or aiayn-average) and `--source`/`--reference` files: ours,
`generate` on the exported MarianMTModel, and CTranslate2 float32 and int8 (the checkpoint converted by
`aiayn.export`) translate the same sentences with beam 4, α = 0.6, source length + 50, each through
its own batching of equal-length groups or of 8192 source tokens; printed are sentences/s, the ratio to
ours, sacreBLEU and the share of lines identical to ours.
Needs the `bench` extra (`pip install -e ".[bench]"`: `transformers` and `ctranslate2`).
With `--ensemble`, also an ensemble of two models of that size (the mean of their log-probabilities at
each step; each with its own caches): its cost against one model. With `--checkpoint` and `--mbr`, also
minimum Bayes risk decoding as `decoding=mbr` makes it (beam 8's 8 best and 8 draws, chrF): its cost per
sentence against the beam, and its sacreBLEU.
Usage: python benchmarks/decoding.py [--sentences 128] [--src-len 16] [--out-len 24] [--rounds 3] [--ensemble]
       python benchmarks/decoding.py --checkpoint <run>/checkpoints/averaged.ckpt \
           --source <multi30k>/test_2016_flickr.en.gz --reference <multi30k>/test_2016_flickr.de.gz
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from aiayn.data.corpus import read_parallel
from aiayn.evaluation.translator import Translator
from aiayn.model import PAPER_DECODING, DecodingOptions, Transformer, TransformerConfig, beam_search
from aiayn.model.flops import count_parameters
from aiayn.scoring import corpus_scores
from aiayn.training.checkpoints import load_model

PAD, BOS, EOS = 0, 2, 3
SMALL = {"vocab_size": 8000, "n_layers": 3, "d_model": 256, "d_ff": 1024, "n_heads": 4, "d_k": 64, "d_v": 64}
NO_EOS = -1.0e4  # added to EOS's logit: finite, so EOS still closes a sentence at the length limit


class LateEosTransformer(Transformer):
    """Our model with EOS pushed down, so that only the length limit ends a sentence."""

    def decode(self, *args, **kwargs) -> torch.Tensor:  # type: ignore[override]
        logits = super().decode(*args, **kwargs)
        logits[..., EOS] += NO_EOS
        return logits


def engine_search(
    model: Transformer, batches: tuple[torch.Tensor, ...], out_len: int, device: torch.device, compute_type: str
) -> Callable[[], None]:
    """CTranslate2's beam search on ``model`` (converted by aiayn.export), EOS kept off by its minimum
    length: ``out_len`` decoder steps per sentence, as the others run."""
    import ctranslate2

    from aiayn.export.ctranslate2 import write_engine_model

    pieces = ["<pad>", "<unk>", "<s>", "</s>", *(f"w{i}" for i in range(4, SMALL["vocab_size"]))]
    with tempfile.TemporaryDirectory(prefix="aiayn-ct2-bench-") as folder:  # read whole when loaded
        write_engine_model(model, pieces, Path(folder), "float32")
        threads = torch.get_num_threads()
        engine = ctranslate2.Translator(folder, device=device.type, compute_type=compute_type, intra_threads=threads)
    sources = [[[pieces[t] for t in row[:-1]] for row in batch.tolist()] for batch in batches]  # EOS: added

    def run() -> None:
        for batch in sources:
            results = engine.translate_batch(
                batch, beam_size=4, length_penalty=0.6, min_decoding_length=out_len, max_decoding_length=out_len
            )
            assert all(len(result.hypotheses[0]) == out_len for result in results)

    return run


def timed_rounds(contestants: dict[str, Callable[[], object]], rounds: int, items: int) -> dict[str, list[float]]:
    """Items per second of each contestant in ``rounds`` alternating rounds, after one warm-up each."""
    timings: dict[str, list[float]] = {name: [] for name in contestants}
    for run in contestants.values():
        run()  # warm-up
    for _ in range(rounds):
        for name, run in contestants.items():
            start = time.perf_counter()
            run()
            timings[name].append(items / (time.perf_counter() - start))
    return timings


def real_text(args: argparse.Namespace) -> None:
    """Ours, ``generate`` and CTranslate2 on a trained checkpoint's translations of ``args.source``."""
    from aiayn.export.ctranslate2 import engine_of
    from aiayn.export.marian import generate_ids, to_marian

    model, tokenizer, _ = load_model(args.checkpoint)
    sources, references = read_parallel(args.source, args.reference)
    if args.sentences:
        sources, references = sources[: args.sentences], references[: args.sentences]
    options = replace(PAPER_DECODING, length_penalty="power")  # the engines' penalty: equal lines are possible
    translators: dict[str, Callable[[list[str]], list[str]]] = {}
    translators["aiayn"] = Translator(model, tokenizer, options).translate
    if not args.skip_hf:
        hf = to_marian(model)
        translators["transformers generate"] = lambda lines: tokenizer.decode(
            generate_ids(hf, tokenizer.encode(lines), options, tokenizer)
        )
    for compute_type in ("float32", "int8"):
        engine = engine_of(model, tokenizer, {}, compute_type=compute_type)
        translators[f"ctranslate2 {compute_type}"] = Translator(engine, tokenizer, options).translate
    if args.mbr:  # decoding=mbr's settings
        mbr = replace(PAPER_DECODING, beam_size=8, mbr="chrf", mbr_samples=8)
        translators["aiayn mbr chrf (8 best + 8 draws)"] = Translator(model, tokenizer, mbr).translate
    outputs: dict[str, list[str]] = {}

    def contestant(name: str) -> Callable[[], None]:
        def run() -> None:
            outputs[name] = translators[name](sources)

        return run

    timings = timed_rounds({name: contestant(name) for name in translators}, args.rounds, len(sources))
    speeds = {name: statistics.median(values) for name, values in timings.items()}
    bleu = {name: corpus_scores(hypotheses, references)["sacrebleu"] for name, hypotheses in outputs.items()}
    same = {name: sum(a == b for a, b in zip(hyps, outputs["aiayn"], strict=True)) / len(sources)
            for name, hyps in outputs.items()}  # fmt: skip
    print(
        f"{args.checkpoint}: {len(sources)} sentences of {args.source}, beam 4, α 0.6, source length + 50; "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} cores; {count_parameters(model) / 1e6:.2f}M parameters"
    )
    print(f"{'decoder':<24} {'sentences/s':>12} {'vs aiayn':>9} {'sacreBLEU':>10} {'lines as aiayn':>15}")
    for name, speed in speeds.items():
        print(f"{name:<24} {speed:>12.1f} {speed / speeds['aiayn']:>8.2f}x {bleu[name]:>10.2f} {same[name]:>14.1%}")
    speedup = {name: speed / speeds["aiayn"] for name, speed in speeds.items()}
    print(json.dumps({"sentences_per_s": speeds, "speedup": speedup, "sacrebleu": bleu, "same_as_aiayn": same}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, help="default: 128 random ones; all of --source")
    parser.add_argument("--src-len", type=int, default=16, help="source tokens per sentence, EOS included")
    parser.add_argument("--out-len", type=int, default=24, help="decoder steps per sentence, EOS included")
    parser.add_argument("--batch", type=int, default=64, help="sentences per batch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true", help="without transformers installed")
    parser.add_argument(
        "--skip-recompute", action="store_true", help="random weights: without our use_cache=False search"
    )
    parser.add_argument(
        "--ct2", nargs="*", default=["float32", "int8"], help="random weights: the CTranslate2 compute types to race"
    )
    parser.add_argument("--device", default="cpu", help="random weights: cpu or cuda")
    parser.add_argument(
        "--bf16", action="store_true", help="random weights: ours under bf16 autocast, generate in bf16"
    )
    parser.add_argument("--ensemble", action="store_true", help="random weights: also an ensemble of two models")
    parser.add_argument("--checkpoint", type=Path, help="a trained checkpoint: race on real translations")
    parser.add_argument("--source", type=Path, help="with --checkpoint: the sentences to translate")
    parser.add_argument("--mbr", action="store_true", help="with --checkpoint: also decoding=mbr")
    parser.add_argument("--reference", type=Path, help="with --checkpoint: their references, for sacreBLEU")
    args = parser.parse_args()
    if args.checkpoint:
        if not (args.source and args.reference):
            parser.error("--checkpoint needs --source and --reference")
        real_text(args)
        return
    args.sentences = args.sentences or 128

    from aiayn.export.marian import to_marian

    device = torch.device(args.device)
    torch.manual_seed(0)
    ours = LateEosTransformer(TransformerConfig(**SMALL)).eval().to(device)
    src = torch.randint(4, SMALL["vocab_size"], (args.sentences, args.src_len))
    src[:, -1] = EOS
    batches = src.to(device).split(args.batch)
    # out_len - 1 tokens may precede EOS: out_len decoder steps, as max_new_tokens=out_len gives Hugging Face
    options = DecodingOptions(beam_size=4, alpha=0.6, max_len_offset=args.out_len - 1 - args.src_len)

    def our_search(use_cache: bool, models: Transformer | list[Transformer] = ours) -> Callable[[], None]:
        def run() -> None:
            with torch.autocast(device.type, torch.bfloat16, enabled=args.bf16):
                for batch in batches:
                    found = beam_search(models, batch, BOS, EOS, options, use_cache=use_cache)
                    assert all(len(h.tokens) == args.out_len - 1 for h in found)

        return run

    contestants: dict[str, Callable[[], None]] = {"aiayn cached": our_search(True)}
    if not args.skip_recompute:
        contestants["aiayn recompute"] = our_search(False)
    if args.ensemble:  # a second model of the same size (another seed): the cost of an ensemble of two
        torch.manual_seed(1)
        contestants["aiayn ensemble of 2"] = our_search(True, [ours, LateEosTransformer(TransformerConfig(**SMALL))
                                                                .eval().to(device)])  # fmt: skip
    if not args.skip_hf:
        hf = to_marian(ours).to(device)  # the same weights; generate keeps EOS off with min_new_tokens
        if args.bf16:
            hf = hf.to(torch.bfloat16)

        def hf_generate() -> None:
            with torch.no_grad():
                for batch in batches:
                    out = hf.generate(
                        input_ids=batch,
                        attention_mask=batch.ne(PAD),
                        num_beams=4,
                        length_penalty=0.6,
                        do_sample=False,
                        min_new_tokens=args.out_len,
                        max_new_tokens=args.out_len,
                    )
                    assert out.size(1) == args.out_len + 1  # the start token + out_len new ones

        contestants["transformers generate"] = hf_generate
    for compute_type in args.ct2:
        contestants[f"ctranslate2 {compute_type}"] = engine_search(ours, batches, args.out_len, device, compute_type)

    timings = timed_rounds(contestants, args.rounds, args.sentences)
    medians = {name: statistics.median(speeds) for name, speeds in timings.items()}
    reference = medians["aiayn cached"]
    print(
        f"beam 4, {args.sentences} sentences of {args.src_len} source tokens, {args.out_len} decoder steps each, "
        f"batches of {args.batch}; {torch.get_num_threads()} threads, {os.cpu_count()} cores; "
        f"ours {count_parameters(ours) / 1e6:.2f}M parameters"
        + ("" if args.skip_hf else f", Hugging Face {count_parameters(hf) / 1e6:.2f}M")
    )
    print(f"{'decoder':<24} {'sentences/s (median)':>21} {'vs aiayn cached':>16}")
    for name, speed in medians.items():
        print(f"{name:<24} {speed:>21.1f} {speed / reference:>15.2f}x")
    print(json.dumps({"sentences_per_s": medians, "rounds": timings}))


if __name__ == "__main__":
    main()
