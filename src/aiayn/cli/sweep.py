"""``aiayn-sweep <sweep file>``: run a W&B sweep file's trials here, without a W&B server.

The same file works with ``wandb sweep <file>`` + ``wandb agent <id>``; this runs its trials one after
another (or ``--parallel N`` at a time; on a GPU machine each on GPUs of its own), logs them to W&B
offline and records them in the sweep's folder, so that running it again skips what has finished.
``--launcher slurm`` submits each trial as a SLURM job instead (the settings of ``hardware=slurm``); the
runner stays where it was started, and started again it re-attaches to the jobs it submitted.
``--dry-run`` lists the trials and checks that each
composes as a Hydra config, without training. Ctrl-C or SIGTERM stops the running trials gently (they save
their last checkpoint) and exits with 128 + the signal; a second Ctrl-C kills them at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from aiayn.cli.common import reported_as_usage_errors
from aiayn.experiments.sweeps.file import expand, load_sweep, trial_command, trial_count, with_overrides
from aiayn.experiments.sweeps.runner import SweepStopped, run_sweep
from aiayn.experiments.sweeps.state import FINISHED, LAUNCHERS, LOCAL, Trial
from aiayn.experiments.sweeps.trial import NotComposed, compose_trial

DRY_RUN_LIMIT = 100  # trials listed for a random or bayes sweep without a count


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="aiayn-sweep", description="Run a W&B sweep file's trials here, without a W&B server."
    )
    parser.add_argument("sweep", type=Path, help="a W&B sweep file (sweeps/*.yaml)")
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides added to every trial's command (they win over the file's)"
    )
    parser.add_argument(
        "--dir", type=Path, help="the sweep's folder (default: $AIAYN_OUTPUT/sweeps/<sweep name>, else outputs/...)"
    )
    parser.add_argument(
        "--count", type=int, help="trials in the sweep in all (default: the file's run_cap; a grid: all of it)"
    )
    parser.add_argument("--parallel", type=int, default=1, help="trials running (or submitted) at a time (default: 1)")
    parser.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default=LOCAL,
        help="local: processes here, each on GPUs of its own where there are GPUs; slurm: each trial a SLURM job "
        "(hardware=slurm's settings, through submitit); submitit-local: submitit's jobs as local processes",
    )
    parser.add_argument("--dry-run", action="store_true", help="list the trials and compose each; train nothing")
    return parser.parse_intermixed_args(argv)


def dry_run(args: argparse.Namespace) -> int:
    """Print each trial's command; 0 when every one composes, else 2 with Hydra's reason per trial."""
    config = with_overrides(load_sweep(args.sweep), args.overrides)
    ends = config["method"] == "grid" or args.count or config.get("run_cap")
    limit = trial_count(config, args.count, args.sweep) if ends else None
    failures = 0
    trials = expand(config, limit or DRY_RUN_LIMIT)
    if limit is None and len(trials) == DRY_RUN_LIMIT:
        print(f"the first {DRY_RUN_LIMIT} trials of a {config['method']} sweep (--count N for more):")
    for number, params in enumerate(trials, start=1):
        command = trial_command(config, params)
        print(f"trial {number}: {' '.join(command)}")
        try:
            compose_trial(command)
        except NotComposed as error:
            failures += 1
            print(f"  does not compose: {error.reason}", file=sys.stderr)
    return 2 if failures else 0


def show(trial: Trial) -> None:
    outcome = f"metric {trial.metric:.4g}" if trial.metric is not None else (trial.error or trial.state)
    params = " ".join(f"{key}={value}" for key, value in trial.params.items())
    where = f" on device(s) {','.join(trial.devices) or 'none'}" if trial.devices is not None else ""
    job = f" [{trial.launcher} job {trial.job_id}]" if trial.submitted else ""
    print(f"{trial.name} {trial.state}{where}{job} ({outcome}): {params}", flush=True)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    args = parse_args(argv)
    with reported_as_usage_errors("aiayn-sweep"):
        if args.dry_run:
            sys.exit(dry_run(args))
        try:
            state = run_sweep(
                args.sweep,
                args.dir,
                args.count,
                args.parallel,
                report=show,
                launcher=args.launcher,
                overrides=args.overrides,
            )
        except SweepStopped as stopped:  # while trials ran: they were stopped and recorded
            print(f"aiayn-sweep: {stopped}", file=sys.stderr)
            sys.exit(128 + stopped.signum)
        except KeyboardInterrupt:  # before any trial started
            print("aiayn-sweep: interrupted; run the same command again to continue", file=sys.stderr)
            sys.exit(130)
    trials, folder = state.trials, os.path.relpath(state.folder)
    failed = [trial for trial in trials if trial.state != FINISHED]
    print(f"{len(trials) - len(failed)} of {len(trials)} trials finished; folder {folder}")
    print(f"table and plots: aiayn-report {folder}")
    if failed:
        print("failed: " + ", ".join(f"{trial.name} ({trial.error})" for trial in failed), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
