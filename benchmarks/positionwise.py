"""Position-wise work on padded batches against the same work on their real tokens only (issue 31).

A layer's feed-forward sub-layer with its residual chain, `LayerNorm(x + Dropout(FFN(x)))` (§3.1, §3.3,
§5.4), forward and backward, on the source and the target side of real Multi30k training batches, three
ways: on the padded (B, T, d_model) activations as training runs it; on the packed real tokens (N,
d_model), as a model that kept its activations packed between layers would (pack and unpack once per
stack, not counted); and packed around this one sub-layer (gather the real rows, compute, scatter back),
as a padded model that packed only where it pays would. Contestants in turn on every batch (shared
with `train_throughput.py`: spread over the first epoch's lengths); tokens/s counts real tokens; the
ratios are medians of per-round ratios with their range.
Usage: python benchmarks/positionwise.py [--data ../shared/data/multi30k] [--models small base] [--steps 8]
       [--rounds 5]
"""

from __future__ import annotations

import json
from collections.abc import Callable
from statistics import median
from typing import Any

import torch

from aiayn.model import Packing
from aiayn.model.feed_forward import FeedForward
from aiayn.model.layers import SublayerConnection
from workload import (
    benchmark_parser,
    machine,
    parse_counts,
    prepare_process,
    race,
    ratio_spread,
    spread_batches,
    training_config,
)

Block = Callable[[torch.Tensor], torch.Tensor]


def sides(batch: dict[str, Any]) -> list[tuple[Packing, int, int]]:
    """Each side's packing, its batch size and padded width: source, then target."""
    target, source = Packing.of_batch(batch)
    return [(source, *batch["src"].shape), (target, *batch["tgt_in"].shape)]


def contestants(d_model: int, d_ff: int, dropout: float) -> dict[str, Callable[[dict[str, Any]], None]]:
    """The three ways, each a step over both sides of a batch (fresh activations each time, as training's)."""
    torch.manual_seed(0)
    ffn, chain = FeedForward(d_model, d_ff), SublayerConnection(d_model, dropout, norm_first=False)
    block: Block = lambda x: chain(x, ffn)  # noqa: E731

    def run(shape: tuple[int, ...], compute: Block) -> None:
        x = torch.randn(*shape, d_model, requires_grad=True)
        compute(x).sum().backward()

    def padded(batch: dict[str, Any]) -> None:
        for _, rows, width in sides(batch):
            run((rows, width), block)

    def packed(batch: dict[str, Any]) -> None:
        for packing, _, _ in sides(batch):
            run((packing.rows.numel(),), block)

    def packed_here(batch: dict[str, Any]) -> None:
        for packing, rows, width in sides(batch):
            run((rows, width), lambda x, p=packing, b=rows, w=width: p.unpack(block(p.pack(x)), b, w))

    for module in (ffn, chain):
        module.train()
    return {"padded": padded, "packed": packed, "packed here": packed_here}


def main() -> None:
    parser = benchmark_parser(__doc__, steps=8, rounds=5, steps_help="training batches per round")
    parser.add_argument("--models", nargs="+", default=["small", "base"], help="model configs (conf/model)")
    args = parse_counts(parser)
    prepare_process()
    print(machine())
    results: dict[str, Any] = {}
    for name in args.models:
        cfg = training_config(name, args.data, args.overrides)
        batches = spread_batches(cfg, args.steps)
        real = sum(int(b["lengths"].sum()) for b in batches)
        padded = sum(b["src"].numel() + b["tgt_in"].numel() for b in batches)
        speeds = race(contestants(cfg.model.d_model, cfg.model.d_ff, cfg.model.dropout), batches, args.rounds)
        result: dict[str, Any] = {"fill": round(real / padded, 4)}
        print(f"model={name}: {len(batches)} batches, real tokens {real / padded:.1%} of the padded ones")
        print(f"{'way':<14}{'tokens/s (median)':>19}{'over padded (median, range)':>30}")
        for way, values in speeds.items():
            spread = ratio_spread(values, speeds["padded"])
            result[way] = {"tokens_per_s": round(median(values)), "vs_padded": spread}
            ratio = f"{spread['median']:.3f} ({spread['min']:.3f}-{spread['max']:.3f})"
            print(f"{way:<14}{median(values):>19.0f}{ratio:>30}")
        results[name] = result
    print(json.dumps(results))


if __name__ == "__main__":
    main()
