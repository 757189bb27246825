"""The training layer: the LightningModule (loss, Adam and the schedule, validation BLEU), the effective
batch, checkpoints and their loading, loggers, the DDP helpers, and the callbacks of a run
(:mod:`.callbacks`). It builds on :mod:`aiayn.model`, :mod:`aiayn.data` and the scoring leaf."""
