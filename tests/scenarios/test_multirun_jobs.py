"""Hydra's multirun (``aiayn-train -m``) with jobs that train on 2 DDP ranks: each job once, with both
ranks, in its own folder and W&B run."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from helpers.batch_recorder import recorded
from helpers.processes import environment
from helpers.runs import SMOKE_RUN_EXTRA, smoke_run
from helpers.wandb_records import offline_runs

pytestmark = pytest.mark.slow
# Each job records its ranks' batches into its own folder (Hydra resolves the job's output_dir per job).
JOB_RECORDER = "callbacks=[{_target_:helpers.batch_recorder.BatchRecorder,folder:'${hydra:runtime.output_dir}'}]"


def test_a_multirun_of_ddp_jobs_runs_each_job_once_with_both_ranks_in_its_own_folder(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, wandb_offline: None
) -> None:
    overrides = [*smoke_run(corpus_root, cache_dir, *SMOKE_RUN_EXTRA), "logger=wandb", JOB_RECORDER]
    command = ["aiayn-train", "-m", "hardware=cpu_ddp", "seed=1,2", *overrides]
    # Before the fix the second rank started a multirun of its own and rank 0 waited for it for ever.
    done = subprocess.run(command, cwd=tmp_path, env=environment(), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]

    assert [p.name for p in (tmp_path / "outputs").iterdir()] == ["multirun"]  # no stray run folders
    (multirun,) = (tmp_path / "outputs" / "multirun").iterdir()
    jobs = sorted(p for p in multirun.iterdir() if p.is_dir())
    assert [job.name for job in jobs] == ["0", "1"]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 2  # one summary per job, from its rank 0
    run_ids = set()
    for seed, job, report in zip((1, 2), jobs, reports, strict=True):
        results = json.loads((job / "results.json").read_text())
        assert results == report
        assert results["steps"] == 12 and results["batch"]["world_size"] == 2
        assert f"seed={seed}" in results["overrides"] and "-m" not in results["overrides"]
        assert yaml.safe_load((job / "config.yaml").read_text())["seed"] == seed
        ranks = [recorded(job, rank) for rank in (0, 1)]
        # each rank of the job trained its 12 steps once, on batches of its own
        assert [[batch["step"] for batch in rank] for rank in ranks] == [list(range(12))] * 2
        for first, second in zip(*ranks, strict=True):
            assert not set(first["index"]) & set(second["index"])
        (run,) = offline_runs(job / "wandb")
        assert run.group == f"multirun/{multirun.name}" and run.exit_code == 0
        run_ids.add(run.run_id)
    assert len(run_ids) == 2
    # the two jobs drew different batches: each composed its own seed, on both ranks
    assert recorded(jobs[0], 1) != recorded(jobs[1], 1)
