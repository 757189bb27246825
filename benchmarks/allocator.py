"""Training-step speed with glibc's default allocator thresholds against `retain_freed_memory()`.

Both settings run in this one process on the same Multi30k batches, alternating, after warm-up.
Usage: python benchmarks/allocator.py [--data ../shared/data/multi30k] [--rounds 3] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from aiayn.data import Multi30kDataModule
from aiayn.data.tokenizer import BOS_ID, EOS_ID
from aiayn.machine import GLIBC_DEFAULT_THRESHOLD, RETAINING_THRESHOLD, set_malloc_thresholds
from aiayn.model import TransformerConfig
from aiayn.training.module import TranslationModule

SMALL = {"vocab_size": 8000, "n_layers": 3, "d_model": 256, "d_ff": 1024, "n_heads": 4, "d_k": 64, "d_v": 64}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data/multi30k")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    dm = Multi30kDataModule(root=args.data, vocab_size=8000, max_tokens=4096)
    dm.prepare_data()
    dm.setup()
    batches = list(dm.train_dataloader())[: args.steps]
    tokens = sum(int(b["src"].ne(0).sum() + b["tgt_out"].ne(0).sum()) for b in batches)
    module = TranslationModule(model=TransformerConfig(**SMALL), bos_id=BOS_ID, eos_id=EOS_ID)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)

    def run_steps() -> float:
        start = time.perf_counter()
        for batch in batches:
            loss, _ = module.training_loss(batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return tokens / (time.perf_counter() - start)

    settings = {"glibc_default": GLIBC_DEFAULT_THRESHOLD, "retain_freed": RETAINING_THRESHOLD}
    run_steps()  # warm-up
    speed: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(args.rounds):
        for name, threshold in settings.items():
            if not set_malloc_thresholds(threshold, threshold):
                raise SystemExit("mallopt is not available here (glibc on Linux only)")
            speed[name].append(run_steps())

    print(
        f"{'setting':<16} {'tokens/s (median)':>18}   {args.rounds} rounds x {args.steps} steps, {os.cpu_count()} cores"
    )
    for name, values in speed.items():
        print(f"{name:<16} {statistics.median(values):>18.0f}")
    ratio = statistics.median(speed["retain_freed"]) / statistics.median(speed["glibc_default"])
    print(
        json.dumps({"retain_vs_default": round(ratio, 3), **{k: round(statistics.median(v)) for k, v in speed.items()}})
    )


if __name__ == "__main__":
    main()
