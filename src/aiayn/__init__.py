"""aiayn: reproduce "Attention Is All You Need" and its ablations with Lightning and Hydra.

The subpackages are layers, from the inside out; each imports only itself and those before it
(``tests/test_layout.py`` checks it): :mod:`aiayn.model` (plain PyTorch), :mod:`aiayn.data`,
:mod:`aiayn.training`, :mod:`aiayn.export`, :mod:`aiayn.evaluation`, :mod:`aiayn.config`,
:mod:`aiayn.experiments` (one run's recipe; its rooms :mod:`aiayn.experiments.sweeps` and
:mod:`aiayn.experiments.report`) and :mod:`aiayn.cli`. The leaves :mod:`aiayn.errors`,
:mod:`aiayn.extras` (the optional libraries), :mod:`aiayn.files`, :mod:`aiayn.scoring` and
:mod:`aiayn.machine` serve them all.

From Python: ``aiayn.load(checkpoint)`` (translate, n-best, score), ``aiayn.train(overrides)`` and
``aiayn.runs(folder)`` (:mod:`aiayn.cli.api`), and ``aiayn.check_component(kind, spec)``, the component
test kit (:mod:`aiayn.experiments.component_kit`), imported on first use: ``import aiayn`` stays light.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
API = {"load": "aiayn.cli.api", "train": "aiayn.cli.api", "runs": "aiayn.cli.api"}
API["check_component"] = "aiayn.experiments.component_kit"


def __getattr__(name: str) -> Any:
    if name in API:
        from importlib import import_module

        return getattr(import_module(API[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
