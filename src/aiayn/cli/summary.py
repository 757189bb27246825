"""``aiayn-summary <overrides>``: parameter counts by component and training FLOPs per token."""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from aiayn.cli.common import reported_as_usage_errors, reported_hydra_errors
from aiayn.cli.help import exit_with_help_if_asked
from aiayn.config.compose import config_dir
from aiayn.config.settings import check_settings


def summarize(cfg: DictConfig) -> dict[str, Any]:
    """The model's parameters (total and by component), its training FLOPs per token and its settings.
    The model is built on the meta device: its shapes are counted, no memory is allocated for them."""
    # torch and the model layer are imported here, by the work that needs them: --help starts at once.
    import torch

    from aiayn.config.build import transformer_config
    from aiayn.model import Transformer, parameters_by_component, training_flops_per_token

    model_cfg = transformer_config(cfg)
    with torch.device("meta"):
        model = Transformer(model_cfg)
    by_component = parameters_by_component(model)
    return {
        "params": sum(by_component.values()),
        "params_by_component": by_component,
        "train_flops_per_token": training_flops_per_token(model_cfg, cfg.seq_len),
        "seq_len": cfg.seq_len,
        "model": model_cfg.to_dict(),
    }


def with_override(argv: list[str], override: str) -> list[str]:
    """``argv`` with ``override`` after its own overrides, which Hydra's parser wants together (flags such
    as ``--cfg job`` may come before or after them)."""
    from hydra._internal.utils import get_args_parser  # Hydra's own reading of its command line

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # Hydra's own parse says it, once
            overrides = get_args_parser().parse_args(argv[1:]).overrides
    except SystemExit:  # a command line Hydra refuses: it says why, with the override or without
        return [*argv, override]
    flags = list(argv[1:])
    for item in overrides:
        flags.remove(item)
    return [argv[0], *flags, *overrides, override]


def main() -> None:
    """The console script: :func:`run`, with Hydra's own errors (an unknown key) reported in one line.

    A summary leaves nothing where it runs: ``-m``'s sweep folder (Hydra writes ``multirun.yaml`` and a
    folder per job into it) is a temporary one, removed at the end."""
    exit_with_help_if_asked("aiayn-summary", "summary", multirun=True)
    argv = sys.argv
    # Composing merges this config's hydra.run.dir over train's, and OmegaConf resolves train's on the way:
    # with an earlier run's Hydra state left in this process (a notebook, a test), its resolver would
    # reserve a run folder here. Without that state it cannot resolve, as in a fresh process.
    HydraConfig.instance().cfg = None
    with tempfile.TemporaryDirectory(prefix="aiayn-summary-") as scratch:
        sys.argv = with_override(argv, f"hydra.sweep.dir={scratch}")
        try:
            with reported_hydra_errors("aiayn-summary"):
                run()
        finally:
            sys.argv = argv


@hydra.main(config_path=config_dir(), config_name="summary", version_base="1.3")
def run(cfg: DictConfig) -> None:
    with reported_as_usage_errors("aiayn-summary"):
        check_settings(cfg, "summary", HydraConfig.get().overrides.task)
        summary = summarize(cfg)
    print(f"parameters: {summary['params']:,}")
    for name, count in summary["params_by_component"].items():
        print(f"  {name:<12} {count:>14,}")
    print(f"training FLOPs per token (src+tgt, length {cfg.seq_len}): {summary['train_flops_per_token']:.4g}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
