"""A checkpoint's training state is aiayn's own before Lightning restores it: a shared checkpoint whose
tracker names files elsewhere (through a protocol, ``..`` or a link) has that tracker dropped and
deletes nothing outside the run's ``checkpoints/``; foreign optimizer rules, weights, loop counters and
generator states end the resume in one line naming the file and the field."""

from __future__ import annotations

import copy
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from aiayn.config.build import module_kwargs
from aiayn.config.compose import compose_run_config
from aiayn.errors import CheckpointError
from aiayn.experiments.run import build_trainer, run_callbacks
from aiayn.training.checkpoints import RunCheckpointIO, remove_plain_file
from aiayn.training.module import TranslationModule
from aiayn.training.restored_state import RestoredState
from helpers.runs import smoke_run, train_in_process

BEST = "ModelCheckpoint{'monitor': 'val/bleu', 'mode': 'max', 'every_n_train_steps': 0, 'every_n_epochs': 1, 'train_time_interval': None}"  # noqa: E501
STEPS = "ModelCheckpoint{'monitor': 'step', 'mode': 'max', 'every_n_train_steps': 0, 'every_n_epochs': 1, 'train_time_interval': None}"  # noqa: E501
SMOKE = ("checkpoint.average_last=0", "decoding=greedy", "decoding.max_len_offset=3")


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("run.lock"))
    return copy


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
    argv = [*smoke_run(corpus_root, cache_dir, *SMOKE), f"hydra.run.dir={run}", "trainer.max_steps=18", *extra]
    return train_in_process(argv, monkeypatch)


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
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best.ckpt", "last.ckpt", "step0000018.ckpt"]


@pytest.fixture(scope="module")
def restorer(smoke_run_dir: Path, corpus_root: Path, cache_dir: Path) -> RestoredState:
    """The check a resume of the smoke run goes through, on a trainer built as aiayn-train builds it."""
    cfg = compose_run_config(smoke_run(corpus_root, cache_dir, *SMOKE))
    resolved = OmegaConf.to_container(cfg, resolve=True)
    module = TranslationModule(**module_kwargs(cfg))
    callbacks = run_callbacks(cfg, smoke_run_dir, resolved, [], "quiet")
    trainer = build_trainer(cfg.trainer, smoke_run_dir, "quiet", callbacks.all(), [], module)
    module.trainer = trainer
    return RestoredState(smoke_run_dir / "checkpoints", module)


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
    ],
)
def test_training_state_aiayn_does_not_write_is_refused_naming_the_field(
    restorer: RestoredState, smoke_run_dir: Path, field: str, change: Callable[[dict[str, Any]], None]
) -> None:
    path = smoke_run_dir / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    restorer(copy.deepcopy(checkpoint), path)  # as written, it passes
    change(checkpoint)
    with pytest.raises(CheckpointError) as refused:
        restorer(checkpoint, path)
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
    restorer: RestoredState, smoke_run_dir: Path, tmp_path: Path, named: str
) -> None:
    folder = smoke_run_dir / "checkpoints"
    path = folder / "last.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    assert set(restorer(copy.deepcopy(checkpoint), path)["callbacks"]) >= {BEST, STEPS}
    value = named.format(victim=sentinel_tree(tmp_path), folder=folder)
    for field in ("best_model_path", "kth_best_model_path", "last_model_path", "best_k_models"):
        changed = copy.deepcopy(checkpoint)
        tracker = changed["callbacks"][BEST]
        tracker[field] = {value: torch.tensor(1.0)} if field == "best_k_models" else value
        assert BEST not in restorer(changed, path)["callbacks"], (field, value)
    moved = copy.deepcopy(checkpoint)
    moved["callbacks"][STEPS]["dirpath"] = str(tmp_path)
    assert STEPS not in restorer(moved, path)["callbacks"]


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
