"""aiayn-sweep on a machine with GPUs: each running trial gets devices of its own, as many as its hardware
option asks for, and no more trials run than fit. The machine is simulated through the runner's own
device list ($AIAYN_SWEEP_DEVICES); the trials are stand-ins that record the devices they were given and
when they ran (there is no GPU to train on here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from aiayn.experiments.placement import DEVICES_ENV, DevicePool, PlacementError, devices_needed
from aiayn.experiments.sweep import run_sweep

TRIAL = """\
import json, os, sys, time
from pathlib import Path
folder = Path(os.environ["AIAYN_RUN_DIR"])
folder.mkdir(parents=True, exist_ok=True)
start = time.time()
time.sleep(1.5)
(folder / "placed.json").write_text(json.dumps(
    {"devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "start": start, "end": time.time()}
))
(folder / "csv").mkdir(exist_ok=True)
(folder / "csv" / "metrics.csv").write_text("step,val/bleu\\n1,1.0\\n")
(folder / "results.json").write_text("{}")
"""


def placement_sweep(tmp_path: Path, seeds: list[int], *hardware: str) -> Path:
    script = tmp_path / "trial.py"
    script.write_text(TRIAL)
    sweep = tmp_path / "s.yaml"
    sweep.write_text(
        json.dumps(
            {
                "method": "grid",
                "program": str(script),
                "metric": {"name": "val/bleu", "goal": "maximize"},
                "parameters": {"seed": {"values": seeds}},
                "command": ["${env}", "${interpreter}", "${program}", *hardware, "${args_no_hyphens}"],
            }
        )
    )
    return sweep


def placed(state_folder: Path) -> list[dict]:
    state = json.loads((state_folder / "sweep.json").read_text())
    out = []
    for trial in state["trials"]:
        record = json.loads((state_folder / trial["run_dir"] / "placed.json").read_text())
        assert record["devices"] == ",".join(trial["devices"])  # what sweep.json says it was given
        out.append(record)
    return out


def overlapping(a: dict, b: dict) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


def test_trials_get_disjoint_devices_and_only_as_many_run_as_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DEVICES_ENV, "0,1,2,3")
    sweep = placement_sweep(tmp_path, [1, 2], "hardware=gpu", "trainer.devices=2")
    state = run_sweep(sweep, tmp_path / "four", parallel=2)
    assert [t.state for t in state.trials] == ["finished", "finished"]
    first, second = placed(tmp_path / "four")
    assert overlapping(first, second)  # both at once: 2 + 2 devices fit on 4
    assert sorted(first["devices"].split(",") + second["devices"].split(",")) == ["0", "1", "2", "3"]

    monkeypatch.setenv(DEVICES_ENV, "0,1,2")
    state = run_sweep(sweep, tmp_path / "three", parallel=2)
    assert [t.state for t in state.trials] == ["finished", "finished"]
    first, second = placed(tmp_path / "three")
    assert not overlapping(first, second)  # the second waits for the first's devices
    assert first["devices"] == second["devices"] == "0,1"


def test_a_trial_that_cannot_fit_fails_and_cpu_trials_get_no_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DEVICES_ENV, "0,1,2")
    too_big = run_sweep(placement_sweep(tmp_path, [1], "hardware=gpu8_ddp"), tmp_path / "big")
    (trial,) = too_big.trials
    assert trial.state == "failed" and "it needs 8 devices and this runner has 3 (0, 1, 2)" in trial.error
    cpu = run_sweep(placement_sweep(tmp_path, [1, 2], "hardware=cpu"), tmp_path / "cpu", parallel=2)
    records = placed(tmp_path / "cpu")
    assert [t.devices for t in cpu.trials] == [[], []] and [r["devices"] for r in records] == ["", ""]
    assert overlapping(*records)  # CPU trials take no device: both ran at once


@pytest.mark.parametrize(
    ("trainer", "available", "needed"),
    [
        ({"accelerator": "gpu", "devices": 2}, 4, 2),
        ({"accelerator": "cuda", "devices": "3"}, 4, 3),
        ({"accelerator": "gpu", "devices": -1}, 4, 4),
        ({"accelerator": "auto", "devices": "auto"}, 2, 2),
        ({"accelerator": "auto", "devices": 1}, 0, 0),
        ({"accelerator": "cpu", "devices": 2}, 4, 0),
    ],
)
def test_devices_a_trial_needs(trainer: dict, available: int, needed: int) -> None:
    assert devices_needed(OmegaConf.create(trainer), available) == needed


def test_a_multi_node_trial_needs_slurm_and_device_indices_are_refused() -> None:
    with pytest.raises(PlacementError, match="send the sweep to SLURM"):
        devices_needed(OmegaConf.create({"accelerator": "gpu", "devices": 8, "num_nodes": 2}), 8)
    for devices in ([0, 2], "0,1,3", "1,"):
        with pytest.raises(PlacementError, match="names devices, and the sweep places its trials itself"):
            devices_needed(OmegaConf.create({"accelerator": "gpu", "devices": devices}), 4)


def test_a_trial_outliving_its_runner_keeps_its_devices() -> None:
    pool = DevicePool(["0", "1", "2", "3"])
    assert pool.hold(["2", "3", "7"]) == ["2", "3"]  # 7 is not this runner's (sweep.json may say anything)
    assert pool.take(2) == ["0", "1"] and pool.take(1) is None
    pool.give_back(["2", "3", "7"])
    assert pool.free == ["2", "3"]
