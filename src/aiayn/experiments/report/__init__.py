"""A Table-3-style report of finished runs: one row per setting (the runs that differ only in their seed),
with the paper's numbers beside ours where the setting is one of its rows, whether each setting's test BLEU
differs significantly from the first row's (sacreBLEU's paired bootstrap on the seeds' test translations),
and plots of BLEU and perplexity against what the settings vary (heads, d_k, positional encoding, model
size).

Run folders are shared and copied, so what they hold is read as untrusted data:

- a setting is keyed by its overrides and by what else defines a run (:class:`Conditions`: the corpus and
  its fingerprint, the direction, the precision, the checkpoint validated, the run's answer (the checkpoint
  its test BLEU and test translations are of), the number of test sentences): runs that differ in any of
  these are never averaged together;
- every field the report reads from a ``results.json``, ``config.yaml``, ``.hydra/hydra.yaml`` or
  ``sweep.json`` is checked (type and range) and only plain files are read, never through a link; a file
  that fails is skipped with one warning line naming it and the field, or refused (:class:`DataError`)
  where the user named its run or sweep folder, or the file, directly;
- folders are walked without following links, and a run's stored ``data`` section is only read for the
  test references from the folder the user gives (``data_root``): never a stored folder, download or
  Hugging Face Hub dataset;
- nothing is written but ``report.md``, its table as ``report.csv``, ``report.json`` and ``report.tex``,
  and the plots, atomically, into the output folder.

The modules, in the order a report is made: :mod:`.records` (reading untrusted files and checking their
fields), :mod:`.runs` (finding and reading runs, and the sweeps' unfinished trials), :mod:`.settings`
(runs grouped by setting), :mod:`.significance` (paired bootstrap), :mod:`.table` (the table as rows,
rendered to Markdown), :mod:`.exports` (the table as CSV, JSON and LaTeX), :mod:`.plots` and
:mod:`.document` (``report.md`` itself).
"""
