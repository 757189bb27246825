"""The benchmarks run end to end at tiny sizes and report what benchmarks/RESULTS.md quotes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# model=tiny with the paper's dropout, so that the timed steps use it
TINY = ["--data", "{root}", "data.max_tokens=512", "data.cache_dir={cache}", "model.dropout=0.1"]
pytestmark = pytest.mark.slow


def run_benchmark(script: str, root: Path, cache: Path, *args: str) -> dict[str, Any]:
    command = [sys.executable, str(BENCHMARKS / script), *args]
    command += [part.format(root=root, cache=cache) for part in TINY]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB__DISABLE_STATS": "true"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_train_throughput_races_the_peers_with_the_same_parameters(multi30k_root: Path, cache_dir: Path) -> None:
    result = run_benchmark("train_throughput.py", multi30k_root, cache_dir, "--models", "tiny", "--steps", "2")
    tiny = result["tiny"]
    # the three models have the same dimensions: the same trainable parameters
    assert len(set(tiny["params"].values())) == 1, tiny["params"]
    for key in ("vs_marian", "vs_nn_transformer"):
        assert 0.2 < tiny[key] < 5.0
    assert 0.0 < tiny["efficiency"] < 1.0  # no step beats the machine's own matrix product
    assert set(tiny["tokens_per_s"]) == {"aiayn", "marian", "nn_transformer"}


def test_efficiency_is_model_flops_over_the_matmul_ceiling(multi30k_root: Path, cache_dir: Path) -> None:
    result = run_benchmark("efficiency.py", multi30k_root, cache_dir, "--models", "tiny", "--rounds", "1")
    tiny = result["tiny"]
    assert 0.0 < tiny["efficiency"] < 1.0
    assert tiny["efficiency"] == pytest.approx(tiny["model_gflops"] / tiny["matmul_gflops"], abs=0.01)


def test_overhead_times_the_real_training_loop_against_the_bare_one(multi30k_root: Path, cache_dir: Path) -> None:
    # the script itself stops unless every timed step of the run was paired with a bare step
    args = ("--model", "tiny", "--steps", "4", "--warmup", "1", "--rounds", "1")
    result = run_benchmark("overhead.py", multi30k_root, cache_dir, *args)
    speeds = result["tokens_per_s"]
    assert 0.2 < speeds["aiayn-train"] / speeds["bare"] < 1.1
    assert 0.0 < result["data_share"] < 0.5


def test_decoding_races_cached_and_recomputed_beam_search_against_generate_and_ctranslate2() -> None:
    command = [sys.executable, str(BENCHMARKS / "decoding.py"), "--sentences", "8", "--batch", "4", "--rounds", "1",
               "--ct2", "int8"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    speeds = json.loads(done.stdout.strip().splitlines()[-1])["sentences_per_s"]
    assert set(speeds) == {"aiayn cached", "aiayn recompute", "transformers generate", "ctranslate2 int8"}
    assert all(speed > 0 for speed in speeds.values())
