"""``aiayn-average``: average the newest N checkpoints of a run (or given ones) into one (§6.1)."""

from __future__ import annotations

import argparse
from pathlib import Path

from aiayn.cli.common import reported_as_usage_errors
from aiayn.files import same_file
from aiayn.training.checkpoints import CheckpointError, average_checkpoints, save_checkpoint, step_checkpoints


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="aiayn-average",
        description="Average model weights element-wise. The paper averages the last 5 checkpoints of a base "
        "model and the last 20 of a big one.",
    )
    parser.add_argument(
        "inputs", nargs="+", type=Path, help="a run folder (its newest step checkpoints), or .ckpt files"
    )
    parser.add_argument("--last", "-n", type=int, default=5, help="with a run folder: how many newest (default 5)")
    parser.add_argument("--output", "-o", type=Path, help="default: <run>/checkpoints/averaged-last<N>.ckpt")
    parser.add_argument(
        "--across-seeds",
        action="store_true",
        help="average checkpoints of runs that differ only in their seed (otherwise refused: one run's only)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with reported_as_usage_errors("aiayn-average"):
        if len(args.inputs) == 1 and args.inputs[0].is_dir():
            run = args.inputs[0]
            if args.last < 1:
                raise CheckpointError(f"--last={args.last} must be at least 1")
            found = step_checkpoints(run)
            if len(found) < args.last:
                raise CheckpointError(
                    f"{run} has {len(found)} step checkpoints, fewer than --last={args.last}; "
                    "lower --last or keep more (checkpoint.keep_last)"
                )
            paths = found[-args.last :]
            output = args.output or paths[-1].parent / f"averaged-last{args.last}.ckpt"
        else:
            paths = args.inputs
            if len(paths) == 1 and not paths[0].exists():
                raise CheckpointError(f"{paths[0]} does not exist; give a run folder or checkpoint files")
            if args.output is None:
                raise CheckpointError("with checkpoint files as inputs, --output is required")
            output = args.output
        if output.exists() and any(same_file(output, path) for path in paths):
            raise CheckpointError(f"--output {output} is one of the inputs; write the average to a new file")
        save_checkpoint(average_checkpoints(paths, args.across_seeds), output)
    print(f"averaged {len(paths)} checkpoints ({', '.join(p.name for p in paths)}) into {output}")


if __name__ == "__main__":
    main()
