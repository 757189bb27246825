"""``aiayn-translate``: translate lines from stdin (or a file) to stdout (or a file); see conf/translate.yaml.

What is written:

- to stdout, each block of ``buffer_lines`` translations as soon as it is done (a pipe's reader does not
  wait for the end);
- to ``output=<file>``, everything at the end, through a temporary file beside it that is renamed over
  it: a translation that fails or is killed leaves the old file as it was;
- a line that is not UTF-8 ends the input: the lines before it are translated and written (to stdout,
  or as the new output file), then one error line names the line (``<file>:<line>``, ``<stdin>:<line>``)
  and the exit status is 2. Any other error (a line longer than the model reads) writes nothing more.

Every setting is checked before the model is loaded, and ``output`` may not be the input file (through
any path or link to it): opening it for writing would empty the input before it is read.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from typing import IO, TYPE_CHECKING

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from aiayn.cli.common import reported_as_usage_errors, reported_hydra_errors
from aiayn.cli.help import exit_with_help_if_asked
from aiayn.config.compose import config_dir
from aiayn.errors import DataError
from aiayn.files import atomic_write, bounded_lines, open_plain

if TYPE_CHECKING:
    from aiayn.evaluation.settings import TranslateSettings
    from aiayn.evaluation.translator import Candidate


def main() -> None:
    """The console script: :func:`run`, with Hydra's own errors (an unknown key) reported in one line."""
    exit_with_help_if_asked("aiayn-translate", "translate")
    with reported_hydra_errors("aiayn-translate"):
        run()


@hydra.main(config_path=config_dir(), config_name="translate", version_base="1.3")
def run(cfg: DictConfig) -> None:
    # torch and the model are imported by the work that needs them: --help starts at once.
    from aiayn.config.tool_plans import plan_translate, tool_keys

    with reported_as_usage_errors("aiayn-translate"), tool_keys():
        translate(plan_translate(cfg, HydraConfig.get().overrides.task))


def translate(settings: TranslateSettings) -> None:
    """Translate ``settings.input`` (or stdin) to ``settings.output`` (or stdout), as the module says."""

    decode, source, target = settings.decode, settings.input, settings.output
    with ExitStack() as files:
        # Opened before the model is loaded: a FIFO or a device there is refused at once.
        stream = files.enter_context(open_plain(source, follow_links=True)) if source else sys.stdin.buffer
        translator, _ = decode.loaded()
        lines = Utf8Lines(stream, str(source) if source else "<stdin>")
        blocks = written(
            translator.translate_blocks(lines, block=settings.buffer_lines), decode.nbest, translator.ensemble
        )
        if target is None:
            sys.stdout.reconfigure(encoding="utf-8")
            for text in blocks:
                sys.stdout.write(text)
                sys.stdout.flush()  # a reader at the other end of a pipe gets each block at once
        else:
            atomic_write(target, lambda out: write_all(blocks, out))
    if lines.error is not None:
        raise lines.error


class Utf8Lines:
    """The lines of a binary stream as text, without their line ends; split at line feeds only, so that
    a stray carriage return inside a line does not split it (a file as stdin). Iteration stops at the
    first line that is not UTF-8, and :attr:`error` names it: the lines before it are still translated.
    A line longer than :data:`~aiayn.files.LINE_BYTES` is a :class:`DataError` once that much of it is
    read (:func:`~aiayn.files.bounded_lines`)."""

    def __init__(self, stream: IO[bytes], name: str) -> None:
        self.stream, self.name = stream, name
        self.error: DataError | None = None

    def __iter__(self) -> Iterator[str]:
        for number, raw in enumerate(bounded_lines(self.stream, self.name), start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                self.error = DataError(
                    f"{self.name}:{number}: invalid UTF-8 ({err.reason} at byte {err.start}); "
                    f"the {number - 1} line(s) before it were translated"
                )
                return
            yield line.rstrip("\r")


def written(blocks: Iterable[list[list[Candidate]]], nbest: int, ensemble: str | None = None) -> Iterator[str]:
    """The text of each block: a translation per line, or with ``nbest`` > 1 a JSON object per
    translation (``{"line", "rank", "text", "score", "log_prob"}``, an ensemble's with how its members
    combined; ``line`` counts from 0 in the input, ``rank`` from 1; an empty line has none), in input
    order."""
    from aiayn.evaluation.translator import nbest_jsonl  # the format aiayn-eval nbest= writes too

    first = 0
    for block in blocks:
        if nbest == 1:
            yield "".join((found[0].text if found else "") + "\n" for found in block)
        else:
            yield nbest_jsonl(block, first, ensemble)
        first += len(block)


def write_all(blocks: Iterable[str], out: IO[bytes]) -> None:
    for text in blocks:
        out.write(text.encode("utf-8"))


if __name__ == "__main__":
    main()
