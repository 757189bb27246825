"""``aiayn-translate`` never destroys what it is given or what it replaces, and says which line is wrong:
on the checkpoint of a real training run, the real console script where its process is what is tested
(a pipe, a kill, the status a shell sees), its ``main()`` in this process elsewhere."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from aiayn.cli import translate as translate_cli
from aiayn.data.corpus import read_lines
from aiayn.evaluation.translator import Translator, longest_piece
from helpers.runs import exit_status

pytestmark = pytest.mark.slow  # real runs of the console scripts, seconds each


def best_checkpoint(smoke_run_dir: Path) -> Path:
    """The best checkpoint of the shared ``debug=smoke`` run: its weights do not matter here."""
    return smoke_run_dir / "checkpoints" / "best.ckpt"


@pytest.fixture
def checkpoint(smoke_run_dir: Path) -> Path:
    return best_checkpoint(smoke_run_dir)


def translate(checkpoint: Path, *overrides: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    """The console script in its own process."""
    command = ["aiayn-translate", f"checkpoint={checkpoint}", "decoding=greedy", *overrides]
    return subprocess.run(command, input=stdin, capture_output=True, timeout=300)


def translated_here(checkpoint: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str) -> int:
    """``aiayn-translate`` in this process, reading and writing files: its exit status."""
    argv = ["aiayn-translate", f"checkpoint={checkpoint}", "decoding=greedy", *overrides]
    return exit_status(translate_cli.main, argv, monkeypatch)


@pytest.fixture
def translate_here(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> Callable[..., tuple[int, str]]:
    """``translate_here(*overrides)``: ``aiayn-translate`` in this process, its exit status and stderr."""

    def run(*overrides: str) -> tuple[int, str]:
        status = translated_here(checkpoint, monkeypatch, *overrides)
        return status, capsys.readouterr().err

    return run


def one_error_line(status: int, stderr: str) -> str:
    """The one line on stderr of a run that ended with status 2."""
    assert status == 2 and len(stderr.strip().splitlines()) == 1, stderr[-3000:]
    assert stderr.startswith("aiayn-translate: error: ")
    return stderr.strip()


def process_error_line(done: subprocess.CompletedProcess[bytes]) -> str:
    return one_error_line(done.returncode, done.stderr.decode())


SOURCE = ["A man is riding a bike.", "Two dogs play in the snow.", "A woman reads a book.", "Children run."]


@pytest.mark.parametrize("spelling", ["same", "dotted", "symlink", "hardlink"])
def test_an_output_that_is_the_input_is_refused_before_anything_is_written(
    translate_here: Callable[..., tuple[int, str]], tmp_path: Path, spelling: str
) -> None:
    source = tmp_path / "in.en"
    source.write_text("".join(line + "\n" for line in SOURCE))
    output = {"same": source, "dotted": tmp_path / "sub" / ".." / "in.en"}.get(spelling, tmp_path / "other.en")
    (tmp_path / "sub").mkdir()
    if spelling == "symlink":
        output.symlink_to(source)
    elif spelling == "hardlink":
        output.hardlink_to(source)
    message = one_error_line(*translate_here(f"input={source}", f"output={output}"))
    assert message.startswith(f"aiayn-translate: error: output={output} is the input file")
    assert source.read_text() == "".join(line + "\n" for line in SOURCE)


def test_a_failed_translation_leaves_the_old_output_as_it_was(
    translate_here: Callable[..., tuple[int, str]], tmp_path: Path
) -> None:
    source, output = tmp_path / "in.en", tmp_path / "out.de"
    output.write_text("the old translation\n")
    too_long = " ".join(["man"] * 1500)  # more tokens than the model reads, not more characters than they can hold
    source.write_text("".join(line + "\n" for line in [*SOURCE, too_long]))
    message = one_error_line(*translate_here(f"input={source}", f"output={output}", "buffer_lines=1"))
    assert re.search(r"line 5 has \d+ tokens; this model reads at most 1023$", message), message
    assert output.read_text() == "the old translation\n"  # not the four lines translated before line 5
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in.en", "out.de"]  # no temporary file left


def test_a_killed_translation_leaves_the_old_output_as_it_was(checkpoint: Path, tmp_path: Path) -> None:
    source, output = tmp_path / "in.en", tmp_path / "out.de"
    output.write_text("the old translation\n")
    source.write_text("".join(line + "\n" for line in SOURCE * 20_000))  # minutes of translating
    command = ["aiayn-translate", f"checkpoint={checkpoint}", f"input={source}", f"output={output}", "buffer_lines=1"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".out.de.*.tmp")) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)  # some blocks translated
        assert process.poll() is None, "the translation ended before it could be interrupted"
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.kill()
        process.wait()
    assert output.read_text() == "the old translation\n"


GOOD = "".join(line + "\n" for line in SOURCE[:3]).encode()


@pytest.fixture(scope="module")
def good_lines_translated(smoke_run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The translation of the three good lines alone, as aiayn-translate writes it to a file."""
    folder = tmp_path_factory.mktemp("good")
    (folder / "in.en").write_bytes(GOOD)
    files = f"input={folder / 'in.en'}", f"output={folder / 'out.de'}"
    with pytest.MonkeyPatch.context() as monkeypatch:
        status = translated_here(best_checkpoint(smoke_run_dir), monkeypatch, *files)
    translated = (folder / "out.de").read_bytes()
    assert status == 0 and len(translated.splitlines()) == 3
    return translated


BAD = GOOD + b"a bad \xff byte\n" + SOURCE[3].encode() + b"\n"  # line 4 is not UTF-8


def test_invalid_utf8_on_stdin_names_its_line_after_the_lines_before_it_are_written(
    checkpoint: Path, good_lines_translated: bytes
) -> None:
    """Through a pipe, to the console script."""
    done = translate(checkpoint, "buffer_lines=10", stdin=BAD)
    message = process_error_line(done)
    assert message.startswith("aiayn-translate: error: <stdin>:4: invalid UTF-8 (invalid start byte at byte 6)")
    assert done.stdout == good_lines_translated  # the block's good lines, translated (and the same as to a file)


def test_invalid_utf8_in_a_file_names_its_line_after_the_lines_before_it_are_written(
    translate_here: Callable[..., tuple[int, str]], tmp_path: Path, good_lines_translated: bytes
) -> None:
    source, output = tmp_path / "in.en", tmp_path / "out.de"
    source.write_bytes(BAD)
    message = one_error_line(*translate_here(f"input={source}", f"output={output}", "buffer_lines=10"))
    assert message.startswith(f"aiayn-translate: error: {source}:4: invalid UTF-8 (invalid start byte at byte 6)")
    assert output.read_bytes() == good_lines_translated


def test_a_huge_line_is_refused_by_its_size_before_it_is_tokenized(checkpoint: Path, tmp_path: Path) -> None:
    huge = "man " * 250_000  # 1 MB without a line end: under the bytes a line may have (LINE_BYTES)
    (tmp_path / "in.en").write_text(SOURCE[0] + "\n" + huge)
    message = process_error_line(translate(checkpoint, f"input={tmp_path / 'in.en'}"))
    assert "line 2 has 750000 characters besides spaces: far more than the 1023 tokens" in message

    translator = Translator.from_checkpoint(checkpoint)
    encoded: list[int] = []  # the length of every line given to sentencepiece
    encode = translator.tokenizer.encode

    def counted(lines: list[str], threads: int | None = None) -> list[list[int]]:
        encoded.extend(map(len, lines))
        return encode(lines, threads)

    translator.tokenizer.encode = counted
    with pytest.raises(ValueError, match="line 7 has 750000 characters"):
        translator.translate([SOURCE[0], huge], first_line=6)
    assert encoded == []  # not even the short line: the block is refused whole, as an over-long one is


def test_the_size_bound_never_refuses_a_line_that_fits(checkpoint: Path, corpus_root: Path) -> None:
    """No line has more characters (spaces aside) than its tokens can hold: the bound is safe. (Not for
    characters the model has never seen: a run of them is one unknown token, see Translator.translate.)"""
    translator = Translator.from_checkpoint(checkpoint)
    lines = read_lines(corpus_root / "train.en") + read_lines(corpus_root / "train.de") + ["  a   b  ", "a" * 40]
    longest = longest_piece(translator.tokenizer)
    for line, ids in zip(lines, translator.tokenizer.encode([line.strip() for line in lines]), strict=True):
        assert len(line.strip()) - line.strip().count(" ") <= len(ids) * longest, line


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("decoding.beam_size=abc", "decoding.beam_size"),
        ("decoding.alpha=x", "decoding.alpha"),
        ("decoding.max_len_offset=..", "decoding.max_len_offset"),
        ("max_tokens=foo", "max_tokens"),
        ("buffer_lines=1.5", "buffer_lines"),
        ("input=[1]", "input"),
        ("output={a:1}", "output"),
        ("device=[1]", "device"),
        ("checkpoint=[1]", "checkpoint"),
        ("sdpa_backends=[flash,fast]", "sdpa_backends"),
        ("sdpa_backends=cudnn", "sdpa_backends"),
    ],
)
def test_a_bad_setting_ends_in_one_line_naming_its_key(
    checkpoint: Path, override: str, key: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """In this process (the console script's status and stderr are tested above): seconds saved per case."""
    monkeypatch.setattr(sys, "argv", ["aiayn-translate", f"checkpoint={checkpoint}", "decoding=greedy", override])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"a man\n")))
    with pytest.raises(SystemExit) as stopped:
        translate_cli.main()
    assert stopped.value.code == 2
    (message,) = capsys.readouterr().err.strip().splitlines()
    assert message.startswith(f"aiayn-translate: error: {key}=")
