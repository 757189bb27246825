"""The ``--help`` page of each Hydra command, built from its config in conf/ (the single source): the
leading comment of ``<config>.yaml`` (a description, and example command lines indented under it), the
config groups its defaults list names with their options and the first sentence of each option's
comment, the keys that are required, and the text of the config itself, comments included, without its
``defaults:`` and ``hydra:`` blocks. Hydra's own help (``--hydra-help``) is left to Hydra.

Only the standard library, Hydra's argument parser, PyYAML and :mod:`aiayn.config.compose` are imported:
``--help`` starts at once, without torch, Lightning or the model.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import yaml
from hydra._internal.utils import get_args_parser

from aiayn.config.compose import config_dir

INDENT = "  "
TOP_LEVEL_KEY = re.compile(r"^([A-Za-z_][\w.-]*)\s*:")
KEY_LINE = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z_][\w.-]*)\s*:\s*(?P<value>[^#]*?)\s*(?:#\s*(?P<comment>.*))?$")
SENTENCE_END = re.compile(r"(?<=[.!?])\s")
LONGEST_SENTENCE = 240  # characters of a config group option's description


def exit_with_help_if_asked(program: str, config_name: str, multirun: bool = False) -> None:
    """When the command line asks for help as Hydra reads it (``--help``, ``-h``), print
    :func:`help_page` on stdout and exit with status 0; otherwise return at once. ``multirun``: the
    command documents Hydra's ``-m``."""
    if not asks_for_help(sys.argv[1:]):
        return
    page = help_page(program, config_name, multirun, width=page_width())
    try:
        sys.stdout.write(page)
        sys.stdout.flush()
    except BrokenPipeError:  # the reader went away (``| head``): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(0)


def asks_for_help(arguments: list[str]) -> bool:
    """Whether Hydra's own parser would show the app's help for ``arguments`` (``--help``, ``-h``, an
    abbreviation, ``-mh``). A command line that parser rejects is not a request for help: Hydra reports it."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            parsed, _ = get_args_parser().parse_known_args(arguments)
        except SystemExit:
            return False
    return bool(parsed.help)


def page_width() -> int:
    """The terminal's width, between 60 and 120 columns (100 where there is no terminal)."""
    return max(60, min(120, shutil.get_terminal_size((100, 24)).columns))


@dataclass(frozen=True)
class Group:
    """A config group a command accepts: its name, the option chosen by default (None: none) and its
    options: their names (file names under conf/<name>/, recursively: ``table3/A1``) and files."""

    name: str
    default: str | None
    files: dict[str, Path]


@dataclass(frozen=True)
class Setting:
    """A key of a config (dotted) with its value as written and its comment (continuation lines joined)."""

    key: str
    value: str
    comment: str

    @property
    def required(self) -> bool:
        """Hydra's mandatory value ``???``, or a comment that starts with ``required``."""
        return self.value == "???" or self.comment.lower().startswith("required")


def help_page(program: str, config_name: str, multirun: bool = False, width: int = 100) -> str:
    """The help of ``program``, whose config is ``<config_name>.yaml`` in :func:`config_dir`: usage,
    description, examples, required keys, config groups, settings, and where Hydra's own flags are."""
    root = Path(config_dir())
    chain = included_configs(root, config_name)
    groups = config_groups(root, chain)
    description, examples = header(read(root / f"{config_name}.yaml"), program)
    if not examples:  # none of its own: those in its groups' options (hardware/slurm: aiayn-train -m ...)
        examples = [
            line for group in groups for path in group.files.values() for line in header(read(path), program)[1]
        ]
    out = [f"usage: {program} {'[-m] ' if multirun else ''}[KEY=VALUE ...]", ""]
    out += [wrapped(line, width) for line in description] + [""]
    if multirun:
        line = "-m, --multirun: a job for each combination of comma-separated values (model=small,base seed=1,2)"
        out += [wrapped(line, width, INDENT, INDENT * 3), ""]
    if examples:
        out += ["Examples:", *(INDENT + example.replace("\n", "\n" + INDENT) for example in examples[:3]), ""]
    out += required_section([setting for path in chain for setting in config_settings(read(path))], width)
    out += groups_section(groups, program, width)
    for path in chain:
        if body := settings_text(read(path)):
            out += [f"Settings (KEY=VALUE, nested keys with dots) as {path} sets them:", ""]
            out += [INDENT + line if line else "" for line in body] + [""]
    out.append(f"Hydra's own flags (--cfg, --info, --shell-completion, ...): {program} --hydra-help")
    return "\n".join(out) + "\n"


def required_section(settings: list[Setting], width: int) -> list[str]:
    """The required keys among ``settings``, each with its comment ([] when none is)."""
    required = [setting for setting in settings if setting.required]
    if not required:
        return []
    key_width = max(len(setting.key) for setting in required) + 2
    out = ["Required:"]
    for setting in required:
        comment = re.sub(r"^required\s*:?\s*", "", setting.comment, flags=re.IGNORECASE)
        out.append(wrapped(f"{setting.key:<{key_width}}{comment}", width, INDENT, INDENT + " " * key_width))
    return [*out, ""]


def groups_section(groups: list[Group], program: str, width: int) -> list[str]:
    """The config groups with their options and descriptions, the default marked ([] when there are none)."""
    if not groups:
        return []
    out = ["Config groups (GROUP=OPTION; * marks the default):"]
    for group in groups:
        out.append(f"{INDENT}{group.name}:" if group.default else f"{INDENT}{group.name}: (none by default)")
        name_width = max((len(name) for name in group.files), default=0) + 4
        for name, path in group.files.items():
            label = f"{name} *" if name == group.default else name
            about = first_sentence(read(path))
            out.append(wrapped(f"{label:<{name_width}}{about}", width, INDENT * 2, INDENT * 2 + " " * name_width))
    line = (
        f"A group's own keys are set with dots (GROUP.KEY=VALUE); {program} --cfg job [KEY=VALUE ...] prints "
        "the config they compose, every key included."
    )
    return [*out, wrapped(line, width, INDENT, INDENT), ""]


def wrapped(text: str, width: int, first: str = "", rest: str = "") -> str:
    """``text`` wrapped to ``width``, its first line indented by ``first``, the others by ``rest``."""
    return textwrap.fill(text, width, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False) or first


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def header(text: str, program: str) -> tuple[list[str], list[str]]:
    """The leading comment of a config file, split into its description lines and its example command
    lines: the indented ones that start with ``program``, each with the lines that continue it (after a
    ``\\``) joined by line feeds. ``# @package`` lines are left out."""
    description: list[str] = []
    examples: list[str] = []
    continued = False
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        comment = line[1:].strip()
        if continued:
            examples[-1] += f"\n  {comment}"
        elif line.startswith("#  ") and comment.split(" ", 1)[0] == program:
            examples.append(comment)
        elif not comment.startswith("@package"):
            description.append(comment)
        continued = bool(examples) and examples[-1].endswith("\\")
    return description, examples


def first_sentence(text: str) -> str:
    """The first sentence of a config file's description: its leading comment up to the first indented
    line (an example), ``# @package`` left out; a sentence longer than :data:`LONGEST_SENTENCE` is cut
    after its first line."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("#") or line.startswith("#  "):
            break
        if not line.startswith("# @package"):
            lines.append(line[1:].strip())
    sentence = SENTENCE_END.split(" ".join(lines), maxsplit=1)[0].strip().rstrip(":").strip()
    if len(sentence) > LONGEST_SENTENCE:
        return lines[0].rstrip(",;: ") + " ..."
    return sentence


def defaults_list(text: str) -> list[str | dict[str, object]]:
    """The ``defaults`` list of a config file ([] when it has none)."""
    loaded = yaml.safe_load(text) or {}
    return list(loaded.get("defaults") or []) if isinstance(loaded, dict) else []


def included_configs(root: Path, config_name: str) -> list[Path]:
    """The config files that make up ``config_name``: those its defaults list names as whole configs
    (``- train``), recursively and in their order, then itself."""
    own = root / f"{config_name}.yaml"
    chain: list[Path] = []
    for entry in defaults_list(read(own)):
        if isinstance(entry, str) and entry != "_self_":
            chain += included_configs(root, entry.lstrip("/").removesuffix(".yaml"))
    return [*chain, own]


def config_groups(root: Path, chain: list[Path]) -> list[Group]:
    """The config groups that the defaults lists of ``chain`` name (Hydra's own, ``hydra/...``, left out),
    in their order, each with the default that the last of them chooses; only groups that are folders of
    ``root``."""
    defaults: dict[str, str | None] = {}
    for path in chain:
        for entry in defaults_list(read(path)):
            if not isinstance(entry, dict) or len(entry) != 1:
                continue
            ((key, choice),) = entry.items()
            name = str(key).removeprefix("override ").removeprefix("optional ").strip().lstrip("/")
            name = name.split("@", 1)[0]
            if name == "hydra" or name.startswith("hydra/") or not (root / name).is_dir():
                continue
            defaults[name] = None if choice is None else str(choice)
    return [Group(name, default, option_files(root / name)) for name, default in defaults.items()]


def option_files(folder: Path) -> dict[str, Path]:
    """The options of the group in ``folder``: its .yaml files, recursively (``table3/A1``), by name; a
    file or folder whose name starts with ``_`` is internal (``data/_shared``), not an option."""
    found = {}
    for path in sorted(folder.rglob("*.yaml")):
        relative = path.relative_to(folder).with_suffix("")
        if not any(part.startswith("_") for part in relative.parts):
            found[relative.as_posix()] = path
    return found


def settings_text(text: str) -> list[str]:
    """The lines of a config file without its leading comment and without its ``defaults:`` and ``hydra:``
    blocks (blank lines around them dropped), as the user reads them: keys, values and comments."""
    lines = text.splitlines()
    start = 0
    while start < len(lines) and lines[start].startswith("#"):
        start += 1
    kept: list[str] = []
    skipping = False
    for line in lines[start:]:
        match = TOP_LEVEL_KEY.match(line)
        if match:
            skipping = match.group(1) in ("defaults", "hydra")
        elif line and not line[0].isspace() and not line.startswith("-"):
            skipping = False  # a comment at the left margin: it belongs to the next key
        if not skipping:
            kept.append(line.rstrip())
    while kept and not kept[0]:
        kept.pop(0)
    while kept and not kept[-1]:
        kept.pop()
    return [line for i, line in enumerate(kept) if line or (i and kept[i - 1])]  # no two blank lines in a row


def config_settings(text: str) -> list[Setting]:
    """The keys of :func:`settings_text` (dotted for nested ones) with their values and comments; a
    comment line indented past the end of the key above it continues that key's comment."""
    settings: list[Setting] = []
    parents: list[tuple[int, str]] = []  # (indentation, key) of the mappings the next line may be in
    continues_past = None  # the column a comment line must start after to continue the last key's comment
    for line in settings_text(text):
        stripped = line.strip()
        if not stripped:
            continues_past = None
            continue
        indent = len(line) - len(line.lstrip())
        if stripped.startswith("#"):
            if continues_past is not None and indent > continues_past:
                last = settings[-1]
                settings[-1] = Setting(last.key, last.value, f"{last.comment} {stripped[1:].strip()}".strip())
            else:
                continues_past = None
            continue
        match = KEY_LINE.match(line)
        if not match:
            continues_past = None
            continue  # a list item, or a flow collection's next line
        while parents and parents[-1][0] >= indent:
            parents.pop()
        key = ".".join([*(name for _, name in parents), match.group("key")])
        if not match.group("value"):
            parents.append((indent, match.group("key")))
        settings.append(Setting(key, match.group("value"), (match.group("comment") or "").strip()))
        continues_past = indent + len(match.group("key")) + 1
    return settings
