"""``aiayn-eval``: a checkpoint (or an ensemble) + a data split → hypotheses and their scores (with
``nbest=``, the n best of each line too); with ``compare=``, also a second system (another checkpoint or
ensemble, or a file of hypotheses) on the same references, and whether the two differ significantly
(sacreBLEU's paired bootstrap); with ``tune.<decoding key>=[...]``, every combination of decoding settings
scored on the validation split instead. See conf/eval.yaml; the work is
:func:`aiayn.evaluation.evaluate.evaluate`'s and :func:`aiayn.evaluation.tuning.tune`'s."""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from aiayn.cli.common import reported_as_usage_errors, reported_hydra_errors
from aiayn.cli.help import exit_with_help_if_asked
from aiayn.config.compose import config_dir


def main() -> None:
    """The console script: :func:`run`, with Hydra's own errors (an unknown key) reported in one line."""
    exit_with_help_if_asked("aiayn-eval", "eval")
    with reported_hydra_errors("aiayn-eval"):
        run()


@hydra.main(config_path=config_dir(), config_name="eval", version_base="1.3")
def run(cfg: DictConfig) -> None:
    # torch and the model are imported by the work that needs them: --help starts at once.
    from aiayn.config.tool_plans import plan_eval, tool_keys
    from aiayn.evaluation.evaluate import evaluate, summary_lines
    from aiayn.evaluation.tuning import tune, tune_lines

    with reported_as_usage_errors("aiayn-eval"), tool_keys():
        settings = plan_eval(cfg, HydraConfig.get().overrides.task)
        print("\n".join(tune_lines(tune(settings)) if settings.tune else summary_lines(evaluate(settings))))


if __name__ == "__main__":
    main()
