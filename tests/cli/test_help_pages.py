"""Each Hydra command's ``--help`` is its own page (aiayn.cli.help): its name and usage, the examples of its
config's leading comment, only the config groups its defaults list names (their options, without internal
``_`` files), its keys with their comments and which are required, and a pointer to ``--hydra-help``.

The real console scripts run, all at once (``aiayn-train`` imports Lightning before its ``main`` runs: it
sets the pace); Hydra's own flags are checked to still be Hydra's.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from aiayn.cli.help import config_settings

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"
BIN = Path(sys.executable).parent
CONFIGS = {
    "aiayn-train": "train",
    "aiayn-eval": "eval",
    "aiayn-translate": "translate",
    "aiayn-export": "export",
    "aiayn-summary": "summary",
}
MULTIRUN = {"aiayn-train", "aiayn-summary"}
# A command line, and what it printed: (exit status, stdout, stderr).
Ran = dict[tuple[str, ...], tuple[int, str, str]]
RUNS = [
    *((command, "--help") for command in CONFIGS),
    ("aiayn-eval", "checkpoint=x.ckpt", "-h"),
    ("aiayn-eval", "--hydra-help"),
    ("aiayn-eval", "--cfg", "job", "decoding=greedy"),
]


def run(command: tuple[str, ...], cwd: Path = REPO, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    done = subprocess.run(
        [str(BIN / command[0]), *command[1:]], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    return done.returncode, done.stdout, done.stderr


@pytest.fixture(scope="module")
def ran() -> Ran:
    with ThreadPoolExecutor(len(RUNS)) as pool:
        return dict(zip(RUNS, pool.map(run, RUNS), strict=True))


def page(ran: Ran, command: str) -> str:
    status, out, err = ran[(command, "--help")]
    assert status == 0, err[-3000:]
    return out


def section(text: str, title: str) -> list[str]:
    """The lines of the page's section that starts with the line ``title``, up to the next blank line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title)) + 1
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


def groups(text: str) -> dict[str, list[str]]:
    """The config groups the page lists, each with its options in order (``*`` of the default dropped)."""
    if "Config groups" not in text:
        return {}
    found: dict[str, list[str]] = {}
    for line in section(text, "Config groups"):
        if match := re.match(r"^  (\S+):( \(none by default\))?$", line):
            found[match.group(1)] = []
        elif match := re.match(r"^    (\S+)", line):
            found[list(found)[-1]].append(match.group(1))
    return found


def header_examples(config: str) -> list[str]:
    """The example command lines of a config's leading comment, as written there."""
    lines = (CONF / f"{config}.yaml").read_text().splitlines()
    return [line[1:].strip() for line in lines if line.startswith("#   aiayn-")]


def own_keys(config: str) -> list[str]:
    loaded = yaml.safe_load((CONF / f"{config}.yaml").read_text())
    return [key for key in loaded if key not in ("defaults", "hydra")]


@pytest.mark.parametrize("command", CONFIGS)
def test_each_command_has_its_own_page(ran: Ran, command: str) -> None:
    text = page(ran, command)
    usage = f"usage: {command} [-m] [KEY=VALUE ...]" if command in MULTIRUN else f"usage: {command} [KEY=VALUE ...]"
    assert text.splitlines()[0] == usage
    assert f"{command}:" in text  # the config's description names it
    assert "powered by Hydra" not in text
    assert "_shared" not in text
    offered = [option for options in groups(text).values() for option in options]
    assert not [option for option in offered if any(part.startswith("_") for part in option.split("/"))]
    assert text.rstrip().splitlines()[-1].endswith(f"{command} --hydra-help")
    examples = section(text, "Examples:")
    assert len(examples) >= 2, text
    assert all(line.lstrip().startswith(command) for line in examples if not line.startswith("    "))
    for key in own_keys(CONFIGS[command]):
        assert re.search(rf"^  {re.escape(key)}:", text, re.MULTILINE), f"{key} is not on {command}'s page"
    assert not re.search(r"^  (defaults|hydra):", text, re.MULTILINE)


@pytest.mark.parametrize("command", ["aiayn-eval", "aiayn-translate", "aiayn-export", "aiayn-summary"])
def test_the_examples_are_those_of_the_config(ran: Ran, command: str) -> None:
    written = header_examples(CONFIGS[command])
    assert written
    assert section(page(ran, command), "Examples:") == [f"  {line}" for line in written]


def test_eval_page_lists_its_required_checkpoint_and_only_its_groups(ran: Ran) -> None:
    text = page(ran, "aiayn-eval")
    required = " ".join(line.strip() for line in section(text, "Required:"))
    assert required.startswith("checkpoint ")
    assert "a .ckpt written by aiayn-train or aiayn-average, or a folder of aiayn-export format=ctranslate2" in required
    assert groups(text) == {"decoding": ["greedy", "mbr", "paper", "sample", "tuned"]}
    assert re.search(r"^    paper \*\s+Decoding as §6\.1", text, re.MULTILINE)  # the default, with its description
    for foreign in ("hardware", "experiment", "logger", "table3"):
        assert foreign not in text
    assert not re.search(r"^model:", text, re.MULTILINE)  # the training model's section (comet.model is eval's own)
    assert "checkpoint: null              # required: a .ckpt" in text  # the config's own text and comments


def test_export_page_has_no_groups_and_two_required_keys(ran: Ran) -> None:
    text = page(ran, "aiayn-export")
    assert groups(text) == {}
    required = [line.split()[0] for line in section(text, "Required:") if not line.startswith("   ")]
    assert required == ["checkpoint", "output"]


def test_train_page_lists_the_groups_of_its_defaults_list(ran: Ran) -> None:
    text = page(ran, "aiayn-train")
    listed = groups(text)
    defaults = yaml.safe_load((CONF / "train.yaml").read_text())["defaults"]
    named = [next(iter(entry)) for entry in defaults if isinstance(entry, dict)]
    assert list(listed) == [name for name in named if (CONF / name).is_dir()]
    assert {"model", "data", "hardware", "logger", "decoding", "experiment", "debug"} <= set(listed)
    assert {"base", "big", "small", "tiny"} <= set(listed["model"])
    assert {"table3/A1", "table3/base", "paper/base_wmt14_en_de", "mini/A1"} <= set(listed["experiment"])
    assert "multi30k_en_de" in listed["data"]
    assert re.search(r"^    small \*\s+The default CPU model", text, re.MULTILINE)
    assert re.search(r"^  experiment: \(none by default\)$", text, re.MULTILINE)
    assert re.search(r"^    table3/A1\s+Table 3 row A1: one head", text, re.MULTILINE)
    assert "-m, --multirun" in text
    assert "\n  optim:\n    label_smoothing: 0.2        # ε_ls (§5.4: 0.1;" in text


def test_summary_page_has_the_keys_of_train_and_its_own(ran: Ran) -> None:
    text = page(ran, "aiayn-summary")
    assert set(groups(text)) == set(groups(page(ran, "aiayn-train")))
    for key in [*own_keys("train"), *own_keys("summary")]:
        assert re.search(rf"^  {re.escape(key)}:", text, re.MULTILINE)
    assert "source and target length at which training FLOPs per token are counted" in text


def test_hydra_flags_are_still_hydras(ran: Ran) -> None:
    status, out, err = ran[("aiayn-eval", "checkpoint=x.ckpt", "-h")]
    assert status == 0 and out.startswith("usage: aiayn-eval "), err
    status, out, err = ran[("aiayn-eval", "--hydra-help")]
    assert status == 0 and "Hydra" in out and "--cfg" in out, err
    status, out, err = ran[("aiayn-eval", "--cfg", "job", "decoding=greedy")]
    assert status == 0 and "beam_size: 1" in out and "checkpoint: null" in out, err


def test_page_reads_the_configs_of_an_installed_wheel(tmp_path: Path) -> None:
    """A wheel holds conf/ as aiayn/conf (pyproject.toml): its page is built from there."""
    package = tmp_path / "aiayn"
    shutil.copytree(REPO / "src" / "aiayn", package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(CONF, package / "conf")
    (package / "conf" / "decoding" / "wide.yaml").write_text("# Beam 12: only in this installation.\nbeam_size: 12\n")
    (package / "conf" / "decoding" / "_internal.yaml").write_text("# Not an option.\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "aiayn.cli.evaluate", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert groups(done.stdout) == {"decoding": ["greedy", "mbr", "paper", "sample", "tuned", "wide"]}
    assert "Beam 12: only in this installation" in done.stdout
    assert str(package / "conf" / "eval.yaml") in done.stdout


def test_required_keys_and_comments_of_a_config() -> None:
    text = """# a header
defaults:
  - _self_
corpus:
  root: ???                # where it is
  lang: null               # required: the language,
                           # two letters
  # a comment above the next key
  size: 3
hydra:
  run:
    dir: .
"""
    settings = {setting.key: setting for setting in config_settings(text)}
    assert list(settings) == ["corpus", "corpus.root", "corpus.lang", "corpus.size"]
    assert [key for key, setting in settings.items() if setting.required] == ["corpus.root", "corpus.lang"]
    assert settings["corpus.lang"].comment == "required: the language, two letters"
    assert settings["corpus.size"].comment == ""
