"""The GPU check behind `benchmarks/gpu_check.sh` (after `gpu_diagnose.py`), on one CUDA GPU, in 7 minutes:

1. the CUDA-marked tests (`-m cuda`, most in `tests/scenarios/test_cuda.py`: bf16-mixed and 16-mixed
   training steps, training steps under `torch.cuda.set_sync_debug_mode("error")` (no host sync outside the
   logging steps), the SDPA kernel each attention takes (FlashAttention for the decoder's causal self-
   attention and for encoder and cross attention over packed sequences, memory-efficient attention under
   their padding masks), cached vs recomputed beam search on the GPU, the exported CTranslate2 engine on
   CUDA); the names of any that failed are listed;
2. training in bf16-mixed through `aiayn-train` itself (on a generated corpus of 100k pairs, 5000-piece
   BPE, the paper's 25000-token batches) at `model=base` and `model=big`, and at `model=base` with
   `model.compile=true` (the whole model compiled): logged `train/tokens_per_s` and `train/mfu`
   (median of the logged steps after the first 20, so compiling is not counted, and of their later
   half), each run stopping itself in time for its part's limit, and where the host's time per step went
   (Lightning's simple profiler: the loader, the backward pass, the optimizer step, the callbacks);
3. the residual chain `LayerNorm(x + Dropout(y))` eager against a compiled region (`benchmarks/fusion.py`);
4. decoding speed (`benchmarks/decoding.py` on the GPU): our beam search under bf16 autocast,
   `generate` in bf16 and CTranslate2 float16 on the same random `small` model, 512 sentences.

Prints a table per part and, last, one JSON line with everything.
Usage: python benchmarks/gpu_bench.py [--steps 150] [--skip-tests] [--skip-train] [--skip-decoding]
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
# seconds: 425 in all, with the set-up; training's include the tokenizer (trained once, cached)
TIMEOUTS = {
    "tests": 150, "train": 90, "train_big": 60, "train_compiled": 65, "fusion": 25, "decoding": 35
}  # fmt: skip
# Of a training part's time, what is not training: starting (imports, CUDA, the tokenizer the first time:
# 17 s on an H200 host, 2026-12-04), the final validation and tests (15 s) and a margin. Training stops
# itself at what remains (trainer.max_time), so a slow step costs steps, not the part's numbers.
NOT_TRAINING_S = 40
# The host's time in these parts of a step (Lightning's simple profiler): where the host waits, for the
# loader, for the GPU (when a step's metrics are read) or for a checkpoint, the time goes.
HOST_ACTIONS = ("run_training_batch", "train_dataloader_next", "backward", "optimizer_step", "on_train_batch_end")


def timed_out(part: Callable[[], dict[str, Any]], name: str) -> dict[str, Any]:
    """``part()``, or what is known when it ran past its time: the JSON line is printed either way."""
    try:
        return part()
    except subprocess.TimeoutExpired:
        return {"error": f"{name} ran past its {TIMEOUTS[name]} s"}


def cuda_tests(folder: Path) -> dict[str, Any]:
    report = folder / "cuda-tests.xml"
    command = [sys.executable, "-m", "pytest", "-n", "0", "-m", "cuda", "tests", "-q",
               "-p", "no:cacheprovider", f"--junitxml={report}"]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUTS["tests"])
    print(done.stdout[-2000:])
    suite = ET.parse(report).getroot().find("testsuite") if report.exists() else None
    if suite is None:
        return {"error": done.stderr[-500:] or "pytest wrote no report"}
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    failed = [case.get("name") for case in suite.iter("testcase") if case.find("failure") is not None
              or case.find("error") is not None]  # fmt: skip
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed": failed, "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip


def generated_corpus(folder: Path, pairs: int = 100_000, seed: int = 0) -> None:
    """Sentences of 6-40 words drawn from 12000 made-up words (Zipf), each side its own words,
    neighbouring words swapped on the target side: text whose BPE and lengths look like a corpus."""
    rng = random.Random(seed)
    words = 12_000
    weights = [1.0 / (rank + 1) for rank in range(words)]
    for split, count in (("train", pairs), ("val", 500)):
        with open(folder / f"{split}.src", "w") as src, open(folder / f"{split}.tgt", "w") as tgt:
            for _ in range(count):
                ids = rng.choices(range(words), weights, k=rng.randint(6, 40))
                target = [f"v{i}" for i in ids]
                for k in range(0, len(target) - 1, 3):
                    target[k], target[k + 1] = target[k + 1], target[k]
                src.write(" ".join(f"w{i}" for i in ids) + "\n")
                tgt.write(" ".join(target) + "\n")


def training(folder: Path, model: str, steps: int, timeout: str, *extra: str) -> dict[str, Any]:
    """At most ``steps`` bf16-mixed training steps of ``model`` through aiayn-train, with ``extra``
    overrides, stopping in time for the part's limit; the host's time per step by where it went."""
    corpus = folder / "corpus"
    if not corpus.exists():
        corpus.mkdir()
        generated_corpus(corpus)
    run = folder / f"run-{timeout}"
    budget = max(TIMEOUTS[timeout] - NOT_TRAINING_S, 5)
    command = [
        "aiayn-train", f"model={model}", "hardware=gpu", "data=text", f"data.root={corpus}",
        "data.src_lang=src", "data.tgt_lang=tgt", "data.train=[train.src,train.tgt]", "data.val=[val.src,val.tgt]",
        f"data.cache_dir={folder / 'cache'}", "data.vocab_size=5000", "data.max_tokens=25000", "data.eval_limit=64",
        "logger=none", "progress=quiet", f"trainer.max_steps={steps}",
        f"trainer.max_time=00:00:{budget // 60:02d}:{budget % 60:02d}", f"trainer.val_check_interval={steps}",
        "trainer.log_every_n_steps=5", "+trainer.profiler=simple", f"hydra.run.dir={run}",
        # no step checkpoints for an average: the default writes the whole state (0.75 GB at base) every
        # 50 steps, which would be timed as training
        "checkpoint.average_last=0", "checkpoint.average_every=null", *extra,
    ]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUTS[timeout])
    wall = time.perf_counter() - start
    if done.returncode != 0:
        return {"error": done.stderr[-1000:]}
    with open(run / "csv" / "metrics.csv", newline="") as metrics:
        rows = list(csv.DictReader(metrics))
    logged = [row for row in rows if row.get("train/tokens_per_s") and int(row["step"]) >= 20]
    results = json.loads((run / "results.json").read_text())
    result: dict[str, Any] = {"model": model, "steps": results.get("steps"), "wall_s": round(wall, 1)}
    result.update(precision="bf16-mixed", overrides=list(extra), training_s_limit=budget)
    for key in ("train/tokens_per_s", "train/mfu"):
        values = [float(row[key]) for row in logged if row.get(key)]
        name = key.split("/")[1]
        result[name] = statistics.median(values) if values else None
        # the later half of the run apart: a step that speeds up as the run goes on is warming up
        result[f"{name}_later_half"] = statistics.median(values[len(values) // 2 :]) if values else None
    result["params"], result["val_loss"] = results.get("params"), results.get("val_loss")
    result["run_tokens_per_s"] = results.get("train_tokens_per_s")  # every step, the first ones included
    result["host_s_per_step"] = host_time(done.stdout + done.stderr, results.get("steps") or 1)
    return result


def host_time(output: str, steps: int) -> dict[str, float]:
    """Seconds per training step that the host spent in each of :data:`HOST_ACTIONS`, from the table
    Lightning's simple profiler prints at the end: every callback's ``on_train_batch_end`` summed; of the
    others, which nest (the module's ``optimizer_step`` holds the strategy's, and the backward pass),
    the longest of the same name."""
    seconds = dict.fromkeys(HOST_ACTIONS, 0.0)
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 5:
            continue
        try:
            total = float(cells[3])
        except ValueError:
            continue  # the header
        for action in HOST_ACTIONS:
            if cells[0] == action or cells[0].endswith(f".{action}"):
                summed = action == "on_train_batch_end"
                seconds[action] = seconds[action] + total if summed else max(seconds[action], total)
    return {action: round(total / steps, 4) for action, total in seconds.items()}


def fusion() -> dict[str, Any]:
    command = [sys.executable, str(REPO / "benchmarks" / "fusion.py"), "--device", "cuda", "--tokens", "25000",
               "--d-model", "512", "--dropout", "0.1", "--rounds", "3"]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUTS["fusion"])
    print(done.stdout[-2000:])
    if done.returncode != 0:
        return {"error": done.stderr[-1000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def decoding() -> dict[str, Any]:
    """Sentences/s of each decoder. CTranslate2 is a peer, not ours: when it is missing the race runs
    without it, and when the race with it fails (its CUDA build loads the cuBLAS it was built against)
    the race runs again without it; either way the result says why, and our numbers are not lost."""
    command = [sys.executable, str(REPO / "benchmarks" / "decoding.py"), "--device", "cuda", "--bf16",
               "--skip-recompute", "--sentences", "512", "--batch", "128", "--src-len", "20", "--out-len", "40",
               "--rounds", "3", "--ct2"]  # fmt: skip

    def race(*ct2_compute_types: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*command, *ct2_compute_types], cwd=REPO, capture_output=True, text=True,
                              timeout=TIMEOUTS["decoding"])  # fmt: skip

    peer: dict[str, Any] = {}
    if importlib.util.find_spec("ctranslate2") is None:
        peer["ctranslate2"] = "not installed"
        done = race()
    else:
        done = race("float16")
        if done.returncode != 0:
            peer["ctranslate2"] = (done.stderr.strip().splitlines() or ["failed"])[-1][-300:]
            done = race()
    print(done.stdout[-2000:])
    if done.returncode != 0:
        return {"error": done.stderr[-1000:], **peer}
    return {**json.loads(done.stdout.strip().splitlines()[-1])["sentences_per_s"], **peer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="model=base training steps (big: half)")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--skip-decoding", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench: no CUDA GPU is visible (torch.cuda.is_available() is False)")
    start = time.perf_counter()
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    with tempfile.TemporaryDirectory(prefix="aiayn-gpu-check-") as tmp:
        folder = Path(tmp)
        if not args.skip_tests:
            result["cuda_tests"] = timed_out(lambda: cuda_tests(folder), "tests")
        if not args.skip_train:
            result["train_base_bf16"] = timed_out(lambda: training(folder, "base", args.steps, "train"), "train")
            big = args.steps // 2
            result["train_big_bf16"] = timed_out(lambda: training(folder, "big", big, "train_big"), "train_big")
            compiled = ("model.compile=true",)
            result["train_base_bf16_compiled"] = timed_out(
                lambda: training(folder, "base", args.steps, "train_compiled", *compiled), "train_compiled"
            )
            result["fusion"] = timed_out(fusion, "fusion")
        if not args.skip_decoding:
            result["decoding_sentences_per_s"] = timed_out(decoding, "decoding")
    result["wall_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
