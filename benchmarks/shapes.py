"""Batch shapes and the loader: how many (rows, source, target) shapes an epoch of training batches takes,
how much of them is padding, and how fast one process makes them, before and after data.batch_shapes.

Per token budget (25000, the paper's batch, and the CPU default's data.max_tokens), two epochs of the
training sampler: each batch padded to its own longest sentences ("before", data.batch_shapes=null)
against batches of at most N shapes ("after", N as hardware=gpu sets it). Reported: distinct shapes per
epoch (and of the second epoch, the share already seen in the first: what a shape-keyed cache still has
to build), fill (real / padded tokens, both sides; target side alone), batches per epoch and the share
whose rows are a multiple of 8. Then the loader at 25000 tokens in one process and one thread: ms per
batch of the dataset reads plus the collate, the row-by-row collate of before against the whole-array
one with its shapes, the batches/s that make per core, and what `model=base` at 30% MFU on an H200 needs.

--data reads the training pairs of a Multi30k-layout folder as aiayn-train tokenizes them; --generated
draws WMT-like lengths instead (lognormal, 1-250 tokens, targets ~8% longer with a spread of
--ratio-sigma in log-length; pairs past data.max_len or data.max_len_ratio=2 dropped, as the WMT14
config does) over random ids.
Usage: python benchmarks/shapes.py [--data ../shared/data/multi30k | --generated [--pairs N] [--ratio-sigma S]]
       [--shapes N] [overrides]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from aiayn.config.build import transformer_config
from aiayn.data.dataset import Collator, EncodedText, ParallelDataset
from aiayn.data.sampler import ROWS_MULTIPLE, TokenBudgetBatchSampler
from aiayn.machine import PEAK_TFLOPS
from aiayn.model.flops import batch_training_flops
from workload import training_config

PAD, BOS, EOS = 0, 1, 2
PAPER_TOKENS = 25000
TARGET_MFU = 0.30
GPU_PRESET = Path(__file__).resolve().parents[1] / "conf" / "hardware" / "gpu.yaml"


def row_by_row(items: list[tuple[int, np.ndarray, np.ndarray]]) -> dict[str, Any]:
    """The collator before 76e5105, one row at a time, with every field it made (the reference)."""
    n = len(items)
    src_len = max(len(s) for _, s, _ in items) + 1
    tgt_len = max(len(t) for _, _, t in items) + 1
    src = torch.full((n, src_len), PAD, dtype=torch.long)
    tgt_in = torch.full((n, tgt_len), PAD, dtype=torch.long)
    tgt_out = torch.full((n, tgt_len), PAD, dtype=torch.long)
    for row, (_, s, t) in enumerate(items):
        src[row, : len(s)] = torch.from_numpy(s.astype(np.int64))
        src[row, len(s)] = EOS
        tgt_in[row, 0] = BOS
        tgt_in[row, 1 : len(t) + 1] = torch.from_numpy(t.astype(np.int64))
        tgt_out[row, : len(t)] = tgt_in[row, 1 : len(t) + 1]
        tgt_out[row, len(t)] = EOS
    lengths = np.array([(len(s) + 1, len(t) + 1) for _, s, t in items], dtype=np.int64)

    def real_rows(counts: np.ndarray, width: int) -> torch.Tensor:
        return (torch.arange(width) < torch.as_tensor(counts)[:, None]).flatten().nonzero().squeeze(1)

    return {
        "src": src,
        "tgt_in": tgt_in,
        "tgt_out": tgt_out,
        "index": torch.tensor([i for i, _, _ in items], dtype=torch.long),
        "lengths": lengths,
        "target_rows": real_rows(lengths[:, 1], tgt_len),
        "source_rows": real_rows(lengths[:, 0], src_len),
        "offsets": torch.as_tensor(np.concatenate([np.zeros((2, 1), dtype=np.int64), lengths.T.cumsum(1)], 1)),
    }


def generated_dataset(pairs: int, sigma: float, max_len: int, seed: int = 0) -> ParallelDataset:
    """WMT-like pairs of random ids: source lengths lognormal around 24 tokens (WMT14 En-De's BPE sentences
    average ~28, with a long tail), targets ~8% longer."""
    rng = np.random.default_rng(seed)
    src = np.clip(np.round(rng.lognormal(np.log(24), 0.7, pairs)), 1, 250).astype(np.int64)
    tgt = np.clip(np.round(src * np.exp(rng.normal(0.08, sigma, pairs))), 1, 250).astype(np.int64)
    keep = (np.maximum(src, tgt) + 1 <= max_len) & (np.maximum(src, tgt) <= 2 * np.minimum(src, tgt))
    src, tgt = src[keep], tgt[keep]
    sides = [EncodedText.joined([(rng.integers(3, 37000, int(n.sum()), dtype=np.uint16), n)]) for n in (src, tgt)]
    return ParallelDataset(*sides, np.arange(len(src)))


def layout(lengths: np.ndarray, max_tokens: int, shapes: int | None, seed: int) -> dict[str, Any]:
    """Shapes, fill and batches of two training epochs."""
    sampler = TokenBudgetBatchSampler(lengths, max_tokens, seed=seed, shapes=shapes)
    epochs = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        made = []
        for batch in sampler:
            longest = lengths[batch].max(axis=0).tolist()
            widths = sampler.shapes.widths_of(len(batch), *longest) if sampler.shapes is not None else longest
            made.append((len(batch), *widths))
        epochs.append(made)
    first, second = ({shape for shape in made} for made in epochs)
    padded = np.array([[rows * src, rows * tgt] for rows, src, tgt in epochs[0]]).sum(axis=0)
    real = lengths.sum(axis=0)  # every pair once per epoch (one rank)
    return {
        "shapes_per_epoch": max(len(first), len(second)),
        "seen_next_epoch": round(len(second & first) / len(second), 3),
        "fill": round(float(real.sum() / padded.sum()), 4),
        "target_fill": round(float(real[1] / padded[1]), 4),
        "batches": len(epochs[0]),
        "rows_multiple_of_8": round(sum(rows % ROWS_MULTIPLE == 0 for rows, _, _ in epochs[0]) / len(epochs[0]), 3),
    }


def one_by_one(dataset: ParallelDataset, batch: list[int]) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """A batch's pairs read as the DataLoader read them before 76e5105: one ``__getitem__`` each."""
    return [dataset[i] for i in batch]


def at_once(dataset: ParallelDataset, batch: list[int]) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """... and as it reads them now: ``__getitems__``."""
    return dataset.__getitems__(batch)


def loader_ms(dataset: ParallelDataset, batches: list[list[int]], fetch: Any, collate: Any, rounds: int = 3) -> float:
    """Median ms per batch of reading its pairs and collating them, in this process."""
    times = []
    for _ in range(rounds):
        for batch in batches:
            start = time.perf_counter()
            collate(fetch(dataset, batch))
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def spread(sampler: TokenBudgetBatchSampler, count: int) -> list[list[int]]:
    """``count`` batches of the first epoch spread over its lengths (its order is shuffled)."""
    batches = list(sampler)
    return [batches[round(k * (len(batches) - 1) / max(count - 1, 1))] for k in range(min(count, len(batches)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--data", default="../shared/data/multi30k", help="Multi30k-layout folder (data.root)")
    source.add_argument("--generated", action="store_true", help="WMT-like generated lengths instead of a corpus")
    parser.add_argument("--pairs", type=int, default=1_000_000, help="generated pairs (WMT14 En-De has 4.5M)")
    parser.add_argument("--ratio-sigma", type=float, default=0.17, help="spread of log(target/source) lengths")
    parser.add_argument("--shapes", type=int, help="data.batch_shapes after (default: hardware=gpu's)")
    parser.add_argument("--batches", type=int, default=12, help="batches the loader is timed on")
    parser.add_argument("overrides", nargs="*", help="more aiayn-train overrides (data.max_tokens=4096 ...)")
    args = parser.parse_args()
    if min(args.pairs, args.batches, args.shapes or 1) < 1 or args.ratio_sigma < 0:
        parser.error("--pairs, --batches and --shapes must be at least 1, --ratio-sigma at least 0")
    torch.set_num_threads(1)  # per core: a loader worker is one process
    if args.generated:  # WMT14's vocabulary and filters
        cfg = training_config("base", None, ["data=wmt14_en_de", *args.overrides])
    else:
        cfg = training_config("base", args.data, args.overrides)
    shapes = args.shapes or int(OmegaConf.load(GPU_PRESET).data.batch_shapes)
    if args.generated:
        dataset, name = generated_dataset(args.pairs, args.ratio_sigma, cfg.data.max_len), "generated"
    else:
        datamodule = instantiate(cfg.data)
        datamodule.prepare_data()
        datamodule.setup("fit")
        dataset, name = datamodule.datasets["train"], "multi30k"
    lengths = dataset.padded_lengths()
    means = lengths.mean(axis=0).round(1).tolist()
    print(f"{name}: {len(lengths)} training pairs, mean (source, target) lengths {means}, seed {cfg.seed}")
    results: dict[str, Any] = {"data": name, "pairs": len(lengths), "batch_shapes": shapes}
    columns = ("shapes", "seen", "fill", "tgt fill", "batches", "rows%8")
    print(f"{'max_tokens':>10} {'layout':<8}" + "".join(f"{column:>9}" for column in columns))
    for max_tokens in dict.fromkeys((PAPER_TOKENS, int(cfg.data.max_tokens))):
        for label, count in (("before", None), ("after", shapes)):
            row = layout(lengths, max_tokens, count, cfg.seed)
            results[f"{label}_{max_tokens}"] = row
            keys = ("shapes_per_epoch", "seen_next_epoch", "fill", "target_fill", "batches", "rows_multiple_of_8")
            print(f"{max_tokens:>10} {label:<8}" + "".join(f"{row[key]:>9}" for key in keys))
    before_sampler = TokenBudgetBatchSampler(lengths, PAPER_TOKENS, seed=cfg.seed)
    after_sampler = TokenBudgetBatchSampler(lengths, PAPER_TOKENS, seed=cfg.seed, shapes=shapes)
    before_batches, after_batches = spread(before_sampler, args.batches), spread(after_sampler, args.batches)
    vectorised = Collator(PAD, BOS, EOS, shapes=after_sampler.shapes, packing=False)
    timings = {
        "before": loader_ms(dataset, before_batches, one_by_one, row_by_row),
        "now_same_batches": loader_ms(dataset, before_batches, at_once, Collator(PAD, BOS, EOS)),
        "after": loader_ms(dataset, after_batches, at_once, vectorised),
    }
    base = transformer_config(cfg)
    flops = statistics.mean(
        batch_training_flops(base, *map(torch.as_tensor, lengths[batch].T)) for batch in after_batches
    )
    needed = TARGET_MFU * PEAK_TFLOPS["H200"]["bf16"] * 1e12 / flops
    print(f"loader at {PAPER_TOKENS} tokens, one process, one thread (dataset reads + collate):")
    for label, ms in timings.items():
        print(f"  {label:<24}{ms:8.2f} ms per batch  {1000 / ms:8.1f} batches/s per core")
    per_core = 1000 / timings["after"] / needed
    print(f"  speed-up {timings['before'] / timings['after']:.1f}x")
    print(
        f"  model=base at {TARGET_MFU:.0%} MFU on an H200 needs {needed:.1f} batches/s ({flops / 1e12:.2f} TFLOP "
        f"per batch): {per_core:.2f}x of it per core"
    )
    results["loader_ms"] = {label: round(ms, 2) for label, ms in timings.items()}
    results["batches_per_s_per_core"] = {label: round(1000 / ms, 1) for label, ms in timings.items()}
    results["needed_batches_per_s"] = round(needed, 1)
    results["per_core_over_needed"] = round(per_core, 2)
    after = results[f"after_{PAPER_TOKENS}"]
    print(json.dumps({"shapes_per_epoch": after["shapes_per_epoch"], "fill": after["fill"], **results}))


if __name__ == "__main__":
    main()
