"""aiayn-report: Table 3's layout over seeds, the paper's numbers beside ours, plots per varied axis."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf
from PIL import Image

from aiayn.cli import report as report_cli
from aiayn.config.compose import compose_run_config
from aiayn.data.corpus import read_lines
from aiayn.experiments.report.document import write_report
from aiayn.scoring import paired_bootstrap
from helpers.extras import dev_extra
from helpers.wandb_records import offline_runs

axes = dev_extra("matplotlib.axes")  # the report extra


@functools.cache
def composed(overrides: tuple[str, ...]) -> str:
    """The resolved config of ``overrides`` (a setting's, without the seed) as YAML: composed once."""
    return OmegaConf.to_yaml(compose_run_config(list(overrides)))


def fake_run(
    folder: Path,
    overrides: list[str],
    bleu: float,
    ppl: float,
    params: int = 2_000_000,
    hypotheses: list[str] | None = None,
    other_hypotheses: Mapping[str, list[str]] | None = None,
    answer_rule: str | None = None,
    **results: Any,
) -> Path:
    """A finished run's folder as aiayn-train leaves it: the resolved config and results.json (more
    ``results``, e.g. ``evaluated`` or ``answer``; without, as an older aiayn-train wrote it) and, given
    ``hypotheses``, its test.hyp.txt; ``other_hypotheses``: other checkpoints' test translations by file
    name (test.ema.hyp.txt). ``checkpoint.answer`` is ``answer_rule``, else the rule that always gives the
    recorded answer (none for an older run)."""
    folder.mkdir(parents=True)
    config = OmegaConf.create(composed(tuple(o for o in overrides if not o.startswith("seed="))))
    config.seed = config.data.seed = next(
        (int(o.split("=")[1]) for o in overrides if o.startswith("seed=")), config.seed
    )
    answer = results.get("answer")
    if answer_rule is None and answer is None:
        del config.checkpoint.answer
    else:
        config.checkpoint.answer = answer_rule or (answer if answer in ("averaged", "ema") else "evaluated")
    OmegaConf.save(config, folder / "config.yaml")
    scores = {"params": params, "val_bleu": bleu, "val_ppl": ppl, "test_bleu": bleu + 1, "steps": 500}
    (folder / "results.json").write_text(json.dumps({**scores, "wall_s": 420.0, "overrides": overrides, **results}))
    (folder / ".hydra").mkdir()
    files = {**({"test.hyp.txt": hypotheses} if hypotheses is not None else {}), **(other_hypotheses or {})}
    for name, lines in files.items():
        (folder / name).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return folder


def table_rows(markdown: str) -> dict[str, list[str]]:
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[1:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells, strict=True))
    return rows


@pytest.fixture
def positional_sweep(tmp_path: Path) -> Path:
    scores = {"sinusoidal": [(20.0, 9.0), (22.0, 8.0)], "learned": [(21.0, 8.5), (21.0, 8.7)], "none": [(5.0, 40.0)]}
    for encoding, runs in scores.items():
        for seed, (bleu, ppl) in enumerate(runs, start=1):
            overrides = ["experiment=mini/base", f"model.positional={encoding}", f"seed={seed}"]
            fake_run(tmp_path / "sweep" / f"model.positional={encoding},seed={seed}", overrides, bleu, ppl)
    unfinished = tmp_path / "sweep" / "model.positional=rope,seed=1"
    (unfinished / ".hydra").mkdir(parents=True)
    return tmp_path / "sweep"


@pytest.mark.slow
def test_settings_are_averaged_over_seeds_beside_the_paper_rows(positional_sweep: Path) -> None:
    written = write_report([positional_sweep], positional_sweep)
    markdown, plots = written.markdown, written.plots
    rows = table_rows(markdown)
    assert list(rows) == ["model.positional=sinusoidal", "model.positional=learned", "model.positional=none"]
    base, learned, none = rows.values()
    assert base["BLEU (val)"] == "21.00 ± 1.41" and base["PPL (val)"] == "8.50 ± 0.71" and base["seeds"] == "2"
    assert base["BLEU (test)"] == "22.00 ± 1.41" and base["steps"] == "500" and base["minutes"] == "7.0"
    assert (base["paper row"], base["paper BLEU"], base["paper PPL"]) == ("base", "25.8", "4.92")  # mini/base
    assert (learned["paper row"], learned["paper BLEU"]) == ("E", "25.7") and learned["BLEU (val)"] == "21.00 ± 0.00"
    assert none["paper row"] == "" and none["BLEU (val)"] == "5.00" and none["seeds"] == "1"
    # Table 3's layout: the first row in full, the others blank where unchanged
    assert (base["d_model"], base["h"], base["positional"]) == ("128", "4", "sinusoidal")
    assert (learned["d_model"], learned["h"], learned["positional"]) == ("", "", "learned")
    assert "1 other run folder(s) without results" in markdown
    assert (
        base["paper params ×10⁶"] == "65" and learned["paper params ×10⁶"] == "65" and none["paper params ×10⁶"] == ""
    )
    assert [p.name for p in plots] == ["bleu_ppl_vs_positional.png"]
    with Image.open(plots[0]) as image:
        assert image.format == "PNG" and image.width > 500
    assert (positional_sweep / "report.md").read_text() == markdown


@pytest.mark.slow
def test_table_2025_compares_each_component_with_the_2017_base_row(tmp_path: Path) -> None:
    """Rows found before base (folder order) still come after it: base is the reference of every p-value;
    a positional spec shows as its name and arguments."""
    hypotheses = {"alibi": ["a b c", "d e f"], "t5": ["a b", "d e"], "base": ["a b c", "d e"]}
    for row, bleu in (("alibi", 24.0), ("t5", 23.0), ("base", 22.0)):
        for seed in (1, 2):
            overrides = [f"experiment=mini2025/{row}", f"seed={seed}"]
            fake_run(tmp_path / "t" / f"{row},{seed}", overrides, bleu + seed, 9.0, hypotheses=hypotheses[row])
    rows = table_rows(write_report([tmp_path / "t"], tmp_path / "t").markdown)
    assert list(rows) == ["experiment=mini2025/base", "experiment=mini2025/alibi", "experiment=mini2025/t5"]
    base, alibi, t5 = rows.values()
    assert (base["positional"], alibi["positional"]) == ("sinusoidal", "alibi")
    assert t5["positional"] == "t5(n_buckets=32, max_distance=128)"
    assert base["p (test)"] == "" and alibi["p (test)"] not in ("", "not tested")


@pytest.mark.slow
def test_plots_follow_what_the_settings_vary(tmp_path: Path) -> None:
    for row, bleu in (("A1", 18.0), ("A2", 20.0), ("base", 21.0), ("A4", 19.0)):
        fake_run(tmp_path / "heads" / row, [f"experiment=mini/{row}", "seed=1"], bleu, 10.0)
    for row in ("C1", "C3", "base"):
        fake_run(tmp_path / "size" / row, [f"experiment=mini/{row}", "seed=1"], 20.0, 10.0, params=int(1e6))
    written = write_report([tmp_path / "heads"], tmp_path / "heads")
    markdown, plots = written.markdown, written.plots
    assert [p.name for p in plots] == ["bleu_ppl_vs_heads.png"]  # rows A change d_k with h: one axis
    rows = table_rows(markdown)
    assert list(rows) == ["experiment=mini/base", "experiment=mini/A1", "experiment=mini/A2", "experiment=mini/A4"]
    assert (rows["experiment=mini/A1"]["h"], rows["experiment=mini/A1"]["d_k"], rows["experiment=mini/A1"]["N"]) == (
        "1",
        "128",
        "",
    )
    assert rows["experiment=mini/A4"]["paper BLEU"] == "25.4"
    plots = write_report([tmp_path / "size"], tmp_path / "size").plots
    assert [p.name for p in plots] == ["bleu_ppl_vs_size.png"]
    fake_run(tmp_path / "size" / "B1", ["experiment=mini/B1", "seed=1"], 20.0, 10.0)
    fake_run(tmp_path / "size" / "D1", ["experiment=mini/D1", "seed=1"], 20.0, 10.0)
    plots = write_report([tmp_path / "size"], tmp_path / "size").plots  # D1 is on no axis; B1 alone on d_k
    assert [p.name for p in plots] == ["bleu_ppl_vs_d_k.png", "bleu_ppl_vs_size.png"]


@pytest.mark.slow
def test_runs_found_twice_count_once_and_seeds_group_whatever_the_order(positional_sweep: Path, tmp_path: Path) -> None:
    one_run = positional_sweep / "model.positional=none,seed=1"
    fake_run(tmp_path / "again", ["++seed=2", "model.positional=none", "experiment=mini/base"], 7.0, 30.0)
    markdown = write_report([positional_sweep, one_run, tmp_path / "again"], tmp_path / "out").markdown
    rows = table_rows(markdown)
    assert (
        rows["model.positional=none"]["seeds"] == "2" and rows["model.positional=none"]["BLEU (val)"] == "6.00 ± 1.41"
    )


@pytest.mark.slow
def test_the_cli_reports_to_w_and_b_and_refuses_folders_without_runs(
    positional_sweep: Path, tmp_path: Path, wandb_offline: None, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report"
    report_cli.main([str(positional_sweep), "--out", str(out), "--wandb", "offline"])
    printed = capsys.readouterr().out
    assert "| model.positional=learned |" in printed and (out / "bleu_ppl_vs_positional.png").is_file()
    (run,) = offline_runs(out)
    (table,) = run.media("table")  # W&B's table holds the cells report.md shows
    logged = json.loads(table.read_text())
    markdown = [line for line in (out / "report.md").read_text().splitlines() if line.startswith("| ")]
    header, *rows = [[cell.strip() for cell in line.strip("|").split(" | ")] for line in markdown]
    assert logged["columns"] == header and logged["data"] == rows and len(rows) == 3
    (image,) = run.media("images")  # the one plot, logged under its file's name
    assert image.name.startswith("bleu_ppl_vs_positional_")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match=r"^2$"):  # the exit status of a usage error
        report_cli.main([str(empty)])
    assert capsys.readouterr().err == (
        f"aiayn-report: error: no finished run (a folder with results.json) under {empty}\n"
    )


def test_the_checkpoint_scored_is_named_and_a_final_checkpoint_shows_the_best_validation_too(tmp_path: Path) -> None:
    runs = {  # setting -> per seed: results.json's evaluated and best_val_bleu (None: an older run without them)
        "sinusoidal": [None, None],
        "learned": [("final", 23.0), ("final", 25.0)],
        "none": [("final", 9.0), ("best", None)],
    }
    for encoding, seeds in runs.items():
        for seed, recorded in enumerate(seeds, start=1):
            extra = {} if recorded is None else {"evaluated": recorded[0], "best_val_bleu": recorded[1]}
            overrides = ["model=tiny", f"model.positional={encoding}", f"seed={seed}"]  # no paper rows to match
            fake_run(tmp_path / "sweep" / f"{encoding},{seed}", overrides, 20.0, 9.0, **extra)
    markdown = write_report([tmp_path / "sweep"], tmp_path / "sweep").markdown
    rows = table_rows(markdown)
    base, learned = (rows[f"model.positional={encoding}"] for encoding in ("sinusoidal", "learned"))
    # seeds scored on different checkpoints are two settings, never one mean: the label tells them apart
    final, best = (rows[f"model.positional=none [checkpoint={kind}]"] for kind in ("final", "best"))
    assert len(rows) == 4 and (final["seeds"], best["seeds"]) == ("1", "1")
    assert (base["checkpoint"], learned["checkpoint"], final["checkpoint"], best["checkpoint"]) == (
        "best",
        "final",
        "final",
        "best",
    )
    assert [row["BLEU (val, best)"] for row in (base, learned, final, best)] == ["-", "24.00 ± 1.41", "9.00", "-"]
    assert "from the checkpoint named in the checkpoint column" in markdown
    assert "BLEU (val, best): the best validation BLEU any validation of the run saw" in markdown
    only_best = tmp_path / "best"
    fake_run(only_best / "a", ["model=tiny", "seed=1"], 20.0, 9.0, evaluated="best", best_val_bleu=20.0)
    markdown = write_report([only_best], only_best).markdown
    assert "BLEU (val, best)" not in markdown and table_rows(markdown)["(as configured)"]["checkpoint"] == "best"


def test_without_a_paired_test_the_p_value_is_a_dash_and_the_reason_is_given(tmp_path: Path, corpus_root: Path) -> None:
    # the references are read from the corpus folder the reader gives (data_root), whatever a run's config says
    references = read_lines(corpus_root / "test_2016_flickr.de")
    corpus = [f"data.root={corpus_root}", "data.eval_limit=16"]
    sweep = tmp_path / "sweep"
    for seed in (1, 2):
        fake_run(sweep / f"base,{seed}", ["model=tiny", *corpus, f"seed={seed}"], 20.0, 9.0, hypotheses=references[:16])
    fake_run(sweep / "heads,1", ["model=tiny", *corpus, "model.n_heads=2", "seed=1"], 20.0, 9.0)  # no test.hyp.txt
    fake_run(sweep / "heads,3", ["model=tiny", *corpus, "model.n_heads=1", "seed=3"], 20.0, 9.0, hypotheses=[])
    gone = ["model=tiny", f"data.root={tmp_path / 'gone'}", "model.d_ff=64", "seed=1"]  # data.root: not in labels
    fake_run(sweep / "gone,1", gone, 20.0, 9.0, hypotheses=references[:16])
    fewer = ["model=tiny", f"data.root={corpus_root}", "data.eval_limit=8", "model.d_ff=32", "seed=2"]
    fake_run(sweep / "fewer,2", fewer, 20.0, 9.0, hypotheses=references[:8])
    shorter = ["model=tiny", *corpus, "model.d_ff=16", "seed=1"]
    fake_run(sweep / "shorter,1", shorter, 20.0, 9.0, hypotheses=references[:15])
    markdown = write_report([sweep], sweep, data_root=corpus_root).markdown
    here, gone_corpus = (f"[corpus=Multi30k {root} (test split test)]" for root in (corpus_root, tmp_path / "gone"))
    first, *others = table_rows(markdown).values()
    assert first["setting"] == f"data.eval_limit=16 {here}" and first["p (test)"] == ""  # the baseline
    assert [row["p (test)"] for row in others] == ["-"] * 5
    reasons = dict(
        line.removeprefix("p (test) of ").split(": -, ", 1) for line in markdown.splitlines() if ": -, " in line
    )
    run = sweep.resolve()
    assert reasons == {
        f"data.eval_limit=16 model.n_heads=2 {here}": f"{run / 'heads,1' / 'test.hyp.txt'} does not exist.",
        f"data.eval_limit=16 model.n_heads=1 {here}": "no seed in common with the first row.",
        f"model.d_ff=64 {gone_corpus}": f"tested with corpus {gone_corpus[8:-1]}, the first row with corpus "
        f"{here[8:-1]}.",
        f"data.eval_limit=8 model.d_ff=32 {here}": f"seed 2: {run / 'base,2'} and {run / 'fewer,2'} were tested on "
        "different references.",
        f"data.eval_limit=16 model.d_ff=16 {here}": f"{run / 'shorter,1' / 'test.hyp.txt'} has 15 lines for 16 test "
        "references.",
    }


def test_every_plotted_point_has_its_error_bar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for encoding, bleus in {"sinusoidal": (20.0, 22.0), "learned": (21.0, 21.5), "none": (5.0,)}.items():
        for seed, bleu in enumerate(bleus, start=1):
            overrides = ["model=tiny", f"model.positional={encoding}", f"seed={seed}"]
            fake_run(tmp_path / f"{encoding},{seed}", overrides, bleu, 9.0)
    drawn = []  # x -> error bar, of every bar chart and line plot the report draws
    for name in ("bar", "errorbar"):
        original = getattr(axes.Axes, name)

        def spy(self: axes.Axes, x: Any, y: Any, *args: Any, _draw: Any = original, **kwargs: Any) -> Any:
            if kwargs.get("fmt") != "none":  # not the error bars bar() draws through errorbar()
                drawn.append(dict(zip(x, kwargs.get("yerr"), strict=True)))
            return _draw(self, x, y, *args, **kwargs)

        monkeypatch.setattr(axes.Axes, name, spy)
    plots = write_report([tmp_path], tmp_path).plots
    assert [p.name for p in plots] == ["bleu_ppl_vs_positional.png"]
    bleu, ppl = drawn  # every point has an error bar: the sample std over seeds, 0 for one seed
    assert bleu == {"sinusoidal": pytest.approx(1.41421356), "learned": pytest.approx(0.35355339), "none": 0.0}
    assert ppl == {"sinusoidal": 0.0, "learned": 0.0, "none": 0.0}  # the same perplexity for every seed


def test_a_run_is_reported_by_its_answer_and_tested_on_its_answers_translations(
    tmp_path: Path, corpus_root: Path
) -> None:
    references = read_lines(corpus_root / "test_2016_flickr.de")[:16]
    worse = [line if i % 2 else "x" for i, line in enumerate(references)]  # half the sentences lost
    tiny = ["model=tiny", f"data.root={corpus_root}", "data.eval_limit=16"]
    sweep = tmp_path / "sweep"  # found in the order of the folders' names: the first row first
    # the first row: a run from before answers were recorded (test_bleu 21, test.hyp.txt) and one whose
    # answer is its evaluated checkpoint: one setting
    fake_run(sweep / "1-base,1", [*tiny, "seed=1"], 20.0, 9.0, hypotheses=references)
    evaluated = {"evaluated": "best", "answer": "best", "answer_test_bleu": 23.0}
    fake_run(sweep / "1-base,2", [*tiny, "seed=2"], 22.0, 9.0, hypotheses=references, **evaluated)
    # the EMA's answer: its test BLEU and translations, not the evaluated checkpoint's (test_bleu 21, as base)
    for seed in (1, 2):
        ema = {"evaluated": "best", "answer": "ema", "answer_test_bleu": 30.0 + seed}
        overrides = [*tiny, "model.d_ff=64", f"seed={seed}"]
        files = {"hypotheses": references, "other_hypotheses": {"test.ema.hyp.txt": worse}}
        fake_run(sweep / f"2-ema,{seed}", overrides, 20.0, 9.0, **files, **ema)
    # the same overrides answered by the averaged checkpoint: another setting, never averaged with the EMA's
    averaged = {"evaluated": "best", "answer": "averaged", "answer_test_bleu": 25.0}
    fake_run(sweep / "3-averaged,1", [*tiny, "model.d_ff=64", "seed=1"], 20.0, 9.0, hypotheses=references, **averaged)
    markdown = write_report([sweep], sweep, data_root=corpus_root).markdown
    rows = table_rows(markdown)
    assert list(rows) == ["(as configured)", "model.d_ff=64 [answer=ema]", "model.d_ff=64 [answer=averaged]"]
    _, ema_row, averaged_row = rows.values()
    assert [(r["checkpoint"], r["answer"], r["seeds"]) for r in rows.values()] == [
        ("best", "best", "2"),
        ("best", "ema", "2"),
        ("best", "averaged", "1"),
    ]
    assert [r["BLEU (test)"] for r in rows.values()] == ["22.00 ± 1.41 ‡", "31.50 ± 0.71 ‡", "25.00 ‡"]
    assert [r["BLEU (val)"] for r in rows.values()] == ["21.00 ± 1.41", "20.00 ± 0.00", "20.00"]
    # the EMA's translations of both seeds against the first row's: its test.hyp.txt, alike the first row's,
    # would differ in nothing
    expected = paired_bootstrap([("base", references * 2), ("ema", worse * 2)], references * 2).systems[1].p_value
    assert expected < 0.05 and ema_row["p (test)"] == f"{expected:.4f}*"
    assert averaged_row["p (test)"] == "-"
    missing = sweep.resolve() / "3-averaged,1" / "test.averaged.hyp.txt"
    assert f"p (test) of model.d_ff=64 [answer=averaged]: -, {missing} does not exist." in markdown


def test_runs_answered_by_validation_are_one_setting_whatever_each_chose(tmp_path: Path, corpus_root: Path) -> None:
    references = read_lines(corpus_root / "test_2016_flickr.de")[:16]
    worse = [line if i % 2 else "x" for i, line in enumerate(references)]
    tiny = ["model=tiny", f"data.root={corpus_root}", "data.eval_limit=16"]
    sweep = tmp_path / "sweep"
    for seed in (1, 2):
        fake_run(sweep / f"1-base,{seed}", [*tiny, f"seed={seed}"], 20.0, 9.0, hypotheses=references)
    # checkpoint.answer=by_validation: seed 1 answered with its EMA, seed 2 with its average; each run's test
    # BLEU and translations are its own answer's, and the two are one setting, as their rule is one
    chose = {1: ("ema", "test.ema.hyp.txt", 30.0), 2: ("averaged", "test.averaged.hyp.txt", 32.0)}
    for seed, (answer, translations, bleu) in chose.items():
        results = {"evaluated": "best", "answer": answer, "answer_test_bleu": bleu}
        files = {"hypotheses": references, "other_hypotheses": {translations: worse}}
        overrides = [*tiny, "model.d_ff=64", f"seed={seed}"]
        fake_run(sweep / f"2-chosen,{seed}", overrides, 20.0, 9.0, answer_rule="by_validation", **files, **results)
    rows = table_rows(write_report([sweep], sweep, data_root=corpus_root).markdown)
    assert list(rows) == ["(as configured)", "model.d_ff=64"]
    chosen = rows["model.d_ff=64"]
    assert (chosen["answer"], chosen["seeds"], chosen["BLEU (test)"]) == ("by_validation", "2", "31.00 ± 1.41 ‡")
    # paired by seed with the first row, each on the translations of the checkpoint it answered with
    expected = paired_bootstrap([("base", references * 2), ("chosen", worse * 2)], references * 2).systems[1].p_value
    assert expected < 0.05 and chosen["p (test)"] == f"{expected:.4f}*"
