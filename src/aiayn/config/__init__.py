"""The configuration layer: composing Hydra configs (:mod:`.compose`), naming runs and their folders
(:mod:`.naming`, :mod:`.run_folder`), checking what spans a config's parts before any work
(:mod:`.preflight`), and planning a run (:mod:`.plan`): the typed settings of every part, built and
checked once, from the pieces :mod:`.build` makes. It knows every layer below (model, data, training,
export, evaluation); the experiments and the console scripts above use it."""
