"""What reaches the dashboards: real Lightning runs logging to real offline W&B runs, read back from disk."""

from __future__ import annotations

import csv
import io
import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from omegaconf import OmegaConf
from PIL import Image
from tensorboardX.proto import event_pb2

from aiayn.config.build import build_loggers
from aiayn.config.compose import compose_run_config
from aiayn.config.naming import RunIdentity, run_identity
from aiayn.data.corpus import read_lines
from aiayn.errors import FieldError
from aiayn.experiments.run import train
from aiayn.machine import peak_flops
from aiayn.model import TransformerConfig, batch_training_flops, forward_flops
from aiayn.training.callbacks.progress import progress_style
from aiayn.training.callbacks.samples import ascii_label, attention_image
from aiayn.training.loggers.csv_logger import RunCSVLogger
from aiayn.training.loggers.tensorboard_logger import TensorBoardRunLogger
from aiayn.training.loggers.wandb_identity import wandb_mode
from aiayn.training.loggers.wandb_logger import WandbRunLogger
from helpers.runs import smoke_run
from helpers.wandb_records import offline_runs

KINDS = ("encoder_self", "decoder_self", "cross")


def tiny_run(root: Path, cache: Path, *extra: str) -> list[str]:
    """The smoke run (12 optimizer steps of the tiny model, validating after steps 6 and 12) with the
    dashboards on: W&B, attention maps at every validation."""
    return smoke_run(root, cache, "logger=wandb", "dashboard.attention_every=1", *extra)


@pytest.mark.slow
@pytest.mark.usefixtures("wandb_offline")
def test_an_offline_run_holds_metrics_config_sample_table_and_attention_images(
    tmp_path: Path, multi30k_root: Path, cache_dir: Path
) -> None:
    overrides = tiny_run(
        multi30k_root, cache_dir, "dashboard.samples=4", "peak_tflops=0.5", "seed=3", "logger.wandb.artifacts=answer"
    )
    cfg = compose_run_config(overrides)
    results = train(cfg, tmp_path, overrides)

    (run,) = offline_runs(tmp_path / "wandb")
    assert run.exit_code == 0
    # named by what changes the model, not by where data or output live or how the run reports
    left_out = ("data.root", "data.cache_dir", "progress", "dashboard", "peak_tflops", "logger")
    defining = [o for o in overrides if not o.startswith(left_out)]
    assert run.name == " ".join(["tiny_multi30k_en_de", *defining]) and "seed=3" in defining
    assert run.group == "tiny_multi30k_en_de" and run.tags == ["tiny", "multi30k_en_de", "cpu"]

    # the config is the composed config, plus what it cannot hold under "aiayn"
    composed = OmegaConf.to_container(cfg, resolve=True)
    assert {key: value for key, value in run.config.items() if key not in ("_wandb", "aiayn")} == composed
    meta = run.config["aiayn"]
    assert meta["overrides"] == overrides and meta["parameters"] == results["params"]
    assert meta["hardware"]["precision"] == composed["trainer"]["precision"]  # bf16-mixed where the CPU has bf16
    assert meta["hardware"]["accelerator"] == "cpu"
    assert set(meta["git"]) == {"commit", "dirty"}

    # per step: every log_every_n_steps=2 steps
    train_rows = run.rows_with("train/loss")
    assert [row["trainer/global_step"] for row in train_rows] == [1, 3, 5, 7, 9, 11]
    # warmup over 10 steps, then the default's linear decay, at its floor (0) by the last step (logged at 11)
    lrs = [row["train/lr"] for row in train_rows]
    assert lrs[0] > 0 and lrs[:-1] == sorted(lrs[:-1]) and lrs[-1] == 0
    for row in train_rows:
        assert row["train/grad_norm"] > 0 and row["train/tokens_per_s"] > 0
        assert 0 < row["train/mfu"] < 1
    # per validation: two during the fit, then the best checkpoint's once more
    val_rows = run.rows_with("val/bleu")
    assert [row["trainer/global_step"] for row in val_rows] == [5, 11, 12]
    for row in val_rows:
        assert row["val/ppl"] == pytest.approx(np.exp(row["val/nll"]), rel=1e-5) and row["val/loss"] > 0
    assert run.summary["test_bleu"] == results["test_bleu"] and run.summary["val/bleu"] == val_rows[-1]["val/bleu"]

    # media at the validations of the fit, at the step of their metrics
    media_rows = run.rows_with("val/samples/path")
    assert [row["trainer/global_step"] for row in media_rows] == [5, 11]
    sources = read_lines(multi30k_root / "val.en.gz")[:4]
    references = read_lines(multi30k_root / "val.de.gz")[:4]
    for row in media_rows:
        table = json.loads((run.folder / "files" / row["val/samples/path"]).read_text())
        assert table["columns"] == ["source", "reference", "hypothesis"]
        assert [r[0] for r in table["data"]] == sources and [r[1] for r in table["data"]] == references
        for kind in KINDS:
            for layer in (1, 2):
                key = f"attention/{kind}/layer_{layer}"
                assert row[f"{key}/count"] == 4 and row[f"{key}/captions"] == [f"head {h}" for h in (1, 2, 3, 4)]
                for name in row[f"{key}/filenames"]:
                    assert Image.open(run.folder / "files" / name).size == (row[f"{key}/width"], row[f"{key}/height"])
    assert len(run.media("images")) == 2 * len(KINDS) * 2 * 4  # validations × kinds × layers × heads

    # the answer checkpoint as a version of the folder's model artifact
    (artifact,) = [artifact for artifact in run.artifacts if artifact["type"] == "model"]  # not the tables'
    answer = tmp_path / results["answer_checkpoint"]
    assert (artifact["name"], artifact["type"]) == (f"model-{run.run_id}", "model")
    assert sorted(artifact["aliases"]) == ["answer", "latest", f"step-{results['steps']}"]
    assert list(artifact["files"]) == [answer.name] and artifact["metadata"]["answer"] == results["answer"]
    assert Path(artifact["files"][answer.name]).read_bytes() == answer.read_bytes()  # staged as it was


@pytest.mark.slow
@pytest.mark.usefixtures("wandb_offline")
def test_logger_tensorboard_gets_the_metrics_samples_and_attention_images(
    tmp_path: Path, multi30k_root: Path, cache_dir: Path
) -> None:
    overrides = tiny_run(multi30k_root, cache_dir, "logger=tensorboard", "trainer.max_steps=6")
    train(compose_run_config(overrides), tmp_path, overrides)
    # one event file: the test's, opened anew, could share the first's name (its second) and replace it
    assert len(list((tmp_path / "tensorboard").rglob("events.out.tfevents.*"))) == 1
    tags = tensorboard_tags(tmp_path / "tensorboard")
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "val/bleu", "val/ppl"} <= tags
    assert "val/samples/text_summary" in tags
    heads = {f"attention/{kind}/layer_{layer}/head_{h}" for kind in KINDS for layer in (1, 2) for h in (1, 2, 3, 4)}
    assert heads <= tags
    assert not (tmp_path / "wandb").exists() and (tmp_path / "csv" / "metrics.csv").is_file()


def tensorboard_tags(folder: Path) -> set[str]:
    """Tags of every summary in the TFRecord event files under ``folder``."""
    tags: set[str] = set()
    for path in folder.rglob("events.out.tfevents.*"):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[pos + 12 : pos + 12 + length])  # after length and its CRC
            tags.update(value.tag for value in event.summary.value)
            pos += 12 + length + 4  # and the data's CRC
    return tags


class FailAtStep(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("injected failure")


@pytest.mark.slow
@pytest.mark.usefixtures("wandb_offline")
def test_a_run_that_raises_finishes_its_wandb_run_and_keeps_its_csv_metrics(
    tmp_path: Path, multi30k_root: Path, cache_dir: Path
) -> None:
    overrides = tiny_run(multi30k_root, cache_dir, "trainer.log_every_n_steps=1")
    with pytest.raises(RuntimeError, match="injected failure"):
        train(compose_run_config(overrides), tmp_path, overrides, callbacks=[FailAtStep(4)])
    (run,) = offline_runs(tmp_path / "wandb")
    assert run.exit_code == 1
    # batches 1-3 were logged; the 4th raised in its end hook, before Lightning logs a batch's metrics
    assert [row["trainer/global_step"] for row in run.rows_with("train/loss")] == [0, 1, 2]
    with open(tmp_path / "csv" / "metrics.csv") as f:
        assert [int(row["step"]) for row in csv.DictReader(f) if row["train/loss"]] == [0, 1, 2]
    assert not (tmp_path / "results.json").exists()


@pytest.mark.slow
def test_the_jobs_of_a_multirun_are_separate_wandb_runs_in_one_group(
    tmp_path: Path, multi30k_root: Path, cache_dir: Path, wandb_offline: None
) -> None:
    sweep_dir = tmp_path / "sweep"
    command = ["aiayn-train", "-m", *tiny_run(multi30k_root, cache_dir, "trainer.max_steps=6"), "seed=1,2"]
    done = subprocess.run([*command, f"hydra.sweep.dir={sweep_dir}"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = offline_runs(sweep_dir)
    assert len(runs) == 2 and runs[0].run_id != runs[1].run_id
    assert [run.exit_code for run in runs] == [0, 0]
    assert [run.name.split()[-1] for run in runs] == ["seed=1", "seed=2"]
    assert runs[0].group == runs[1].group == f"multirun/{sweep_dir.name}"
    for job, run in zip(sorted(p for p in sweep_dir.iterdir() if p.is_dir()), runs, strict=True):
        assert run.folder.parent.parent == job  # each job's W&B run lives in that job's folder
        assert [row["trainer/global_step"] for row in run.rows_with("val/bleu")] == [5, 6]
        log = (job / "train.log").read_text()
        assert f"wandb sync {run.folder}" in log  # how to upload it, printed at the end
        assert "step 6: val/loss " in log and "val/bleu" in log  # progress=quiet: one line per validation


def test_wandb_mode_follows_the_environment_and_the_credentials(
    tmp_path: Path, wandb_offline: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import wandb

    def mode(requested: str = "auto") -> str:
        wandb.teardown()  # W&B reads its settings once per process
        return wandb_mode(requested)[0]

    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org:8443")
    assert mode() == "offline"  # no key, no netrc entry
    netrc = tmp_path / "netrc"
    monkeypatch.setenv("NETRC", str(netrc))
    for machine, expected in (("wandb.example.org", "offline"), ("wandb.example.org:8443", "online")):
        netrc.write_text(f"machine {machine}\n  login user\n  password {'1' * 40}\n")
        netrc.chmod(0o600)
        assert mode() == expected, machine  # `wandb login` writes the entry for the host and port
    netrc.unlink()
    monkeypatch.setenv("WANDB_API_KEY", "2" * 40)
    assert mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert mode() == "disabled" and mode("offline") == "offline"  # an explicit mode wins
    assert wandb_mode("auto")[1] == "WANDB_MODE=disabled"
    with pytest.raises(FieldError, match=r"^mode=cloud is not a W&B mode; use one of auto, online"):
        wandb_mode("cloud")


def test_run_names_keep_what_changes_the_model_and_groups_follow_the_sweep() -> None:
    overrides = ["model=base", "data.root=/data", "+logger.wandb.entity=me", "hydra.verbose=true", "seed=2"]
    assert run_identity("base_wmt14", overrides) == RunIdentity("base_wmt14 model=base seed=2", "base_wmt14")
    assert run_identity("table3_A1", ["experiment=table3/A1", "peak_tflops=989"], "sweep/heads") == RunIdentity(
        "table3_A1", "sweep/heads"
    )


@pytest.mark.parametrize(
    ("option", "dashboard"), [("wandb", WandbRunLogger), ("tensorboard", TensorBoardRunLogger), ("none", None)]
)
def test_every_logger_option_writes_csv_too(
    option: str, dashboard: type | None, tmp_path: Path, wandb_offline: None
) -> None:
    cfg = compose_run_config([f"logger={option}"])
    loggers = build_loggers(cfg.logger, tmp_path, RunIdentity("run", "group"))
    assert [type(logger) for logger in loggers] == [RunCSVLogger, *([dashboard] if dashboard else [])]
    if option == "wandb":
        assert loggers[1]._wandb_init["name"] == "run" and loggers[1]._wandb_init["group"] == "group"


def test_attention_images_shade_each_cell_by_its_weight() -> None:
    weights = np.array([[1.0, 0.0, 0.0], [0.25, 0.75, 0.0]])
    image = np.asarray(attention_image(weights, ["_a", "_b"], ["x", "y", "z"], cell=10))
    height, width, _ = image.shape
    assert height > 20 and width > 30  # the heat map and its labels
    corner = (height - 20, width - 30)  # the heat map sits in the bottom-right corner

    def cell(row: int, column: int) -> np.ndarray:
        return image[corner[0] + 10 * row + 5, corner[1] + 10 * column + 5]

    assert cell(0, 1).tolist() == [255, 255, 255] and cell(0, 0).tolist() == [8, 48, 107]
    assert (cell(1, 1) < cell(1, 0)).all() and (cell(1, 0) < cell(0, 2)).all()  # darker means more
    # without DejaVu Sans the labels fall back to ASCII, keeping what can be kept
    assert [ascii_label(p) for p in ("\u2581Männer", "été", "日")] == ["_Manner", "ete", "?"]


def test_mfu_counts_the_real_tokens_against_the_device_peak() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16-mixed") == 989e12
    assert peak_flops("NVIDIA H100 PCIe", "16-mixed") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-40GB", "32-true") == 19.5e12  # torch's default: full fp32
    assert peak_flops("Intel(R) Xeon(R) Processor", "32-true") is None
    assert peak_flops("Intel(R) Xeon(R) Processor", "32-true", override_tflops=2.0) == 2e12
    cfg = TransformerConfig(vocab_size=1000, n_layers=2, d_model=64, d_ff=128, n_heads=4, d_k=16, d_v=16)
    src, tgt = [5, 9, 30], [7, 12, 25]
    expected = 3 * sum(forward_flops(cfg, s, t) for s, t in zip(src, tgt, strict=True))
    assert batch_training_flops(cfg, torch.tensor(src), torch.tensor(tgt)) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("progress=loud", "progress=loud is not a progress display; use one of auto, rich, tqdm, quiet"),
        ("dashboard.samples=-1", "dashboard.samples=-1 must be a whole number >= 0"),
        ("logger.wandb.mode=cloud", "logger.wandb.mode=cloud is not a W&B mode; use one of auto, online"),
        ("logger.wandb.artifacts=best", "logger.wandb.artifacts=best must be none, answer (the run's answer"),
    ],
)
def test_bad_dashboard_options_fail_before_training(
    override: str, message: str, tmp_path: Path, wandb_offline: None
) -> None:
    cfg = compose_run_config([override, "model=tiny", "data.vocab_size=1000", f"data.cache_dir={tmp_path}"])
    with pytest.raises(ValueError, match=re.escape(message)):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "wandb").exists()


def test_progress_auto_is_the_bar_on_a_terminal_and_quiet_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdout", Terminal())
    assert progress_style("auto") == "rich"
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # a file, a pipe: CI, SLURM and nohup logs
    assert progress_style("auto") == "quiet"
    assert progress_style("rich") == "rich"
