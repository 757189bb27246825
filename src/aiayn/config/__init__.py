"""The configuration layer: composing Hydra configs (:mod:`.compose`), naming runs and their folders
(:mod:`.naming`), checking a whole config before any work (:mod:`.preflight`) and building a run's
pieces from it (:mod:`.build`). It knows every layer below (model, data, training, evaluation); the
experiments and the console scripts above use it."""
