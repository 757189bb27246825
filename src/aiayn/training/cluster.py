"""Who starts a run's DDP ranks inside a SLURM job: SLURM (``srun``, one task per device: ``hardware=slurm``)
or Lightning (one task, which starts the others, as on a workstation).

Lightning believes SLURM started the ranks whenever it runs inside a SLURM job. A job of one task that
runs a DDP run of several devices on its node (``wandb agent`` in an sbatch script, whose trials use
``hardware=gpu8_ddp``; a batch script that calls aiayn-train without ``srun``) would then stop with
Lightning's complaint that the job's tasks do not match its devices (wandb#5695). Such a run is told it is
not under SLURM: Lightning starts its ranks itself.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from lightning_fabric.plugins.environments import ClusterEnvironment, LightningEnvironment, SLURMEnvironment

from aiayn.machine import Devices

log = logging.getLogger(__name__)


def cluster_environment(options: dict[str, Any], plugins: list[Any]) -> list[ClusterEnvironment]:
    """The cluster environment to add to ``plugins`` for ``pl.Trainer(**options)``: Lightning's own when a
    one-task SLURM job runs several ranks on one node (Lightning then starts them), else none (Lightning
    decides, or the user's own plugin does)."""
    if any(isinstance(plugin, ClusterEnvironment) for plugin in plugins) or not SLURMEnvironment.detect():
        return []
    devices = Devices.parse(options.get("devices", "auto"), options.get("num_nodes", 1))
    if os.environ.get("SLURM_NTASKS") != "1" or devices.nodes != 1 or devices.count is None or devices.count < 2:
        return []
    log.info("a SLURM job of one task runs %d ranks on its node: Lightning starts them itself", devices.count)
    return [LightningEnvironment()]
