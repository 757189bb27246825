"""W&B's logger for a run (``logger=wandb``, the default): Lightning's, in the mode and for the W&B run
that :mod:`.wandb_identity` picks, at W&B steps that are the trainer's global steps, so that the parts of
a run folder continue one history, online and after ``wandb sync`` of offline parts."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pytorch_lightning.loggers import WandbLogger
from pytorch_lightning.loggers.logger import rank_zero_experiment
from pytorch_lightning.utilities.rank_zero import rank_zero_only

from aiayn.errors import FieldError
from aiayn.files import WANDB_FOLDERS, refuse_linked_paths
from aiayn.training.loggers.wandb_identity import (
    RUN_ID_FILE,
    bind_run_id,
    bound_run_id,
    folder_run_id,
    in_wandb_sweep,
    shut_down_wandb,
    unsynced_parts,
    wandb_mode,
)

log = logging.getLogger(__name__)


ARTIFACTS = ("none", "answer", "all")  # logger.wandb.artifacts: which checkpoints a finished run logs


def quiet_unless_asked() -> dict[str, bool]:
    """W&B's console output without its end-of-run history and summary (the run's own log and
    results.json say the same, and the run says how to sync it), unless ``WANDB_QUIET`` decides."""
    return {} if "WANDB_QUIET" in os.environ else {"quiet": True}


class WandbRunLogger(WandbLogger):
    """Lightning's W&B logger that picks its mode (:func:`wandb_mode`), falls back to offline when an
    online run cannot start (no network, a rejected key) and to no W&B at all when no run can start,
    and finishes its run explicitly (:meth:`finish`).

    All parts of the run in ``save_dir`` log to one W&B run: its id (:func:`folder_run_id`) is written
    to ``save_dir``'s :data:`RUN_ID_FILE`, bound to the folder, before the first part starts it, and every
    part passes it with ``resume="allow"`` (an offline part records that it resumes, so ``wandb sync``
    appends it); a copy of the folder starts a W&B run of its own. A ``wandb`` (or ``.wandb``) that is a
    link or not a folder is refused: W&B would write through it, outside the run folder. Metrics
    are logged at W&B step = the trainer's global step (:meth:`log_metrics`), so that the parts' steps
    continue one another instead of each starting at 0."""

    def __init__(
        self,
        save_dir: str,
        project: str = "aiayn",
        entity: str | None = None,
        mode: str = "auto",
        name: str | None = None,
        group: str | None = None,
        tags: Sequence[str] = (),
        job_type: str = "train",
        init_timeout: float = 90.0,
        artifacts: str = "none",
    ) -> None:
        import wandb

        if artifacts not in ARTIFACTS:
            raise FieldError("artifacts", artifacts, "must be none, answer (the run's answer checkpoint) or all")
        self.artifacts = artifacts

        # Ranks other than 0 never start a run (Lightning hands them a dummy), nor W&B's service, nor
        # read or write the run id.
        resolved, reason = wandb_mode(mode) if rank_zero_only.rank == 0 else ("disabled", "not rank 0")
        self.run_dir = Path(save_dir)
        if resolved != "disabled":
            for folder in WANDB_FOLDERS:
                refuse_linked_paths(self.run_dir, self.run_dir / folder)
        self.run_id = folder_run_id(self.run_dir) if resolved != "disabled" else None
        self.run_id_file = self.run_dir / RUN_ID_FILE
        if rank_zero_only.rank == 0:
            log.info("W&B logs %s (%s)%s", resolved, reason, f" to run {self.run_id}" if self.run_id else "")
        super().__init__(
            name=name,
            save_dir=save_dir,
            project=project,
            entity=entity,
            group=group,
            tags=list(tags),
            job_type=job_type,
            mode=resolved,
            log_model=False,
            settings=wandb.Settings(init_timeout=init_timeout, **quiet_unless_asked()),
            # Lightning adds resume="allow". In a sweep W&B uses the agent's id, and warns about any other.
            id=None if in_wandb_sweep() else self.run_id,
        )
        # Lightning passes anonymous=None, which W&B answers with a warning a user cannot act on.
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)
        self._said_replayed = False  # whether log_metrics said that it skips steps the W&B run holds

    @property
    def mode(self) -> str:
        return self._wandb_init["mode"]

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._experiment is None and self.mode != "disabled":
            self._start()
        return super().experiment

    def _start(self) -> None:
        """Starts the W&B run, as offline when it cannot start online, with no W&B when it cannot start
        at all. The folder's run id is written before: a part killed while W&B starts keeps it."""
        import wandb

        if bound_run_id(self.run_dir)[0] != self.run_id:
            bind_run_id(self.run_dir, self.run_id)
        if self.mode == "online" and (waiting := unsynced_parts(self.run_id_file.parent, self.run_id)):
            log.warning(
                "%d offline parts of W&B run %s are not uploaded yet: upload them before this part logs online "
                "(wandb sync %s), or W&B puts them after it", len(waiting), self.run_id, self.run_id_file.parent,
            )  # fmt: skip
        while self._experiment is None and self.mode != "disabled":
            try:
                run = super().experiment
            except Exception as error:  # whatever W&B raises, the metrics must not die with the dashboard
                fallback = "offline" if self.mode == "online" else "disabled"
                why = " ".join(str(error).split())  # one line: W&B's messages can have several
                log.warning("W&B could not start an %s run (%s); logging %s instead", self.mode, why, fallback)
                self._wandb_init["mode"] = fallback  # with the same id: offline parts sync into the run
                if wandb.run is not None:
                    wandb.run.finish(exit_code=1)
                shut_down_wandb()  # its service keeps the failed run's id in use; a new one lets the fallback take it
                continue
            if run.id != self.run_id:
                log.warning(
                    "W&B logs this part to run %s (a sweep agent's), not to %s of %s", run.id, self.run_id,
                    self.run_id_file,
                )  # fmt: skip

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Logs ``metrics`` at W&B step ``step``, the trainer's global step (also ``trainer/global_step``,
        the charts' x-axis), not at W&B's own count of ``log`` calls, which starts at 0 in every part:
        two offline parts of one run would repeat their steps. The metrics of one step (training,
        validation, its media; the evaluations after training at the final step) make one history row,
        which holds one value per key: the test of the averaged checkpoint replaces the best one's there
        (the summary has both, from ``results.json``).

        An online part that continues a W&B run already holding steps from ``step`` on (an earlier
        part logged past its last checkpoint, or evaluated before it was killed) does not log them
        again: W&B keeps the first values (``metrics.csv`` has the new ones) and would refuse each with
        a warning."""
        if step is None:
            super().log_metrics(metrics)
            return
        run = self.experiment
        if step < run.starting_step:
            if not self._said_replayed:
                log.info("W&B run %s holds steps before %d already; it gets this part's from there", run.id,
                         run.starting_step)  # fmt: skip
                self._said_replayed = True
            return
        run.log({**metrics, "trainer/global_step": step}, step=step)

    def _log_checkpoints(self, run: Any, summary: dict[str, Any]) -> None:
        """The run's answer checkpoint (``answer``), or every checkpoint it kept with it (``all``), as a
        version of the W&B model artifact ``model-<run id>``: the parts of one run folder (resumes,
        requeues) log versions of one artifact, a lineage, each aliased with its step (and ``answer``)."""
        import wandb

        answer = Path(summary["answer_checkpoint"])
        answer = answer if answer.is_absolute() else self.run_dir / answer
        kept = sorted((self.run_dir / "checkpoints").glob("*.ckpt")) if self.artifacts == "all" else []
        files = [path for path in dict.fromkeys([answer, *kept]) if path.is_file() and not path.is_symlink()]
        if not files:
            log.warning("W&B: no checkpoint to log as an artifact (%s is not a file)", answer)
            return
        described = ("answer", "answer_test_bleu", "answer_test_chrf", "steps", "params", "sacrebleu_signature")
        artifact = wandb.Artifact(f"model-{run.id}", type="model", metadata={k: summary.get(k) for k in described})
        for path in files:
            artifact.add_file(str(path), name=path.name)
        run.log_artifact(artifact, aliases=["latest", "answer", f"step-{summary.get('steps')}"])

    @rank_zero_only
    def mark_preempting(self) -> None:
        """Tells W&B that the run stops to be continued (a scheduler's signal; it saved its last checkpoint):
        the run ends as preempted, not crashed, and under ``wandb agent`` W&B's sweep requeues the trial
        with its run id, whose folder (``<sweep>/<overrides>-<run id>``) it then continues."""
        if self._experiment is not None:
            self._experiment.mark_preempting()

    def finish(self, failed: bool, summary: dict[str, Any] | None = None) -> None:
        """Adds ``summary`` to the run's summary, logs the checkpoints ``artifacts`` asks for (a finished
        run's), ends the run (exit code 1 when ``failed``) and says where it is, or how to upload it. Only
        rank 0 ever starts a run; elsewhere this does nothing."""
        run = self._experiment
        if run is None:
            return
        self._experiment = None
        try:
            if summary:
                run.summary.update(summary)
            if summary and not failed and self.artifacts != "none":
                self._log_checkpoints(run, summary)
        finally:
            run.finish(exit_code=1 if failed else 0)
            # finish() can return before W&B's service has flushed the run's files; shutting the service
            # down waits for it, so a job killed right after (a SLURM time limit) loses nothing.
            shut_down_wandb()
        if self.mode == "offline":
            parts = Path(run.settings.sync_dir).parent
            if len(list(parts.glob(f"offline-run-*-{run.id}"))) > 1:  # one wandb sync uploads them in order
                log.info("W&B run saved offline; upload it with its earlier parts: wandb sync %s", parts)
            else:
                log.info("W&B run saved offline; upload it with: wandb sync %s", run.settings.sync_dir)
        elif self.mode == "online":
            log.info("W&B run: %s", run.url)
