"""aiayn-sweep stopped and restarted from outside: Ctrl-C at the terminal or SIGTERM reaches the runner alone,
which stops its trials gently (they save and continue next time); a runner killed outright, run again,
starts no trial twice but waits for the one still running in its folder; the sweep's name cannot put its
folder elsewhere; sweep.json is whole whenever its writer dies.

Most trials here are a small script that behaves as aiayn-train does at the edges the runner sees: it holds
its run folder, saves at SIGTERM (exit 143), stops without saving at SIGINT as Lightning does, and writes
results.json at its end. One test runs real ``debug=smoke`` trials."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from aiayn.config.naming import run_label
from aiayn.experiments.sweeps.file import default_folder
from aiayn.experiments.sweeps.state import STATE_FILE, SweepError, SweepState, Trial
from aiayn.experiments.sweeps.trial import last_logged
from helpers.batch_recorder import HELD, RELEASE
from helpers.processes import environment, wait_until
from helpers.sweeps import run_runner, script_sweep, start_runner, sweep_main, trials

TRIAL = """\
import json, os, signal, sys, time
from pathlib import Path
from aiayn.files import hold_run_folder

folder = Path(os.environ["AIAYN_RUN_DIR"])
hold_run_folder(folder)  # as aiayn-train does: a second writer of the folder fails here
params = dict(arg.split("=", 1) for arg in sys.argv[1:])

def note(event):
    with open(folder / "events", "a") as events:
        events.write(f"{event} {time.time()} {os.getpid()}\\n")

def save(signum, frame):
    (folder / "last.ckpt").write_text("saved")
    note("saved")
    sys.exit(128 + signum)

def interrupted(signum, frame):  # Lightning at Ctrl-C: it stops without saving
    note("sigint")
    sys.exit(130)

signal.signal(signal.SIGTERM, (lambda *_: note("ignored")) if params.get("stubborn") else save)
signal.signal(signal.SIGINT, interrupted)
note("started")
if not (folder / "last.ckpt").exists():  # a continued trial has the rest of its work done at once
    time.sleep(float(params["seconds"]))
while not Path(params.get("until", "/")).exists():  # the test's word to end
    time.sleep(0.05)
(folder / "csv").mkdir(exist_ok=True)
(folder / "csv" / "metrics.csv").write_text(f"step,val/bleu\\n3,{int(params['seed']) / 10}\\n3,\\n")
(folder / "results.json").write_text(json.dumps({"val_bleu": int(params["seed"]) / 10}))
note("finished")
"""


def fake_sweep(tmp_path: Path, seeds: list[int], *fixed: str) -> Path:
    """A grid over ``seeds`` whose trials are :data:`TRIAL`, with the ``fixed`` arguments."""
    return script_sweep(tmp_path, TRIAL, seeds, *fixed)


def events(run_dir: Path) -> list[tuple[str, float, int]]:
    """What a :data:`TRIAL` noted in ``run_dir``: (event, time, pid)."""
    path = run_dir / "events"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(event, float(at), int(pid)) for event, at, pid in (line.split() for line in lines)]


def started(folder: Path, count: int) -> Callable[[], bool]:
    return lambda: sum(event == "started" for d in folder.glob("*/") for event, _, _ in events(d)) >= count


SWEEP_FOLDER = Path("outputs", "sweeps", "s")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_runner_stops_its_trials_gently_and_continues_them(signum: int, tmp_path: Path) -> None:
    folder = tmp_path / SWEEP_FOLDER
    runner = start_runner(fake_sweep(tmp_path, [1, 2], "seconds=120"), tmp_path, "--parallel", "2")
    wait_until(started(folder, 2), runner, "two trials started")
    if signum == signal.SIGINT:
        os.killpg(runner.pid, signal.SIGINT)  # Ctrl-C: the terminal signals its foreground process group
    else:
        runner.send_signal(signal.SIGTERM)  # `kill <runner>`
    _, stderr = runner.communicate(timeout=60)
    assert runner.returncode == 128 + signum, stderr
    assert stderr.strip().splitlines()[-1] == (
        f"aiayn-sweep: {signal.Signals(signum).name} received: 2 running trial(s) stopped and recorded as "
        f"interrupted in {folder / STATE_FILE}; run the same command again to continue the sweep"
    )
    stopped = trials(folder)
    for trial in stopped:  # the runner's SIGTERM, not the terminal's SIGINT, reached them: they saved
        assert [event for event, _, _ in events(folder / trial["run_dir"])] == ["started", "saved"]
        assert trial["state"] == "interrupted" and trial["returncode"] == 143

    again = run_runner(fake_sweep(tmp_path, [1, 2], "seconds=120"), tmp_path, "--parallel", "2")
    assert again.returncode == 0, again.stderr
    finished = trials(folder)
    assert [t["run_dir"] for t in finished] == [t["run_dir"] for t in stopped]  # continued in their folders
    assert [(t["state"], t["metric"]) for t in finished] == [("finished", 0.1), ("finished", 0.2)]
    for trial in finished:
        assert [event for event, _, _ in events(folder / trial["run_dir"])][2:] == ["started", "finished"]


@pytest.mark.slow
def test_a_second_ctrl_c_kills_the_trials_at_once(tmp_path: Path) -> None:
    folder = tmp_path / SWEEP_FOLDER
    runner = start_runner(fake_sweep(tmp_path, [1], "seconds=120", "stubborn=yes"), tmp_path)
    wait_until(started(folder, 1), runner, "the trial started")
    os.killpg(runner.pid, signal.SIGINT)
    wait_until(lambda: "ignored" in {e for d in folder.glob("*/") for e, _, _ in events(d)}, runner, "the SIGTERM")
    asked = time.monotonic()
    os.killpg(runner.pid, signal.SIGINT)  # rather than waiting STOP_SECONDS for a trial that does not stop
    runner.communicate(timeout=30)
    assert runner.returncode == 130 and time.monotonic() - asked < 15
    (trial,) = trials(folder)
    assert trial["state"] == "interrupted" and trial["returncode"] == -signal.SIGKILL
    (_, _, pid), _ = events(folder / trial["run_dir"])
    with pytest.raises(ProcessLookupError, match="No such process"):
        os.kill(pid, 0)


@pytest.mark.slow
def test_a_restarted_runner_waits_for_the_trial_its_killed_predecessor_left(tmp_path: Path) -> None:
    folder = tmp_path / SWEEP_FOLDER
    go = tmp_path / "go"
    sweep = fake_sweep(tmp_path, [1], "seconds=0", f"until={go}")
    try:
        runner = start_runner(sweep, tmp_path)
        wait_until(started(folder, 1), runner, "the trial started")
        runner.kill()  # kill -9: no handler runs; the trial lives on in its own session
        runner.communicate()

        again = start_runner(sweep, tmp_path)

        def waiting() -> bool:
            return (trials(folder)[0]["error"] or "").startswith("waiting for pid")

        wait_until(waiting, again, "the runner waiting for the trial")
    finally:
        go.touch()  # the orphaned trial ends, whatever happened
    _, stderr = again.communicate(timeout=60)
    assert again.returncode == 0, stderr
    (trial,) = trials(folder)
    run_events = events(folder / trial["run_dir"])
    assert [event for event, _, _ in run_events] == ["started", "finished"]  # started once, by the first runner
    assert trial["state"] == "finished" and trial["metric"] == 0.1  # its results.json, as a finished trial's
    assert f"is in use by pid {run_events[0][2]} on" in stderr


@pytest.mark.slow
def test_a_trial_waits_until_its_run_folder_is_released_and_then_continues(tmp_path: Path) -> None:
    folder = tmp_path / SWEEP_FOLDER
    run_dir = folder / run_label(["seed=1"])
    go, released = tmp_path / "go", tmp_path / "released"
    holder = (  # another process in the trial's folder: it holds it until the test's word, then says when
        "import sys, time\nfrom pathlib import Path\nfrom aiayn.files import hold_run_folder\n"
        "hold_run_folder(sys.argv[1])\nprint('held', flush=True)\n"
        "while not Path(sys.argv[2]).exists():\n    time.sleep(0.05)\n"
        "Path(sys.argv[3]).write_text(str(time.time()))\n"
    )
    helper = subprocess.Popen([sys.executable, "-c", holder, run_dir, go, released], stdout=subprocess.PIPE, text=True)
    try:
        assert helper.stdout.readline() == "held\n"
        runner = start_runner(fake_sweep(tmp_path, [1], "seconds=0"), tmp_path)

        def waiting() -> bool:  # the runner's decision, recorded: it waits rather than start the trial
            recorded = trials(folder) if (folder / STATE_FILE).exists() else []
            return bool(recorded) and (recorded[0]["error"] or "").startswith("waiting for pid")

        wait_until(waiting, runner, "the runner waiting for the holder")
        assert not (run_dir / "events").exists()
        go.touch()
        _, stderr = runner.communicate(timeout=60)
    finally:
        go.touch()
        helper.communicate(timeout=60)
    assert runner.returncode == 0, stderr
    assert f"is in use by pid {helper.pid} on" in stderr
    (trial,) = trials(folder)
    assert trial["state"] == "finished" and trial["metric"] == 0.1 and trial["run_dir"] == run_dir.name
    (event, at, _), _ = events(run_dir)  # started once, after the holder was gone
    assert event == "started" and at >= float(released.read_text())


@pytest.mark.parametrize("name", ["../x", "/tmp/x", "a/b", "x/", "", ".", ".."])
def test_a_sweep_name_that_leaves_the_sweeps_folder_is_refused(name: str, tmp_path: Path) -> None:
    with pytest.raises(SweepError, match=f"s.yaml: name: {name!r} is not a folder name"):
        default_folder({"name": name}, tmp_path / "s.yaml")
    assert default_folder({"name": "x.y"}, tmp_path / "s.yaml") == Path("outputs", "sweeps", "x.y")
    assert default_folder({}, tmp_path / "s.yaml") == Path("outputs", "sweeps", "s")


def test_aiayn_sweep_refuses_an_escaping_name_before_it_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = tmp_path / "s.yaml"
    text = "name: ../../escaped\nmethod: grid\nparameters: {seed: {values: [1]}}\ncommand: ['${args_no_hyphens}']\n"
    sweep.write_text(text)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    status, _, err = sweep_main([sweep], capsys)
    assert status == 2 and err.startswith(f"aiayn-sweep: error: {sweep}: name: '../../escaped' is not a folder name")
    assert len(err.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.yaml", "work"] and not any(work.iterdir())


@pytest.mark.slow
def test_sweep_json_is_whole_whenever_its_writer_dies(tmp_path: Path) -> None:
    writer = (
        "import sys\nfrom pathlib import Path\nfrom aiayn.experiments.sweeps.state import SweepState, Trial\n"
        "trials = [Trial(n, {'seed': n, 'x': 'y' * 200}) for n in range(1, 3001)]\n"
        "config = {'method': 'grid', 'parameters': {'seed': {'min': 1, 'max': 3000}, 'x': {'value': 'y' * 200}}}\n"
        "state = SweepState(Path(sys.argv[1]), config, trials)\n"
        "trials[0].seconds = 0\n"
        "state.save()\n"  # one whole file first: a kill before it would leave nothing to check
        "print('ready', flush=True)\n"
        "for n in range(10**6):\n"
        "    trials[0].seconds = n\n"
        "    state.save()\n"
    )
    for attempt in range(3):  # killed at different points of a 1 MB write
        process = subprocess.Popen([sys.executable, "-c", writer, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        assert process.stdout.readline() == "ready\n"
        time.sleep(0.5 + 0.23 * attempt)
        process.kill()
        process.communicate()
        config = {"method": "grid", "parameters": {"seed": {"min": 1, "max": 3000}, "x": {"value": "y" * 200}}}
        state = SweepState.open(tmp_path, config, tmp_path / "s.yaml")  # whole: it parses
        assert len(state.trials) == 3000 and isinstance(state.trials[0].seconds, int)
    SweepState(tmp_path, {"method": "grid"}, [Trial(1, {"seed": 1})]).save()
    assert [p.name for p in tmp_path.iterdir()] == [STATE_FILE]  # no temporary file of a killed writer left


SMOKE_SWEEP = """\
name: smoke
method: grid
metric: {{name: val/bleu, goal: maximize}}
parameters:
  seed: {{values: [1]}}
command:
  - ${{env}}
  - ${{interpreter}}
  - -m
  - aiayn.cli.train
  - debug=smoke
  - data.root={root}
  - data.cache_dir={cache}
  - checkpoint.average_last=0  # helpers.runs.SMOKE_RUN_EXTRA: short greedy decodes, which no test reads
  - decoding=greedy
  - decoding.max_len_offset=3
  - "callbacks=[{{_target_:helpers.batch_recorder.BatchRecorder,folder:'{batches}',hold_at:2}}]"
  - ${{args_no_hyphens}}
"""


@pytest.mark.slow
def test_ctrl_c_stops_real_trials_which_save_and_continue(
    tmp_path: Path, corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", environment()["PYTHONPATH"])  # the recorder
    batches = tmp_path / "batches"
    sweep = tmp_path / "smoke.yaml"
    sweep.write_text(SMOKE_SWEEP.format(root=corpus_root, cache=cache_dir, batches=batches))
    folder = tmp_path / "outputs" / "sweeps" / "smoke"
    runner = start_runner(sweep, tmp_path)
    wait_until((batches / HELD).is_file, runner, "the trial held after its second batch")
    os.killpg(runner.pid, signal.SIGINT)  # the runner sends the trial SIGTERM; it stops at its next batch
    (batches / RELEASE).touch()  # (the continued trial passes its hold at once)
    _, stderr = runner.communicate(timeout=120)
    assert runner.returncode == 130, stderr
    (trial,) = trials(folder)
    assert trial["state"] == "interrupted" and trial["returncode"] == 143, trial
    run_dir = folder / trial["run_dir"]
    assert (run_dir / "checkpoints" / "last.ckpt").is_file() and not (run_dir / "results.json").exists()

    again = run_runner(sweep, tmp_path)
    assert again.returncode == 0, again.stderr
    (trial,) = trials(folder)
    results = json.loads((run_dir / "results.json").read_text())
    assert results["resumed_from"] == str(run_dir / "checkpoints" / "last.ckpt") and results["steps"] == 12
    assert trial["state"] == "finished" and trial["metric"] == results["val_bleu"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("run_dir", "../../elsewhere"),
        ("run_dir", "/etc"),
        ("run_dir", "."),
        ("run_dir", "logs"),
        ("number", "1"),
        ("params", ["model.n_heads=8"]),
        ("params", {"model.n_heads": {"_target_": "os.system"}}),
        ("params", {"++trainer.plugins": "[{_target_:builtins.print,_args_:[owned]}]"}),  # an override to build
        ("params", {"model.n_heads": "8 ++trainer.plugins=[]"}),
        ("params", {"model.n_heads": 16}),  # not one of the file's values
        ("state", "done"),
        ("command", "aiayn-train; rm -rf ~"),
        ("returncode", "0"),
        ("metric", float("nan")),
        ("metric", "12.5"),
        ("seconds", -1),
        ("error", 3),
        ("launcher", "ssh"),
        ("job_id", "12; scancel -u $USER"),
        ("devices", "0,1"),
    ],
)
def test_a_trial_record_aiayn_does_not_write_is_refused_in_one_line(field: str, value: object, tmp_path: Path) -> None:
    """``sweep.json`` comes with a copied sweep folder: each trial's fields have the types the runner writes
    (it prints them, hands them to W&B's sweep engine, starts commands and jobs from them)."""
    config = {"method": "grid", "parameters": {"model.n_heads": {"values": [4, 8]}}}
    trial = {"number": 1, "params": {"model.n_heads": 4}, "state": "finished", "command": ["aiayn-train"],
             "run_dir": "trial-0001", "returncode": 0, "metric": 10.0, "seconds": 3.0, field: value}  # fmt: skip
    (tmp_path / STATE_FILE).write_text(json.dumps({"config": config, "trials": [trial]}))
    refusal = f"^{re.escape(str(tmp_path / STATE_FILE))}: (trial 1's|a trial's) "
    with pytest.raises(SweepError, match=refusal) as refused:
        SweepState.open(tmp_path, config, tmp_path / "sweep.yaml")
    assert "\n" not in str(refused.value) and field in str(refused.value)
    del trial[field]
    if field not in ("number", "params"):  # without the odd field, the same record opens
        (tmp_path / STATE_FILE).write_text(json.dumps({"config": config, "trials": [trial]}))
        assert SweepState.open(tmp_path, config, tmp_path / "sweep.yaml").trials[0].number == 1


def test_a_trial_metric_is_read_from_a_damaged_metrics_file_without_a_traceback(tmp_path: Path) -> None:
    """The metric a sweep records (and hands to bayes) from a trial's metrics CSV: damaged rows, bytes
    that are not UTF-8 and non-finite values are passed over; a file that is no metrics CSV is none."""
    history = tmp_path / "metrics.csv"
    history.write_bytes(b"step,val/bleu\n6,12.5\n\xff\xfe,3\n9,nan\n12,inf\n" + b"15," + b"9" * 4000 + b"x\n")
    assert last_logged(history, "val/bleu") == 12.5
    history.write_bytes(b"\x00\x01 not a csv \xff\n")
    assert last_logged(history, "val/bleu") is None
    assert last_logged(tmp_path / "missing.csv", "val/bleu") is None


@pytest.mark.parametrize("entry", ["logs", "logs/trial-1.params.yaml", "logs/trial-1.log", "seed=1", ".lock"])
def test_a_shared_sweep_folder_with_a_link_is_refused_before_any_trial_writes(
    entry: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A link in logs/ took a trial's parameters and output elsewhere; one named like a trial's folder had the
    trial trained in its target, replacing that folder's results.json."""
    sweep = fake_sweep(tmp_path, [1], "seconds=0")
    folder = tmp_path / "shared"
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "results.json").write_text("precious")
    (folder / entry).parent.mkdir(parents=True, exist_ok=True)
    (folder / entry).symlink_to(victim if entry in ("logs", "seed=1") else victim / "results.json")
    monkeypatch.chdir(tmp_path)
    status, _, err = sweep_main([sweep, "--dir", folder], capsys)
    assert status == 2 and err.startswith(f"aiayn-sweep: error: {folder / entry}: is a link"), err
    assert len(err.splitlines()) == 1
    assert sorted(p.name for p in victim.iterdir()) == ["results.json"]
    assert (victim / "results.json").read_text() == "precious"
