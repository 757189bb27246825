"""``aiayn-eval``: a checkpoint + a data split → hypotheses and their scores; with ``compare=``, also a
second system (another checkpoint, or a file of hypotheses) on the same references, and whether the two
differ significantly (sacreBLEU's paired bootstrap). See conf/eval.yaml; the work is
:func:`aiayn.evaluation.evaluate.evaluate`'s."""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from aiayn.cli.common import reported_as_usage_errors, reported_hydra_errors, required_checkpoint, resolve_device
from aiayn.cli.help import exit_with_help_if_asked
from aiayn.config.compose import config_dir
from aiayn.config.settings import check_settings
from aiayn.errors import ConfigError


def checked_settings(cfg: DictConfig) -> None:
    """The settings that name files and texts are strings, before any model is loaded."""
    for key in ("split", "source", "reference", "output_dir", "data.root", "data.hub"):
        value = OmegaConf.select(cfg, key)
        if value is not None and not (isinstance(value, str) and value.strip()):
            allowed = "must be train, val or test" if key == "split" else "must be a path or a name (or null)"
            raise ConfigError(key, value, allowed)


def main() -> None:
    """The console script: :func:`run`, with Hydra's own errors (an unknown key) reported in one line."""
    exit_with_help_if_asked("aiayn-eval", "eval")
    with reported_hydra_errors("aiayn-eval"):
        run()


@hydra.main(config_path=config_dir(), config_name="eval", version_base="1.3")
def run(cfg: DictConfig) -> None:
    # torch and the model are imported by the work that needs them: --help starts at once.
    from aiayn.config.build import decoding_options
    from aiayn.evaluation.evaluate import Texts, compared_system, evaluate, summary_lines

    with reported_as_usage_errors("aiayn-eval"):
        check_settings(cfg, "eval", HydraConfig.get().overrides.task)
        checkpoint = required_checkpoint(cfg.checkpoint)
        checked_settings(cfg)
        compare = compared_system(cfg.compare)
        texts = Texts(
            split=cfg.split,
            source=Path(cfg.source) if cfg.source else None,
            reference=Path(cfg.reference) if cfg.reference else None,
            data_root=cfg.data.root,
            data_hub=cfg.data.hub,
        )
        evaluation = evaluate(
            checkpoint,
            texts,
            decoding_options(cfg.decoding),
            resolve_device(cfg.device),
            backend=cfg.backend,
            compute_type=cfg.compute_type,
            max_tokens=cfg.max_tokens,
            tokenized_bleu=cfg.tokenized_bleu,
            compare=compare,
            output_dir=Path(cfg.output_dir) if cfg.output_dir else None,
        )
        print("\n".join(summary_lines(evaluation)))


if __name__ == "__main__":
    main()
