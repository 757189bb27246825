"""The Lightning callbacks of a training run, one concern per module: the checkpoints it writes
(:mod:`.checkpointing`), what each checkpoint carries beyond Lightning's state (:mod:`.run_state`),
speed (:mod:`.throughput`), non-finite steps (:mod:`.faults`), the EMA of the weights (:mod:`.ema`), a
scheduler's signals (:mod:`.preemption`), the dashboard's samples and attention maps (:mod:`.samples`), the console
(:mod:`.progress`), the steps at which the loggers get the step metrics (:mod:`.cadence`), and users'
callbacks from the other Lightning package (:mod:`.namespaces`)."""
