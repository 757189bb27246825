"""W&B sweep files run without a W&B server: the trials are proposed by W&B's own sweep engine (the
``sweeps`` package that the W&B server runs: grid, random and bayes behave as there), their commands are
built by the W&B agent's own code from the file's ``command``, and each trial is one process.

A sweep's folder (``outputs/sweeps/<name>`` by default) holds ``sweep.json`` (the sweep file's config and
every trial: parameters, state, exit code, metric), ``logs/<trial>.log`` (each trial's output) and the
trials' run folders, ``<folder>/<their swept overrides>`` (handed to each trial as ``$AIAYN_RUN_DIR``,
which conf/train.yaml's run folder follows; ``$AIAYN_SWEEP_DIR`` groups the W&B runs). Run again, a sweep
skips its finished trials, runs failed and interrupted ones again (they continue from their last
checkpoint) and proposes new ones until it has its count.

Each trial runs in a process group of its own, so that a terminal's Ctrl-C reaches the runner alone: at
SIGINT or SIGTERM the runner sends its trials SIGTERM (they save ``checkpoints/last.ckpt`` and exit),
records them as interrupted and raises :class:`.runner.SweepStopped`. A runner killed outright leaves its trials
running; run again, it starts no trial twice: a trial whose run folder a living process still holds
(:func:`aiayn.files.run_folder_holder`) is waited for, and its ``results.json`` taken or the trial continued.

On a machine with GPUs each running trial gets GPUs of its own (:mod:`.placement`),
recorded as the trial's ``devices``. ``launcher`` ``slurm`` (or ``submitit-local``) submits each trial as a
job instead (:mod:`.launchers`): the runner records its job id and state, a stopping
runner leaves the jobs running, and a runner started again re-attaches to them.

The sweep's metric (``metric.name``) is a key the trials log to their history (``val/bleu``), where W&B's
bayes search and early termination read it; a trial's value is the last one its ``csv/metrics.csv`` holds,
the value W&B's run summary shows: the validation of the checkpoint the run scores.

The modules, from the bottom up: :mod:`.state` (``sweep.json`` and the trials it records: the file's one
owner), :mod:`.file` (the sweep file, its proposals and each trial's command), :mod:`.placement` (GPUs per
trial), :mod:`.launchers` (processes and submitted jobs), :mod:`.trial` (one trial's life) and
:mod:`.runner` (the loop, the lock and the signals).
"""
