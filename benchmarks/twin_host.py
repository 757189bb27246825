"""The host's time per step of `model=base`'s structural twin through `aiayn-train`, this tree against another
commit side by side (issue 50's CPU target: at most a third of 31efa24's).

The twin is `model=base` with widths of 64 (d_ff 128, d_k = d_v = 8): the same 6+6 layers, 8 heads, parameter
tensors and callbacks, with arithmetic small enough that what is left is the host's work per step, the work
that must not starve a GPU. Each contestant runs `aiayn-train` itself (its own CLI, config and callbacks,
bf16 autocast as on a GPU, W&B offline, one torch thread) in a fresh process for --warmup + --steps steps on
Multi30k; a callback added to its Trainer reads the training thread's CPU time (`time.thread_time`) at the
start of every step, so a step's time covers fetching its batch, forward, backward, the optimizer and every
callback, and leaves out work the run hands to other threads. The contestants alternate, --rounds each;
reported: each one's median and mean ms per step (medians over rounds), and the per-round ratios.
The other commit is unpacked with `git archive` into a temporary folder and run from there.
Usage: python benchmarks/twin_host.py [--against 31efa24] [--steps 60] [--warmup 10] [--rounds 3]
       [--data ../shared/data/multi30k] [more aiayn-train overrides]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean, median
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TWIN = ["model=base", "model.d_model=64", "model.d_ff=128", "model.d_k=8", "model.d_v=8"]
RUN = ["cpu_bf16=true", "logger=wandb", "progress=quiet", "data.eval_limit=16"]


def child(out: Path, overrides: list[str]) -> None:
    """Run `aiayn-train` in this process with a Trainer that times its steps; write the times to ``out``."""
    import pytorch_lightning as pl
    import torch

    import aiayn

    class StepClock(pl.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            self.starts.append(time.thread_time())

        def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
            ms = [1000 * (b - a) for a, b in zip(self.starts, self.starts[1:], strict=False)]
            out.write_text(json.dumps({"ms": ms, "package": str(Path(aiayn.__file__).parent)}))

    clock = StepClock()
    trainer_init = pl.Trainer.__init__

    @functools.wraps(trainer_init)  # the run checks trainer.* against its signature
    def with_clock(self: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), clock]
        trainer_init(self, *args, **kwargs)

    pl.Trainer.__init__ = with_clock  # type: ignore[method-assign]
    torch.set_num_threads(1)
    from aiayn.cli.train import main as train_main

    sys.argv = ["aiayn-train", *overrides]
    try:
        train_main()
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            raise


def contestant(src: Path, folder: Path, overrides: list[str], warmup: int) -> dict[str, Any]:
    """One run of the tree under ``src``: its steps' ms after ``warmup``."""
    out = folder / "times.json"
    out.unlink(missing_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": str(src),
        "AIAYN_OUTPUT": str(folder / "outputs"),
        "AIAYN_CACHE": str(folder / "cache"),
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(folder),
    }
    command = [sys.executable, __file__, "--child", str(out), *overrides]
    done = subprocess.run(command, env=env, cwd=folder, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"the run under {src} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    times = json.loads(out.read_text())
    if not times["package"].startswith(str(src)):
        raise SystemExit(f"the run under {src} imported aiayn from {times['package']}")
    return {"ms": times["ms"][warmup:]}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(Path(sys.argv[2]), sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="31efa24", help="the commit to compare with")
    parser.add_argument("--data", default="../shared/data/multi30k", help="Multi30k folder (data.root)")
    parser.add_argument("--steps", type=int, default=60, help="timed steps")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="more aiayn-train overrides for both")
    args = parser.parse_args()
    if min(args.steps, args.rounds) < 1 or args.warmup < 0:
        parser.error("--steps and --rounds must be at least 1, --warmup at least 0")
    data = Path(args.data).resolve()
    # The steps timed stop before the first validation and the first epoch's end (250+ batches).
    overrides = [*TWIN, *RUN, f"data.root={data}", f"trainer.max_steps={args.warmup + args.steps + 2}"]
    overrides += args.overrides
    with tempfile.TemporaryDirectory() as temp:
        reference = Path(temp) / "reference"
        reference.mkdir()
        archive = subprocess.run(["git", "archive", args.against], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(reference)], input=archive.stdout, check=True)
        trees = {args.against: reference / "src", "this tree": ROOT / "src"}
        folders = {name: Path(temp) / f"run{i}" for i, name in enumerate(trees)}
        for folder in folders.values():
            folder.mkdir()
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, src in trees.items():
                runs[name].append(contestant(src, folders[name], overrides, args.warmup))
    sys.path.insert(0, str(Path(__file__).parent))
    from workload import machine

    summary = {
        name: {
            "median_ms": round(median(median(run["ms"]) for run in rounds), 2),
            "mean_ms": round(median(mean(run["ms"]) for run in rounds), 2),
        }
        for name, rounds in runs.items()
    }
    ratios = [mean(new["ms"]) / mean(old["ms"]) for new, old in zip(runs["this tree"], runs[args.against], strict=True)]
    print(machine())
    print(f"twin of model=base, steps {args.warmup}..{args.warmup + args.steps - 1}, {args.rounds} rounds")
    for name, row in summary.items():
        print(f"{name:<12} median {row['median_ms']:7.2f} ms  mean {row['mean_ms']:7.2f} ms per step (thread CPU)")
    print(f"this tree / {args.against} (means, per round): {' '.join(f'{r:.3f}' for r in ratios)}")
    print(json.dumps({"against": args.against, **summary, "ratio_of_means": round(median(ratios), 3)}))


if __name__ == "__main__":
    main()
