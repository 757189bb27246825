"""``aiayn-eval``: a checkpoint (or an ensemble) + a data split → hypotheses and their scores (with
``nbest=``, the n best of each line too); with ``compare=``, also a second system (another checkpoint or
ensemble, or a file of hypotheses) on the same references, and whether the two differ significantly
(sacreBLEU's paired bootstrap); with ``tune.<decoding key>=[...]``, every combination of decoding settings
scored on the validation split instead. See conf/eval.yaml; the work is
:func:`aiayn.evaluation.evaluate.evaluate`'s and :func:`aiayn.evaluation.tuning.tune`'s."""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from aiayn.cli.common import reported_as_usage_errors, reported_hydra_errors, required_checkpoints, resolve_device
from aiayn.cli.help import exit_with_help_if_asked
from aiayn.config.compose import config_dir
from aiayn.config.settings import check_settings
from aiayn.errors import ConfigError, whole


def checked_settings(cfg: DictConfig) -> None:
    """The settings that name files and texts are strings, ``nbest`` and ``seed`` whole numbers, before any
    model is loaded."""
    for key in ("split", "source", "reference", "output_dir", "data.root", "data.hub"):
        value = OmegaConf.select(cfg, key)
        if value is not None and not (isinstance(value, str) and value.strip()):
            allowed = "must be train, val or test" if key == "split" else "must be a path or a name (or null)"
            raise ConfigError(key, value, allowed)
    if not whole(cfg.nbest, 1):
        raise ConfigError("nbest", cfg.nbest, "must be a whole number >= 1")
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int):
        raise ConfigError("seed", cfg.seed, "must be a whole number")


def plain(value: object) -> object:
    """A config value as plain Python (a list, a dict), as the evaluation reads it."""
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


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
    from aiayn.evaluation.tuning import TUNE_SPLIT, tune, tune_lines, tuning_grid
    from aiayn.model import sdpa_backends

    with reported_as_usage_errors("aiayn-eval"):
        check_settings(cfg, "eval", HydraConfig.get().overrides.task)
        checkpoints = required_checkpoints(cfg.checkpoint)
        checked_settings(cfg)
        decoding = decoding_options(cfg.decoding)
        grid = tuning_grid(plain(cfg.tune), decoding)
        if grid is not None and (cfg.compare is not None or cfg.nbest != 1):
            key = "compare" if cfg.compare is not None else "nbest"
            allowed = "is for one setting; tune= scores each setting's 1-best: evaluate the best one with it after"
            raise ConfigError(key, plain(cfg[key]), allowed)
        compare = compared_system(plain(cfg.compare))
        texts = Texts(
            split=cfg.split or (TUNE_SPLIT if grid else "test"),
            source=Path(cfg.source) if cfg.source else None,
            reference=Path(cfg.reference) if cfg.reference else None,
            data_root=cfg.data.root,
            data_hub=cfg.data.hub,
        )
        device, output_dir = resolve_device(cfg.device), Path(cfg.output_dir) if cfg.output_dir else None
        common = {
            "backend": cfg.backend,
            "compute_type": cfg.compute_type,
            "max_tokens": cfg.max_tokens,
            "sdpa_backends": sdpa_backends(plain(cfg.sdpa_backends)),
        }
        if grid is not None:
            tuning = tune(checkpoints, texts, grid, device, **common, seed=cfg.seed, output_dir=output_dir)
            print("\n".join(tune_lines(tuning)))
            return
        evaluation = evaluate(
            checkpoints,
            texts,
            decoding,
            device,
            **common,
            tokenized_bleu=cfg.tokenized_bleu,
            compare=compare,
            output_dir=output_dir,
            nbest=cfg.nbest,
            seed=cfg.seed,
        )
        print("\n".join(summary_lines(evaluation)))


if __name__ == "__main__":
    main()
