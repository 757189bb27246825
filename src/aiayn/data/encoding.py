"""Encoding corpus splits into token ids: chunk by chunk, in worker processes, straight to the cache.

At WMT scale (4.5M pairs for En-De, 36M for En-Fr) the Python side of encoding (building and flattening
id lists) dominates, so chunks of pairs go to a pool of processes, each with its own sentencepiece
model and its own view of the corpus; results are written in corpus order as they arrive.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aiayn.data.corpus import ParallelCorpus
from aiayn.data.dataset import EncodedTextWriter
from aiayn.data.tokenizer import Tokenizer
from aiayn.machine import available_cpus

log = logging.getLogger(__name__)

CHUNK_PAIRS = 20_000  # pairs per job: large enough to amortise the transfer, small enough to stream

_state: dict[str, object] = {}  # the worker's corpus and tokenizer


def _start_worker(corpus: ParallelCorpus, model_file: Path) -> None:
    _state["corpus"], _state["tokenizer"] = corpus, Tokenizer(model_file)


def in_workers(
    function: Callable[[Any], Any],
    jobs: Iterable[Any],
    workers: int,
    start: Callable[..., None],
    start_args: tuple[Any, ...],
) -> Iterator[Any]:
    """``function`` of each job, in the jobs' order, computed in ``workers`` processes (in this one when 1),
    each prepared by ``start(*start_args)``."""
    if workers <= 1:
        start(*start_args)
        yield from map(function, jobs)
        return
    # fork on Linux, as DataLoader workers: a worker starts at once, and the caller's script is not
    # imported again (spawn and forkserver re-run an unguarded script in every worker).
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with context.Pool(workers, initializer=_start_in_worker, initargs=(start, start_args)) as pool:
        yield from pool.imap(function, jobs)
        # Every job done: the workers end at the pool's sentinels. Leaving the block ends them with SIGTERM
        # instead, which a worker forked from the training process may only note (its handlers are
        # Lightning's and aiayn's until _start_in_worker runs): it then waits for a next job for ever, and
        # the training process with it (seen at the end of an epoch's BPE-dropout draw).
        pool.close()
        pool.join()


def _start_in_worker(start: Callable[..., None], start_args: tuple[Any, ...]) -> None:
    """A worker's own signal handling, then ``start(*start_args)``: SIGTERM ends it (a pool left early,
    on an error, ends its workers so); Ctrl-C and the schedulers' notices (SIGINT, SIGUSR1, SIGUSR2) are
    the training process's to act on."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for signum in (signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_IGN)
    start(*start_args)


def flatten(ids: list[list[int]], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of many sentences as one flat array and the per-sentence lengths."""
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    tokens = np.fromiter((t for row in ids for t in row), dtype=dtype, count=int(lengths.sum()))
    return tokens, lengths


@dataclass(frozen=True)
class Rows:
    """Rows ``start:stop`` of ``split``, for a worker that reads them itself."""

    split: str
    start: int
    stop: int


def _encode_rows(job: tuple[object, str, tuple[int, ...]]) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """Ids of one chunk: ``job`` is (rows or the chunk's (source, target) text, token dtype, source prefix)."""
    chunk, dtype, prefix = job
    tokenizer = _state["tokenizer"]
    assert isinstance(tokenizer, Tokenizer)
    if isinstance(chunk, Rows):
        corpus = _state["corpus"]
        assert isinstance(corpus, ParallelCorpus)
        chunk = corpus.read(chunk.split, np.arange(chunk.start, chunk.stop))
    src, tgt = (tokenizer.encode(side, threads=1) for side in chunk)
    if prefix:  # an empty source stays empty: training drops it as empty, not as a tag alone
        src = [[*prefix, *ids] if ids else ids for ids in src]
    return flatten(src, np.dtype(dtype)), flatten(tgt, np.dtype(dtype))


def encode_split(
    corpus: ParallelCorpus,
    split: str,
    model_file: Path,
    stems: tuple[Path, Path],
    dtype: np.dtype,
    workers: int | None = None,
    source_prefix: tuple[int, ...] = (),
) -> None:
    """Encode ``split`` of ``corpus`` with the sentencepiece model ``model_file`` into the cache entries
    ``stems`` (source, target), using ``workers`` processes (default: one per CPU); ``source_prefix``:
    ids put in front of every non-empty source (a tag, :mod:`aiayn.data.back_translation`)."""
    n = corpus.size(split)
    ranges = [(start, min(start + CHUNK_PAIRS, n)) for start in range(0, n, CHUNK_PAIRS)]
    workers = min(workers or available_cpus(), len(ranges))
    # Memory-mapped corpora are read by the workers themselves; text held in this process is sent
    # chunk by chunk, so that no worker holds a whole corpus.
    chunks: Iterable[object] = (
        (Rows(split, start, stop) if corpus.readable_by_workers else corpus.read(split, np.arange(start, stop)))
        for start, stop in ranges
    )
    jobs = ((chunk, np.dtype(dtype).str, source_prefix) for chunk in chunks)
    log.info("encoding %d pairs of %s in %d process(es)", n, corpus.where(split), workers)
    with EncodedTextWriter(stems[0], dtype) as src_out, EncodedTextWriter(stems[1], dtype) as tgt_out:
        try:
            for (src, src_len), (tgt, tgt_len) in in_workers(
                _encode_rows, jobs, workers, _start_worker, (corpus, model_file)
            ):
                src_out.append(src, src_len)
                tgt_out.append(tgt, tgt_len)
        finally:
            _state.clear()
