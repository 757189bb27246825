"""What each speed change buys: our training step against the same step with one change undone.

Variants, all on the same Multi30k batches (spread over the first epoch's lengths), taking turns on
every batch in this one process after a warm-up; ratios are the median of the per-round ratios, with
their lowest and highest:
- `aiayn`: the step as `aiayn-train` runs it;
- `nn.Dropout`: torch's dropout instead of `aiayn.model.dropout.Dropout`;
- `F.cross_entropy`: torch's label-smoothed loss instead of `aiayn.training.loss`;
- `Adam for-loop`: Adam without its fused kernel;
- `none of them`: all three undone (the step before this work);
- `model.packed_attention`: the encoder and encoder-decoder attention over packed sequences (for a GPU's
  FlashAttention-2; on the CPU SDPA runs them sequence by sequence);
- `model.compile` (with `--compile`): `torch.compile` on top of the step (compiling takes minutes);
- with `--bf16`, `bf16 autocast`: the step under bf16 autocast, as `aiayn-train` runs it where the CPU
  multiplies bf16 (`cpu_bf16=auto`: attention in fp32), and `bf16, bf16 attention`: the same with SDPA
  left to autocast (bf16). Ratios below 1 there mean faster than the fp32 step.
Usage: python benchmarks/speedups.py [--data ../shared/data/multi30k] [--model base] [--steps 3]
       [--rounds 3] [--compile] [--bf16]
"""

from __future__ import annotations

import dataclasses
import json
from statistics import median
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

import aiayn.model.attention
from aiayn.config.plan import module_settings
from aiayn.model.dropout import Dropout
from train_throughput import Step, in_precision
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


def variant(
    cfg: DictConfig, torch_dropout: bool, torch_loss: bool, fused_adam: bool, compile: bool, packed: bool = False
) -> Step:
    """A training step of ``cfg``'s module with the chosen parts."""
    torch.manual_seed(0)
    settings = dataclasses.replace(module_settings(cfg), compile=compile, packed_attention=packed)
    module = settings.build().train()
    if torch_dropout:
        for parent in list(module.model.modules()):
            for name, child in parent.named_children():
                if isinstance(child, Dropout):
                    setattr(parent, name, nn.Dropout(child.p))
    optimization = module.configure_optimizers()
    optimizer, schedule = optimization["optimizer"], optimization["lr_scheduler"]["scheduler"]
    if not fused_adam:
        settings = {key: optimizer.defaults[key] for key in ("lr", "betas", "eps")}
        optimizer = torch.optim.Adam(module.parameters(), **settings, fused=False)
        schedule = type(schedule)(optimizer, schedule.lr_lambdas[0])
    smoothing, pad = module.hparams.label_smoothing, module.pad_id

    def step(batch: dict[str, Any]) -> None:
        if torch_loss:  # on the same real target positions: only the loss differs
            logits, target = module.real_target_logits(batch)
            total = F.cross_entropy(logits, target, ignore_index=pad, label_smoothing=smoothing, reduction="sum")
            loss = total / batch["target_rows"].numel()
        else:
            loss, _ = module.training_loss(batch)
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def bf16_attention(step: Step) -> Step:
    """``step`` with SDPA as autocast runs it on the CPU (bf16), not in fp32."""

    def run(batch: dict[str, Any]) -> None:
        ours = aiayn.model.attention.scaled_dot_product_attention
        aiayn.model.attention.scaled_dot_product_attention = F.scaled_dot_product_attention
        try:
            step(batch)
        finally:
            aiayn.model.attention.scaled_dot_product_attention = ours

    return run


def main() -> None:
    parser = benchmark_parser(__doc__, steps=3, rounds=3, steps_help="training batches per round")
    parser.add_argument("--model", default="base", help="a model config (conf/model)")
    parser.add_argument("--compile", action="store_true", help="also race model.compile=true")
    parser.add_argument("--bf16", action="store_true", help="also race bf16 autocast, attention in fp32 and in bf16")
    args = parse_counts(parser)

    prepare_process()
    cfg = training_config(args.model, args.data, args.overrides)
    batches = spread_batches(cfg, args.steps)
    variants = {
        "aiayn": (False, False, True, False),
        "nn.Dropout": (True, False, True, False),
        "F.cross_entropy": (False, True, True, False),
        "Adam for-loop": (False, False, False, False),
        "none of them": (True, True, False, False),
        "packed attention": (False, False, True, False, True),
    }
    if args.compile:
        variants["model.compile"] = (False, False, True, True)
    steps = {name: variant(cfg, *parts) for name, parts in variants.items()}
    if args.bf16:
        steps["bf16 autocast"] = in_precision(variant(cfg, *variants["aiayn"]), "bf16-mixed")
        steps["bf16, bf16 attention"] = bf16_attention(in_precision(variant(cfg, *variants["aiayn"]), "bf16-mixed"))
    speeds = race(steps, batches, args.rounds)
    result: dict[str, Any] = {}
    for name in speeds:
        if name != "aiayn":
            spread = ratio_spread(speeds["aiayn"], speeds[name])
            result[f"vs_{name}"], result[f"vs_{name}_range"] = spread["median"], [spread["min"], spread["max"]]

    print(machine())
    print(f"model={args.model}: {len(batches)} batches per round, {args.rounds} rounds")
    print(f"{'variant':<22}{'tokens/s (median)':>19}{'all rounds':>36}{'aiayn / variant (median, range)':>34}")
    for name, values in speeds.items():
        low, high = result.get(f"vs_{name}_range", (0, 0))
        ratio = "" if name == "aiayn" else f"{result[f'vs_{name}']:.3f} ({low:.3f}-{high:.3f})"
        print(f"{name:<22}{median(values):>19.0f}{' '.join(f'{v:.0f}' for v in values):>36}{ratio:>34}")
    print(json.dumps({**result, "tokens_per_s": {name: round(median(v)) for name, v in speeds.items()}}))


if __name__ == "__main__":
    main()
