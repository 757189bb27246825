"""``aiayn-report <run folders or sweep folders>``: a Table-3-style markdown table and plots of finished runs.

Writes ``report.md`` and ``bleu_ppl_vs_<axis>.png`` into the folder given (or ``--out``) and prints the
table, with each setting's test BLEU tested against the first row's (sacreBLEU's paired bootstrap on the
runs' ``test.hyp.txt``, paired by seed; the test references are read from each run's corpus). With W&B
online (logged in, or ``--wandb online``) it also logs the table and the plots to a W&B run of job type
``report``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from aiayn.cli.common import reported_as_usage_errors
from aiayn.experiments.report import write_report
from aiayn.training.loggers import WANDB_MODES, wandb_mode


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="aiayn-report",
        description="A Table-3-style markdown table and plots of finished runs, with paired bootstrap p-values "
        "of each setting's test BLEU against the first row's.",
    )
    parser.add_argument("paths", type=Path, nargs="+", help="run folders, sweep folders, or folders holding them")
    parser.add_argument("--out", type=Path, help="where report.md and the plots go (default: the first path)")
    parser.add_argument("--wandb", choices=WANDB_MODES, default="auto", help="W&B for the report (auto: if logged in)")
    parser.add_argument("--project", default="aiayn", help="the W&B project of the report run")
    return parser.parse_args(argv)


def log_to_wandb(markdown: str, plots: list[Path], mode: str, project: str, output: Path) -> str:
    """The table (parsed back from the markdown, so W&B shows what report.md shows) and the plots, in
    a W&B run; returns where the run is."""
    import wandb

    rows = [line.strip("|").split("|") for line in markdown.splitlines() if line.startswith("| ")]
    header, *body = [[cell.strip() for cell in row] for row in rows]
    run = wandb.init(project=project, job_type="report", name=f"report {output.name}", mode=mode, dir=str(output))
    try:
        run.log({"table3": wandb.Table(columns=header, data=body), **{p.stem: wandb.Image(str(p)) for p in plots}})
        return run.url or run.settings.sync_dir
    finally:
        run.finish()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with reported_as_usage_errors("aiayn-report"):
        output = args.out or args.paths[0]
        markdown, plots = write_report(args.paths, output)
        print(markdown)
        print(f"written: {output / 'report.md'}" + "".join(f", {p}" for p in plots))
        mode, _ = wandb_mode(args.wandb)
        if mode == "online" or args.wandb == "offline":
            print(f"W&B: {log_to_wandb(markdown, plots, mode, args.project, output)}")


if __name__ == "__main__":
    main()
