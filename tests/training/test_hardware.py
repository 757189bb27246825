"""Hardware options: each composes into a Trainer set-up, SLURM renders a real submitit job, and the
effective batch (tokens per optimizer step) holds for any number of devices."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationResolutionError
from pytorch_lightning.plugins.environments import SLURMEnvironment
from pytorch_lightning.strategies import DDPStrategy

from aiayn.config.build import config_keys, trainer_options
from aiayn.config.compose import compose_config, compose_run_config
from aiayn.config.plan import BATCH_KEYS
from aiayn.errors import ConfigError, FieldError
from aiayn.experiments.run import train
from aiayn.machine import Devices, cpu_multiplies_bf16, cpu_precision, lists_bf16_flags
from aiayn.training.batching import BatchSettings, accumulation_steps, micro_batches, plan_batches, trainer_arguments
from helpers.runs import resumable_run, train_in_process

EXPECTED = {  # option: (accelerator, devices, nodes, precision, DDP backend)
    "cpu": ("cpu", 1, 1, "bf16-mixed" if cpu_multiplies_bf16() else "32-true", None),
    "cpu_ddp": ("cpu", 2, 1, "32-true", "gloo"),
    "gpu": ("gpu", 1, 1, "bf16-mixed", None),
    "gpu8_ddp": ("gpu", 8, 1, "bf16-mixed", "nccl"),
    "slurm": ("gpu", 8, 2, "bf16-mixed", "nccl"),
}


@pytest.mark.parametrize("option", sorted(EXPECTED))
def test_every_hardware_option_composes_into_trainer_arguments(option: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIAYN_CPU_BF16")  # set by conftest.py; a user's default is auto
    cfg = compose_config("train", [f"hardware={option}"])
    kwargs = trainer_options(cfg.trainer)
    accelerator, devices, nodes, precision, backend = EXPECTED[option]
    assert (kwargs["accelerator"], kwargs["devices"], kwargs.get("num_nodes", 1)) == (accelerator, devices, nodes)
    assert kwargs["precision"] == precision
    if backend is None:
        assert kwargs["strategy"] == "auto"
    else:
        assert isinstance(kwargs["strategy"], DDPStrategy) and kwargs["strategy"]._process_group_backend == backend
    if option == "slurm":
        (environment,) = kwargs["plugins"]
        assert isinstance(environment, SLURMEnvironment) and not environment.auto_requeue
    if accelerator == "cpu":  # buildable here: a real Trainer with that many processes
        trainer = pl.Trainer(**kwargs, logger=False, enable_checkpointing=False)
        assert trainer.world_size == devices


@pytest.mark.parametrize(("choice", "precision"), [("true", "bf16-mixed"), ("false", "32-true")])
def test_cpu_bf16_chooses_bf16_autocast_or_fp32_on_any_cpu(choice: str, precision: str) -> None:
    kwargs = trainer_options(compose_config("train", [f"cpu_bf16={choice}"]).trainer)
    assert kwargs["precision"] == precision
    trainer = pl.Trainer(**kwargs, logger=False, enable_checkpointing=False)
    assert trainer.precision == precision


@pytest.mark.parametrize(("choice", "precision"), [("true", "bf16-mixed"), ("False", "32-true"), ("yes", None)])
def test_aiayn_cpu_bf16_sets_the_choice_of_a_run_that_makes_none(
    choice: str, precision: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIAYN_CPU_BF16", choice)
    trainer = compose_config("train", []).trainer
    if precision is None:  # aiayn-train's one line names it as for cpu_bf16=yes (test_bad_configs.py)
        with pytest.raises(InterpolationResolutionError, match="cpu_bf16=yes must be true, false or auto"):
            trainer_options(trainer)
    else:
        assert trainer_options(trainer)["precision"] == precision


CPUINFO = "processor\t: 0\nvendor_id\t: {vendor}\nmodel name\t: {name}\nflags\t\t: fpu sse2 avx2 fma {extra}\n\n"


@pytest.mark.parametrize(
    ("vendor", "name", "extra", "bf16"),
    [
        ("AuthenticAMD", "AMD EPYC 7B13", "sha_ni", False),  # Zen 3: AVX2 only
        ("AuthenticAMD", "AMD EPYC 9B14", "avx512f avx512_bf16 avx512_vnni", True),  # Zen 4
        ("GenuineIntel", "Intel(R) Xeon(R) Platinum 8481C", "avx512f amx_bf16 amx_tile", True),  # Sapphire Rapids
        ("GenuineIntel", "Intel(R) Xeon(R) CPU @ 2.20GHz", "avx512f avx512bw avx512_vnni", False),  # Cascade Lake
    ],
)
def test_bf16_autocast_is_chosen_where_the_cpu_multiplies_bf16(vendor: str, name: str, extra: str, bf16: bool) -> None:
    cpuinfo = CPUINFO.format(vendor=vendor, name=name, extra=extra) * 2
    assert lists_bf16_flags(cpuinfo) is bf16
    assert not lists_bf16_flags(cpuinfo.replace("flags", "Features").replace("amx_bf16", "bf16"))  # an Arm's


def test_cpu_precision_follows_the_machine_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    import aiayn.machine

    for has_bf16, expected in ((True, "bf16-mixed"), (False, "32-true")):
        monkeypatch.setattr(aiayn.machine, "cpu_multiplies_bf16", lambda has_bf16=has_bf16: has_bf16)
        assert cpu_precision("auto") == expected
        assert (cpu_precision(True), cpu_precision(False)) == ("bf16-mixed", "32-true")
    with pytest.raises(FieldError, match=r"^cpu_bf16=yes must be true, false or auto"):
        cpu_precision("yes")


def test_fp16_is_one_override_away_from_bf16() -> None:
    cfg = compose_config("train", ["hardware=gpu8_ddp", "trainer.precision=16-mixed"])
    assert trainer_options(cfg.trainer)["precision"] == "16-mixed"


def test_slurm_renders_a_submitit_job_of_nodes_times_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``aiayn-train -m hardware=slurm`` hands to sbatch, built by submitit from our launcher
    config exactly as Hydra's submitit launcher builds it (no cluster needed)."""
    import submitit

    # submitit checks that it runs where SLURM's srun exists; this one is never called
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "bin" / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    cfg = compose_config(
        "train",
        ["hardware=slurm", "trainer.num_nodes=2", "experiment=paper/base_wmt14_en_de", "hydra.launcher.partition=gpu"],
    )
    HydraConfig.instance().set_config(cfg)  # as Hydra sets it before it starts the launcher
    try:
        params = dict(instantiate(cfg.hydra.launcher).params)
    finally:
        HydraConfig.instance().cfg = None
    assert params["nodes"] == 2 and params["tasks_per_node"] == params["gpus_per_node"] == 8
    executor = submitit.AutoExecutor(folder=tmp_path, cluster="slurm", slurm_max_num_timeout=params["max_num_timeout"])
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    skip = {"submitit_folder", "max_num_timeout"}
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items() if k not in skip})
    script = executor._executor._make_submission_file_text("python -u -m submitit.core._submit x", "uid")
    expected = ["--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--cpus-per-task=8", "--partition=gpu",
                "--job-name=paper_base_wmt14_en_de", "--signal=USR2@", "--open-mode=append", "--time=4320"]  # fmt: skip
    for line in expected:
        assert f"#SBATCH {line}" in script, line
    assert "srun" in script
    assert executor._executor.max_num_timeout == 20  # requeued up to 20 times, into the same run folder


def test_slurm_without_multirun_refuses_to_train_on_the_login_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("SLURM_JOB_ID", "SUBMITIT_EXECUTOR"):  # on a login node, not inside a job
        monkeypatch.delenv(name, raising=False)
    assert train_in_process(["hardware=slurm", f"hydra.run.dir={tmp_path}"], monkeypatch) == 2
    assert capsys.readouterr().err.strip() == (
        "hardware=slurm submits jobs through Hydra's launcher: add -m (aiayn-train -m hardware=slurm ...)"
    )


@pytest.mark.parametrize(
    ("world", "max_tokens", "expected"),
    [(1, 3125, 8), (2, 3125, 4), (8, 3125, 1), (1, 4096, 6), (2, 4096, 3), (16, 1562, 1), (1, 25000, 1), (8, 200, 16)],
)
def test_accumulation_reaches_the_tokens_per_step_on_any_number_of_devices(
    world: int, max_tokens: int, expected: int
) -> None:
    steps = accumulation_steps(25000, max_tokens, world)
    assert steps == expected
    # the nearest whole number of batches: no other count comes closer to 25000 tokens
    assert all(abs(steps * max_tokens * world - 25000) <= abs(n * max_tokens * world - 25000) for n in range(1, 40))


def planned_trainer(devices: int, batching: dict[str, Any], every_steps: int | None) -> pl.Trainer:
    """A real Trainer on ``devices`` CPU processes with the arguments the planned batches set."""
    strategy = "ddp" if devices > 1 else "auto"
    arguments = trainer_arguments(batching, every_steps)
    return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False, max_steps=1, **arguments)


@pytest.mark.parametrize(("devices", "expected"), [(1, 8), (2, 4), (8, 1)])
def test_a_real_trainer_gets_the_accumulation_planned_for_its_world_size(devices: int, expected: int) -> None:
    world = Devices.parse(devices).world_size("cpu")
    batching = plan_batches(BatchSettings(tokens_per_step=25000, max_tokens=3125), world, accumulate=1)
    trainer = planned_trainer(devices, batching, every_steps=100)
    assert trainer.world_size == world == devices
    assert trainer.accumulate_grad_batches == batching["accumulation"] == expected
    assert batching["max_tokens_per_step"] == 25000 and batching["world_size"] == devices
    assert trainer.val_check_interval == 100 * expected  # validation every 100 optimizer steps


def test_tokens_per_step_and_an_explicit_accumulation_conflict() -> None:
    conflict = r"trainer\.accumulate_grad_batches=4 conflicts with tokens_per_step=25000"
    with pytest.raises(ConfigError, match=conflict), config_keys("", BATCH_KEYS):  # as aiayn-train says it
        plan_batches(BatchSettings(tokens_per_step=25000, max_tokens=3125), 1, accumulate=4)
    with pytest.raises(FieldError, match=r"^tokens_per_step=0"):
        accumulation_steps(0, 3125, 1)


@pytest.mark.parametrize(("world", "max_tokens", "fitting"), [(16, 3125, 1562), (8, 4096, 3125), (3, 5000, 4167)])
def test_a_batch_that_cannot_come_near_tokens_per_step_is_refused_with_the_fix(
    world: int, max_tokens: int, fitting: int
) -> None:
    out_of_reach = rf"tokens_per_step=25000 is out of reach .* set data\.max_tokens={fitting}$"
    with pytest.raises(ConfigError, match=out_of_reach), config_keys("", BATCH_KEYS):
        accumulation_steps(25000, max_tokens, world)
    assert accumulation_steps(25000, fitting, world) * fitting * world == pytest.approx(25000, rel=0.1)


@pytest.mark.parametrize(
    ("world", "cap", "expected"),
    [(1, None, (25000, 1)), (2, None, (12500, 1)), (8, None, (3125, 1)), (3, None, (8333, 1)), (16, None, (1562, 1)),
     (1, 25000, (25000, 1)), (1, 12500, (12500, 2)), (1, 8000, (6250, 4)), (1, 3125, (3125, 8)), (2, 5000, (4166, 3))],
)  # fmt: skip
def test_each_device_takes_its_share_as_one_micro_batch_unless_it_is_over_the_cap(
    world: int, cap: int | None, expected: tuple[int, int]
) -> None:
    tokens, accumulation = micro_batches(25000, world, cap)
    assert (tokens, accumulation) == expected
    assert 25000 - world * accumulation <= tokens * accumulation * world <= 25000  # the effective batch, floored
    if cap is not None:  # the fewest micro-batches within the cap
        assert tokens <= cap and (accumulation == 1 or 25000 // world // (accumulation - 1) > cap)


@pytest.mark.parametrize(
    ("devices", "cap", "micro", "accumulation"),
    [(1, None, 25000, 1), (2, None, 12500, 1), (1, 8000, 6250, 4), (2, 5000, 4166, 3)],
)
def test_a_real_trainer_takes_its_share_of_tokens_per_step_and_says_how(
    devices: int, cap: int | None, micro: int, accumulation: int
) -> None:
    batch = BatchSettings(tokens_per_step=25000, max_tokens=None, cap=cap, max_len=256)
    batching = plan_batches(batch, devices, accumulate=1)
    trainer = planned_trainer(devices, batching, every_steps=100)
    assert trainer.accumulate_grad_batches == batching["accumulation"] == accumulation
    assert batching["max_tokens_per_device"] == micro and batching["world_size"] == devices
    assert batching["formed"] == "tokens_per_step / world_size" + (f" within micro_batch_cap={cap}" if cap else "")
    assert trainer.val_check_interval == 100 * accumulation


def test_a_micro_batch_too_small_for_the_longest_sentence_is_refused_with_the_fix() -> None:
    fewer = r"fewer than the longest sentence training keeps \(data.max_len=256\)"
    too_few = rf"^tokens_per_step=2000 leaves micro-batches of 250 tokens .*{fewer}"
    with pytest.raises(ConfigError, match=too_few), config_keys("", BATCH_KEYS):
        micro_batches(2000, 8, None, max_len=256)
    capped = rf"^micro_batch_cap=300 leaves micro-batches of 250 tokens .*{fewer}"
    with pytest.raises(ConfigError, match=capped), config_keys("", BATCH_KEYS):
        micro_batches(1000, 1, 300, max_len=256)  # 4 x 250: 3 x 333 would be over the cap
    # without the config, the training layer names its own fields
    with pytest.raises(FieldError, match=r"\(max_len=256\); raise cap or lower max_len$"):
        micro_batches(1000, 1, 300, max_len=256)


@pytest.mark.parametrize(
    ("hardware", "cap", "micro", "accumulation"),
    [("gpu", None, 25000, 1), ("gpu", 8000, 6250, 4), ("gpu8_ddp", None, 3125, 1), ("slurm", None, 1562, 1)],
)
def test_the_paper_experiment_trains_25000_tokens_per_step_in_one_micro_batch_where_it_fits(
    hardware: str, cap: int | None, micro: int, accumulation: int
) -> None:
    overrides = ["experiment=paper/base_wmt14_en_de", f"hardware={hardware}", f"micro_batch_cap={cap or 'null'}"]
    cfg = compose_config("train", overrides)
    assert cfg.data.max_tokens is None and cfg.tokens_per_step == 25000
    devices = cfg.trainer.devices * cfg.trainer.get("num_nodes", 1)
    assert micro_batches(cfg.tokens_per_step, devices, cfg.micro_batch_cap, cfg.data.max_len) == (micro, accumulation)


class BatchSizes(pl.Callback):
    """The padded tokens of each training batch, per side."""

    def __init__(self) -> None:
        self.tokens: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any) -> None:
        self.tokens.append((batch["src"].numel(), batch["tgt_in"].numel()))


def test_a_run_with_a_null_max_tokens_trains_on_its_share_and_records_how_it_was_formed(
    tmp_path: Path, corpus_root: Path, cache_dir: Path
) -> None:
    """1000 tokens per step within a cap of 600: two accumulated micro-batches of 500 (not 600, the budget
    the data module had before the trainer knew its devices)."""
    overrides = resumable_run(corpus_root, cache_dir, "trainer.max_steps=3", "checkpoint.every_steps=3", pairs=200)
    overrides = [o for o in overrides if not o.startswith("data.max_tokens=")]
    overrides += ["data.max_tokens=null", "tokens_per_step=1000", "micro_batch_cap=600"]
    sizes = BatchSizes()
    results = train(compose_run_config(overrides), tmp_path / "run", overrides, callbacks=[sizes])
    assert results["batch"] == {
        "world_size": 1,
        "max_tokens_per_device": 500,
        "accumulation": 2,
        "max_tokens_per_step": 1000,
        "tokens_per_step": 1000,
        "formed": "tokens_per_step / world_size within micro_batch_cap=600",
    }
    assert results["steps"] == 3 and len(sizes.tokens) == 6  # two micro-batches per optimizer step
    assert OmegaConf.load(tmp_path / "run" / "config.yaml").data.max_tokens == 500  # what it trained on
    assert 400 < max(max(side) for side in sizes.tokens) <= 500
