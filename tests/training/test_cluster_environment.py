"""Who starts the DDP ranks inside a SLURM job: SLURM when it runs a task per rank, Lightning when the job
is one task (``wandb agent`` in an sbatch script; Lightning alone would refuse the mismatch)."""

from __future__ import annotations

import pytest
from lightning_fabric.plugins.environments import LightningEnvironment, SLURMEnvironment

from aiayn.training.cluster import cluster_environment


def slurm_job(monkeypatch: pytest.MonkeyPatch, tasks: int) -> None:
    for name, value in {"SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "agent", "SLURM_NTASKS": str(tasks)}.items():
        monkeypatch.setenv(name, value)


def test_a_one_task_slurm_job_with_several_devices_lets_lightning_start_the_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slurm_job(monkeypatch, tasks=1)
    (environment,) = cluster_environment({"devices": 8, "num_nodes": 1}, [])
    assert isinstance(environment, LightningEnvironment)


@pytest.mark.parametrize(
    ("tasks", "options", "plugins"),
    [
        (8, {"devices": 8}, []),  # srun started a task per GPU (hardware=slurm): SLURM's ranks
        (1, {"devices": 1}, []),  # one process: nothing to start
        (1, {"devices": 8, "num_nodes": 2}, []),  # other nodes: Lightning cannot start ranks there
        (1, {"devices": 8}, [SLURMEnvironment(auto_requeue=False)]),  # the user's own choice
    ],
)
def test_otherwise_lightning_or_the_users_plugin_decides(
    tasks: int, options: dict, plugins: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    slurm_job(monkeypatch, tasks)
    assert cluster_environment(options, plugins) == []


def test_outside_slurm_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_JOB_NAME"):
        monkeypatch.delenv(name, raising=False)
    assert cluster_environment({"devices": 8}, []) == []
