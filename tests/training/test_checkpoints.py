"""Checkpoint averaging (§6.1), finding a run's newest checkpoints, and loading one for translation."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from aiayn.cli.average import main as average_main
from aiayn.errors import CheckpointError
from aiayn.training.checkpoints import average_checkpoints, load_model, save_checkpoint, step_checkpoints


def fake_checkpoint(seed: int, step: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        "global_step": step,
        "state_dict": {
            "model.weight": torch.randn(4, 3, generator=generator),
            "model.half": torch.randn(5, generator=generator).half(),
            "model.count": torch.tensor(step),
        },
        "optimizer_states": [{"state": "large"}],
        "hyper_parameters": {"beam_size": 4},
    }


def test_averaging_gives_the_element_wise_mean(tmp_path: Path) -> None:
    checkpoints = [fake_checkpoint(seed, step) for seed, step in ((1, 100), (2, 200), (3, 300))]
    paths = []
    for checkpoint in checkpoints:
        paths.append(tmp_path / f"step{checkpoint['global_step']:07d}.ckpt")
        torch.save(checkpoint, paths[-1])
    averaged = average_checkpoints(paths)
    weights = averaged["state_dict"]
    expected = sum(c["state_dict"]["model.weight"].double() for c in checkpoints) / 3
    torch.testing.assert_close(weights["model.weight"], expected.float())
    assert weights["model.weight"].dtype == torch.float32 and weights["model.half"].dtype == torch.float16
    torch.testing.assert_close(
        weights["model.half"], (sum(c["state_dict"]["model.half"].double() for c in checkpoints) / 3).half()
    )
    assert int(weights["model.count"]) == 300  # integer buffers are taken from the newest, not averaged
    assert "optimizer_states" not in averaged and averaged["hyper_parameters"] == {"beam_size": 4}
    assert [source["global_step"] for source in averaged["averaged_from"]] == [100, 200, 300]


def test_checkpoints_of_different_models_are_not_averaged(tmp_path: Path) -> None:
    first, second = fake_checkpoint(1, 1), fake_checkpoint(2, 2)
    second["state_dict"]["model.weight"] = torch.zeros(4, 4)
    torch.save(first, tmp_path / "a.ckpt")
    torch.save(second, tmp_path / "b.ckpt")
    with pytest.raises(CheckpointError, match=r"b\.ckpt: model\.weight has shape \(4, 4\)"):
        average_checkpoints([tmp_path / "a.ckpt", tmp_path / "b.ckpt"])
    del second["state_dict"]["model.weight"]
    torch.save(second, tmp_path / "b.ckpt")
    with pytest.raises(CheckpointError, match="other weights"):
        average_checkpoints([tmp_path / "a.ckpt", tmp_path / "b.ckpt"])
    (tmp_path / "broken.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"broken\.ckpt cannot be read"):
        average_checkpoints([tmp_path / "broken.ckpt"])


def run_of(seed: int, src: str = "en", tgt: str = "de", corpus: str = "multi30k-de-en-bpe1000-abc") -> dict:
    return {"tokenizer": b"bpe-1", "data_cache": corpus, "config": {"seed": seed, "data": {"src_lang": src,
            "tgt_lang": tgt}}}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda c: c["aiayn"].update(tokenizer=b"bpe-2"), "another tokenizer"),
        (lambda c: c.update(hyper_parameters={"model": {"d_model": 8}}), "another model hyperparameters"),
        (lambda c: c["aiayn"]["config"]["data"].update(src_lang="de", tgt_lang="en"), "data.src_lang=de (not en)"),
        (lambda c: c["aiayn"].update(data_cache="wmt14-de-en-bpe1000-def"), "another corpus"),
        (lambda c: c["aiayn"]["config"].update(seed=2), "seed=2 (not 1); pass --across-seeds"),
    ],
)
def test_only_checkpoints_of_one_run_are_averaged_each_once(
    tmp_path: Path, change: Callable[[dict], None], named: str, capsys: pytest.CaptureFixture
) -> None:
    first, other = fake_checkpoint(1, 1), fake_checkpoint(2, 2)
    first["aiayn"], other["aiayn"] = run_of(1), run_of(1)
    change(other)
    torch.save(first, tmp_path / "a.ckpt")
    torch.save(other, tmp_path / "b.ckpt")
    with pytest.raises(SystemExit) as stopped:
        average_main([str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt"), "-o", str(tmp_path / "avg.ckpt")])
    error = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(error) == 1 and "b.ckpt is of another run" in error[0], error
    assert named in error[0] and not (tmp_path / "avg.ckpt").exists()
    seeds_only = "seed" in named
    if seeds_only:  # said explicitly, seeds may be averaged; nothing else may
        average_main([str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt"), "-o", str(tmp_path / "avg.ckpt"),
                      "--across-seeds"])  # fmt: skip
        assert (tmp_path / "avg.ckpt").is_file()
    else:
        with pytest.raises(CheckpointError, match="another run"):
            average_checkpoints([tmp_path / "a.ckpt", tmp_path / "b.ckpt"], across_seeds=True)
    with pytest.raises(CheckpointError, match="listed twice"):
        average_checkpoints([tmp_path / "a.ckpt", tmp_path / ".." / tmp_path.name / "a.ckpt"])


def test_tied_weights_stay_tied_in_the_average(tmp_path: Path) -> None:
    paths = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        shared = torch.randn(6, 4)
        checkpoint = {"global_step": seed, "state_dict": {"model.src": shared, "model.out": shared}}
        paths.append(tmp_path / f"{seed}.ckpt")
        save_checkpoint(checkpoint, paths[-1])
    assert (paths[0].stat().st_mode & 0o777) == 0o666 & ~_umask()
    averaged = average_checkpoints(paths)["state_dict"]
    assert averaged["model.src"] is averaged["model.out"]  # one tensor: saved once, loaded tied


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def test_step_checkpoints_are_ordered_by_step_not_by_name(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for name in ("step0000900.ckpt", "step10000000.ckpt", "step0001000.ckpt", "best.ckpt", "last.ckpt"):
        (folder / name).touch()
    expected = ["step0000900.ckpt", "step0001000.ckpt", "step10000000.ckpt"]
    assert [p.name for p in step_checkpoints(tmp_path)] == expected
    assert [p.name for p in step_checkpoints(folder)] == expected


def test_aiayn_average_takes_the_newest_of_a_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = tmp_path / "checkpoints"
    for seed, step in ((1, 50), (2, 100), (3, 150), (4, 200)):
        save_checkpoint(fake_checkpoint(seed, step), folder / f"step{step:07d}.ckpt")
    average_main([str(tmp_path), "--last", "3"])
    averaged = torch.load(folder / "averaged-last3.ckpt", weights_only=False)
    assert [s["global_step"] for s in averaged["averaged_from"]] == [100, 150, 200]
    expected = sum(fake_checkpoint(seed, 0)["state_dict"]["model.weight"] for seed in (2, 3, 4)) / 3
    torch.testing.assert_close(averaged["state_dict"]["model.weight"], expected)
    with pytest.raises(SystemExit) as exit_info:
        average_main([str(tmp_path), "--last", "7"])
    assert exit_info.value.code == 2
    assert "has 4 step checkpoints, fewer than --last=7" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        average_main([str(folder / "step0000050.ckpt"), str(folder / "step0000100.ckpt")])
    assert exit_info.value.code == 2
    assert "--output is required" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        average_main([str(tmp_path), "--last", "2", "-o", str(folder / "step0000200.ckpt")])
    assert exit_info.value.code == 2
    assert "is one of the inputs" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        average_main([str(tmp_path / "no-such-run")])
    assert exit_info.value.code == 2
    assert "no-such-run does not exist" in capsys.readouterr().err


def test_a_checkpoint_without_tokenizer_and_config_is_refused(tmp_path: Path) -> None:
    torch.save(fake_checkpoint(1, 1), tmp_path / "foreign.ckpt")
    with pytest.raises(CheckpointError, match="not written by aiayn-train"):
        load_model(tmp_path / "foreign.ckpt")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "missing.ckpt")


def test_a_checkpoint_older_than_a_model_field_averages_with_newer_ones_at_its_default(tmp_path: Path) -> None:
    """A run resumed across an upgrade: its older step checkpoints lack ``activation_dropout``."""
    old, new, other = fake_checkpoint(1, 1), fake_checkpoint(2, 2), fake_checkpoint(3, 3)
    model = {"vocab_size": 100, "d_model": 8}
    old["hyper_parameters"] = {"model": model}
    new["hyper_parameters"] = {"model": {**model, "activation_dropout": 0.0}}
    other["hyper_parameters"] = {"model": {**model, "activation_dropout": 0.1}}
    for name, checkpoint in (("old", old), ("new", new), ("other", other)):
        checkpoint["aiayn"] = run_of(1)
        torch.save(checkpoint, tmp_path / f"{name}.ckpt")
    averaged = average_checkpoints([tmp_path / "old.ckpt", tmp_path / "new.ckpt"])
    assert [source["global_step"] for source in averaged["averaged_from"]] == [1, 2]
    with pytest.raises(CheckpointError, match="another model hyperparameters"):
        average_checkpoints([tmp_path / "old.ckpt", tmp_path / "other.ckpt"])
