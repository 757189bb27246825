"""The experiments layer: one training run from a composed config to ``results.json`` (:mod:`.run`) and
its resume decisions (:mod:`.resume`), sweeps of runs without a W&B server (:mod:`.sweeps`: the sweep
file, its state, each trial, the runner, launchers and GPU placement), the paper's Table 3
(:mod:`.table3`) and the Table-3-style report of finished runs (:mod:`.report`: finding runs, settings,
significance, the table, plots). It builds on the config layer and everything below it; only the console
scripts import it."""
