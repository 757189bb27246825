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

from aiayn.data import Multi30kDataModule, TokenBudgetBatchSampler
from helpers.batch_recorder import recorded, recorder
from helpers.bleu import assert_reported_bleu
from helpers.processes import assert_same_weights, environment, hold_and_signal, stopped, weights
from helpers.runs import SMOKE_RUN_EXTRA, smoke_run
from helpers.wandb_records import offline_runs

pytestmark = pytest.mark.slow
SEED, STEPS = 3, 12  # debug=smoke trains 12 steps
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


def agent_trial(tmp_path: Path, corpus_root: Path, cache_dir: Path, run_id: str) -> tuple[list[str], dict[str, str]]:
    """The command `wandb agent` runs for trial ``run_id`` of sweep sw1 (seed 3, trained on 2 DDP ranks)
    and the SLURM job's environment it runs in."""
    fixed = [*smoke_run(corpus_root, cache_dir, *SMOKE_RUN_EXTRA), "logger=wandb", "progress=quiet"]
    sweep_command = ["${env}", "${program}", "hardware=cpu_ddp", *fixed, "${args_no_hyphens}"]
    params = tmp_path / "wandb" / "sweep-sw1" / f"config-{run_id}.yaml"
    params.parent.mkdir(parents=True, exist_ok=True)
    config_util.save_config_file_from_dict(str(params), {"seed": {"value": SEED}})
    env = {**environment(), **ONE_TASK_JOB, "WANDB_SWEEP_ID": "sw1", "WANDB_RUN_ID": run_id}
    command = agent_command(sweep_command, {"seed": SEED})
    assert command[:3] == ["/usr/bin/env", "aiayn-train", "hardware=cpu_ddp"] and command[-1] == f"seed={SEED}"
    return command, {**env, "WANDB_SWEEP_PARAM_PATH": str(params)}


def shares_of(folder: Path) -> list[list[list[int]]]:
    """Each rank's recorded batches (their pairs), in training order."""
    return [[batch["index"] for batch in recorded(folder, rank)] for rank in (0, 1)]


def test_a_ddp_trial_of_wandb_agent_stopped_by_its_slurm_job_continues_as_if_never_stopped(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, wandb_offline: None
) -> None:
    """The trial the agent starts trains on both ranks, each on its own share of every epoch as the sampler
    deals it; the job's USR1 (``sbatch --signal=B:USR1``, forwarded by the agent) stops both ranks at one
    step, marks the W&B run preempting, and the same command, run again by the next agent, continues in the
    same folder and W&B run and ends as an uninterrupted trial does: the same batches, tokens and weights."""
    command, env = agent_trial(tmp_path, corpus_root, cache_dir, "run8")  # the uninterrupted trial
    whole = tmp_path / "outputs" / "sweeps" / "sw1" / f"seed={SEED}-run8"
    done = subprocess.run([*command, recorder(tmp_path / "whole")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert len([line for line in done.stdout.splitlines() if line.startswith("{")]) == 1  # rank 0 reports

    command, env = agent_trial(tmp_path, corpus_root, cache_dir, "run7")
    held = tmp_path / "held"
    first = subprocess.Popen([*command, recorder(held, hold_at=4)], cwd=tmp_path, env=env, stderr=subprocess.PIPE,
                             text=True)  # fmt: skip
    hold_and_signal(first, held, signal.SIGUSR1)
    stopped(first, signal.SIGUSR1)
    trial = tmp_path / "outputs" / "sweeps" / "sw1" / f"seed={SEED}-run7"  # the sweep's parameters and the W&B run
    assert torch.load(trial / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4
    # both ranks trained 4 steps, and stopped as the next batch came (the recorder sees it first)
    assert [[batch["step"] for batch in recorded(held, rank)] for rank in (0, 1)] == [[0, 1, 2, 3, 4]] * 2

    # W&B's sweep requeues a preempted trial: the next agent runs the same command with the same run id
    done = subprocess.run([*command, recorder(held)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((trial / "results.json").read_text())
    assert results["steps"] == STEPS and results["batch"]["world_size"] == 2
    assert results["resumed_from"] == str(trial / "checkpoints" / "last.ckpt")
    parts = offline_runs(trial / "wandb")
    assert [(part.run_id, part.preempting) for part in parts] == [("run7", True), ("run7", False)]
    assert parts[1].exit_code == 0

    # the batch fetched before the stop is the one the continued trial began with: none lost or repeated
    for rank in (0, 1):
        records = recorded(held, rank)
        assert [r["step"] for r in records] == [0, 1, 2, 3, 4, *range(4, STEPS)]
    shares = [share[:4] + share[5:] for share in shares_of(held)]
    assert shares == shares_of(tmp_path / "whole")
    assert_same_weights(weights(whole), weights(trial))  # on both ranks: DDP keeps them equal
    whole_results = json.loads((whole / "results.json").read_text())
    assert results["train_tokens"] == whole_results["train_tokens"]
    references = (corpus_root / "test_2016_flickr.de").read_text().splitlines()[:16]
    assert_reported_bleu(trial, results, references)  # both ranks' shares of the test set, in its order

    # each rank's share of each epoch is what the sampler deals it; the two are disjoint; the tokens counted
    # are both ranks' real ones (source + EOS and target + EOS of every pair trained on)
    dm = Multi30kDataModule(root=str(corpus_root), cache_dir=str(cache_dir), vocab_size=1000, train_limit=400)
    dm.prepare_data()
    dm.setup()
    train_set = dm.datasets["train"]
    epochs = [batch["epoch"] for batch in recorded(tmp_path / "whole")]
    dealt = []
    for rank in (0, 1):
        sampler = TokenBudgetBatchSampler(train_set.padded_lengths(), 800, seed=SEED, num_replicas=2, rank=rank)
        dealt.append([])
        for epoch in sorted(set(epochs)):
            sampler.set_epoch(epoch)
            dealt[rank] += list(sampler)
    assert shares == [deal[:STEPS] for deal in dealt]
    for epoch in set(epochs):
        pairs = [{i for batch, e in zip(share, epochs, strict=True) if e == epoch for i in batch} for share in shares]
        assert not pairs[0] & pairs[1]
    real = train_set.src.lengths[train_set.indices] + train_set.tgt.lengths[train_set.indices] + 2
    assert results["train_tokens"] == int(sum(real[batch].sum() for share in shares for batch in share))
