"""Start-up of the commands that do not train: each one's `--help` against `python -c "import torch"`.

Issue 27 asks that they start without Lightning, in at most 1.5x the time Python takes to import torch on
the same machine. Each round starts, in fresh processes of this Python, `import torch` and then every
command's `--help` as its console script runs it (its module imported, its `main()` called); the rounds
interleave them, so that the machine's slow moments hit all alike, after `--warmup` untimed rounds that
bring the files into the page cache. Prints the medians and each command's ratio to `import torch` as
one JSON line, and exits with status 1 when a ratio exceeds `--limit` (naming the commands).
The commands are aiayn's installed console scripts except `aiayn-train`, or those of `--commands`.
Usage: python benchmarks/startup.py [--rounds 5] [--warmup 1] [--limit 1.5] [--commands aiayn-eval ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from importlib.metadata import entry_points, version
from statistics import median

BASELINE = "import torch"


def console_scripts() -> dict[str, str]:
    """aiayn's console scripts that do not train: name → ``module:function``."""
    scripts = entry_points(group="console_scripts")
    return {s.name: s.value for s in scripts if s.dist and s.dist.name == "aiayn" and s.name != "aiayn-train"}


def program(name: str, target: str) -> str:
    """What the console script ``name`` runs, as a ``python -c`` program: its module, then its function
    with ``--help``."""
    module, _, function = target.partition(":")
    return f"import sys; sys.argv = [{name!r}, '--help']; from {module} import {function}; sys.exit({function}())"


def seconds(code: str) -> float:
    """Wall time of a fresh ``python -c code``, which must exit 0."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"python -c {code!r} exited {done.returncode}: {done.stderr.decode()[-500:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (medians over them)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--limit", type=float, default=1.5, help="the most a command may take, in import-torch times")
    parser.add_argument("--commands", nargs="+", help="these console scripts only (default: all but aiayn-train)")
    args = parser.parse_args()
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be at least 1 and --warmup at least 0")
    scripts = console_scripts()
    if unknown := sorted(set(args.commands or ()) - set(scripts)):
        parser.error(f"not a console script of aiayn (or aiayn-train): {', '.join(unknown)}")
    programs = {BASELINE: BASELINE} | {name: program(name, scripts[name]) for name in args.commands or sorted(scripts)}

    timings: dict[str, list[float]] = {name: [] for name in programs}
    for round_ in range(args.warmup + args.rounds):
        for name, code in programs.items():
            elapsed = seconds(code)
            if round_ >= args.warmup:
                timings[name].append(elapsed)
    medians = {name: median(times) for name, times in timings.items()}
    torch_s = medians.pop(BASELINE)
    ratios = {name: round(s / torch_s, 3) for name, s in medians.items()}
    over = sorted(name for name, ratio in ratios.items() if ratio > args.limit)
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, torch {version('torch')}",
        "rounds": args.rounds,
        "import_torch_s": round(torch_s, 3),
        "help_s": {name: round(s, 3) for name, s in medians.items()},
        "ratio": ratios,
        "limit": args.limit,
        "over_limit": over,
    }
    print(json.dumps(result))
    if over:
        sys.exit(f"start-up over {args.limit}x import torch: {', '.join(f'{n} {ratios[n]}x' for n in over)}")


if __name__ == "__main__":
    main()
