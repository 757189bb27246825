"""Padding in the training batches: how the token-budget sampler's ordering trades fill for variety.

For the training pairs of `aiayn-train`'s data (its token budget, its seed), the sampler's epochs
batched two ways: by size alone (the longer side of each pair), and by size then the longer side
(what training uses). Per way: real tokens over padded tokens (both sides, and the target side, where
the output projection and the loss used to run on every position), the batches per epoch, and how
alike two consecutive epochs' batches are: the share of a pair's batch mates in epoch 1 that were
its batch mates in epoch 0 (over 2000 pairs).
Usage: python benchmarks/padding.py [--data ../shared/data/multi30k] [--epochs 3] [data.max_tokens=8192 ...]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from hydra.utils import instantiate

from aiayn.data.sampler import TokenBudgetBatchSampler
from workload import training_config


def epoch(sampler: TokenBudgetBatchSampler, number: int) -> list[list[int]]:
    sampler.set_epoch(number)
    return list(sampler)


def fill(lengths: np.ndarray, batches: list[list[int]]) -> tuple[float, float]:
    """Real over padded tokens, both sides and the target side."""
    padded = np.array([len(b) * lengths[b].max(axis=0) for b in batches]).sum(axis=0)
    real = lengths[[i for b in batches for i in b]].sum(axis=0)
    return float(real.sum() / padded.sum()), float(real[1] / padded[1])


def mates_kept(first: list[list[int]], second: list[list[int]], sample: np.ndarray) -> float:
    """The mean share of a pair's batch mates in ``second`` that shared its batch in ``first``."""
    before = {i: set(b) for b in first for i in b}
    after = {i: set(b) for b in second for i in b}
    shares = [len(before[i] & after[i] - {i}) / max(len(after[i]) - 1, 1) for i in sample.tolist()]
    return float(np.mean(shares))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data/multi30k", help="Multi30k folder (data.root)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs whose fill is averaged (at least 2)")
    parser.add_argument("overrides", nargs="*", help="more aiayn-train overrides (data.max_tokens=8192 ...)")
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be at least 2: two epochs' batches are compared")
    cfg = training_config("small", args.data, args.overrides)
    datamodule = instantiate(cfg.data)
    datamodule.prepare_data()
    datamodule.setup("fit")
    lengths = datamodule.datasets["train"].padded_lengths()
    sample = np.random.default_rng(0).choice(len(lengths), size=min(2000, len(lengths)), replace=False)
    result = {}
    print(f"{len(lengths)} training pairs, data.max_tokens={cfg.data.max_tokens}, seed {cfg.seed}")
    print(f"{'batched by':<22}{'fill':>8}{'target fill':>13}{'batches':>9}{'mates kept':>12}")
    for name, sizes in (("size", lengths.max(axis=1)), ("size, longer side", lengths)):
        sampler = TokenBudgetBatchSampler(sizes, cfg.data.max_tokens, seed=cfg.seed)
        epochs = [epoch(sampler, number) for number in range(args.epochs)]
        both, target = np.mean([fill(lengths, batches) for batches in epochs], axis=0)
        kept = mates_kept(epochs[0], epochs[1], sample)
        result[name] = {"fill": round(both, 4), "target_fill": round(target, 4), "mates_kept": round(kept, 3)}
        print(f"{name:<22}{both:>8.4f}{target:>13.4f}{len(epochs[0]):>9}{kept:>12.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
