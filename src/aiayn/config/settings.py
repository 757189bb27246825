"""The top-level settings a command reads, from its own yaml file in conf/: a key added on the command line
that nothing reads is a typo or another tool's habit (``+seeds=3``, lightning-hydra-template's
``ckpt_path=``), refused in one line before any work rather than silently ignored. Reads only yaml
files, so the light commands can use it."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from aiayn.config.compose import config_dir
from aiayn.errors import ConfigError

# Other tools' names for aiayn's settings: what a user of lightning-hydra-template or fairseq types.
OTHER_NAMES = {
    "ckpt_path": "resume=<checkpoint> continues from a checkpoint (resume=true: the latest run of this name)",
    "seeds": "seed=<n> (several seeds: -m seed=1,2,3)",
    "log_dir": "paths.output_dir=<folder> (or $AIAYN_OUTPUT) is where runs are written",
}
HYDRA_OWN = ("hydra",)


@cache
def top_level_settings(config_name: str) -> frozenset[str]:
    """The top-level keys of ``conf/<config_name>.yaml``, with the config groups of its defaults list
    that are placed under their own name (``model``, ``data``; not ``@package _global_`` ones such as
    ``hardware``) and the settings of the configs it includes (aiayn-summary includes train)."""
    root = Path(config_dir())
    text = yaml.safe_load((root / f"{config_name}.yaml").read_text()) or {}
    keys = {key for key in text if key != "defaults"}
    for entry in text.get("defaults", []):
        if isinstance(entry, str) and entry not in ("_self_",) and (root / f"{entry}.yaml").is_file():
            keys |= top_level_settings(entry)
        elif isinstance(entry, dict):
            ((group, _),) = entry.items()
            if not group.startswith(("override ", "hydra/")) and not _global_group(root / group):
                keys.add(group)
    return frozenset(keys)


def _global_group(folder: Path) -> bool:
    """A group whose options put their keys at the top (``# @package _global_``)."""
    return any("@package _global_" in option.read_text() for option in folder.glob("*.yaml"))


def check_settings(cfg: Mapping[str, Any], config_name: str, overrides: Iterable[str]) -> None:
    """Refuse the first top-level key that an override adds with ``+`` (``+seeds=3``) and the command does
    not read. Keys that a user's own config files add (variables for their interpolations) are theirs."""
    known = top_level_settings(config_name)
    for override in overrides:
        if not override.startswith("+") or override.startswith("++"):
            continue
        key = override[1:].split("=", 1)[0].split(".", 1)[0]
        if key in cfg and key not in known and key not in HYDRA_OWN:
            raise ConfigError(key, cfg[key], unread_setting(key, known))


def unread_setting(key: str, known: Iterable[str]) -> str:
    """Why ``key`` does nothing, and what the user may have meant."""
    if key in OTHER_NAMES:
        return f"is not a setting of aiayn; {OTHER_NAMES[key]}"
    close = difflib.get_close_matches(key, list(known), n=1)
    meant = f"did you mean {close[0]}? " if close else ""
    return f"is not a setting aiayn reads ({meant}--help lists them)"


def unread_override(error: BaseException, command: str) -> str | None:
    """Hydra's refusal of an override of a top-level key that does not exist (``ckpt_path=x``: "Could not
    override 'ckpt_path'. To append to your config use +ckpt_path=x"), said as :func:`check_settings`
    says it: the ``+`` Hydra suggests would only be refused next. None for any other error, and for keys
    inside a section, where Hydra's ``+`` is right (``+trainer.limit_val_batches=2``)."""
    found = re.match(r"Could not override '(\w+)'\.\s+To append to your config use \+(\w+=.*)", str(error))
    if not found or not (Path(config_dir()) / f"{command}.yaml").is_file():
        return None
    key, value = found[1], found[2].split("=", 1)[1]
    return f"{key}={value} {unread_setting(key, top_level_settings(command))}"
