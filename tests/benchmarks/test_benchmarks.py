"""Smoke tests of the benchmark scripts: each runs end to end on the generated corpus at tiny sizes (one
round, a 512² matrix product for the machine's ceiling) and races its contestants fairly: the same
parameters, every batch stepped by every contestant, decoders held to the same output lengths. The speeds
are not checked; benchmarks/RESULTS.md quotes full runs on a quiet machine. The scripts run in this
process (``runpy``), as ``python benchmarks/<script>.py`` runs them, without starting another Python."""

from __future__ import annotations

import importlib
import json
import os
import runpy
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.runs import REPO

BENCHMARKS = REPO / "benchmarks"
pytestmark = pytest.mark.slow

Benchmark = Callable[..., dict[str, Any]]


@pytest.fixture
def run_benchmark(
    corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> Benchmark:
    """Runs a script of benchmarks/ with its arguments; with ``data=True``, on the generated corpus with the
    session's 1000-piece tokenizer, model=tiny's batches of 512 tokens and the paper's dropout (so that the
    timed steps use it). Returns its last line of output, JSON."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import their neighbours, as from their folder

    def run(script: str, *args: str, data: bool = True) -> dict[str, Any]:
        argv = [str(BENCHMARKS / script), *args]
        if data:
            argv += ["--data", str(corpus_root), f"data.cache_dir={cache_dir}", "data.vocab_size=1000"]
            argv += ["data.max_tokens=512", "model.dropout=0.1"]
        monkeypatch.setattr(sys, "argv", argv)
        runpy.run_path(argv[0], run_name="__main__")
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    return run


def stepped_batches(monkeypatch: pytest.MonkeyPatch, module: str, function: str) -> dict[str, list[int]]:
    """The batches that the training steps handed to ``module.function`` (``workload.race``: steps by name;
    ``workload.timed_steps``: one step) are given, as ids in order by contestant, and under ``"batches"``
    those the function was asked to run. Needs benchmarks/ on the path, where ``run_benchmark`` puts it."""
    target = importlib.import_module(module)
    real = getattr(target, function)
    stepped: dict[str, list[int]] = {}

    def counted(name: str, step: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
        def run(batch: dict[str, Any]) -> None:
            stepped.setdefault(name, []).append(id(batch))
            step(batch)

        return run

    def spy(steps: Any, batches: list[dict[str, Any]], *args: Any) -> Any:
        stepped["batches"] = [id(batch) for batch in batches]
        if isinstance(steps, dict):
            return real({name: counted(name, step) for name, step in steps.items()}, batches, *args)
        return real(counted("aiayn", steps), batches, *args)

    monkeypatch.setattr(target, function, spy)
    return stepped


def test_train_throughput_races_the_peers_with_the_same_parameters_on_the_same_batches(
    run_benchmark: Benchmark, monkeypatch: pytest.MonkeyPatch
) -> None:
    stepped = stepped_batches(monkeypatch, "workload", "race")
    args = ("--models", "tiny", "--steps", "2", "--rounds", "1", "--matmul-size", "512")
    tiny = run_benchmark("train_throughput.py", *args)["tiny"]
    contestants = {"aiayn", "marian", "nn_transformer"}
    assert set(tiny["params"]) == set(tiny["tokens_per_s"]) == contestants
    assert len(set(tiny["params"].values())) == 1, tiny["params"]  # the same dimensions: the same parameters
    # every contestant stepped both batches, in a warm-up pass and the one timed round: the same tokens
    batches = stepped.pop("batches")
    assert len(batches) == 2 and stepped == dict.fromkeys(contestants, batches * 2)
    assert set(tiny) >= {"efficiency", "model_gflops", "matmul_gflops", "vs_marian", "vs_nn_transformer"}
    for peer in ("marian", "nn_transformer"):  # one round: its ratio is the median, the lowest and the highest
        assert tiny[f"vs_{peer}_range"] == [tiny[f"vs_{peer}"]] * 2
        # the bound: our step with only its matrix products left, a share of its time profiled apart (the
        # share is reported to 3 decimals: above 0.05, that is within 1% of the share the bound used)
        assert tiny[f"vs_{peer}_bound"] == pytest.approx(tiny[f"vs_{peer}"] / tiny["matmul_share"], rel=0.01)
    assert 0.05 < tiny["matmul_share"] < 1


def test_the_raced_batches_span_the_epochs_lengths_and_the_ratios_are_taken_round_by_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    workload = importlib.import_module("workload")
    lengths = (9, 3, 14, 5, 11, 7, 2, 20, 6, 8)  # of each pair of the epoch's batches, in their order
    epoch = [{"lengths": torch.tensor([[n, n]] * 3)} for n in lengths]
    monkeypatch.setattr(workload, "training_batches", lambda cfg, count: epoch[:count])
    # ranks 0, 3, 6, 9 of the 10 by length (2, 6, 9, 20), in the epoch's order
    assert [workload.mean_length(batch) for batch in workload.spread_batches(None, 4)] == [18, 4, 40, 12]
    assert workload.spread_batches(None, 20) == epoch and len(workload.spread_batches(None, 1)) == 1
    # per-round ratios 2, 1.333, 3: their median is 2, where the ratio of the medians (4 / 3) is the worst round's
    assert workload.ratio_spread([2.0, 4.0, 9.0], [1.0, 3.0, 3.0]) == {"median": 2.0, "min": 1.333, "max": 3.0}


def test_components_races_each_2025_row_against_base_on_the_same_batches(
    run_benchmark: Benchmark, monkeypatch: pytest.MonkeyPatch
) -> None:
    stepped = stepped_batches(monkeypatch, "workload", "race")
    rows = ["swiglu", "grouped_query"]
    result = run_benchmark("components.py", "--rows", *rows, "--steps", "2", "--rounds", "1")
    assert all(stepped[row] == stepped["batches"] * 2 for row in ["base", *rows])  # warm-up, then the round
    base, swiglu, grouped = (result[row] for row in ["base", *rows])
    assert base["vs_base"] == 1.0 and min(r["tokens_per_s"] for r in result.values()) > 0
    assert abs(swiglu["params"] / base["params"] - 1) < 0.01  # SwiGLU at the paper's parameters
    assert grouped["params"] < base["params"] and grouped["flops_per_token"] < base["flops_per_token"]


def test_padding_compares_the_batches_by_size_with_those_by_longer_side_over_epochs(run_benchmark: Benchmark) -> None:
    result = run_benchmark("padding.py", "--epochs", "2")
    by_size, by_side = result["size"], result["size, longer side"]
    # the generated corpus translates word for word: its sides are about as long, and the side gains
    # little (tests/data/test_sampler.py measures that gain on pairs whose sides differ)
    assert 0.5 < by_size["fill"] <= by_side["fill"] < 1 and 0.5 < by_size["target_fill"] <= by_side["target_fill"] < 1
    assert 0 < by_size["mates_kept"] <= by_side["mates_kept"] < 1


def test_positionwise_times_the_feed_forward_on_padded_and_packed_tokens(run_benchmark: Benchmark) -> None:
    result = run_benchmark("positionwise.py", "--models", "tiny", "--steps", "2", "--rounds", "1")["tiny"]
    assert set(result) == {"fill", "padded", "packed", "packed here"} and 0.5 < result["fill"] < 1
    assert result["padded"]["vs_padded"]["median"] == 1.0
    assert min(result[way]["tokens_per_s"] for way in ("padded", "packed", "packed here")) > 0


def test_fusion_times_the_residual_chain_eager_and_compiled(run_benchmark: Benchmark) -> None:
    args = ("--tokens", "64", "--d-model", "32", "--dropout", "0.1", "--rounds", "2", "--repeats", "1")
    result = run_benchmark("fusion.py", *args, data=False)["d32_p0.1"]
    assert set(result["ms"]) == {"eager", "compiled"} and min(result["ms"].values()) > 0
    low, high = result["range"]
    assert 0 < low <= result["compiled_speedup"] <= high


def test_efficiency_times_our_step_on_every_batch_against_the_matmul_ceiling(
    run_benchmark: Benchmark, monkeypatch: pytest.MonkeyPatch
) -> None:
    stepped = stepped_batches(monkeypatch, "workload", "timed_steps")
    args = ("--models", "tiny", "--steps", "2", "--rounds", "1", "--matmul-size", "512")
    tiny = run_benchmark("efficiency.py", *args)["tiny"]
    batches = stepped.pop("batches")
    assert len(batches) == 2 and stepped == {"aiayn": batches * 2}  # a warm-up pass and the timed round
    assert set(tiny) == {"efficiency", "model_gflops", "matmul_gflops"}
    assert min(tiny.values()) > 0


@pytest.mark.usefixtures("wandb_offline")
def test_overhead_times_the_real_training_loop_against_the_bare_one(
    run_benchmark: Benchmark, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The script itself stops unless every timed step of the run was paired with a bare step."""
    train_throughput = importlib.import_module("train_throughput")
    our_step = train_throughput.our_step
    bare: list[int] = []

    def counted_step(module: Any) -> Callable[[dict[str, Any]], None]:
        step = our_step(module)

        def run(batch: dict[str, Any]) -> None:
            bare.append(id(batch))
            step(batch)

        return run

    monkeypatch.setattr(train_throughput, "our_step", counted_step)
    result = run_benchmark("overhead.py", "--model", "tiny", "--steps", "4", "--warmup", "1", "--rounds", "1")
    assert len(bare) == 5  # the bare loop stepped the run's warm-up batch and its 4 timed ones
    assert set(result["tokens_per_s"]) == {"bare", "aiayn-train"}
    assert min(result["tokens_per_s"].values()) > 0 and result["full_vs_bare"] > 0 and result["data_share"] > 0


def test_snapshots_times_the_whole_state_and_the_snapshot_at_the_same_steps(run_benchmark: Benchmark) -> None:
    """The script itself stops unless every timed step had both saves; the snapshot is the weights only."""
    result = run_benchmark("snapshots.py", "--model", "tiny", "--steps", "2", "--warmup", "1")
    assert result["model"] == "tiny" and result["whole_state_ms"] > 0 and result["snapshot_ms"] > 0
    assert result["snapshot_vs_whole"] == pytest.approx(result["snapshot_ms"] / result["whole_state_ms"], rel=0.05)
    assert 0 < result["snapshot_mb"] < result["whole_state_mb"] / 2  # not Adam's two moments, nor the EMA


def test_decoding_races_cached_and_recomputed_beam_search_against_generate_and_ctranslate2(
    run_benchmark: Benchmark,
) -> None:
    """The script itself stops unless every contestant decoded exactly --out-len steps per sentence."""
    args = ("--sentences", "8", "--batch", "4", "--rounds", "1", "--ct2", "int8")
    result = run_benchmark("decoding.py", *args, data=False)
    names = {"aiayn cached", "aiayn recompute", "transformers generate", "ctranslate2 int8"}
    assert set(result["sentences_per_s"]) == set(result["rounds"]) == names
    assert all(len(speeds) == 1 for speeds in result["rounds"].values())


def test_speedups_races_bf16_autocast_with_attention_in_fp32_and_in_bf16(
    run_benchmark: Benchmark, monkeypatch: pytest.MonkeyPatch
) -> None:
    attended: list[torch.dtype] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(q: torch.Tensor, *args: Any, **options: Any) -> torch.Tensor:
        attended.append(q.dtype)
        return sdpa(q, *args, **options)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    result = run_benchmark("speedups.py", "--model", "tiny", "--steps", "2", "--rounds", "1", "--bf16")
    variants = {"nn.Dropout", "F.cross_entropy", "Adam for-loop", "none of them", "packed attention"}
    variants |= {"bf16 autocast", "bf16, bf16 attention"}
    assert set(result["tokens_per_s"]) == {"aiayn", *variants} and all(result[f"vs_{name}"] > 0 for name in variants)
    # 2 layers x 3 attentions x 2 batches x (warm-up + 1 round) per variant: bf16 only where asked for
    assert attended.count(torch.bfloat16) == 6 * 2 * 2 and len(attended) == 6 * 2 * 2 * (len(variants) + 1)


def test_memory_summary_marks_epochs_and_fits_their_growth(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory benchmark's reading of a run: its own process tree sampled from /proc, and a log of three
    validations (each ends an epoch) and a test, with samples between them, summed into the numbers its
    JSON reports. The whole run it starts is the default one: too long for the suite."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    memory = importlib.import_module("memory")
    assert memory.tree_rss_mb(os.getpid()) >= memory.rss_kb(os.getpid()) / 1024 > 10
    sampler = memory.Sampler(subprocess.Popen([sys.executable, "-c", ""]), interval=1.0)
    sampler.process.wait()
    sampler.samples = [(1.0, 900.0), (2.0, 1500.0), (3.0, 1000.0), (4.0, 1700.0), (5.0, 1200.0), (6.0, 1900.0)]
    sampler.events = [
        {"event": "validation", "s": 2.0, "rss_mb": 1500, "step": 10},
        {"event": "validation", "s": 4.0, "rss_mb": 1700, "step": 20},
        {"event": "validation", "s": 5.0, "rss_mb": 1200, "step": 30},
        {"event": "evaluate best.ckpt", "s": 5.5, "rss_mb": 1200},
    ]
    result = memory.summary(sampler)
    assert result["epoch_steps"] == [10, 20, 30] and result["epoch_mb"] == [1500, 1700, 1200]
    assert result["epoch_peak_mb"] == [1500, 1700, 1200] and result["growth_mb_per_epoch"] == -500.0
    assert result["peak_mb"] == 1900 and result["evaluation_peak_mb"] == 1900
    assert result["training_peak_after_first_epoch_mb"] == 1700


def test_step_host_races_the_clipped_optimizer_steps_and_times_a_collection(run_benchmark: Benchmark) -> None:
    result = run_benchmark("step_host.py", "--rounds", "2", "--steps", "2", data=False)
    assert result["parameter_tensors"] == 193  # model=base's structure
    assert set(result["ms"]) == {"unfused", "fused", "foreach"} and min(result["ms"].values()) > 0
    low, high = result["fused_vs_unfused"]["min"], result["fused_vs_unfused"]["max"]
    assert 0 < low <= result["fused_vs_unfused"]["median"] <= high
    assert result["gc"]["tracked_objects"] > 10_000 and result["gc"]["full_ms"] > 0


def test_twin_host_times_each_commits_own_aiayn_train_in_turn(run_benchmark: Benchmark) -> None:
    args = ("--against", "HEAD", "--steps", "3", "--warmup", "1", "--rounds", "1")
    result = run_benchmark("twin_host.py", *args)
    assert result["against"] == "HEAD" and {"HEAD", "this tree"} <= set(result)
    assert min(result[tree]["median_ms"] for tree in ("HEAD", "this tree")) > 0 and result["ratio_of_means"] > 0
