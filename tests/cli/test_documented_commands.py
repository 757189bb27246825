"""Every ``aiayn-*`` command that README.md and docs/*.md show in a code block works as written, as far as
it can without training: the Hydra commands compose their config (``--cfg job --resolve``; under ``-m``
every combination of the swept values), ``aiayn-sweep`` lists and composes its trials (``--dry-run``),
``aiayn-average`` and ``aiayn-report`` parse their arguments, and the file of an ``sbatch`` or a
``wandb sweep`` line exists.

The commands run in this process (a compose costs about 0.1 s, a fresh process several seconds), from a
scratch working folder with the repository's ``sweeps/`` linked in, so that nothing is written into the
repository. Placeholders (``<run>``) take the values of :data:`PLACEHOLDERS`; the reader's own files
(``my_random_sweep.yaml``, ``/home/me/aiayn-conf``) are written by the test; ``NAME=value`` before a
command is set in the environment while it is checked."""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import import_module
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from helpers.extras import toml_reader
from helpers.runs import REPO

DOCUMENTS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
SHELL = {"", "bash", "sh", "shell", "console"}  # the code blocks whose lines are commands
HYDRA_APPS = {"aiayn-train", "aiayn-eval", "aiayn-translate", "aiayn-export", "aiayn-summary"}
ARGPARSE = {"aiayn-average", "aiayn-report"}  # parsed only: what they read are real runs and checkpoints
SWEEP = "aiayn-sweep"
SCRATCH = "{scratch}"  # the test's scratch folder, in the values below

# What the pages write for a value of the reader's, and the value it takes here. Only the shape of a
# command is checked, so a path need not exist.
PLACEHOLDERS = {
    "<run>": "small_multi30k_en_de/2026-11-30_09-00-00",  # outputs/<run>/...
    "<run2>": "small_multi30k_en_de/2026-11-30_10-00-00",  # another run (an ensemble's second member)
    "<date_time>": "2026-11-30_09-00-00",
    "<corpus folder>": "../shared/data/multi30k",
    "<partition>": "gpu",
    "<account>": "lab",
    "<entity>": "lab",
    "<project>": "aiayn",
    "<sweep id>": "x7k2m9qa",
    "<entity/project/sweep id>": "lab/aiayn/x7k2m9qa",
    "<you>": "me",  # a Hub user
}
# The reader's own paths: written under the scratch folder (READER_FILES), never where the page says.
READER_PATHS = {
    "/home/me/aiayn-conf": f"{SCRATCH}/aiayn-conf",
    "/scratch/$USER": f"{SCRATCH}/scratch/me",
    "my_random_sweep.yaml": f"{SCRATCH}/my_random_sweep.yaml",
}
# Their files, as the pages describe them (docs/scaling.md, "Config folders of your own").
READER_FILES = {
    "aiayn-conf/experiment/my_row.yaml": (
        "# @package _global_\ndefaults:\n  - /experiment/table3/base\n  - _self_\nmodel:\n  n_heads: 16\n"
    ),
    "aiayn-conf/hardware/my_cluster.yaml": (
        "# @package _global_\ndefaults:\n  - gpu8_ddp\n  - _self_\ntrainer:\n  devices: 4\n"
    ),
    "my_random_sweep.yaml": (
        "method: random\nmetric: {name: val/bleu, goal: maximize}\nparameters:\n"
        "  optim.warmup: {values: [200, 400, 800]}\n  seed: {values: [1, 2, 3]}\n"
        "command: [aiayn-train, experiment=mini/base, '${args_no_hyphens}']\n"
    ),
}
PLACEHOLDER = re.compile(r"<[^\s<>][^<>]*>")  # <run>, <corpus folder>; not the redirections of `< in > out`
HIDDEN = re.compile(r"@@(\d+)@@")  # a placeholder while its line is split into words (it may hold spaces)
SEPARATORS = {"|", "||", "&&", ";", "&"}
REDIRECTIONS = {"<", ">", ">>"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass
class Command:
    """One simple command of a page's code block: ``program args...``, run with ``env`` set."""

    where: str  # page:line (a line continued with \: its first)
    text: str  # the line as the page writes it
    program: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)  # its placeholders that PLACEHOLDERS has no value for


def shell_lines(markdown: str) -> Iterator[tuple[int, str]]:
    """The lines of the shell code blocks of ``markdown``, continuations (``\\``) joined, each with the
    number of its first line."""
    fence, start, pending = None, 0, ""
    for number, line in enumerate(markdown.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = stripped[3:].strip().lower() if fence is None else None
            continue
        if fence not in SHELL:  # outside a block (None), or a block of Python, YAML, text
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        if (joined := pending + stripped).strip():
            yield start, joined
        pending = ""


def simple_commands(line: str) -> Iterator[list[str]]:
    """The words of each simple command of a shell line (split at pipes, ``&&`` and ``;``), without its
    redirections and comments."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words: list[str] = []
    redirected = False
    for token in [*lexer, ";"]:
        if token in SEPARATORS:
            if words:
                yield words
            words = []
        elif token in REDIRECTIONS:
            redirected = True
        elif redirected:
            redirected = False  # the file a redirection names
        else:
            words.append(token)


def commands_of(markdown: str, page: str, scratch: str = SCRATCH) -> Iterator[Command]:
    """The ``aiayn-*``, ``sbatch`` and ``wandb sweep`` commands of the page's shell code blocks, with the
    placeholders' values and the reader's paths (under ``scratch``) in place."""
    for number, line in shell_lines(markdown):
        found: list[str] = []
        text = PLACEHOLDER.sub(lambda m, found=found: found.append(m[0]) or f"@@{len(found) - 1}@@", line)
        for path, replacement in READER_PATHS.items():
            text = text.replace(path, replacement.replace(SCRATCH, scratch))

        def shown(word: str, found: list[str] = found) -> str:
            return HIDDEN.sub(lambda m: PLACEHOLDERS.get(found[int(m[1])], found[int(m[1])]), word)

        for words in simple_commands(text):
            env = {}
            while words and ASSIGNMENT.match(words[0]):
                name, _, value = words.pop(0).partition("=")
                env[name] = shown(value)
            if words and (words[0].startswith("aiayn-") or words[0] == "sbatch" or words[:2] == ["wandb", "sweep"]):
                named = [found[int(i)] for word in words for i in HIDDEN.findall(word)]
                unknown = [placeholder for placeholder in named if placeholder not in PLACEHOLDERS]
                yield Command(f"{page}:{number}", line, words[0], [shown(w) for w in words[1:]], env, unknown)


def documented() -> list[Command]:
    """Every command of the pages once, where a page first shows it."""
    seen: dict[tuple[object, ...], Command] = {}
    for document in DOCUMENTS:
        for command in commands_of(document.read_text(), document.relative_to(REPO).as_posix()):
            seen.setdefault((*sorted(command.env.items()), command.program, *command.args), command)
    return list(seen.values())


def console_script(program: str) -> Callable[..., object]:
    """The function the installed console script ``program`` runs."""
    (script,) = [point for point in entry_points(group="console_scripts") if point.name == program]
    return script.load()


def exit_status(run: Callable[[], object]) -> int:
    """``run()``'s exit status, as the console script's process would end with it."""
    try:
        run()
    except SystemExit as stopped:
        return 0 if stopped.code is None else stopped.code if isinstance(stopped.code, int) else 1
    return 0


def hydra_argvs(args: list[str]) -> list[list[str]]:
    """The command lines that check a Hydra command: its config printed (``--cfg job --resolve``), once,
    or under ``-m`` once per combination of the swept values (``seed=1,2``), as Hydra's basic sweeper makes
    them (Hydra prints no multirun's config). The flags go first, where every Hydra app takes them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if "--help" in args or "--cfg" in args:
        return [args]
    flags = [arg for arg in args if arg.startswith("-") and arg not in ("-m", "--multirun")]
    overrides = [arg for arg in args if not arg.startswith("-")]
    combinations = [overrides]
    if len(flags) < len(args) - len(overrides):  # -m
        parsed = OverridesParser.create().parse_overrides(overrides)
        combinations = [c for batch in BasicSweeper.split_arguments(parsed, None) for c in batch]
    return [["--cfg", "job", "--resolve", *flags, *combination] for combination in combinations]


def problem(command: Command, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str | None:
    """What is wrong with ``command`` as the pages write it, or None. Run in the test's working folder,
    with the command's environment set."""
    if command.unknown:
        return f"{', '.join(command.unknown)}: no value in PLACEHOLDERS for the check to give"
    program, args = command.program, command.args
    if program in ("sbatch", "wandb"):
        script = next((arg for arg in args if not arg.startswith("-") and arg != "sweep"), None)
        return None if script and (REPO / script).is_file() else f"{program}: {script} is no file of the repository"
    if program not in HYDRA_APPS | ARGPARSE | {SWEEP}:
        return f"{program} is not one of aiayn's commands"
    main = console_script(program)
    checks: list[tuple[list[str], Callable[[], object]]]
    if program in ARGPARSE:
        parse = import_module(main.__module__).parse_args
        checks = [(args, lambda: parse(args))]
    elif program == SWEEP:
        dry = args if "--dry-run" in args else [*args, "--dry-run"]
        checks = [(dry, lambda: main(dry))]
    else:
        checks = [(argv, lambda argv=argv: [monkeypatch.setattr(sys, "argv", [program, *argv]), main()])
                  for argv in hydra_argvs(args)]  # fmt: skip
    with monkeypatch.context() as patch:
        patch.delenv("AIAYN_OUTPUT", raising=False)  # a developer's own would hide the page's
        for name, value in command.env.items():
            patch.setenv(name, value)
        for argv, check in checks:
            capsys.readouterr()
            try:
                status = exit_status(check)
            except Exception as error:  # a traceback the reader would see
                return f"{program} {' '.join(argv)}: {type(error).__name__}: {error}"
            if status != 0:
                said = " | ".join(capsys.readouterr().err.strip().splitlines()[-3:])
                return f"{program} {' '.join(argv)}: exit status {status}: {said}"
    return None


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The working folder of the checks: the repository's sweep files linked in, the reader's files written."""
    folder = tmp_path_factory.mktemp("documented")
    (folder / "sweeps").symlink_to(REPO / "sweeps")
    for name, text in READER_FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


@pytest.fixture
def in_scratch(scratch: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The scratch folder as the working folder; a check leaves it, and the repository's outputs/, as they were."""

    def files() -> list[Path]:
        return sorted([*scratch.rglob("*"), *(REPO / "outputs").glob("*")])

    before = files()
    monkeypatch.chdir(scratch)
    yield scratch
    assert files() == before, "checking a documented command wrote files"


def in_folder(command: Command, scratch: Path) -> Command:
    """``command`` with the reader's paths in ``scratch``."""
    args = [arg.replace(SCRATCH, str(scratch)) for arg in command.args]
    env = {name: value.replace(SCRATCH, str(scratch)) for name, value in command.env.items()}
    return Command(command.where, command.text, command.program, args, env, command.unknown)


COMMANDS = documented()


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.where} {c.program}" for c in COMMANDS])
def test_documented_command_works_as_written(
    command: Command, in_scratch: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    found = problem(in_folder(command, in_scratch), monkeypatch, capsys)
    assert found is None, f"{command.where}: {command.text}\n  {found}"


def test_the_pages_show_every_command_and_the_readme_the_recipes() -> None:
    assert {command.program for command in COMMANDS} >= HYDRA_APPS | ARGPARSE | {SWEEP, "sbatch"}
    readme = [command for command in COMMANDS if command.where.startswith("README.md:")]
    assert len(readme) >= 10
    assert any(command.args[:1] == ["-m"] and "hparams_search=mini_optuna" in command.args for command in readme)


@pytest.mark.parametrize(
    ("markdown", "expected"),
    [
        ("```bash\naiayn-train model.n_layer=3\n```", "Could not override 'model.n_layer'"),
        ("```bash\naiayn-train experiment=table3/Z9\n```", "table3/Z9"),
        ("```bash\naiayn-train -m hardware=cpu_ddp seed=1,2 model=huge\n```", "huge"),
        ("```bash\naiayn-train --cfg job model=huge\n```", "huge"),
        ("```bash\naiayn-eval checkpoint=a.ckpt beam=5\n```", "beam"),
        ("```bash\naiayn-summary -m model=small,huge\n```", "huge"),
        ("```bash\naiayn-sweep sweeps/nowhere_mini.yaml --parallel 2\n```", "nowhere_mini"),
        ("```bash\naiayn-sweep sweeps/heads_mini.yaml model.d_modle=8\n```", "d_modle"),
        ("```bash\naiayn-average outputs/run --lats 5\n```", "exit status 2"),
        ("```bash\naiayn-report outputs/sweeps/x --data-rot y\n```", "exit status 2"),
        ("```sh\nsbatch sweeps/nowhere.sbatch lab/aiayn/x\n```", "nowhere.sbatch"),
        ("```\necho hi | aiayn-translate checkpoint=a.ckpt decoding=fast < in.en\n```", "decoding"),
        ("```bash\naiayn-train data.root=../shared/data/multi30k \\\n  model.d_modle=8\n```", "d_modle"),
        ("```bash\naiayn-trian model=base\n```", "not one of aiayn's commands"),
    ],
)
def test_a_broken_command_is_caught(
    markdown: str, expected: str, in_scratch: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (command,) = commands_of(markdown, "broken.md", str(in_scratch))
    found = problem(command, monkeypatch, capsys)
    assert found is not None and expected in found


def test_a_placeholder_without_a_value_is_caught(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (command,) = commands_of("```bash\naiayn-train data.root=<nowhere>  # writes <somewhere>\n```", "broken.md")
    assert command.unknown == ["<nowhere>"]  # not the comment's
    assert problem(command, monkeypatch, capsys) == "<nowhere>: no value in PLACEHOLDERS for the check to give"


def test_commands_are_read_as_a_shell_reads_them() -> None:
    markdown = (
        "text\n```bash\n# a comment\n"
        'echo "A man." | AIAYN_OUTPUT=/scratch/$USER/aiayn aiayn-translate checkpoint=<run>/best.ckpt < in.en > o.de\n'
        "aiayn-train -m seed=1,2 \\\n  'data.train=[a.en,a.de]'   # why\n"
        "pip install -e . && aiayn-summary model=base\n```\n"
        "```python\nimport aiayn  # aiayn-train in Python is not a command\n```\n"
    )
    found = [(c.where, c.env, c.program, c.args) for c in commands_of(markdown, "page.md", "/tmp/s")]
    assert found == [
        ("page.md:4", {"AIAYN_OUTPUT": "/tmp/s/scratch/me/aiayn"}, "aiayn-translate",
         [f"checkpoint={PLACEHOLDERS['<run>']}/best.ckpt"]),
        ("page.md:5", {}, "aiayn-train", ["-m", "seed=1,2", "data.train=[a.en,a.de]"]),
        ("page.md:7", {}, "aiayn-summary", ["model=base"]),
    ]  # fmt: skip
    assert hydra_argvs(["-m", "seed=1,2", "model=a,b"])[1] == ["--cfg", "job", "--resolve", "seed=1", "model=b"]


def test_an_environment_prefix_is_set_while_the_command_is_checked(
    in_scratch: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``NAME=value aiayn-...``: the value reaches the command (here an interpolation of the composed config)."""
    (command,) = commands_of("```bash\nAIAYN_DOC_CHECK=doc aiayn-train 'name=${oc.env:AIAYN_DOC_CHECK}'\n```", "p.md")
    assert problem(command, monkeypatch, capsys) is None
    (command,) = commands_of("```bash\naiayn-train 'name=${oc.env:AIAYN_DOC_CHECK}'\n```", "p.md")
    assert "AIAYN_DOC_CHECK" in (problem(command, monkeypatch, capsys) or "")


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation (backticks, commas, &) dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_pages_leads_somewhere() -> None:
    anchors = {
        page: {github_anchor(h) for h in re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE)} for page in DOCUMENTS
    }
    broken = []
    for page in DOCUMENTS:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            goal = (page.parent / path).resolve() if path else page
            if not goal.exists() or (anchor and goal in anchors and anchor not in anchors[goal]):
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken


def test_the_extras_the_pages_install_exist() -> None:
    """``pip install -e ".[a,b]"``, in a code block or in the text, names extras of pyproject.toml."""
    extras = set(toml_reader().loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    unknown = {
        f"{page.relative_to(REPO)}: {extra}"
        for page in DOCUMENTS
        for group in re.findall(r"""pip install -e ["']?\.\[([\w,\- ]+)\]""", page.read_text())
        for extra in group.split(",")
        if extra.strip() not in extras
    }
    assert not unknown, f"extras that pyproject.toml does not have: {sorted(unknown)}"
