"""``aiayn-export``: a checkpoint → a Hugging Face ``MarianMTModel`` folder or a CTranslate2 model; see
conf/export.yaml. A model variant the target cannot represent stops it in one line naming the setting
(exit status 2), before anything is written."""

from __future__ import annotations

from dataclasses import asdict

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from aiayn.cli.common import reported_as_usage_errors, reported_hydra_errors
from aiayn.cli.help import exit_with_help_if_asked
from aiayn.config.compose import config_dir


def main() -> None:
    """The console script: :func:`run`, with Hydra's own errors (an unknown key) reported in one line."""
    exit_with_help_if_asked("aiayn-export", "export")
    with reported_hydra_errors("aiayn-export"):
        run()


@hydra.main(config_path=config_dir(), config_name="export", version_base="1.3")
def run(cfg: DictConfig) -> None:
    # torch: imported by the work, --help starts at once
    from aiayn.config.tool_plans import plan_export, tool_keys
    from aiayn.experiments.results import checkpoint_scores
    from aiayn.export.checkpoint import export_checkpoint

    with reported_as_usage_errors("aiayn-export"), tool_keys():
        settings = plan_export(cfg, HydraConfig.get().overrides.task)
        scores = checkpoint_scores(settings.checkpoint)
        pushed = export_checkpoint(settings, asdict(scores) if scores else None)
    what = "MarianMTModel" if settings.format == "hf" else f"CTranslate2 ({settings.quantization})"
    print(f"exported {settings.checkpoint} as {what} to {settings.output}")
    if pushed:
        print(f"pushed to {settings.push_to}: {pushed}")


if __name__ == "__main__":
    main()
