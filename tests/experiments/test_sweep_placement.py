"""aiayn-sweep on a machine with GPUs: each running trial gets devices of its own, as many as its hardware
option asks for, and no more trials run than fit. The machine is simulated through the runner's own
device list ($AIAYN_SWEEP_DEVICES); the trials are stand-ins that record the devices they were given and
when they ran (there is no GPU to train on here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from aiayn.experiments.sweeps.placement import DEVICES_ENV, DevicePool, PlacementError, devices_needed
from aiayn.experiments.sweeps.runner import run_sweep
from helpers.sweeps import script_sweep

MEET = "AIAYN_TEST_MEET"  # a folder: each trial notes its start there and runs on once the others have started
TRIAL = """\
import json, os, sys, time
from pathlib import Path
folder = Path(os.environ["AIAYN_RUN_DIR"])
folder.mkdir(parents=True, exist_ok=True)
start = time.time()
meet = os.environ.get("AIAYN_TEST_MEET")
if meet:  # running at once with the others, each ends only after all have started
    Path(meet, os.path.basename(folder)).touch()
    deadline = time.monotonic() + 120
    while len(os.listdir(meet)) < int(os.environ["AIAYN_TEST_MEET_COUNT"]):
        if time.monotonic() > deadline:
            sys.exit("the other trials never started")
        time.sleep(0.02)
(folder / "placed.json").write_text(json.dumps(
    {"devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "start": start, "end": time.time()}
))
(folder / "csv").mkdir(exist_ok=True)
(folder / "csv" / "metrics.csv").write_text("step,val/bleu\\n1,1.0\\n")
(folder / "results.json").write_text("{}")
"""


def placement_sweep(tmp_path: Path, seeds: list[int], *hardware: str) -> Path:
    return script_sweep(tmp_path, TRIAL, seeds, *hardware)


def meeting(tmp_path: Path, name: str, count: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trials of the next sweep run on only once ``count`` of them have started: they overlap."""
    (tmp_path / name).mkdir()
    monkeypatch.setenv(MEET, str(tmp_path / name))
    monkeypatch.setenv(f"{MEET}_COUNT", str(count))


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
    meeting(tmp_path, "met-four", 2, monkeypatch)
    state = run_sweep(sweep, tmp_path / "four", parallel=2)
    assert [t.state for t in state.trials] == ["finished", "finished"]
    first, second = placed(tmp_path / "four")
    assert overlapping(first, second)  # both at once: 2 + 2 devices fit on 4
    assert sorted(first["devices"].split(",") + second["devices"].split(",")) == ["0", "1", "2", "3"]

    monkeypatch.setenv(DEVICES_ENV, "0,1,2")
    monkeypatch.delenv(MEET)  # the second cannot start while the first runs: it must not wait for it
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
    meeting(tmp_path, "met-cpu", 2, monkeypatch)
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
