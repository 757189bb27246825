"""Nothing from outside is taken on faith, as one property over many inputs: whatever a shared
checkpoint, run folder, ``results.json``, ``config.yaml`` or ``sweep.json`` holds, aiayn's commands
create, change or delete nothing outside the run folder they own and the outputs named, and end with
exit 0, or exit 2 and one error line, printing nothing but their own warnings besides, with bounded memory.

Each non-tensor leaf of a real checkpoint (callback, loop, optimizer, schedule, hyper-parameter and
stored-config values) and of a run's and a sweep's files is replaced by hostile values: paths with and
without protocols and ``..``, huge and negative numbers, NaN, wrong types, empty values, a stored
``_target_``, an interpolation. Every leaf goes through the resume's check; a sample of them (the known
dangerous ones always) through the real commands, in this process. The sample is drawn with a seed
printed at the start; ``AIAYN_MUTATION_SEED=<n>`` draws the same one again.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from aiayn.errors import CheckpointError
from aiayn.training.checkpoints import directly_inside
from aiayn.training.restored_state import RestoredState
from helpers.runs import SMOKE_RUN_EXTRA, exit_status, rebased, smoke_run, train_in_process

SEED = int(os.environ.get("AIAYN_MUTATION_SEED") or random.SystemRandom().randrange(2**31))
Leaf = tuple[Any, ...]
STORED_DATA_ROOT = ("aiayn", "config", "data", "root")
# Always mutated through the real commands: the audit's delete, the version that picks migrations, the
# model size that allocates, where the stored data points, what it builds, the optimizer's rule.
DANGEROUS = [
    ("callbacks", "*'monitor': 'val/bleu'*", "best_model_path"),
    ("callbacks", "*'monitor': 'step'*", "kth_best_model_path"),
    ("pytorch-lightning_version",),
    ("hyper_parameters", "model", "max_positions"),
    ("hyper_parameters", "model", "n_layers"),
    STORED_DATA_ROOT,
    ("aiayn", "config", "data", "_target_"),
    ("optimizer_states", 0, "param_groups", 0, "maximize"),
    ("loops", "fit_loop", "state_dict", "combined_loader", 0, "position"),
]


def hostile(sentinel: Path) -> list[Any]:
    made = str(sentinel / "made-by-the-input")
    return [
        f"local://{sentinel}",
        f"simplecache::file://{sentinel}",
        str(sentinel),
        f"{sentinel}/../{sentinel.name}/keep.txt",
        "",
        None,
        -1,
        10**18,
        float("nan"),
        True,
        [],
        {"_target_": "os.makedirs", "name": made},
        "${oc.env:HOME}",
    ]


def leaves(node: Any, path: Leaf = ()) -> Iterator[tuple[Leaf, Any]]:
    """``(path, value)`` of every leaf that is not a tensor or bytes (weights, generator states, the
    tokenizer); long lists (a generator's 625 numbers) count as one leaf."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from leaves(value, (*path, key))
    elif isinstance(node, list | tuple) and 0 < len(node) <= 16:
        for index, value in enumerate(node):
            yield from leaves(value, (*path, index))
    elif not isinstance(node, torch.Tensor | bytes):
        yield path, node


def tensors(node: Any) -> Iterator[torch.Tensor]:
    if isinstance(node, dict):
        for value in node.values():
            yield from tensors(value)
    elif isinstance(node, list | tuple):
        for value in node:
            yield from tensors(value)
    elif isinstance(node, torch.Tensor):
        yield node


def replaced(node: Any, path: Leaf, value: Any) -> Any:
    """``node`` with the leaf at ``path`` set to ``value``; the containers on the way are copies."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(node, dict):
        return {**node, head: replaced(node[head], rest, value)}
    items = list(node)
    items[head] = replaced(items[head], rest, value)
    return tuple(items) if isinstance(node, tuple) else items


def matches(path: Leaf, pattern: Leaf) -> bool:
    return len(path) >= len(pattern) and all(
        p == q or (isinstance(q, str) and q.startswith("*") and isinstance(p, str) and q.strip("*") in p)
        for p, q in zip(path, pattern, strict=False)
    )


def sample(all_leaves: list[Leaf], count: int, rng: random.Random) -> list[Leaf]:
    """The dangerous leaves, then ``count`` others drawn by ``rng``."""
    chosen = [next(path for path in all_leaves if matches(path, pattern)) for pattern in DANGEROUS]
    others = [path for path in all_leaves if path not in chosen]
    return chosen + rng.sample(others, min(count, len(others)))


def tree_state(folder: Path) -> dict[str, str]:
    """Every entry under ``folder`` (links not followed) with what it is: a file's content digest."""
    state = {}
    for path in sorted(folder.rglob("*")):
        if path.is_symlink():
            state[str(path)] = "link:" + os.readlink(path)
        elif path.is_file():
            state[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            state[str(path)] = "folder"
    return state


def status_mib(field: str) -> float:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) / 1024


def reset_peak_rss() -> float:
    """This process's peak resident memory set back to what it holds now (Linux's ``clear_refs``), which
    it returns, in MiB: the peak read later is of what came after, not of earlier tests in this worker."""
    Path("/proc/self/clear_refs").write_text("5")
    return status_mib("VmRSS")


def peak_rss_mib() -> float:
    return status_mib("VmHWM")


def own_copy(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``checkpoint`` to change: its tensors, only read, are shared."""
    return copy.deepcopy(checkpoint, {id(t): t for t in tensors(checkpoint)})


def resume(run: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """``aiayn-train`` continuing the smoke run copied to ``run`` for 2 more steps: a validation and a
    step checkpoint at step 14 (the trackers' next saves)."""
    argv = [*smoke_run(corpus_root, cache_dir, *SMOKE_RUN_EXTRA), f"hydra.run.dir={run}", "trainer.max_steps=14"]
    return train_in_process(argv, monkeypatch)


def assert_clean_exit(status: int, err: str, what: str) -> None:
    assert status in (0, 2), f"{what}: exit {status}\n{err[-2000:]}"
    assert "Traceback" not in err, f"{what}: a traceback\n{err[-2000:]}"
    lines = err.strip().splitlines()
    # Every line the command's own: its warnings (the files a report skipped, say), then, with exit 2, one error.
    warnings = lines[:-1] if status == 2 else lines
    assert all(re.match(r"aiayn-[a-z]+: warning: ", line) for line in warnings), f"{what}: {lines}"
    if status == 2:
        assert re.match(r"aiayn-[a-z]+: error: ", lines[-1]), f"{what}: {lines}"


@pytest.fixture(scope="module")
def shared_checkpoint(smoke_run_dir: Path) -> dict[str, Any]:
    return torch.load(smoke_run_dir / "checkpoints" / "last.ckpt", weights_only=True)


@pytest.mark.slow
def test_the_resume_check_holds_for_every_leaf_of_a_checkpoint(
    smoke_restorer: RestoredState, smoke_run_dir: Path, shared_checkpoint: dict[str, Any], tmp_path: Path
) -> None:
    """Every leaf, each with a path value and one other: a one-line refusal naming the file, or a
    state whose checkpoint trackers name only files of the run's own folder."""
    print(f"mutation seed {SEED} (AIAYN_MUTATION_SEED={SEED} repeats it)")
    rng = random.Random(SEED)
    sentinel = tmp_path / "sentinel"
    path = smoke_run_dir / "checkpoints" / "last.ckpt"
    folder = smoke_run_dir / "checkpoints"
    values = hostile(sentinel)
    checked = refused = 0
    for leaf, _ in list(leaves(shared_checkpoint)):
        for value in (rng.choice(values[:4]), rng.choice(values[4:])):
            mutated = own_copy(replaced(shared_checkpoint, leaf, value))  # the check edits what it is given
            checked += 1
            try:
                restored = smoke_restorer(mutated, path)
            except CheckpointError as error:
                refused += 1
                assert "\n" not in str(error) and str(path) in str(error), (leaf, value, str(error))
                continue
            for state in restored.get("callbacks", {}).values():
                if isinstance(state, dict) and "best_model_path" in state:
                    named = [state.get(key) for key in ("best_model_path", "kth_best_model_path", "last_model_path")]
                    named += list(state.get("best_k_models", {}))
                    assert all(p in ("", None) or directly_inside(p, folder) for p in named), (leaf, value)
    assert checked > 300 and 0 < refused < checked


def tracker_attack(checkpoint: dict[str, Any], original: Path, run: Path, victim: Path) -> dict[str, Any]:
    """The audit's delete with every field it needs, in the run's own folder: each checkpoint tracker
    rebased to ``run`` (so Lightning restores all of it), with a folder outside the run as its worst kept
    file (the one the next save replaces and Lightning then removes, recursively, through fsspec) at a
    score worse than any validation's or step's."""
    attack = own_copy(checkpoint)
    rebased(attack, original, run)
    doomed, worst = f"local://{victim}", torch.tensor(-1.0)
    for name, tracker in attack["callbacks"].items():
        if name.startswith("ModelCheckpoint{"):
            kept = {
                path: score
                for path, score in tracker["best_k_models"].items()
                if path != tracker["kth_best_model_path"]
            }
            tracker["best_k_models"] = {**kept, doomed: worst}
            tracker["kth_best_model_path"], tracker["kth_value"] = doomed, worst
            if not kept:
                tracker["best_model_path"], tracker["best_model_score"] = doomed, worst
    return attack


@pytest.mark.slow
def test_commands_on_a_hostile_checkpoint_touch_nothing_outside_their_folders(
    smoke_run_dir: Path,
    shared_checkpoint: dict[str, Any],
    corpus_root: Path,
    cache_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    """A sample of leaves, each with one hostile value, through ``aiayn-eval``, ``aiayn-translate``,
    ``aiayn-average`` and ``aiayn-export`` on it; ``aiayn-train`` resumes, in the run's own folder, the
    stored data root's case (the stored config's comparison, which the resume check above does not reach)
    and the audit's attack on the checkpoint trackers (:func:`tracker_attack`) against the sentinel."""
    from aiayn.cli import average, evaluate, export, translate

    print(f"mutation seed {SEED} (AIAYN_MUTATION_SEED={SEED} repeats it)")
    rng = random.Random(SEED)
    sentinel = tmp_path / "sentinel"
    sentinel.mkdir()
    (sentinel / "keep.txt").write_text("precious")
    work = tmp_path / "work"  # the commands' working folder: nothing may appear in it
    work.mkdir()
    (work / "input.en").write_text("a man rides a horse .\ntwo dogs play .\n")
    monkeypatch.chdir(work)
    outside = {name: tree_state(tmp_path / name) for name in ("sentinel", "work")}
    all_leaves = [leaf for leaf, _ in leaves(shared_checkpoint)]
    values = hostile(sentinel)
    cases = sample(all_leaves, 8, rng)
    allowed = {"sentinel", "work"}
    statuses: list[int] = []
    rss = reset_peak_rss()
    for number, leaf in enumerate(cases):
        value = rng.choice(values) if number >= 2 else values[0]
        run = tmp_path / f"case{number}"
        shutil.copytree(smoke_run_dir, run, ignore=shutil.ignore_patterns("run.lock"))
        hostile_file = run / "checkpoints" / "last.ckpt"
        torch.save(replaced(shared_checkpoint, leaf, value), hostile_file)
        out = tmp_path / f"out{number}"
        out.mkdir()
        allowed |= {run.name, out.name}
        what = f"seed {SEED}, leaf {leaf}={value!r}"
        commands: list[tuple[str, Callable[[], Any], list[str]]] = [
            ("aiayn-eval", evaluate.main, [f"checkpoint={hostile_file}", f"data.root={corpus_root}",
             "decoding=greedy", "decoding.max_len_offset=3", "device=cpu", f"output_dir={out / 'eval'}"]),
            ("aiayn-translate", translate.main, [f"checkpoint={hostile_file}", f"input={work / 'input.en'}",
             f"output={out / 'output.de'}", "decoding=greedy", "device=cpu"]),
            ("aiayn-average", average.main, [str(hostile_file), str(run / "checkpoints" / "step0000012.ckpt"),
             "-o", str(out / "averaged.ckpt")]),
            ("aiayn-export", export.main, [f"checkpoint={hostile_file}", "format=ctranslate2",
             f"output={out / 'engine'}"]),
        ]  # fmt: skip
        for program, main, argv in commands:
            status = exit_status(main, [program, *argv], monkeypatch)
            assert_clean_exit(status, capsys.readouterr().err, f"{program} ({what})")
            statuses.append(status)
        if matches(leaf, STORED_DATA_ROOT):  # resumed as in its own folder: the stored config is compared
            mutated = own_copy(replaced(shared_checkpoint, leaf, value))
            rebased(mutated, smoke_run_dir, run)
            torch.save(mutated, hostile_file)
            status = resume(run, corpus_root, cache_dir, monkeypatch)
            assert_clean_exit(status, capsys.readouterr().err, f"aiayn-train resuming ({what})")
            statuses.append(status)
        for name, state in outside.items():
            assert tree_state(tmp_path / name) == state, f"{what}: {name} changed"
        assert {path.name for path in tmp_path.iterdir()} <= allowed, what
    run = tmp_path / "attacked"
    shutil.copytree(smoke_run_dir, run, ignore=shutil.ignore_patterns("run.lock"))
    torch.save(tracker_attack(shared_checkpoint, smoke_run_dir, run, sentinel), run / "checkpoints" / "last.ckpt")
    assert resume(run, corpus_root, cache_dir, monkeypatch) == 0, capsys.readouterr().err
    assert tree_state(sentinel) == outside["sentinel"], "the trackers' attack deleted the sentinel"
    assert "step0000014.ckpt" in {path.name for path in (run / "checkpoints").iterdir()}  # a save replaced one
    assert peak_rss_mib() - rss < 1024
    print(f"{len(statuses)} commands: {statuses.count(0)} ended 0, {statuses.count(2)} refused in one line")
    assert 0 in statuses and 2 in statuses


RUN_FILES = ("results.json", "config.yaml")


def read(path: Path) -> Any:
    return json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())


def written(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data) if path.suffix == ".json" else yaml.safe_dump(data))


@pytest.mark.slow
def test_the_report_and_the_sweep_on_hostile_run_files_touch_nothing_and_end_cleanly(
    smoke_run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Every leaf of a trial's ``results.json`` and ``config.yaml`` and of its sweep's ``sweep.json`` (one
    hostile value each, seeded), then ``aiayn-report`` over the sweep's folder and over the trial's, and
    the sweep's state opened as ``aiayn-sweep`` opens it: a report in ``--out`` and nothing else."""
    from aiayn.cli import report
    from aiayn.experiments.sweeps.state import STATE_FILE, SweepError, SweepState

    print(f"mutation seed {SEED} (AIAYN_MUTATION_SEED={SEED} repeats it)")
    rng = random.Random(SEED)
    sentinel = tmp_path / "sentinel"
    sentinel.mkdir()
    (sentinel / "keep.txt").write_text("precious")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    sweep = tmp_path / "sweep"
    trial = sweep / "trial-0001"
    trial.mkdir(parents=True)
    for name in RUN_FILES:
        shutil.copy(smoke_run_dir / name, trial / name)
    config = {"method": "grid", "metric": {"name": "val/bleu", "goal": "maximize"},
              "parameters": {"model.n_heads": {"values": [4]}}}  # fmt: skip
    record = {"number": 1, "params": {"model.n_heads": 4}, "state": "finished", "command": ["aiayn-train"],
              "run_dir": trial.name, "returncode": 0, "metric": 10.0, "seconds": 3.0}  # fmt: skip
    written(sweep / STATE_FILE, {"config": config, "trials": [record]})
    files = [trial / name for name in RUN_FILES] + [sweep / STATE_FILE]
    originals = {path: read(path) for path in files}
    values = hostile(sentinel)
    for path in files:
        for leaf, _ in list(leaves(originals[path])):
            value = rng.choice(values)
            written(path, replaced(originals[path], leaf, value))
            what = f"seed {SEED}, {path.name} {leaf}={value!r}"
            outside = {name: tree_state(tmp_path / name) for name in ("sentinel", "work", "sweep")}
            for named in (sweep, trial):  # found while walking, and named directly
                argv = ["aiayn-report", str(named), "--out", str(tmp_path / "report"), "--wandb", "disabled"]
                assert_clean_exit(exit_status(report.main, argv, monkeypatch), capsys.readouterr().err, what)
            try:
                SweepState.open(sweep, config, tmp_path / "sweep.yaml")
            except SweepError as error:
                assert "\n" not in str(error) and str(sweep) in str(error), what
            for name, state in outside.items():
                assert tree_state(tmp_path / name) == state, f"{what}: {name} changed"
            assert {path.name for path in tmp_path.iterdir()} <= {"sentinel", "work", "sweep", "report"}, what
            written(path, originals[path])


def test_an_export_records_only_what_aiayn_average_writes_of_the_sources(
    smoke_run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``averaged_from`` and ``global_step`` go into the exported folder's JSON: foreign ones are left out."""
    from aiayn.cli import export

    checkpoint = torch.load(smoke_run_dir / "checkpoints" / "best.ckpt", weights_only=True)
    checkpoint["averaged_from"] = {(1, 2): 1}
    checkpoint["global_step"] = float("nan")
    path = tmp_path / "shared.ckpt"
    torch.save(checkpoint, path)
    argv = ["aiayn-export", f"checkpoint={path}", "format=ctranslate2", f"output={tmp_path / 'engine'}"]
    assert exit_status(export.main, argv, monkeypatch) == 0, capsys.readouterr().err
    recorded = json.loads((tmp_path / "engine" / "aiayn.json").read_text())
    assert recorded["averaged_from"] is None and recorded["global_step"] is None
