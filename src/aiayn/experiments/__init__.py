"""The experiments layer: one training run from a composed config to ``results.json`` (:mod:`.run`),
sweeps of runs without a W&B server (:mod:`.sweep`), the paper's Table 3 (:mod:`.table3`) and the
Table-3-style report of finished runs (:mod:`.report`). It builds on the config layer and everything
below it; only the console scripts import it."""
