"""Composed configs remembered for the tests that only read them: a Hydra compose costs about 0.2 s, and
the read-only tests compose the same override lists again and again (every Table 3 row's base, every
experiment in two files). Each call returns a deep copy, so a test that changes its config cannot change
what the next one reads.

Only for configs that depend on nothing but the config name and the overrides: a test that composes
under a changed environment or working folder, or whose composition has a side effect it checks,
composes for itself. The working folder is part of the key all the same (``compose_run_config`` resolves
``outputs/...`` paths against it)."""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence

from omegaconf import DictConfig

from aiayn.config.compose import compose_config, compose_run_config

_COMPOSED: dict[tuple[str, str, tuple[str, ...]], DictConfig] = {}
_RUN = "<run>"  # the key's config name for compose_run_config, which is a train.yaml of its own kind


def _remembered(name: str, overrides: Sequence[str]) -> DictConfig:
    key = (os.getcwd(), name, tuple(overrides))
    if key not in _COMPOSED:
        _COMPOSED[key] = compose_run_config(overrides) if name == _RUN else compose_config(name, overrides)
    return copy.deepcopy(_COMPOSED[key])


def composed(config_name: str = "train", overrides: Sequence[str] = ()) -> DictConfig:
    """:func:`~aiayn.config.compose.compose_config`, composed once per name and override list."""
    return _remembered(config_name, overrides)


def composed_run(overrides: Sequence[str] = ()) -> DictConfig:
    """:func:`~aiayn.config.compose.compose_run_config`, composed once per override list."""
    return _remembered(_RUN, overrides)
