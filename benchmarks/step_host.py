"""Host work around a clipped optimizer step, before and after issue 50's item 6, and Python's collector.

On the structural twin of `model=base` (6+6 layers, 8 heads, its 193 parameter tensors, width 64 so that
arithmetic is small), with the non-finite guard's gradient norm and flags and `trainer.gradient_clip_val`:
"unfused" is what clipping under autocast used to run (single-tensor Adam, since `fused=False` was passed,
and the guard reading its flags on the host every step), "fused" what it runs now (clipping on the
device, fused Adam), "foreach" the Adam an fp16 scaler gets now. Contestants in turn, thread CPU time
per step on one torch thread, the median of per-round ratios with their range. Then one full
`gc.collect()` of what is alive after that set-up, and again after `gc.freeze()`, as `gc_every` freezes
it (issue 50's review, cause #9).
Usage: python benchmarks/step_host.py [--rounds 5] [--steps 50] [--threads 1]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable

import pytorch_lightning  # noqa: F401  (a run has it imported: its objects are among those a collection walks)
import torch

from aiayn.model import Transformer, TransformerConfig
from workload import machine, prepare_process, ratio_spread

TWIN = {"vocab_size": 5000, "n_layers": 6, "d_model": 64, "d_ff": 128, "n_heads": 8, "d_k": 8, "d_v": 8}
ADAM = {"lr": 1e-4, "betas": (0.9, 0.98), "eps": 1e-9}


def clipped_step(parameters: list[torch.Tensor], optimizer: torch.optim.Optimizer, host_read: bool) -> None:
    """The guard's norm and flags, clipping to 1.0, Adam's step."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
    flags = torch.stack([torch.zeros((), dtype=torch.bool), ~torch.isfinite(norm)]).float()
    if host_read:
        flags.tolist()
    torch.nn.utils.clip_grad_norm_(parameters, 1.0)
    optimizer.step()


def seconds_per_step(step: Callable[[], None], steps: int) -> float:
    start = time.thread_time()
    for _ in range(steps):
        step()
    return (time.thread_time() - start) / steps


def collections() -> dict[str, float]:
    """Milliseconds of one full collection of everything alive now, and of one after ``gc.freeze()``."""
    gc.collect()
    tracked = len(gc.get_objects())
    start = time.thread_time()
    gc.collect()
    full = time.thread_time() - start
    gc.freeze()
    try:
        start = time.thread_time()
        gc.collect()
        frozen = time.thread_time() - start
    finally:
        gc.unfreeze()
    return {"tracked_objects": tracked, "full_ms": round(full * 1e3, 2), "frozen_ms": round(frozen * 1e3, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1, help="torch's threads (1: the host's own work)")
    args = parser.parse_args()
    prepare_process()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    parameters = list(Transformer(TransformerConfig(**TWIN)).parameters())
    for p in parameters:
        p.grad = torch.randn_like(p)
    contestants = {
        "unfused": (torch.optim.Adam(parameters, **ADAM, fused=False), True),
        "fused": (torch.optim.Adam(parameters, **ADAM, fused=True, foreach=False), False),
        "foreach": (torch.optim.Adam(parameters, **ADAM, fused=False, foreach=True), False),
    }
    steps = {
        name: (lambda o=optimizer, r=read: clipped_step(parameters, o, r))
        for name, (optimizer, read) in contestants.items()
    }
    for step in steps.values():
        seconds_per_step(step, 3)  # warm-up: Adam's state
    speeds: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(args.rounds):
        names = list(steps)[i % len(steps) :] + list(steps)[: i % len(steps)]
        for name in names:
            speeds[name].append(1.0 / seconds_per_step(steps[name], args.steps))
    ms = {name: round(1e3 / sorted(values)[len(values) // 2], 3) for name, values in speeds.items()}
    result = {
        "parameter_tensors": len(parameters),
        "ms": ms,
        "fused_vs_unfused": ratio_spread(speeds["fused"], speeds["unfused"]),
        "foreach_vs_unfused": ratio_spread(speeds["foreach"], speeds["unfused"]),
        "gc": collections(),
    }
    print(machine())
    print(f"clipped optimizer step, {len(parameters)} tensors, ms: " + ", ".join(f"{k} {v}" for k, v in ms.items()))
    print(f"fused / unfused speed {result['fused_vs_unfused']}, foreach / unfused {result['foreach_vs_unfused']}")
    print(f"gc: {result['gc']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
