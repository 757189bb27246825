"""aiayn-sweep sending its trials as jobs through submitit, on the code path of ``--launcher slurm``:
submitit's local executor runs the same jobs as local processes through the same API. Real trials
(aiayn-train, debug=smoke) with hardware=slurm's settings, made to run on this CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from aiayn.config.compose import compose_config
from aiayn.experiments.sweeps.launchers import executor_settings
from aiayn.experiments.sweeps.runner import run_sweep
from aiayn.experiments.sweeps.state import STATE_FILE, SUBMITIT_FOLDER
from helpers.batch_recorder import HELD, RELEASE, recorded
from helpers.processes import environment, wait_until
from helpers.sweeps import run_runner, script_sweep, sweep_main, trials

JOB_SWEEP = """\
name: jobs
method: grid
metric: {{name: val/bleu, goal: maximize}}
parameters:
  seed: {{values: [1, 2]}}
command:
  - ${{env}}
  - ${{interpreter}}
  - -m
  - aiayn.cli.train
  - hardware=slurm
  - trainer.accelerator=cpu
  - trainer.devices=1
  - trainer.num_nodes=1
  - trainer.strategy=auto
  - trainer.precision=32-true
  - trainer.plugins=null
  - data.num_workers=0
  - data.pin_memory=false
  - hydra.launcher.cpus_per_task=1
  - debug=smoke
  - data.root={root}
  - data.cache_dir={cache}
  - checkpoint.average_last=0  # helpers.runs.SMOKE_RUN_EXTRA: short greedy decodes, which no test reads
  - decoding=greedy
  - decoding.max_len_offset=3
  - "callbacks=[{{_target_:helpers.batch_recorder.BatchRecorder,folder:'${{oc.env:AIAYN_RUN_DIR}}/batches',hold_at:2}}]"
  - ${{args_no_hyphens}}
"""


def test_hardware_slurm_settings_become_the_jobs_settings() -> None:
    overrides = ["hardware=slurm", "trainer.num_nodes=3", "hydra.launcher.partition=gpu", "hydra.launcher.account=nmt"]
    overrides += ["hydra.launcher.timeout_min=600", "hydra.launcher.max_num_timeout=7"]
    init, parameters = executor_settings(compose_config("train", overrides).hydra.launcher)
    assert init == {"slurm_max_num_timeout": 7, "local_max_num_timeout": 7}
    assert parameters["nodes"] == 3 and parameters["tasks_per_node"] == parameters["gpus_per_node"] == 8
    assert parameters["timeout_min"] == 600 and parameters["slurm_partition"] == "gpu"
    assert parameters["slurm_account"] == "nmt" and parameters["slurm_signal_delay_s"] == 120


def task_of(job_id: str) -> int:
    """The task process submitit's local controller (pid ``job_id``) runs the trial's job in."""
    (child,) = Path(f"/proc/{job_id}/task/{job_id}/children").read_text().split()
    return int(child)


@pytest.mark.slow
def test_submitted_trials_survive_their_runner_and_a_preemption(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, wandb_offline: None
) -> None:
    monkeypatch.setenv("PYTHONPATH", environment()["PYTHONPATH"])  # the recorder
    sweep = tmp_path / "jobs.yaml"
    sweep.write_text(JOB_SWEEP.format(root=corpus_root, cache=cache_dir))
    folder = tmp_path / "outputs" / "sweeps" / "jobs"
    # Its output to a file: the jobs it starts inherit it and outlive it (a pipe would stay open with them).
    with open(tmp_path / "runner.log", "w") as output:
        command = [
            sys.executable,
            "-m",
            "aiayn.cli.sweep",
            str(sweep),
            "--launcher",
            "submitit-local",
            "--parallel",
            "2",
        ]
        runner = subprocess.Popen(command, cwd=tmp_path, stdout=output, stderr=output, start_new_session=True)

    def training() -> bool:  # both submitted, the first held after its second batch
        states = trials(folder) if (folder / STATE_FILE).is_file() else []
        if len(states) < 2 or not all(t["job_id"] for t in states):
            return False
        return (folder / states[0]["run_dir"] / "batches" / HELD).is_file()

    wait_until(training, runner, "both jobs submitted and the first training")
    submitted = trials(folder)
    assert [t["launcher"] for t in submitted] == ["submitit-local"] * 2 and all(t["job_id"] for t in submitted)
    runner.kill()  # the runner dies; its jobs go on
    runner.wait()
    os.kill(task_of(submitted[0]["job_id"]), signal.SIGUSR2)  # submitit's preemption notice
    for trial in submitted:  # both go on (the first stops at its next batch; requeued, it passes at once)
        (folder / trial["run_dir"] / "batches").mkdir(parents=True, exist_ok=True)
        (folder / trial["run_dir"] / "batches" / RELEASE).touch()

    again = run_runner(sweep, tmp_path, "--launcher", "submitit-local", "--parallel", "2")
    assert again.returncode == 0, again.stderr
    assert all(f"re-attached to submitit-local job {t['job_id']}" in again.stderr for t in submitted)
    ended = trials(folder)
    assert [t["job_id"] for t in ended] == [t["job_id"] for t in submitted]  # nothing submitted again
    jobs = sorted(p.name for p in (folder / SUBMITIT_FOLDER).iterdir() if p.name.isdigit())  # a folder per job
    assert jobs == sorted(t["job_id"] for t in submitted)
    assert [t["state"] for t in ended] == ["finished", "finished"]

    preempted = folder / ended[0]["run_dir"]
    results = json.loads((preempted / "results.json").read_text())
    assert results["resumed_from"] == str(preempted / "checkpoints" / "last.ckpt") and results["steps"] == 12
    assert ended[0]["metric"] == results["val_bleu"]
    steps = [batch["step"] for batch in recorded(preempted / "batches")]
    (stopped_at,) = {step for step in steps if steps.count(step) == 2}  # fetched before the stop, not trained
    del steps[steps.index(stopped_at)]
    assert steps == list(range(12))  # requeued in its folder: no step lost or repeated
    log = (folder / "logs" / "trial-0001.log").read_text()
    assert "SIGUSR2 received" in log
    untouched = json.loads((folder / ended[1]["run_dir"] / "results.json").read_text())
    assert untouched["resumed_from"] is None and untouched["steps"] == 12


STOPPING_TRIAL = """\
import os, sys
from pathlib import Path
folder = Path(os.environ["AIAYN_RUN_DIR"])
folder.mkdir(parents=True, exist_ok=True)
attempts = folder / "attempts"
attempts.write_text(attempts.read_text() + "x" if attempts.exists() else "x")
if len(attempts.read_text()) == 1:
    sys.exit(143)  # as aiayn-train after saving last.ckpt at a SIGTERM that submitit did not requeue
(folder / "csv").mkdir(exist_ok=True)
(folder / "csv" / "metrics.csv").write_text("step,val/bleu\\n1,2.5\\n")
(folder / "results.json").write_text("{}")
"""


def test_a_job_stopped_at_a_signal_is_submitted_again(tmp_path: Path) -> None:
    sweep = script_sweep(tmp_path, STOPPING_TRIAL, [1], "hardware=slurm", "trainer.num_nodes=1", "trainer.devices=1")
    state = run_sweep(sweep, tmp_path / "sweep", launcher="submitit-local")
    (trial,) = state.trials
    assert trial.state == "finished" and trial.metric == 2.5 and trial.launcher == "submitit-local"
    assert (tmp_path / "sweep" / trial.run_dir / "attempts").read_text() == "xx"  # the same folder, twice
    jobs = [p.name for p in (tmp_path / "sweep" / SUBMITIT_FOLDER).iterdir() if p.name.isdigit()]
    assert len(jobs) == 2 and trial.job_id in jobs  # a second job, not the first one again


def test_a_sweep_that_cannot_submit_stops_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = script_sweep(tmp_path, STOPPING_TRIAL, [1, 2], "hardware=slurm")
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch, no srun: as on a machine without SLURM
    monkeypatch.chdir(tmp_path)
    status, _, err = sweep_main([sweep, "--launcher", "slurm"], capsys)
    assert status == 2, err
    (line,) = err.splitlines()
    assert line.startswith("aiayn-sweep: error: trial-0001 could not be submitted to slurm: ") and "srun" in line
    (trial,) = trials(tmp_path / "outputs" / "sweeps" / "s")  # the second was never proposed
    assert trial["state"] == "failed" and trial["error"].startswith("not submitted: ")
