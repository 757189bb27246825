"""The run's loggers: CSV always, plus the dashboard the ``logger`` config group picks (W&B by default),
one module per concern:

- :mod:`.wandb_identity`: which W&B run a run folder logs to and how (credentials, the mode, the run id
  bound to the folder); no Lightning, so that ``aiayn-report`` picks its W&B mode with it too;
- :mod:`.wandb_logger`: Lightning's W&B logger that logs every part of a run folder to that one run;
- :mod:`.csv_logger`: ``metrics.csv``, continued (not restarted) by a resumed run;
- :mod:`.tensorboard_logger`: one TensorBoard event file per run;
- :mod:`.finish`: ending them when the run ends, whether it failed or not.

A run folder may come from elsewhere (a copy, a colleague's folder, one moved): what the loggers read
back from it is untrusted. A file that is not what aiayn writes there (garbage, a link, a folder) is never
followed, and the loggers never write through a link (:func:`aiayn.files.refuse_linked_paths`).
What a run records about itself (its config, code, hardware) is :mod:`aiayn.experiments.run_info`'s.
"""
