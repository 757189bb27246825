"""``aiayn-translate``: translate lines from stdin (or a file) to stdout (or a file); see conf/translate.yaml."""

from __future__ import annotations

import sys
from contextlib import ExitStack

import hydra
from omegaconf import DictConfig

from aiayn.cli.common import reported_as_usage_errors, reported_hydra_errors, required_checkpoint, resolve_device
from aiayn.config.build import decoding_options
from aiayn.config.compose import config_dir
from aiayn.errors import ConfigError, whole
from aiayn.evaluation.translator import Translator


def main() -> None:
    """The console script: :func:`run`, with Hydra's own errors (an unknown key) reported in one line."""
    with reported_hydra_errors("aiayn-translate"):
        run()


@hydra.main(config_path=config_dir(), config_name="translate", version_base="1.3")
def run(cfg: DictConfig) -> None:
    with reported_as_usage_errors("aiayn-translate"), ExitStack() as files:
        if not whole(cfg.buffer_lines, 1):
            raise ConfigError("buffer_lines", cfg.buffer_lines, "must be >= 1")
        translator = Translator.from_checkpoint(
            required_checkpoint(cfg.checkpoint),
            resolve_device(cfg.device),
            decoding=decoding_options(cfg.decoding),
            max_tokens=cfg.max_tokens,
        )
        if cfg.input:
            # newline="\n": a stray carriage return inside a line must not split it (stdin agrees)
            source = files.enter_context(open(cfg.input, encoding="utf-8", newline="\n"))
        else:
            sys.stdin.reconfigure(encoding="utf-8")
            source = sys.stdin
        if cfg.output:
            target = files.enter_context(open(cfg.output, "w", encoding="utf-8"))
        else:
            sys.stdout.reconfigure(encoding="utf-8")
            target = sys.stdout
        lines = (line.rstrip("\r\n") for line in source)
        for translations in translator.translate_blocks(lines, block=cfg.buffer_lines):
            target.write("".join(line + "\n" for line in translations))
            target.flush()  # a reader at the other end of a pipe gets each block at once


if __name__ == "__main__":
    main()
