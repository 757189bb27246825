"""``aiayn-report <run folders or sweep folders>``: a Table-3-style markdown table and plots of finished runs.

Writes ``report.md`` and ``bleu_ppl_vs_<axis>.png`` into ``--out`` (default: the first folder given) and
prints the table, with each setting's test BLEU tested against the first row's (sacreBLEU's paired
bootstrap on the test translations of the runs' answers, paired by seed; the test references are read
from the corpus folder ``--data-root`` names, never from where a run's config says); with ``--comet MODEL``
also each setting's test COMET and its paired test. With W&B online (logged in, or
``--wandb online``) it also logs the table and the plots to a W&B run of job type ``report``, whose files
go into ``--out`` too.

The folders may be someone else's: a malformed run or sweep found in them is skipped with one warning
line naming the file and the field; one named directly (its folder, or its results.json, config.yaml or
sweep.json) is refused with exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from aiayn.cli.common import reported_as_usage_errors
from aiayn.errors import FieldError, show
from aiayn.experiments import report
from aiayn.experiments.report.document import write_report
from aiayn.experiments.report.table import Table
from aiayn.training.loggers.wandb_identity import WANDB_MODES, wandb_mode

if TYPE_CHECKING:
    from aiayn.evaluation.comet import CometSettings


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="aiayn-report",
        description="A Table-3-style markdown table and plots of finished runs, with paired bootstrap p-values "
        "of each setting's test BLEU against the first row's.",
    )
    parser.add_argument(
        "paths", type=Path, nargs="+", help="run folders, sweep folders, folders holding them, or a run's results.json"
    )
    parser.add_argument("--out", type=Path, help="where report.md and the plots go (default: the first folder)")
    parser.add_argument(
        "--data-root",
        type=Path,
        help="your copy of the runs' corpus, which the test references of the p-values are read from "
        "(default: none; the p-values are then left out)",
    )
    parser.add_argument(
        "--comet",
        metavar="MODEL",
        help="also score each run's test translations with this COMET model (a folder of unbabel-comet's format "
        "or a Hub id in the Hugging Face cache), with its paired test; needs --data-root and aiayn[comet]",
    )
    parser.add_argument(
        "--comet-download", action="store_true", help="fetch a --comet Hub id missing from the cache (default: never)"
    )
    parser.add_argument("--comet-batch-size", type=int, default=16, help="segments per COMET batch (default: 16)")
    parser.add_argument("--wandb", choices=WANDB_MODES, default="auto", help="W&B for the report (auto: if logged in)")
    parser.add_argument("--project", default="aiayn", help="the W&B project of the report run")
    return parser.parse_args(argv)


def log_to_wandb(table: Table, plots: list[Path], mode: str, project: str, output: Path) -> str:
    """The table (the cells report.md shows) and the plots, in a W&B run; returns where the run is."""
    import wandb

    run = wandb.init(project=project, job_type="report", name=f"report {output.name}", mode=mode, dir=str(output))
    try:
        columns, data = list(table.header), [list(row) for row in table.rows]
        run.log({"table3": wandb.Table(columns=columns, data=data), **{p.stem: wandb.Image(str(p)) for p in plots}})
        return run.url or run.settings.sync_dir
    finally:
        run.finish()


class WarningLines(logging.Handler):
    """The report's warnings (a malformed file skipped) as ``aiayn-report: warning: ...`` lines on the
    standard error of the moment (a test's captured one, too)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.setFormatter(logging.Formatter("aiayn-report: warning: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr)


def comet_settings(args: argparse.Namespace) -> CometSettings | None:
    """``--comet`` and its options, checked."""
    if args.comet is None:
        return None
    from aiayn.evaluation.comet import CometSettings

    try:
        return CometSettings(args.comet, args.comet_download, args.comet_batch_size)
    except FieldError as error:
        option = {"comet_model": "--comet", "comet_batch_size": "--comet-batch-size"}[error.field]
        raise ValueError(f"{option} {show(error.value)} {error.allowed}") from None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report_log = logging.getLogger(report.__name__)  # the report's modules log below it
    if not any(isinstance(handler, WarningLines) for handler in report_log.handlers):
        report_log.addHandler(WarningLines())
    with reported_as_usage_errors("aiayn-report"):
        if args.data_root is not None and not args.data_root.is_dir():
            raise ValueError(f"--data-root {args.data_root} is not a folder; give your copy of the runs' corpus")
        first = args.paths[0]
        output = args.out or (first.parent if first.is_file() else first)  # a results.json given: its folder
        written = write_report(args.paths, output, args.data_root, comet_settings(args))
        print(written.markdown)
        print(f"written: {output / 'report.md'}" + "".join(f", {p}" for p in [*written.exports, *written.plots]))
        mode, _ = wandb_mode(args.wandb)
        if mode == "online" or args.wandb == "offline":
            if (output / "wandb").is_symlink():  # W&B writes into <out>/wandb: a link would take it elsewhere
                raise ValueError(f"{output / 'wandb'} is a link; remove it or give --out <another folder>")
            print(f"W&B: {log_to_wandb(written.table, written.plots, mode, args.project, output)}")


if __name__ == "__main__":
    main()
