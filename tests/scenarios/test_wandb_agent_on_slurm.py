"""`wandb agent` inside a SLURM job of one task (sweeps/slurm_agent.sbatch): the trial the agent starts,
with the command W&B composes from a sweep file whose trials train on 2 DDP ranks, runs as a correct DDP
job (Lightning starts the ranks; SLURM did not), and a scheduler's signal marks its W&B run preempting,
after which the same trial, run again by the next agent, continues in the same folder and W&B run.
The SLURM job's environment is simulated; W&B's own agent code composes the command."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from wandb.sdk.launch.sweeps.utils import create_sweep_command, create_sweep_command_args
from wandb.sdk.lib import config_util

from helpers.batch_recorder import recorded, recorder
from helpers.processes import environment, hold_and_signal, stopped
from helpers.runs import SMOKE_RUN_EXTRA, smoke_run
from helpers.wandb_records import offline_runs

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "sweeps" / "slurm_agent.sbatch"
# What SLURM sets in the batch step of `sbatch --nodes=1 --ntasks-per-node=1` (the agent's task).
ONE_TASK_JOB = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "aiayn-agent",
    "SLURM_NTASKS": "1",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_NNODES": "1",
    "SLURM_NODEID": "0",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODELIST": "localhost",
    "SLURM_JOB_NODELIST": "localhost",
}


def agent_command(sweep_command: list[str], args: dict[str, object]) -> list[str]:
    """The trial's command line as `wandb agent` builds it (wandb_agent.Agent._command_run), from W&B's
    own functions: the sweep file's ``command`` with ``${env}``, ``${program}`` and the trial's arguments."""
    variables = create_sweep_command_args({"args": {key: {"value": value} for key, value in args.items()}})
    variables |= {"env": ["/usr/bin/env"], "program": ["aiayn-train"], "interpreter": ["python"]}
    command: list[str] = []
    for item in map(str, create_sweep_command(sweep_command)):
        command += variables.get(item[2:-1]) or [] if item.startswith("${") and item.endswith("}") else [item]
    return command


def test_the_sbatch_recipe_runs_one_agent_task_per_node_that_forwards_signals_to_one_trial() -> None:
    text = SBATCH.read_text()
    options = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.MULTILINE))
    assert options["nodes"] == "1" and options["ntasks-per-node"] == "1"  # the agent; Lightning starts the ranks
    assert options["signal"].startswith("B:USR1@")  # to the batch shell, which is the agent (exec)
    assert re.search(r"^exec wandb agent --forward-signals --count 1 ", text, re.MULTILINE)
    assert subprocess.run(["bash", "-n", str(SBATCH)]).returncode == 0


def test_a_trial_of_wandb_agent_in_a_one_task_slurm_job_trains_on_its_ddp_ranks_and_is_requeued_after_usr1(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, wandb_offline: None
) -> None:
    held = tmp_path / "held"
    fixed = [*smoke_run(corpus_root, cache_dir, *SMOKE_RUN_EXTRA), "logger=wandb", "progress=quiet"]
    sweep_command = ["${env}", "${program}", "hardware=cpu_ddp", *fixed, "${args_no_hyphens}"]
    sweep_dir = tmp_path / "wandb" / "sweep-sw1"
    sweep_dir.mkdir(parents=True)
    params = sweep_dir / "config-run7.yaml"
    config_util.save_config_file_from_dict(str(params), {"seed": {"value": 3}})
    env = {
        **environment(),
        **ONE_TASK_JOB,
        "WANDB_SWEEP_ID": "sw1",
        "WANDB_RUN_ID": "run7",
        "WANDB_SWEEP_PARAM_PATH": str(params),
    }
    command = agent_command(sweep_command, {"seed": 3})
    assert command[:3] == ["/usr/bin/env", "aiayn-train", "hardware=cpu_ddp"] and command[-1] == "seed=3"

    first = subprocess.Popen(
        [*command, recorder(held, hold_at=4)], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True
    )
    hold_and_signal(first, held, signal.SIGUSR1)  # sbatch --signal=B:USR1, forwarded by the agent
    stopped(first, signal.SIGUSR1)
    trial = tmp_path / "outputs" / "sweeps" / "sw1" / "seed=3-run7"  # the sweep's parameters and the W&B run
    assert torch.load(trial / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4
    # both ranks trained 4 steps, and stopped as the next batch came (the recorder sees it first)
    assert [[batch["step"] for batch in recorded(held, rank)] for rank in (0, 1)] == [[0, 1, 2, 3, 4]] * 2

    # W&B's sweep requeues a preempted trial: the next agent runs the same command with the same run id
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((trial / "results.json").read_text())
    assert results["steps"] == 12 and results["batch"]["world_size"] == 2
    assert results["resumed_from"] == str(trial / "checkpoints" / "last.ckpt")
    parts = offline_runs(trial / "wandb")
    assert [(part.run_id, part.preempting) for part in parts] == [("run7", True), ("run7", False)]
    assert parts[1].exit_code == 0
