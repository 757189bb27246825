"""aiayn from Python (a notebook, a script): :func:`load` a checkpoint to translate, score and list the n
best; :func:`train` a run as ``aiayn-train`` would; :func:`runs`, the rows ``aiayn-report`` would show.
``import aiayn`` makes these ``aiayn.load``, ``aiayn.train`` and ``aiayn.runs``.

Quiet by default, as a notebook wants: no Lightning tips or progress bars (``progress=quiet``; give
``progress=rich`` to see them). Mistakes are raised, not printed: a :class:`~aiayn.errors.ConfigError`
names the setting, as the console scripts' one line does."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiayn.cli.common import quiet_libraries, remove_unstarted_run
from aiayn.config.tool_plans import tool_keys
from aiayn.model import PAPER_DECODING, DecodingOptions


@dataclass
class LoadedModel:
    """A checkpoint's model ready to translate (or an ensemble's, or an exported CTranslate2 folder's),
    decoded as its settings say (:class:`~aiayn.evaluation.settings.DecodeSettings`)."""

    translator: Any  # aiayn.evaluation.translator.Translator
    run_config: dict[str, Any]  # the run's stored config (its corpus, direction, model)
    checkpoints: list[Path]

    def translate(self, lines: str | Sequence[str]) -> str | list[str]:
        """The best translation of a line, or of each of ``lines`` in order."""
        if isinstance(lines, str):
            return self.translator.translate([lines])[0]
        return self.translator.translate(list(lines))

    def nbest(self, lines: Sequence[str], n: int) -> list[list[Any]]:
        """The ``n`` best translations of each line (best first; with ``decoding.sample``, ``n`` draws):
        :class:`~aiayn.evaluation.translator.Candidate`\\ s with their text, score and log-probability."""
        with tool_keys():
            searched = self.translator.varied(nbest=n)
        return searched.candidates(list(lines))

    def score(self, lines: Sequence[str], references: Sequence[str], tokenized: bool = False) -> dict[str, Any]:
        """Translate ``lines`` and score the translations against ``references`` (one each): sacreBLEU and
        chrF with their signatures, and with ``tokenized`` the paper's tokenized BLEU too."""
        from aiayn.evaluation.translator import direction
        from aiayn.scoring import corpus_scores

        if len(lines) != len(references):
            raise ValueError(f"{len(lines)} lines but {len(references)} references: give one reference per line")
        target = (direction(self.run_config, self.checkpoints[0]) or (None, None))[1]
        return corpus_scores(self.translate(list(lines)), list(references), target if tokenized else None)


def load(
    checkpoint: str | Path | Sequence[str | Path],
    *,
    device: str = "auto",
    decoding: DecodingOptions | dict[str, Any] = PAPER_DECODING,
    backend: str = "auto",
    compute_type: str = "default",
    max_tokens: int = 8192,
    seed: int = 0,
) -> LoadedModel:
    """The model of ``checkpoint`` (a ``.ckpt`` of aiayn-train or aiayn-average, an exported CTranslate2
    folder, or a list of checkpoints: an ensemble), decoded with ``decoding`` (the paper's beam search by
    default; a dict of :class:`~aiayn.model.DecodingOptions` fields too) on ``device``. Loading runs no
    code from the file (a checkpoint is read as data only)."""
    from aiayn.evaluation.settings import DecodeSettings

    quiet_libraries()
    paths = [checkpoint] if isinstance(checkpoint, str | Path) else list(checkpoint)
    with tool_keys():
        options = decoding if isinstance(decoding, DecodingOptions) else DecodingOptions(**decoding)
        settings = DecodeSettings(
            tuple(Path(path).expanduser() for path in paths), options, backend, compute_type, device, max_tokens,
            seed=seed,
        )  # fmt: skip
        translator, run_config = settings.loaded()
    return LoadedModel(translator, run_config, list(settings.checkpoint))


def train(overrides: Sequence[str] = (), run_dir: str | Path | None = None) -> dict[str, Any]:
    """Train the run that ``aiayn-train <overrides>`` would (``["model=tiny", "trainer.max_steps=100"]``),
    quietly, in ``run_dir`` (default: the folder aiayn-train would choose, ``outputs/<name>/<time>``), and
    return its results (``results.json``'s fields). A run refused before its first step leaves no folder
    it made; an existing ``run_dir`` with a last checkpoint is continued, as aiayn-train continues it."""
    from aiayn.config.compose import compose_run_config, composed_run_dir
    from aiayn.experiments.run import train as train_run

    quiet_libraries()
    overrides = ["progress=quiet", *overrides]
    created = run_dir is None
    folder = composed_run_dir(overrides) if run_dir is None else Path(run_dir).expanduser()
    try:
        return train_run(compose_run_config(overrides), folder, overrides)
    except BaseException:
        if created:
            remove_unstarted_run(folder)
        raise


def runs(*folders: str | Path, data_root: str | Path | None = None) -> list[dict[str, Any]]:
    """The rows ``aiayn-report`` would show for the runs under ``folders`` (run folders, sweep folders, or
    folders holding them), as numbers: a dict per setting (its values, mean, std and n of each score over
    seeds, the p-value of its test BLEU against the first row's where ``data_root`` gives the test
    references, the paper's row); nothing is written."""
    from aiayn.experiments.report.runs import find_runs
    from aiayn.experiments.report.settings import group_settings
    from aiayn.experiments.report.significance import RunTexts, significance
    from aiayn.experiments.report.table import table_of

    paths = [Path(folder).expanduser() for folder in folders]
    found = find_runs(paths)
    if not found.runs:
        raise ValueError(f"no finished run (a folder with results.json) under {', '.join(map(str, paths))}")
    settings = group_settings(found.runs)
    root = Path(data_root).expanduser() if data_root is not None else None
    return list(table_of(settings, significance(settings, RunTexts(root))).records)
