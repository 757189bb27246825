"""How close our training step comes to the machine: achieved model FLOP/s over a large fp32 matmul's.

Model FLOPs are those of `aiayn.model.flops` (every matrix product at the pairs' real lengths,
backward = 2x forward; padding adds none). The ceiling is a 4096³ fp32 matrix product (`--matmul-size`), the
practical peak of this machine; the two are measured in turn, `--rounds` times, and the ratio of each round's pair
is reported (median). Steps are `aiayn-train`'s (its module, loss, optimizer and schedule) on its own
Multi30k batches.
Usage: python benchmarks/efficiency.py [--data ../shared/data/multi30k] [--models base small] [--steps 3]
       [--rounds 3] [--matmul-size 4096] [more aiayn-train overrides]
"""

from __future__ import annotations

import argparse
from statistics import median
from typing import Any

import torch

from aiayn.config.plan import module_settings
from train_throughput import our_step
from workload import (
    benchmark_parser,
    machine,
    matmul_ceiling,
    model_flops,
    parse_counts,
    per_model_json,
    prepare_process,
    real_tokens,
    timed_steps,
    training_batches,
    training_config,
)


def measure(model_name: str, args: argparse.Namespace) -> dict[str, Any]:
    cfg = training_config(model_name, args.data, args.overrides)
    batches = training_batches(cfg, args.steps)
    torch.manual_seed(0)
    module = module_settings(cfg).build().train()
    run = timed_steps(our_step(module), batches)
    flops_per_token = model_flops(module.model.cfg, batches) / sum(real_tokens(batch) for batch in batches)
    run()  # warm-up
    ratios, achieved, ceilings = [], [], []
    for _ in range(args.rounds):
        ceilings.append(matmul_ceiling(args.matmul_size))
        achieved.append(run() * flops_per_token)
        ratios.append(achieved[-1] / ceilings[-1])
    print(f"\nmodel={model_name}: {len(batches)} batches per round, {args.rounds} rounds")
    print(f"{'round':<7}{'model GFLOP/s':>15}{'matmul GFLOP/s':>16}{'efficiency':>12}")
    for i, (flops, ceiling, ratio) in enumerate(zip(achieved, ceilings, ratios, strict=True)):
        print(f"{i + 1:<7}{flops / 1e9:>15.1f}{ceiling / 1e9:>16.1f}{ratio:>12.3f}")
    return {
        "efficiency": round(median(ratios), 3),
        "model_gflops": round(median(achieved) / 1e9, 1),
        "matmul_gflops": round(median(ceilings) / 1e9, 1),
    }


def main() -> None:
    parser = benchmark_parser(__doc__, steps=3, rounds=3, steps_help="training batches per round")
    parser.add_argument("--models", nargs="+", default=["base", "small"], help="model configs (conf/model)")
    parser.add_argument("--matmul-size", type=int, default=4096, help="side of the matrices of the fp32 ceiling")
    args = parse_counts(parser, "matmul_size")

    prepare_process()
    print(machine())
    print(per_model_json({name: measure(name, args) for name in args.models}))


if __name__ == "__main__":
    main()
