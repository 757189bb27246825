"""``aiayn-export``: a checkpoint → a Hugging Face ``MarianMTModel`` folder or a CTranslate2 model; see
conf/export.yaml. A model variant the target cannot represent stops it in one line naming the setting
(exit status 2), before anything is written."""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from aiayn.cli.common import reported_as_usage_errors, reported_hydra_errors, required_checkpoint
from aiayn.cli.help import exit_with_help_if_asked
from aiayn.config.compose import config_dir
from aiayn.config.settings import check_settings
from aiayn.errors import ConfigError


def main() -> None:
    """The console script: :func:`run`, with Hydra's own errors (an unknown key) reported in one line."""
    exit_with_help_if_asked("aiayn-export", "export")
    with reported_hydra_errors("aiayn-export"):
        run()


@hydra.main(config_path=config_dir(), config_name="export", version_base="1.3")
def run(cfg: DictConfig) -> None:
    from aiayn.export.checkpoint import export_checkpoint  # torch: imported by the work, --help starts at once

    with reported_as_usage_errors("aiayn-export"):
        check_settings(cfg, "export", HydraConfig.get().overrides.task)
        checkpoint = required_checkpoint(cfg.checkpoint)
        if not cfg.output or not isinstance(cfg.output, str):
            raise ConfigError("output", cfg.output, "must be the path of a new folder to write the model to")
        output = Path(cfg.output).expanduser()
        export_checkpoint(checkpoint, cfg.format, output, cfg.quantization)
    what = "MarianMTModel" if cfg.format == "hf" else f"CTranslate2 ({cfg.quantization})"
    print(f"exported {checkpoint} as {what} to {output}")


if __name__ == "__main__":
    main()
