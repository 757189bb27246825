"""Training speed: our step against MarianMTModel and a torch.nn.Transformer model of the same size.

Each contestant trains (forward, label-smoothed loss, backward, Adam) on the same Multi30k batches,
`aiayn-train`'s own (token budget data.max_tokens, joint BPE of data.vocab_size pieces), fp32, at each
model config asked for: --steps batches of the first epoch spread over its length distribution (shortest to
longest). Contestants take turns on every batch, in this one process, after a warm-up; tokens/s count
real source and target tokens. Ratios are the median of the per-round ratios, with their lowest and
highest. Efficiency is our achieved model FLOP/s over a large fp32 matrix product's FLOP/s, measured
in this process before and after the race.
Needs the `bench` extra (`pip install -e ".[bench]"`, which brings `transformers`).
Usage: python benchmarks/train_throughput.py [--data ../shared/data/multi30k] [--models base small]
       [--steps 8] [--rounds 5] [--matmul-size 4096] [model.compile=true ...]
The final line is JSON; its top-level ratios are model=base's.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from statistics import median
from typing import Any

import torch

from aiayn.config.plan import module_settings
from aiayn.model import count_parameters
from aiayn.training.module import TranslationModule
from peers import NNTransformer, marian
from workload import (
    adam,
    benchmark_parser,
    machine,
    matmul_ceiling,
    mean_length,
    model_flops,
    parse_counts,
    per_model_json,
    prepare_process,
    race,
    ratio_spread,
    real_tokens,
    smoothed_loss,
    spread_batches,
    training_config,
)

Step = Callable[[dict[str, Any]], None]


def our_step(module: TranslationModule) -> Step:
    """The training step of `aiayn-train`'s module (its loss, its optimizer), without the trainer."""
    optimization = module.configure_optimizers()
    optimizer, schedule = optimization["optimizer"], optimization["lr_scheduler"]["scheduler"]

    def step(batch: dict[str, Any]) -> None:
        loss, _ = module.training_loss(batch)
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def peer_step(model: torch.nn.Module, smoothing: float, pad_id: int) -> Step:
    """A peer's training step: its logits, torch's label-smoothed loss, fused Adam."""
    optimizer = adam(model)

    def step(batch: dict[str, Any]) -> None:
        logits = model(batch["src"], batch["tgt_in"])
        n_tokens = int(batch["lengths"][:, 1].sum())
        smoothed_loss(logits, batch["tgt_out"], n_tokens, smoothing, pad_id).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def in_precision(step: Step, precision: str) -> Step:
    """``step`` under Lightning's ``precision`` as it applies on the CPU: fp32, or bf16 autocast."""

    def run(batch: dict[str, Any]) -> None:
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-mixed"):
            step(batch)

    return run


def measure(model_name: str, args: argparse.Namespace) -> dict[str, Any]:
    cfg = training_config(model_name, args.data, args.overrides)
    batches = spread_batches(cfg, args.steps)
    torch.manual_seed(0)
    settings = module_settings(cfg)
    module = settings.build().train()
    model_cfg = settings.model
    models = {"aiayn": module.model}
    if not args.skip_hf:
        models["marian"] = marian(model_cfg).train()
    models["nn_transformer"] = NNTransformer(model_cfg).train()
    smoothing, pad = module.hparams.label_smoothing, module.pad_id
    steps = {
        name: our_step(module) if name == "aiayn" else peer_step(model, smoothing, pad)
        for name, model in models.items()
    }
    steps = {name: in_precision(step, args.precision) for name, step in steps.items()}

    ceiling_before = matmul_ceiling(args.matmul_size)
    speeds = race(steps, batches, args.rounds)
    ceiling = median([ceiling_before, matmul_ceiling(args.matmul_size)])
    tokens = sum(real_tokens(batch) for batch in batches)
    flops = model_flops(model_cfg, batches)
    ours = median(speeds["aiayn"])
    result: dict[str, Any] = {
        "tokens_per_s": {name: round(median(values)) for name, values in speeds.items()},
        "efficiency": round(ours / tokens * flops / ceiling, 3),
        "model_gflops": round(ours / tokens * flops / 1e9, 1),
        "matmul_gflops": round(ceiling / 1e9, 1),
        "batch_tokens": round(tokens / len(batches)),
        "params": {name: count_parameters(model) for name, model in models.items()},
    }
    share = matmul_share(steps["aiayn"], batches)
    result["matmul_share"] = round(share, 3)
    for name in speeds:
        if name != "aiayn":
            spread = ratio_spread(speeds["aiayn"], speeds[name])
            result[f"vs_{name}"], result[f"vs_{name}_range"] = spread["median"], [spread["min"], spread["max"]]
            # our step with every operation but the matrix products free, against theirs as it is
            result[f"vs_{name}_bound"] = round(spread["median"] / share, 3)

    lengths = sorted(mean_length(batch) for batch in batches)
    shape = (
        f"{len(batches)} batches of ~{result['batch_tokens']} real tokens, pairs of {lengths[0]:.0f}-{lengths[-1]:.0f} "
        f"tokens on average, {args.rounds} rounds"
    )
    print(f"\nmodel={model_name}: {shape}")
    header = f"{'contestant':<16}{'parameters':>12}{'tokens/s (median)':>19}{'all rounds':>36}"
    print(f"{header}{'ours / theirs (median, range)':>32}")
    for name, values in speeds.items():
        low, high = result.get(f"vs_{name}_range", (0, 0))
        ratio = "" if name == "aiayn" else f"{result[f'vs_{name}']:.3f} ({low:.3f}-{high:.3f})"
        rounds = " ".join(f"{v:.0f}" for v in values)
        print(f"{name:<16}{result['params'][name]:>12,}{median(values):>19.0f}{rounds:>36}{ratio:>32}")
    print(
        f"model FLOP/s {result['model_gflops']} G / fp32 matmul {result['matmul_gflops']} G "
        f"= efficiency {result['efficiency']:.3f}"
    )
    bounds = ", ".join(f"{result[f'vs_{name}_bound']:.2f}x {name}" for name in speeds if name != "aiayn")
    print(f"matrix products {share:.1%} of our step; with everything else free it would be {bounds}")
    return result


# The matrix products: the work all contestants share at equal dimensions (ours on fewer rows: the output
# projection skips target padding), at a rate the fp32 ceiling bounds.
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}


def matmul_share(step: Step, batches: list[dict[str, Any]]) -> float:
    """The matrix products' share of the self time of one step on each batch (``torch.profiler``): what
    remains, 1 - share, is all that fusing or removing other work could ever save."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for batch in batches:
            step(batch)
    times = {event.key: event.self_cpu_time_total for event in profile.key_averages()}
    return sum(time for key, time in times.items() if key in MATMULS) / sum(times.values())


def main() -> None:
    parser = benchmark_parser(__doc__, steps=8, rounds=5, steps_help="training batches per round")
    parser.add_argument("--models", nargs="+", default=["base", "small"], help="model configs (conf/model)")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"], help="all contestants'")
    parser.add_argument("--skip-hf", action="store_true", help="without transformers installed")
    parser.add_argument("--matmul-size", type=int, default=4096, help="side of the matrices of the fp32 ceiling")
    args = parse_counts(parser, "matmul_size")

    prepare_process()
    print(machine())
    print(per_model_json({name: measure(name, args) for name in args.models}))


if __name__ == "__main__":
    main()
