"""The libraries only some features need, which ``pip install aiayn`` leaves out: each comes with an extra
of pyproject.toml (``wmt``, ``sweep``, ``report``, ``slurm``, ``export``, ``comet``, ``optuna``). A command that needs
one the install lacks stops in one line naming the ``pip install`` that brings it (exit status 2, no
traceback), through :func:`require` where the library is imported::

    aiayn-sweep: error: W&B's sweep engine is not installed: pip install 'aiayn[sweep]'

Hydra's plugins are not imported by us: a config that names one (``hardware=slurm``) fails Hydra's
composition, which :func:`missing_hydra_plugin` turns into the same line.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from aiayn.errors import ConfigError

# The option Hydra "could not find" without a plugin → (the plugin's module, its extra, what it is).
HYDRA_PLUGINS = {
    "hydra/launcher/submitit_": (
        "hydra_plugins.hydra_submitit_launcher", "slurm", "Hydra's submitit launcher (hardware=slurm)"
    ),
    "hydra/sweeper/optuna": ("hydra_plugins.hydra_optuna_sweeper", "optuna", "Hydra's Optuna sweeper"),
}  # fmt: skip


class MissingExtra(ConfigError):
    """A library that a feature needs is not installed; the message names the extra that brings it. A
    :class:`~aiayn.errors.ConfigError` (a setting this install cannot honour), which every command reports
    in one line with exit status 2."""

    def __init__(self, what: str, extra: str) -> None:
        self.what, self.extra = what, extra
        self.key, self.value, self.allowed = extra, None, "is not installed"
        ValueError.__init__(self, f"{what} is not installed: pip install 'aiayn[{extra}]'")


def require(module: str, extra: str, what: str) -> ModuleType:
    """``module``, imported; :class:`MissingExtra` naming ``extra`` when it is not installed. A library that
    is there but lacks one of its own is a broken install, not a missing extra: its error is raised as is."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name is not None and module != error.name and not module.startswith(f"{error.name}."):
            raise
        raise MissingExtra(what, extra) from None


def require_installed(module: str, extra: str, what: str) -> None:
    """:func:`require` without importing ``module``: for a library slow to import, checked before a run
    starts."""
    if not installed(module):
        raise MissingExtra(what, extra)


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here (it is not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing; a module hidden as None in sys.modules
        return False


def missing_hydra_plugin(error: BaseException) -> MissingExtra | None:
    """The :class:`MissingExtra` behind Hydra's composition ``error`` when it could not find an option
    that only a plugin provides and the plugin is not installed; else None (a typo in an option's name)."""
    for option, (plugin, extra, what) in HYDRA_PLUGINS.items():
        if f"Could not find '{option}" in str(error) and not installed(plugin):
            return MissingExtra(what, extra)
    return None
