"""A checkpoint's training state is aiayn's own before Lightning restores it: a shared checkpoint whose
tracker names files elsewhere (through a protocol, ``..`` or a link) has that tracker dropped and
deletes nothing outside the run's ``checkpoints/``; foreign optimizer rules, weights, loop counters and
generator states end the resume in one line naming the file and the field."""

from __future__ import annotations

import copy
import csv
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from aiayn.errors import CheckpointError
from aiayn.experiments.resume import NOT_COMPARED
from aiayn.training.checkpoint_io import RunCheckpointIO
from aiayn.training.checkpoints import remove_plain_file
from aiayn.training.restored_state import RestoredState
from aiayn.training.schedule import NoamSchedule
from helpers.runs import SMOKE_RUN_EXTRA, copy_of, rebased, smoke_run, train_in_process

BEST = "ModelCheckpoint{'monitor': 'val/bleu', 'mode': 'max', 'every_n_train_steps': 0, 'every_n_epochs': 1, 'train_time_interval': None}"  # noqa: E501
STEPS = "ModelCheckpoint{'monitor': 'step', 'mode': 'max', 'every_n_train_steps': 0, 'every_n_epochs': 1, 'train_time_interval': None}"  # noqa: E501


def poisoned(run: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    """The run's ``last.ckpt`` after ``change``, saved in place."""
    path = run / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    change(checkpoint)
    torch.save(checkpoint, path)
    return path


def sentinel_tree(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    (victim / "inner").mkdir(parents=True)
    (victim / "inner" / "keep.txt").write_text("precious")
    return victim


def resume(run: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, *extra: str) -> int:
    argv = [
        *smoke_run(corpus_root, cache_dir, *SMOKE_RUN_EXTRA),
        f"hydra.run.dir={run}",
        "trainer.max_steps=18",
        *extra,
    ]
    return train_in_process(argv, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["local://", ""])
def test_a_shared_tracker_naming_a_folder_elsewhere_deletes_nothing(
    smoke_run_dir: Path,
    tmp_path: Path,
    corpus_root: Path,
    cache_dir: Path,
    protocol: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The audit's reproduction: a tracker with no ``dirpath`` (so Lightning restores it), a worse score
    than any validation, and a folder outside the run as its best file; the next better validation
    would remove that file, recursively, through fsspec. The tracker is dropped instead."""
    run = copy_of(smoke_run_dir, tmp_path)
    victim = sentinel_tree(tmp_path)

    def poison(checkpoint: dict[str, Any]) -> None:
        tracker = checkpoint["callbacks"][BEST]
        del tracker["dirpath"]
        tracker["best_model_path"] = f"{protocol}{victim}"
        tracker["best_model_score"] = torch.tensor(-1.0)
        tracker["best_k_models"] = {f"{protocol}{victim}": torch.tensor(-1.0)}
        tracker["kth_best_model_path"] = f"{protocol}{victim}"

    poisoned(run, poison)
    with caplog.at_level(logging.WARNING):
        assert resume(run, corpus_root, cache_dir, monkeypatch) == 0
    assert (victim / "inner" / "keep.txt").read_text() == "precious"
    assert "dropped callbacks" in caplog.text and "is not a file of" in caplog.text
    # A copied folder: the step tracker's dirpath is the original's, so it starts afresh too.
    assert {"best.ckpt", "last.ckpt", "step0000018.ckpt"} <= {p.name for p in (run / "checkpoints").iterdir()}


def test_a_checkpoint_from_another_folder_continues_without_its_bookkeeping(
    smoke_run_dir: Path,
    tmp_path: Path,
    corpus_root: Path,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Weights, moments, schedule and data position continue; the trackers of the other folder (here
    pointing into that folder, whose files must survive) start afresh in the new one."""
    shared = copy_of(smoke_run_dir, tmp_path / "shared")
    before = sorted(p.name for p in (shared / "checkpoints").iterdir())
    run = tmp_path / "mine"
    with caplog.at_level(logging.WARNING):
        code = resume(run, corpus_root, cache_dir, monkeypatch, f"resume={shared / 'checkpoints' / 'last.ckpt'}")
    assert code == 0
    assert sorted(p.name for p in (shared / "checkpoints").iterdir()) == before
    assert "starts afresh here" in caplog.text
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 18
    made_here = ["best.ckpt", "ema.ckpt", "last.ckpt", "step0000018.ckpt"]  # ema.ckpt: the default's EMA, tested
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == made_here


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("param_groups[0].maximize", lambda c: c["optimizer_states"][0]["param_groups"][0].update(maximize=True)),
        ("param_groups[0].amsgrad", lambda c: c["optimizer_states"][0]["param_groups"][0].update(amsgrad=True)),
        ("param_groups[0].weight_decay", lambda c: c["optimizer_states"][0]["param_groups"][0].update(weight_decay=1)),
        ("param_groups[0].nesterov", lambda c: c["optimizer_states"][0]["param_groups"][0].update(nesterov=True)),
        ("param_groups[0].params", lambda c: c["optimizer_states"][0]["param_groups"][0]["params"].pop()),
        ("state[0].exp_avg", lambda c: c["optimizer_states"][0]["state"][0].update(exp_avg=torch.zeros(3))),
        ("state_dict['model.src_embed.weight']", lambda c: c["state_dict"].update({"model.src_embed.weight": 1})),
        ("epoch_progress.total.ready", lambda c: c["loops"]["fit_loop"]["epoch_progress"]["total"].update(ready=-1)),
        (
            "combined_loader[0].position",
            lambda c: c["loops"]["fit_loop"]["state_dict"]["combined_loader"][0].update(position="0"),
        ),
        ("['RandomState'].ranks[0]", lambda c: c["callbacks"]["RandomState"]["ranks"][0].update(torch=torch.zeros(3))),
        (
            "['TokenThroughput'].ranks[0].seconds",
            lambda c: c["callbacks"]["TokenThroughput"]["ranks"][0].update(seconds=float("nan")),
        ),
        ("lr_schedulers[0].last_epoch", lambda c: c["lr_schedulers"][0].update(last_epoch=2**60)),
        ("pytorch-lightning_version", lambda c: c.update({"pytorch-lightning_version": "0.1 || rm"})),
        (
            "param_groups[0].weight_decay",
            lambda c: c["optimizer_states"][0]["param_groups"][0].update(weight_decay=torch.zeros(3)),
        ),
        ("param_groups[0].lr", lambda c: c["optimizer_states"][0]["param_groups"][0].update(lr=10**400)),
        (
            "param_groups[0].params",
            lambda c: c["optimizer_states"][0]["param_groups"][0].update(params=torch.arange(65)),
        ),
        (
            "state[0].exp_avg_sq",
            lambda c: c["optimizer_states"][0]["state"][0].update(
                exp_avg_sq=-c["optimizer_states"][0]["state"][0]["exp_avg_sq"] - 1
            ),
        ),
        ("combined_loader[0].epoch", lambda c: c["loops"]["fit_loop"]["state_dict"]["combined_loader"][0].pop("epoch")),
        ("['RandomState'].ranks[0]", lambda c: c["callbacks"]["RandomState"]["ranks"][0].update(cuda="x")),
        (
            "best_k_models[",
            lambda c: c["callbacks"][STEPS]["best_k_models"].update(
                dict.fromkeys(c["callbacks"][STEPS]["best_k_models"], 10**400)
            ),
        ),
    ],
)
def test_training_state_aiayn_does_not_write_is_refused_naming_the_field(
    smoke_restorer: RestoredState, smoke_run_dir: Path, field: str, change: Callable[[dict[str, Any]], None]
) -> None:
    path = smoke_run_dir / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    smoke_restorer(copy.deepcopy(checkpoint), path)  # as written, it passes
    change(checkpoint)
    with pytest.raises(CheckpointError) as refused:
        smoke_restorer(checkpoint, path)
    message = str(refused.value)
    assert "\n" not in message and str(path) in message and field in message, message


def test_a_foreign_optimizer_rule_ends_the_resume_in_one_line_before_any_step(
    smoke_run_dir: Path,
    tmp_path: Path,
    corpus_root: Path,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    run = copy_of(smoke_run_dir, tmp_path)
    path = poisoned(run, lambda c: c["optimizer_states"][0]["param_groups"][0].update(maximize=True))
    assert resume(run, corpus_root, cache_dir, monkeypatch) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and str(path) in error[0] and "param_groups[0].maximize=True" in error[0], error
    assert torch.load(path, weights_only=True)["global_step"] == 12  # nothing trained, nothing saved


@pytest.mark.parametrize(
    "named",
    [
        "local://{victim}",
        "file://{victim}",
        "simplecache::file://{folder}/best.ckpt",
        "memory://best.ckpt",
        "{folder}/../../victim",
        "{folder}/sub/best.ckpt",
        "{victim}",
        "best.ckpt",
    ],
)
def test_a_tracker_naming_anything_but_a_file_of_the_run_is_dropped(
    smoke_restorer: RestoredState, smoke_run_dir: Path, tmp_path: Path, named: str
) -> None:
    folder = smoke_run_dir / "checkpoints"
    path = folder / "last.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    assert set(smoke_restorer(copy.deepcopy(checkpoint), path)["callbacks"]) >= {BEST, STEPS}
    value = named.format(victim=sentinel_tree(tmp_path), folder=folder)
    for field in ("best_model_path", "kth_best_model_path", "last_model_path", "best_k_models"):
        changed = copy.deepcopy(checkpoint)
        tracker = changed["callbacks"][BEST]
        tracker[field] = {value: torch.tensor(1.0)} if field == "best_k_models" else value
        assert BEST not in smoke_restorer(changed, path)["callbacks"], (field, value)
    moved = copy.deepcopy(checkpoint)
    moved["callbacks"][STEPS]["dirpath"] = str(tmp_path)
    assert STEPS not in smoke_restorer(moved, path)["callbacks"]
    cut = copy.deepcopy(checkpoint)  # Lightning reads best_model_score and best_model_path without a default
    cut["callbacks"][STEPS] = {"monitor": "step"}
    assert STEPS not in smoke_restorer(cut, path)["callbacks"]


@pytest.mark.parametrize(
    ("tracker", "named"), [(STEPS, "best.ckpt"), (STEPS, "averaged.ckpt"), (BEST, "step0000006.ckpt")]
)
def test_a_tracker_naming_a_file_another_writes_is_dropped(
    smoke_restorer: RestoredState, smoke_run_dir: Path, tracker: str, named: str
) -> None:
    """Lightning deletes what a tracker's state names once it is displaced: the step checkpoints' tracker
    naming best.ckpt would delete it, the best one's naming a step checkpoint would delete that."""
    folder = smoke_run_dir / "checkpoints"
    path = folder / "last.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    for field in ("best_model_path", "kth_best_model_path", "best_k_models"):
        changed = copy.deepcopy(checkpoint)
        value = str(folder / named)
        changed["callbacks"][tracker][field] = {value: torch.tensor(1.0)} if field == "best_k_models" else value
        assert tracker not in smoke_restorer(changed, path)["callbacks"], field
    assert tracker in smoke_restorer(copy.deepcopy(checkpoint), path)["callbacks"]


@pytest.mark.slow
@pytest.mark.parametrize("keep_last", [1, 2, 3])
def test_a_resume_from_a_checkpoint_holding_one_step_checkpoint_finishes_with_any_keep_last(
    smoke_run_dir: Path, tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch,
    keep_last: int,
) -> None:  # fmt: skip
    """step0000006.ckpt's tracker holds one file of the two it keeps (its k-th is still unset): a run that
    keeps fewer displaces one at once, and must know which (it looked up '' and crashed)."""
    run = copy_of(smoke_run_dir, tmp_path)
    older = run / "checkpoints" / "step0000006.ckpt"
    moved = torch.load(older, weights_only=True)  # the copy's trackers name its own files, as the run's did
    for tracker in (BEST, STEPS):
        moved["callbacks"][tracker] = json.loads(json.dumps(moved["callbacks"][tracker], default=float).replace(
            str(smoke_run_dir), str(run)))  # fmt: skip
    torch.save(moved, older)
    assert resume(run, corpus_root, cache_dir, monkeypatch, f"resume={older}", f"checkpoint.keep_last={keep_last}") == 0
    kept = sorted(path.name for path in (run / "checkpoints").glob("step*.ckpt"))
    # Lightning never deletes the checkpoint a run resumed from; of the others, the newest keep_last stay.
    assert kept == ["step0000006.ckpt", *["step0000012.ckpt", "step0000018.ckpt"][-keep_last:]]
    assert json.loads((run / "results.json").read_text())["steps"] == 18


def test_a_checkpoint_with_another_tokenizer_than_the_cache_is_not_resumed(
    smoke_run_dir: Path,
    tmp_path: Path,
    corpus_root: Path,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    """The cache entry's name matches, the bytes do not: its ids would mean other pieces."""
    run = copy_of(smoke_run_dir, tmp_path)
    path = poisoned(run, lambda c: c["aiayn"].update(tokenizer=c["aiayn"]["tokenizer"] + b"\x00"))
    assert resume(run, corpus_root, cache_dir, monkeypatch) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and f"checkpoint {path} holds another tokenizer" in error[0], error


@pytest.mark.slow
@pytest.mark.parametrize(
    "entry",
    [
        "run.lock",
        "checkpoints",
        "train.log",
        ".hydra",
        ".hydra/config.yaml",
        "checkpoints/abandoned-after-step6",
        "checkpoints/abandoned-after-step6/last.ckpt",
        "csv/metrics.csv",
    ],
)
def test_a_run_folder_with_a_link_in_it_is_not_continued(
    smoke_run_dir: Path,
    tmp_path: Path,
    corpus_root: Path,
    cache_dir: Path,
    entry: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    """A copied folder's link would make the run write elsewhere: the lock file truncated, another run's
    checkpoints taken as its own and pruned, a log appended to a file of the user's."""
    run = copy_of(smoke_run_dir, tmp_path)
    victim = sentinel_tree(tmp_path)
    target = victim / "inner" / "keep.txt" if entry in ("run.lock", "train.log") else victim
    (run / entry).parent.mkdir(parents=True, exist_ok=True)
    if (run / entry).is_dir():
        shutil.rmtree(run / entry)
    (run / entry).unlink(missing_ok=True)
    (run / entry).symlink_to(target)
    assert resume(run, corpus_root, cache_dir, monkeypatch) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and f"{run / entry}: is a link" in error[0], error
    assert (victim / "inner" / "keep.txt").read_text() == "precious" and sorted(victim.iterdir()) == [victim / "inner"]


def test_deletion_removes_only_plain_files_directly_inside_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    victim = sentinel_tree(tmp_path)
    (folder / "step0000006.ckpt").write_bytes(b"x")
    (folder / "sub").mkdir()
    (folder / "link.ckpt").symlink_to(victim / "inner" / "keep.txt")
    (folder / "dirlink").symlink_to(victim)
    refused = [
        victim,
        f"local://{victim}",
        f"file://{folder / 'step0000006.ckpt'}",
        folder / ".." / "checkpoints" / "step0000006.ckpt",
        folder / "sub",
        folder / "link.ckpt",
        folder / "dirlink",
        folder / "dirlink" / "inner",
        str(folder).encode(),
    ]
    for path in refused:
        assert not remove_plain_file(path, folder), path
    assert (victim / "inner" / "keep.txt").read_text() == "precious"
    assert (folder / "step0000006.ckpt").exists() and (folder / "sub").is_dir()
    RunCheckpointIO(folder).remove_checkpoint(str(folder / "step0000006.ckpt"))
    assert not (folder / "step0000006.ckpt").exists()


def test_every_setting_a_resume_reports_as_applied_is_in_force(
    smoke_run_dir: Path,
    tmp_path: Path,
    corpus_root: Path,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Key by key: what the resume's warning lists as applied is what the continued run did. A smaller
    ``checkpoint.keep_last`` prunes the step checkpoints to the new number at once."""
    run = copy_of(smoke_run_dir, tmp_path)
    poisoned(run, lambda c: rebased(c, smoke_run_dir, run))
    changes = {
        "trainer.max_steps": 18,
        "checkpoint.keep_last": 1,
        "trainer.val_check_interval": 3,
        "optim.warmup": 4,
        "optim.schedule": "noam",  # from the default's linear decay to eq. 3, scaled
        "optim.lr": None,
        "optim.lr_scale": 0.5,
        "optim.betas": [0.8, 0.9],
        "optim.eps": 1e-6,
        "optim.label_smoothing": 0.3,
        "decoding.beam_size": 2,
        "val_decoding.beam_size": 2,
        "max_nonfinite_steps": 3,
        "checkpoint.evaluate": "final",
    }
    smoke = smoke_run(corpus_root, cache_dir, *SMOKE_RUN_EXTRA)
    overrides = [f"{key}={json.dumps(value)}" for key, value in changes.items()]
    with caplog.at_level(logging.WARNING):
        assert train_in_process([*smoke, f"hydra.run.dir={run}", *overrides], monkeypatch) == 0
    (applied,) = [r.getMessage() for r in caplog.records if "with this run's settings" in r.getMessage()]
    reported = {part.split("=")[0] for part in applied.split(": ", 1)[1].split(", ") if "=" in part}
    assert set(changes) - reported <= set(NOT_COMPARED), set(changes) - reported  # not compared: not reported

    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    results = json.loads((run / "results.json").read_text())
    hyper, group = last["hyper_parameters"], last["optimizer_states"][0]["param_groups"][0]
    step, warmup, d_model = 18, 4, hyper["model"]["d_model"]
    kept = sorted(p.name for p in (run / "checkpoints").glob("step*.ckpt"))
    validated = metric_steps(run, "val/bleu")
    evaluated = (results["evaluated"], results["evaluated_checkpoint"])
    in_force = {
        "trainer.max_steps": results["steps"] == step,
        "checkpoint.keep_last": kept == ["step0000018.ckpt"],
        "trainer.val_check_interval": validated == [5, 11, 14, 17, 18],  # rows at step - 1; 18: the evaluation
        "optim.warmup": hyper["warmup"] == warmup,
        "optim.schedule": hyper["schedule"] == "noam",
        "optim.lr": hyper["lr"] is None,
        "optim.lr_scale": group["lr"] == pytest.approx(NoamSchedule(d_model, warmup, 0.5)(step)),
        "optim.betas": tuple(group["betas"]) == (0.8, 0.9),
        "optim.eps": group["eps"] == 1e-6,
        "optim.label_smoothing": hyper["label_smoothing"] == 0.3,
        "decoding.beam_size": results["decoding"]["beam_size"] == 2,
        "val_decoding.beam_size": results["val_decoding"]["beam_size"] == 2,
        "max_nonfinite_steps": last["aiayn"]["config"]["max_nonfinite_steps"] == 3,
        "checkpoint.evaluate": evaluated == ("final", "checkpoints/last.ckpt"),
    }
    assert reported <= set(in_force), reported - set(in_force)  # every reported key has its check here
    assert all(in_force.values()), {key: ok for key, ok in in_force.items() if not ok}


def metric_steps(run: Path, name: str) -> list[int]:
    with open(run / "csv" / "metrics.csv", newline="") as rows:
        return [int(row["step"]) for row in csv.DictReader(rows) if row.get(name)]


def test_a_sibling_checkpoint_with_a_foreign_step_is_set_aside_not_a_traceback(
    smoke_run_dir: Path, tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resuming an older checkpoint sets the newer ones aside by their step; one whose step is not a
    number counts as newer, as an unreadable one does."""
    run = copy_of(smoke_run_dir, tmp_path)
    best = run / "checkpoints" / "best.ckpt"
    checkpoint = torch.load(best, weights_only=True)
    checkpoint["global_step"] = "x"
    torch.save(checkpoint, best)
    assert resume(run, corpus_root, cache_dir, monkeypatch, f"resume={run / 'checkpoints' / 'step0000006.ckpt'}") == 0
    assert (run / "checkpoints" / "abandoned-after-step6" / "best.ckpt").is_file()
