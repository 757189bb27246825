"""aiayn: reproduce "Attention Is All You Need" and its ablations with Lightning and Hydra.

The subpackages are layers, from the inside out; each imports only itself and those before it
(``tests/test_layout.py`` checks it): :mod:`aiayn.model` (plain PyTorch), :mod:`aiayn.data`,
:mod:`aiayn.training`, :mod:`aiayn.export`, :mod:`aiayn.evaluation`, :mod:`aiayn.config`,
:mod:`aiayn.experiments` (one run's recipe; its rooms :mod:`aiayn.experiments.sweeps` and
:mod:`aiayn.experiments.report`) and :mod:`aiayn.cli`. The leaves :mod:`aiayn.errors`,
:mod:`aiayn.extras` (the optional libraries), :mod:`aiayn.files`, :mod:`aiayn.scoring` and
:mod:`aiayn.machine` serve them all.
"""

__version__ = "0.1.0"
