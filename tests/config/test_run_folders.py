"""One writer per run folder: a living run's folder is refused to a second ``aiayn-train`` (exit 2, the
holder named, nothing of the first run changed), released by the OS when its process dies however it
dies, skipped by ``resume=true``; fresh run folders never collide. Multiruns likewise: their folders never
collide, and a multirun's folder and each job's are held before Hydra writes into them."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import hydra.core.utils
import pytest
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from aiayn.config.compose import compose_config
from aiayn.config.naming import latest_run, multirun_dir, reserved_folder, sweep_dir
from aiayn.errors import RunFolderBusy
from aiayn.experiments.sweeps.file import default_folder
from aiayn.files import hold_run_folder, release_run_folder, run_folder_holder
from helpers.batch_recorder import HELD, recorder
from helpers.processes import hold_and_signal, start, stopped, wait_until
from helpers.runs import smoke_run, train_in_process

HOLD = (
    "import sys, time\nfrom aiayn.files import hold_run_folder\n"
    "hold_run_folder(sys.argv[1])\nprint('held', flush=True)\ntime.sleep(600)\n"
)


def holder(folder: Path) -> subprocess.Popen[str]:
    """Another process that holds ``folder`` until it is killed."""
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "held\n"
    return process


@pytest.mark.slow
def test_a_second_aiayn_train_in_a_living_runs_folder_is_refused_and_changes_nothing(
    tmp_path: Path,
    corpus_root: Path,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run_dir = tmp_path / "run"
    first = start(f"hydra.run.dir={run_dir}", *smoke_run(corpus_root, cache_dir, recorder(run_dir, hold_at=2)))
    wait_until((run_dir / HELD).is_file, first, "the held batch")  # the first run is alive, held at step 2
    hydra_files = {path.name: path.read_bytes() for path in (run_dir / ".hydra").iterdir()}

    # The second run in this process: the folder's lock is an flock, which the first process holds.
    assert (
        train_in_process([f"hydra.run.dir={run_dir}", *smoke_run(corpus_root, cache_dir, "seed=7")], monkeypatch) == 2
    )
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"aiayn-train: error: run folder {run_dir} is in use by pid {first.pid} on ")
    assert {path.name: path.read_bytes() for path in (run_dir / ".hydra").iterdir()} == hydra_files

    assert first.poll() is None  # the first run goes on
    hold_and_signal(first, run_dir, signal.SIGTERM)
    stopped(first, signal.SIGTERM)
    assert (run_dir / "checkpoints" / "last.ckpt").is_file() and run_folder_holder(run_dir) is None


def test_a_killed_holder_releases_its_folder(tmp_path: Path) -> None:
    before = datetime.datetime.now().replace(microsecond=0)
    process = holder(tmp_path / "run")
    named, since = (run_folder_holder(tmp_path / "run") or "").split(", since ")
    assert named == f"pid {process.pid} on {os.uname().nodename}"
    assert before <= datetime.datetime.strptime(since, "%Y-%m-%d %H:%M:%S") <= datetime.datetime.now()
    with pytest.raises(RunFolderBusy, match=f"in use by pid {process.pid} "):
        hold_run_folder(tmp_path / "run")
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert run_folder_holder(tmp_path / "run") is None
    assert hold_run_folder(tmp_path / "run") is True
    release_run_folder(tmp_path / "run")


def test_fresh_run_folders_of_one_second_never_collide(tmp_path: Path) -> None:
    script = (
        "import sys\nfrom pathlib import Path\nfrom aiayn.config.naming import reserved_folder\n"
        "print(reserved_folder(Path(sys.argv[1]), '2026-12-01_10-00-00'))\n"
    )
    processes = [
        subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    folders = [process.communicate(timeout=120)[0].strip() for process in processes]
    assert sorted(Path(folder).name for folder in folders) == [
        "2026-12-01_10-00-00", "2026-12-01_10-00-00-2", "2026-12-01_10-00-00-3", "2026-12-01_10-00-00-4"
    ]  # fmt: skip
    assert reserved_folder(tmp_path, "2026-12-01_10-00-00").name == "2026-12-01_10-00-00-5"


def test_composing_after_a_job_in_this_process_reserves_no_run_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job leaves Hydra's state in its process (a notebook, aiayn-table3 after a run); composing again
    merges configs, which resolves ``hydra.run.dir`` against that state: it must not reserve a folder."""
    monkeypatch.chdir(tmp_path)
    HydraConfig.instance().set_config(compose_config("train", ["model=tiny"]))  # as a finished job leaves it
    try:
        summary = compose_config("summary", ["experiment=table3/A1"])
        assert HydraConfig.instance().cfg is not None  # the caller's state is put back
    finally:
        HydraConfig.instance().cfg = None
    assert summary.model.n_heads == 1 and list(tmp_path.iterdir()) == []


def test_resume_true_skips_runs_that_a_living_process_writes(tmp_path: Path) -> None:
    for name, written in (("older", 1_000_000), ("newer", 2_000_000)):
        last = tmp_path / name / "checkpoints" / "last.ckpt"
        last.parent.mkdir(parents=True)
        last.write_bytes(b"x")
        os.utime(last, (written, written))
    assert latest_run(tmp_path) == tmp_path / "newer"
    process = holder(tmp_path / "newer")
    try:
        assert latest_run(tmp_path) == tmp_path / "older"
    finally:
        process.kill()
        process.wait(timeout=60)
    assert latest_run(tmp_path) == tmp_path / "newer"


@pytest.mark.parametrize("kind", ["FIFO", "link"])
def test_resume_true_skips_a_run_whose_lock_is_a_fifo_or_a_link_at_once(tmp_path: Path, kind: str) -> None:
    last = tmp_path / "shared" / "checkpoints" / "last.ckpt"
    last.parent.mkdir(parents=True)
    last.write_bytes(b"x")
    lock = tmp_path / "shared" / "run.lock"
    os.mkfifo(lock) if kind == "FIFO" else lock.symlink_to(tmp_path / "elsewhere.lock")
    with ThreadPoolExecutor(1) as pool:  # a FIFO opened for reading would wait for a writer forever
        assert pool.submit(latest_run, tmp_path).result(timeout=10) is None


def test_resume_true_with_nothing_to_resume_is_refused_before_any_work_and_leaves_no_folder(
    tmp_path: Path, corpus_root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    output, cache = tmp_path / "outputs", tmp_path / "cache"
    argv = [*smoke_run(corpus_root, cache, "resume=true", "logger=wandb"), f"paths.output_dir={output}"]
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert train_in_process(argv, monkeypatch) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("aiayn-train: error: resume=true found no earlier run with checkpoints/last.ckpt in ")
    assert not cache.exists()  # no tokenizer trained, no corpus encoded
    assert list(output.iterdir()) == []  # nor a run folder, nor outputs/<name>


def test_a_run_folder_that_cannot_be_made_is_refused_in_one_line_before_hydra_writes(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    (tmp_path / "file").write_text("not a folder")
    run_dir = tmp_path / "file" / "run"
    assert train_in_process([*smoke_run(corpus_root, cache_dir), f"hydra.run.dir={run_dir}"], monkeypatch) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("aiayn-train: error: ") and "Not a directory" in line
    assert (tmp_path / "file").read_text() == "not a folder"


def test_a_bug_in_the_run_folder_callback_stops_the_run_with_its_traceback(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """Hydra would make a warning of the error and write .hydra/ and the log into a folder nobody holds."""

    def broken(folder: Path) -> bool:
        raise RuntimeError("a bug")

    monkeypatch.setattr("aiayn.cli.train.hold_run_folder", broken)
    run_dir = tmp_path / "run"
    assert train_in_process([*smoke_run(corpus_root, cache_dir), f"hydra.run.dir={run_dir}"], monkeypatch) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: a bug" in err
    assert err.strip().splitlines()[-1] == (
        "aiayn-train: error: a bug in aiayn stopped the run before it started (traceback above); please report it"
    )
    assert not (run_dir / ".hydra").exists() and not (run_dir / "train.log").exists()


class OneSecond(datetime.datetime):
    """A clock that stays at one second: Hydra's ``${now:...}`` names every multirun's folder alike."""

    @classmethod
    def now(cls, tz: datetime.tzinfo | None = None) -> OneSecond:
        return cls(2026, 12, 1, 10, 0, 0)


def tree(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder`` with a file's bytes (None for a folder)."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))}


def test_a_multiruns_folder_is_reserved_by_a_multirun_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for mode in (None, RunMode.RUN):  # a run, or its config printed (--cfg hydra --resolve): a name, no folder
        assert multirun_dir("outputs", "2026-12-01_10-00-00", mode) == "outputs/multirun/2026-12-01_10-00-00"
    assert not (tmp_path / "outputs").exists()
    folders = [multirun_dir("outputs", "2026-12-01_10-00-00", RunMode.MULTIRUN) for _ in range(3)]
    assert folders == [f"outputs/multirun/2026-12-01_10-00-00{tail}" for tail in ("", "-2", "-3")]
    assert all((tmp_path / folder).is_dir() for folder in folders)


def test_two_multiruns_started_in_one_second_get_their_own_folders(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hydra.core.utils, "datetime", OneSecond)
    # resume=true ends each multirun's job at once (exit 2), after Hydra has written into its folder.
    for _ in range(2):
        assert train_in_process(["-m", "resume=true", *smoke_run(corpus_root, cache_dir)], monkeypatch) == 2
    multiruns = tmp_path / "outputs" / "multirun"
    assert sorted(path.name for path in multiruns.iterdir()) == ["2026-12-01_10-00-00", "2026-12-01_10-00-00-2"]
    for folder in multiruns.iterdir():
        assert (folder / "multirun.yaml").is_file()
        hydra_yaml = yaml.safe_load((folder / "0" / ".hydra" / "hydra.yaml").read_text())
        assert hydra_yaml["hydra"]["runtime"]["output_dir"] == str(folder / "0")  # each job in its own multirun
        assert run_folder_holder(folder) is None and run_folder_holder(folder / "0") is None  # given up at the end


@pytest.mark.slow
@pytest.mark.parametrize("held", ["", "0"], ids=["the multirun's folder", "a job's folder"])
def test_a_multirun_into_folders_a_living_process_writes_is_refused_before_hydra_writes(
    tmp_path: Path,
    corpus_root: Path,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    held: str,
) -> None:
    sweep = tmp_path / "multirun"
    folder = sweep / held if held else sweep
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text("the living run's\n")
    process = holder(folder)
    try:
        before = tree(folder)
        argv = ["-m", f"hydra.sweep.dir={sweep}", *smoke_run(corpus_root, cache_dir)]
        assert train_in_process(argv, monkeypatch) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"aiayn-train: error: run folder {folder} is in use by pid {process.pid} on ")
        assert tree(folder) == before  # no .hydra/, no multirun.yaml, no log, no lock of its own
    finally:
        process.kill()
        process.wait(timeout=60)


def test_a_multiruns_jobs_hold_their_folders_while_they_run_and_no_longer(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sweep, out = tmp_path / "multirun", tmp_path / "held.jsonl"
    folders = [str(sweep), str(sweep / "0"), str(sweep / "1")]
    # Each job records what is held when it builds its callbacks, then fails (the multirun goes on).
    probe = f"callbacks=[{{_target_:helpers.folder_probe.record,folders:{folders},out:'{out}'}}]"
    argv = ["-m", f"hydra.sweep.dir={sweep}", "seed=1,2", probe, *smoke_run(corpus_root, cache_dir)]
    assert train_in_process(argv, monkeypatch) == 2
    seen = [json.loads(line) for line in out.read_text().splitlines()]
    assert seen == [
        {folders[0]: True, folders[1]: True, folders[2]: False},
        {folders[0]: True, folders[1]: False, folders[2]: True},
    ]
    assert [run_folder_holder(Path(folder)) for folder in folders] == [None, None, None]


def test_runs_multiruns_and_sweeps_go_under_the_output_root(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    scratch = tmp_path / "scratch"
    monkeypatch.setenv("AIAYN_OUTPUT", str(scratch))
    assert train_in_process(["-m", "resume=true", *smoke_run(corpus_root, cache_dir)], monkeypatch) == 2
    (multirun,) = (scratch / "multirun").iterdir()
    assert (multirun / "0" / ".hydra").is_dir()
    capsys.readouterr()
    # paths.output_dir on the command line wins over $AIAYN_OUTPUT
    argv = ["--cfg", "all", "--resolve", f"paths.output_dir={tmp_path / 'mine'}", *smoke_run(corpus_root, cache_dir)]
    assert train_in_process(argv, monkeypatch) == 0
    run_dir = Path(yaml.safe_load(capsys.readouterr().out)["hydra"]["run"]["dir"])
    assert run_dir.parent == tmp_path / "mine" / "tiny_multi30k_en_de"
    assert default_folder({"name": "heads"}, Path("sweeps/heads.yaml")) == scratch / "sweeps" / "heads"
    monkeypatch.setenv("WANDB_SWEEP_ID", "abc123")  # a trial of `wandb agent`
    assert sweep_dir() == str(scratch / "sweeps" / "abc123")
    assert not (tmp_path / "outputs").exists()
