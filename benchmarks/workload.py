"""What the benchmarks share: Multi30k batches as `aiayn-train` makes them, the machine's fp32 ceiling,
and timing contestants against each other in one process.

Not a benchmark itself; the scripts next to it import it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import date
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from aiayn.config.compose import compose_run_config
from aiayn.machine import available_cpus, device_name, retain_freed_memory
from aiayn.model import TransformerConfig
from aiayn.model.flops import batch_training_flops


def benchmark_parser(doc: str, steps: int, rounds: int, steps_help: str) -> argparse.ArgumentParser:
    """The options every benchmark shares: the corpus, batches per round, rounds, more overrides."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--data", default="../shared/data/multi30k", help="Multi30k folder (data.root)")
    parser.add_argument("--steps", type=int, default=steps, help=steps_help)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("overrides", nargs="*", help="more aiayn-train overrides (model.compile=true ...)")
    return parser


def parse_counts(parser: argparse.ArgumentParser, *names: str) -> argparse.Namespace:
    """The parsed arguments; each of ``--steps``, ``--rounds`` and ``names`` must be at least 1."""
    args = parser.parse_args()
    counts = ("steps", "rounds", *names)
    if min(getattr(args, name) for name in counts) < 1:
        parser.error(f"{', '.join('--' + name.replace('_', '-') for name in counts)} must be at least 1")
    return args


def per_model_json(results: dict[str, dict[str, Any]]) -> str:
    """One JSON line: ``model=base``'s results at the top level, every other model's under its name."""
    summary: dict[str, Any] = dict(results.get("base", {}))
    summary.update({name: result for name, result in results.items() if name != "base"})
    return json.dumps(summary)


def training_config(model: str, data_root: str | None, extra: Sequence[str] = ()) -> DictConfig:
    """`aiayn-train`'s composed config with ``model=<model>`` (W&B off, nothing else changed)."""
    overrides = [f"model={model}", "logger=none", *extra]
    if data_root:
        overrides.append(f"data.root={data_root}")
    return compose_run_config(overrides)


def training_batches(cfg: DictConfig, count: int, skip: int = 0) -> list[dict[str, Any]]:
    """Training batches ``skip`` … ``skip + count`` of the first epoch, exactly as the run's loader
    yields them (token budget ``data.max_tokens``, length-bucketed, shuffled with ``seed``)."""
    datamodule = instantiate(cfg.data)
    datamodule.prepare_data()
    datamodule.setup("fit")
    batches = []
    for i, batch in enumerate(datamodule.train_dataloader()):
        if i >= skip:
            batches.append(batch)
        if len(batches) == count:
            break
    return batches


def spread_batches(cfg: DictConfig, count: int, pool: int = 512) -> list[dict[str, Any]]:
    """``count`` training batches of the first epoch, as the run's loader yields them, spread over its
    length distribution: of the epoch's first ``pool`` batches, ranked by their pairs' mean real length,
    those at evenly spaced ranks, the shortest and the longest included, in the epoch's order. The first
    few batches of a shuffled epoch can be all short or all long, and a step's speed depends on length
    (attention grows with its square; the share of padding differs)."""
    epoch = training_batches(cfg, pool)
    if count >= len(epoch):
        return epoch
    ranked = sorted(range(len(epoch)), key=lambda i: mean_length(epoch[i]))
    if count == 1:
        return [epoch[ranked[len(ranked) // 2]]]
    picked = {ranked[round(k * (len(ranked) - 1) / (count - 1))] for k in range(count)}
    return [epoch[i] for i in sorted(picked)]


def mean_length(batch: dict[str, Any]) -> float:
    """Real source plus target tokens per pair of a batch."""
    return real_tokens(batch) / len(batch["lengths"])


def ratio_spread(ours: Sequence[float], theirs: Sequence[float]) -> dict[str, float]:
    """Our speed over theirs, round by round (both timed on the same batches in the same round): the
    median of those ratios and their lowest and highest, the spread a single number would hide."""
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    return {"median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3), "max": round(max(ratios), 3)}


def real_tokens(batch: dict[str, Any]) -> int:
    """Source plus target tokens of a batch, padding not counted."""
    return int(batch["lengths"].sum())


def model_flops(cfg: TransformerConfig, batches: Sequence[dict[str, Any]]) -> float:
    """Training FLOPs (forward + backward) of ``batches`` at their pairs' real lengths."""
    return sum(batch_training_flops(cfg, *map(torch.as_tensor, batch["lengths"].T)) for batch in batches)


def matmul_ceiling(size: int = 4096, repeats: int = 5) -> float:
    """FLOP/s of a large fp32 matrix product: the most this machine does in practice."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times)


def race(
    steps: dict[str, Callable[[dict[str, Any]], None]], batches: Sequence[dict[str, Any]], rounds: int
) -> dict[str, list[float]]:
    """Real tokens per second of each contestant's training ``steps`` over ``batches``, ``rounds`` times.

    Every batch is stepped by each contestant in turn (the order rotates from round to round), so that
    a slow minute of this shared machine hits them all alike; a first pass over the batches warms up.
    """
    names = list(steps)
    tokens = sum(real_tokens(batch) for batch in batches)
    for batch in batches:
        for name in names:
            steps[name](batch)
    results: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        order = names[i % len(names) :] + names[: i % len(names)]
        seconds = dict.fromkeys(names, 0.0)
        for batch in batches:
            for name in order:
                start = time.perf_counter()
                steps[name](batch)
                seconds[name] += time.perf_counter() - start
        for name in names:
            results[name].append(tokens / seconds[name])
    return results


def prepare_process() -> None:
    """The settings `aiayn-train` makes for CPU training (glibc keeps freed blocks)."""
    retain_freed_memory()


def machine() -> str:
    """One line naming the hardware and software the numbers were measured on."""
    return (
        f"{date.today()} · {device_name(torch.device('cpu'))} ({torch.backends.cpu.get_cpu_capability()}), "
        f"{available_cpus()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )


def smoothed_loss(
    logits: torch.Tensor, target: torch.Tensor, n_tokens: int, smoothing: float, pad_id: int
) -> torch.Tensor:
    """Label-smoothed cross-entropy (§5.4) per real target token, as written with plain torch: the loss
    the peers train with."""
    total = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), target.flatten(), ignore_index=pad_id, label_smoothing=smoothing, reduction="sum"
    )
    return total / n_tokens


def adam(model: torch.nn.Module) -> torch.optim.Adam:
    """The paper's Adam (§5.3) with its fused kernel, as ours (one flag any user can set), at a small
    constant rate; the schedule costs nothing worth timing."""
    return torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)


def timed_steps(step: Callable[[dict[str, Any]], None], batches: Sequence[dict[str, Any]]) -> Callable[[], float]:
    """A function that runs `step` on every batch and returns real tokens per second."""
    tokens = sum(real_tokens(batch) for batch in batches)

    def run() -> float:
        start = time.perf_counter()
        for batch in batches:
            step(batch)
        return tokens / (time.perf_counter() - start)

    return run
