"""Memory of the default run: `aiayn-train` on its defaults, its resident memory sampled every second.

Issue 49 asks that the default run fit a laptop: peak RSS at most 4 GB on a 2-core CPU, flat after its
first epoch. This starts `aiayn-train data.root=<--data>` on its defaults with a shorter time budget
(`--minutes`; the default's schedule decays over whatever budget it has, so the run goes through every
phase: tokenizer and encoding into a fresh `AIAYN_CACHE`, epochs with their greedy validations and step
checkpoints, the final beam-search validation, the tests of best, averaged and EMA checkpoints), W&B off
(`logger=none`) and one log line per validation (`progress=quiet`). Every `--interval` seconds it sums
VmRSS over the run's process and all its children (encoding workers, DataLoader workers), from /proc
(Linux only). The run's log marks the epochs (a validation ends each) and the tests.

Prints the events with the RSS at each, then one JSON line: ``peak_mb``; per epoch of training its
steps, the RSS at its validation (``epoch_mb``) and the most within it (``epoch_peak_mb``);
``growth_mb_per_epoch``, the least-squares slope of ``epoch_peak_mb`` from the second epoch on (flat: ~0);
the most while training after the first epoch, and in the evaluations after training; the run's steps
and training tokens per second (its results.json). Exits with status 1 when the peak exceeds ``--limit-gb``.
Usage: python benchmarks/memory.py [--data ../shared/data/multi30k] [--minutes 12] [--interval 1]
       [--limit-gb 4] [--cache DIR] [--keep DIR] [more aiayn-train overrides]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from aiayn.machine import available_cpus, device_name

VALIDATION = re.compile(r"step (\d+): val/loss")  # progress=quiet's line after every validation
TESTED = re.compile(r"Restoring states from the checkpoint path at .*/(\w+)\.ckpt")
STOPPED = "Time limit reached"


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants that are alive now, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue  # ended meanwhile
        parent = int(stat.rsplit(")", 1)[1].split()[1])  # the command may hold spaces and brackets
        children.setdefault(parent, []).append(int(entry.name))
    tree, i = [root], 0
    while i < len(tree):
        tree += children.get(tree[i], [])
        i += 1
    return tree


def rss_kb(pid: int) -> int:
    """VmRSS of ``pid`` in kB (0 when it has ended or is a zombie)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_rss_mb(root: int) -> float:
    return sum(rss_kb(pid) for pid in process_tree(root)) / 1024


class Sampler:
    """The run's RSS every ``interval`` seconds, and the events its log names, each at the RSS of then."""

    def __init__(self, process: subprocess.Popen[str], interval: float) -> None:
        self.process, self.interval, self.start = process, interval, time.monotonic()
        self.samples: list[tuple[float, float]] = []  # (seconds since start, MB)
        self.events: list[dict[str, Any]] = []
        self.log: list[str] = []

    def sample(self) -> float:
        mb = tree_rss_mb(self.process.pid)
        self.samples.append((time.monotonic() - self.start, mb))
        return mb

    def run(self) -> None:
        while self.process.poll() is None:
            self.sample()
            time.sleep(self.interval)

    def read_log(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.log.append(line)
            if (found := VALIDATION.search(line)) is not None:
                self.event("validation", step=int(found.group(1)))
            elif (found := TESTED.search(line)) is not None:
                self.event(f"evaluate {found.group(1)}.ckpt")
            elif STOPPED in line:
                self.event("time limit")

    def event(self, name: str, **fields: Any) -> None:
        mb = self.sample()
        self.events.append({"event": name, "s": self.samples[-1][0], "rss_mb": round(mb), **fields})
        print(f"{self.samples[-1][0]:>6.0f} s  {mb:>7.0f} MB  {name} {fields or ''}", flush=True)


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (x, y) points; None for fewer than two."""
    if len(points) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else None


def summary(sampler: Sampler) -> dict[str, Any]:
    """Peak, RSS at each epoch's validation and the most within each epoch, and the growth after the
    first epoch (see the module's doc). The validations of training are those before the first test's
    checkpoint is loaded (the one after the time limit ends a part of an epoch)."""
    events = sampler.events
    first_test = next((i for i, event in enumerate(events) if event["event"].startswith("evaluate")), len(events))
    validations = [event for event in events[:first_test] if event["event"] == "validation"]
    end = events[first_test]["s"] if first_test < len(events) else sampler.samples[-1][0]
    bounds = [0, *(event["s"] for event in validations)]
    epoch_peaks = [
        round(max((mb for s, mb in sampler.samples if start < s <= stop), default=event["rss_mb"]))
        for start, stop, event in zip(bounds[:-1], bounds[1:], validations, strict=True)
    ]
    growth = slope(list(enumerate(epoch_peaks))[1:])
    after_first = [mb for s, mb in sampler.samples if validations and validations[0]["s"] < s <= end]
    return {
        "peak_mb": round(max((mb for _, mb in sampler.samples), default=0.0)),
        "epoch_steps": [event["step"] for event in validations],
        "epoch_mb": [event["rss_mb"] for event in validations],
        "epoch_peak_mb": epoch_peaks,
        "growth_mb_per_epoch": round(growth, 1) if growth is not None else None,
        "training_peak_after_first_epoch_mb": round(max(after_first)) if after_first else None,
        "evaluation_peak_mb": round(max((mb for s, mb in sampler.samples if s > end), default=0.0)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data/multi30k", help="Multi30k folder (data.root)")
    parser.add_argument("--minutes", type=int, default=12, help="trainer.max_time of the run")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between RSS samples")
    parser.add_argument("--limit-gb", type=float, default=4.0, help="the most the peak may be (GB, 1024³ bytes)")
    parser.add_argument("--cache", help="AIAYN_CACHE for the run (default: a fresh temporary folder)")
    parser.add_argument("--keep", help="the run folder (default: a temporary one, removed)")
    parser.add_argument("overrides", nargs="*", help="more aiayn-train overrides")
    args = parser.parse_intermixed_args()  # overrides may come before and after the options
    if args.minutes < 1 or args.interval <= 0:
        parser.error("--minutes must be at least 1 and --interval above 0")
    if not Path("/proc/self/status").is_file():
        raise SystemExit("reads RSS from /proc: Linux only")
    print(
        f"{device_name(torch.device('cpu'))}, {available_cpus()} CPUs, torch {torch.__version__}; "
        f"aiayn-train on its defaults for {args.minutes} minutes",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="aiayn-memory-") as scratch:
        run_dir = Path(args.keep) if args.keep else Path(scratch) / "run"
        command = [
            str(Path(sys.executable).with_name("aiayn-train")),
            f"data.root={args.data}",
            f"trainer.max_time=00:{args.minutes // 60:02d}:{args.minutes % 60:02d}:00",
            "logger=none",
            "progress=quiet",
            f"hydra.run.dir={run_dir}",
            *args.overrides,
        ]
        env = {**os.environ, "AIAYN_CACHE": args.cache or str(Path(scratch) / "cache")}
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        sampler = Sampler(process, args.interval)
        reader = threading.Thread(target=sampler.read_log, daemon=True)
        reader.start()
        sampler.run()
        reader.join()
        if process.returncode != 0:
            raise SystemExit(f"aiayn-train exited {process.returncode}:\n{''.join(sampler.log[-30:])}")
        run = json.loads((run_dir / "results.json").read_text())
    result = {**summary(sampler), "seconds": round(sampler.samples[-1][0]) if sampler.samples else 0}
    result |= {"steps": run.get("steps"), "train_tokens_per_s": round(run.get("train_tokens_per_s") or 0)}
    print(json.dumps(result))
    if result["peak_mb"] > args.limit_gb * 1024:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
