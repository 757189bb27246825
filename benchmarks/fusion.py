"""Fusing the residual chain `LayerNorm(x + Dropout(y))` (§3.1, §5.4): eager against torch.compile.

The chain follows every sub-layer (2 per encoder layer, 3 per decoder layer); eager PyTorch runs it as
separate memory-bound passes (dropout's mask and product, the add, the LayerNorm), a compiled region
(inductor, dynamic shapes, the matrix products and attention left outside) as one generated kernel
each way. Timed: forward and backward on (tokens, d_model) activations, the way training runs it
(`aiayn.model.layers.SublayerConnection`, with `aiayn.model.dropout.Dropout` in eager mode), with and
without dropout, contestants in turn, median of the per-round ratios with their range.
Usage: python benchmarks/fusion.py [--device cpu] [--tokens 8192] [--d-model 256 512] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from aiayn.model.layers import SublayerConnection
from workload import machine, prepare_process, ratio_spread

Chain = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def timed(chain: Chain, x: torch.Tensor, y: torch.Tensor, grad: torch.Tensor, repeats: int) -> float:
    """Seconds per forward + backward of ``chain``."""
    sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        chain(x, y).backward(grad)
    sync()
    return (time.perf_counter() - start) / repeats


def measure(d_model: int, dropout: float, args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    block = SublayerConnection(d_model, dropout, norm_first=False).to(device).train()
    contestants: dict[str, Chain] = {
        "eager": lambda x, y: block(x, lambda _: y),
        "compiled": torch.compile(lambda x, y: block(x, lambda _: y), dynamic=True),
    }
    x = torch.randn(args.tokens, d_model, device=device, requires_grad=True)
    y = torch.randn(args.tokens, d_model, device=device, requires_grad=True)
    grad = torch.randn(args.tokens, d_model, device=device)
    start = time.perf_counter()
    for chain in contestants.values():
        timed(chain, x, y, grad, 3)  # warm-up; the compiled one compiles here
    warmup = time.perf_counter() - start
    speeds: dict[str, list[float]] = {name: [] for name in contestants}
    for i in range(args.rounds):
        names = list(contestants)[i % 2 :] + list(contestants)[: i % 2]
        for name in names:
            speeds[name].append(1.0 / timed(contestants[name], x, y, grad, args.repeats))
    spread = ratio_spread(speeds["compiled"], speeds["eager"])
    ms = {name: round(1e3 / sorted(values)[len(values) // 2], 3) for name, values in speeds.items()}
    print(
        f"d_model {d_model:>4}  dropout {dropout:<4} eager {ms['eager']:>8.3f} ms  compiled {ms['compiled']:>8.3f} ms  "
        f"compiled / eager speed {spread['median']:.3f} ({spread['min']:.3f}-{spread['max']:.3f})"
    )
    return {"ms": ms, "compiled_speedup": spread["median"], "range": [spread["min"], spread["max"]],
            "warmup_s": round(warmup, 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=8192, help="rows of the activations (a batch's positions)")
    parser.add_argument("--d-model", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.1])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20, help="forward + backward passes per timing")
    args = parser.parse_args()
    if min(args.tokens, args.rounds, args.repeats) < 1:
        parser.error("--tokens, --rounds and --repeats must be at least 1")
    prepare_process()
    print(machine() if args.device == "cpu" else torch.cuda.get_device_name(args.device))
    cases = [(d_model, dropout) for d_model in args.d_model for dropout in args.dropout]
    result = {f"d{d_model}_p{dropout}": measure(d_model, dropout, args) for d_model, dropout in cases}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
