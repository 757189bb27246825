"""The token-budget batch sampler: sentences bucketed by length, batches bounded in tokens (§5.1),
sharded over DDP ranks and resumable mid-epoch."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

log = logging.getLogger(__name__)


class SeededOrder(Sampler[int]):
    """A permutation of ``range(n)`` fixed by (seed, epoch), or the identity when not shuffling.

    Lightning calls ``set_epoch`` on a batch sampler's ``sampler``, which is how this reaches
    :class:`TokenBudgetBatchSampler` at every epoch.
    """

    def __init__(self, n: int, seed: int = 0, shuffle: bool = True) -> None:
        self.n, self.seed, self.shuffle, self.epoch = n, seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.n))
        return iter(torch.randperm(self.n, generator=self.generator()).tolist())

    def __len__(self) -> int:
        return self.n


# Rows per batch are a multiple of this where the token budget allows: tensor cores multiply in tiles of
# 8 rows, and fewer row counts mean fewer shapes (fairseq's --required-batch-size-multiple, default 8).
ROWS_MULTIPLE = 8
# Candidate widths: every length up to 16 tokens, then 8 per doubling of the length (multiples of 2 up
# to 32, of 4 up to 64, ...): rounding pads at most 1/8 of a side, and the histogram of a WMT-sized
# corpus stays small (about 50 x 50 cells), so choosing the shapes takes about a second.
WIDTHS_PER_OCTAVE = 8


def grid_width(lengths: np.ndarray) -> np.ndarray:
    """``lengths`` rounded up to the candidate widths."""
    lengths = np.asarray(lengths, dtype=np.int64)
    octave = np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64)
    step = np.maximum(np.left_shift(1, octave) // WIDTHS_PER_OCTAVE, 1)
    return -(-lengths // step) * step


def grid_cells(lengths: np.ndarray, max_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct candidate (source, target) widths of ``lengths`` (none above ``max_tokens``), how many
    pairs each holds, and each pair's; one key per pair sorts faster than rows of two."""
    widths = np.minimum(grid_width(lengths), max_tokens)
    keys, inverse, pairs = np.unique(
        widths[:, 0] * (max_tokens + 1) + widths[:, 1], return_inverse=True, return_counts=True
    )
    return np.stack(np.divmod(keys, max_tokens + 1), axis=1), pairs, inverse.reshape(-1)


def batch_rows(widths: np.ndarray, max_tokens: int) -> np.ndarray:
    """The rows of a batch of each (source, target) width: as many as ``max_tokens`` holds on the wider
    side, rounded down to a multiple of :data:`ROWS_MULTIPLE` when it holds that many."""
    rows = max_tokens // np.asarray(widths).max(axis=-1)
    return np.where(rows >= ROWS_MULTIPLE, rows // ROWS_MULTIPLE * ROWS_MULTIPLE, rows)


class BatchShapes:
    """At most ``count`` padded (source, target) widths for the batches of a split, and a batch's rows at
    each: every batch has one of these shapes, so a step meets at most ``count`` + 1 tensor shapes (the
    one more: the epoch's last batch, short). fairseq's ``--num-batch-buckets`` buckets each side into
    percentiles "to minimize the number of compilations"; here the pairs of widths are chosen together, as
    most pairs have sides of similar lengths.

    The widths are chosen greedily: first the pair that holds every sentence pair, then, ``count`` - 1
    times, the one that saves the most padding over the pairs it would take (each pair goes to the
    cheapest shape that holds it), among the candidate widths (:func:`grid_width`) of the pairs; a
    shape too rare to fill one batch saves nothing. Depends only on the lengths: every epoch, rank and
    resumed run gets the same shapes.
    """

    def __init__(self, lengths: np.ndarray, count: int, max_tokens: int) -> None:
        """``lengths``: (pairs, 2), source + EOS and BOS + target, as the batches are padded."""
        cells, pairs, _ = grid_cells(lengths, max_tokens)
        cost = cells.sum(axis=1)
        holds = (cells[None, :, 0] <= cells[:, None, 0]) & (cells[None, :, 1] <= cells[:, None, 1])  # (cand, cell)
        rows = batch_rows(cells, max_tokens)
        widths = [cells.max(axis=0)]  # holds every pair
        paid = np.full(len(cells), int(widths[0].sum()))  # per cell, the widths of the cheapest shape holding it
        while len(widths) < count:
            saved = np.where(holds, np.maximum(paid[None, :] - cost[:, None], 0), 0) @ pairs
            saved[(holds @ pairs) < rows] = 0
            best = int(saved.argmax())
            if saved[best] <= 0:
                break
            widths.append(cells[best])
            paid = np.where(holds[best], np.minimum(paid, cost[best]), paid)
        table = np.array(widths, dtype=np.int64)
        # Cheapest first: a shape that holds another comes after it, which is where pairs are carried.
        table = table[np.lexsort((table[:, 1], table[:, 0], table.sum(axis=1)))]
        self.widths, self.rows, self.max_tokens = table, batch_rows(table, max_tokens), max_tokens

    def __len__(self) -> int:
        return len(self.widths)

    def holding(self, lengths: np.ndarray) -> np.ndarray:
        """(pairs, shapes) booleans: whether each shape's widths hold each pair."""
        return (lengths[:, None, 0] <= self.widths[None, :, 0]) & (lengths[:, None, 1] <= self.widths[None, :, 1])

    def of_pairs(self, lengths: np.ndarray) -> np.ndarray:
        """The shape each pair is batched in: the cheapest that holds it (the first, as they are sorted).
        Found per candidate cell (the widths are candidates: a cell fits as its pairs do), not per pair:
        at WMT's millions a (pairs, shapes) mask would be hundreds of MB."""
        cells, _, inverse = grid_cells(lengths, self.max_tokens)
        return self.holding(cells).argmax(axis=1)[inverse]

    def above(self, shape: int) -> int | None:
        """The cheapest later shape that holds ``shape``'s widths: where pairs too few for a batch go."""
        later = self.holding(self.widths[shape][None])[0, shape + 1 :]
        return shape + 1 + int(later.argmax()) if later.any() else None

    def widths_of(self, rows: int, src_len: int, tgt_len: int) -> tuple[int, int]:
        """The widths a batch of ``rows`` pairs whose longest sides are ``src_len`` and ``tgt_len`` is padded
        to: the cheapest shape of that many rows that holds it (any that holds it: the short last batch)."""
        holds = self.holding(np.array([[src_len, tgt_len]]))[0]
        same = holds & (self.rows == rows)
        shape = int((same if same.any() else holds).argmax())
        return int(self.widths[shape, 0]), int(self.widths[shape, 1])

    def pack(self, order: np.ndarray, shape_of: np.ndarray) -> list[list[int]]:
        """The pairs ``order`` in batches of one shape each (``shape_of`` every pair's, :meth:`of_pairs`), in
        that order within a shape: the shapes' full batches, cheapest shape first; the pairs that do not fill
        a last batch of their shape go on to the cheapest shape above it, and only the shape that holds all
        makes a short one."""
        shape_of = shape_of[order]
        waiting: list[list[np.ndarray]] = [[order[shape_of == shape]] for shape in range(len(self))]
        batches: list[list[int]] = []
        for shape, rows in enumerate(self.rows.tolist()):
            pairs = np.concatenate(waiting[shape][::-1])  # the pairs carried here first: they are batched now
            whole = len(pairs) - len(pairs) % rows
            batches += [pairs[i : i + rows].tolist() for i in range(0, whole, rows)]
            if whole < len(pairs):
                above = self.above(shape)
                if above is None:
                    batches.append(pairs[whole:].tolist())
                else:
                    waiting[above].append(pairs[whole:])
        return batches


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Batches of sentence indices, each at most ``max_tokens`` tokens *including padding*.

    A sentence pair's size is the longer of its source and target; a batch of ``n`` pairs whose
    largest size is ``m`` costs ``n * m`` tokens on either side. Sentences are ordered by size (ties
    broken by the seeded permutation) and packed greedily, so batches hold similar lengths and waste
    little padding; the order of the batches is then shuffled. Given both sides' lengths, pairs of one
    size are ordered by which side is the longer one first: a batch whose sources are the longer sides
    pads its shorter targets to a shorter length (on Multi30k real tokens go from 93.2% of the padded
    batches to 95.1%, benchmarks/RESULTS.md). The finer key, the difference of the lengths, fills 96.0%
    but makes the batches of one epoch 60% alike to the last one's, against 36% with the side and 18%
    with the size alone. Everything depends only on (seed, epoch): two runs with the same seed see the
    same batches in the same order.

    With ``num_replicas`` DDP ranks and ``even`` (training), rank ``r`` takes batches ``r, r + R,
    r + 2R, ...`` of the epoch's order, and the epoch's last ``len % R`` batches (different ones every
    epoch) are left out, so that every rank makes the same number of steps. Without ``even``
    (evaluation), every pair is used once: the pairs are dealt out one by one in length order and
    each rank batches its own, so every rank gets work of similar lengths and at least one batch.
    ``group``: the batches each rank accumulates into one optimizer step; a training epoch is cut to a
    multiple of ranks × group, so no optimizer step (and no validation interval) straddles two epochs.

    With ``shapes`` (a count; both sides' lengths needed) the batches take few tensor shapes, as a GPU
    wants (a kernel, graph or compiled region per shape): each pair goes to one of at most that many
    padded (source, target) widths (:class:`BatchShapes`), and the batches of a width are its pairs in
    the seeded order, all of one number of rows (a multiple of 8 where the budget allows).

    The position in the epoch is resumable (:meth:`state_dict`): a run resumed from a mid-epoch
    checkpoint continues with the next unseen batch, also on another number of ranks.
    """

    def __init__(
        self,
        sizes: Sequence[int] | np.ndarray,
        max_tokens: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        num_replicas: int = 1,
        rank: int = 0,
        even: bool = True,
        group: int = 1,
        shapes: int | None = None,
    ) -> None:
        """``sizes``: per pair, its size, or its (source, target) lengths as padded (source + EOS, BOS + target)."""
        sizes = np.asarray(sizes, dtype=np.int64)
        if shapes is not None and sizes.ndim != 2:
            raise ValueError("batches of few shapes need both sides' lengths of every pair")
        lengths = sizes
        self.longer_side: np.ndarray | None = None
        self._by_size_epoch: int | None = None  # an earlier aiayn's epoch, resumed in its own batches
        if sizes.ndim == 2:
            self.longer_side = np.sign(sizes[:, 1] - sizes[:, 0])  # -1: source, 0: neither, 1: target
            sizes = sizes.max(axis=1, initial=0)
        self.sizes = sizes
        if self.sizes.size == 0:
            raise ValueError("cannot batch an empty split")
        longest = int(self.sizes.max())
        if longest > max_tokens:
            raise ValueError(
                f"data.max_tokens={max_tokens} is smaller than the longest sentence ({longest} tokens); "
                "raise data.max_tokens or lower data.max_len"
            )
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not one of {num_replicas} ranks")
        self.max_tokens, self.num_replicas, self.rank, self.even = max_tokens, num_replicas, rank, even
        self.group = group
        self.sampler = SeededOrder(len(self.sizes), seed, shuffle)
        self.shapes = BatchShapes(lengths, shapes, max_tokens) if shapes is not None else None
        self._shape_of = self.shapes.of_pairs(lengths) if self.shapes is not None else None
        self._shape_count = shapes
        if not even and len(self.sizes) < num_replicas:
            raise ValueError(f"an evaluation split of {len(self.sizes)} pairs cannot give all {num_replicas} ranks one")
        # The number of batches does not depend on the order: packing sees the same sorted sizes.
        self.total = len(self._pack(self._own(np.arange(len(self.sizes)))))
        if even and self.total < num_replicas * group:
            raise ValueError(
                f"the training split makes {self.total} batches, fewer than the {num_replicas} rank(s) x {group} "
                "accumulated batches of one optimizer step; lower data.max_tokens or tokens_per_step"
            )
        self._resume: dict[str, int] | None = None  # the position a checkpoint left the epoch at

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def _by_length(self, order: np.ndarray) -> np.ndarray:
        """``order`` sorted by size, then by the longer side; stable: ties keep the seeded order, so they
        differ between epochs."""
        if not self._by_side():
            return order[np.argsort(self.sizes[order], kind="stable")]
        return order[np.lexsort((self.longer_side[order], self.sizes[order]))]

    def _pack(self, order: np.ndarray) -> list[list[int]]:
        if self.shapes is not None:
            return self.shapes.pack(order, self._shape_of)
        order = self._by_length(order)
        batches: list[list[int]] = []
        batch: list[int] = []
        longest = 0
        for index, size in zip(order.tolist(), self.sizes[order].tolist(), strict=True):
            if batch and (len(batch) + 1) * max(longest, size) > self.max_tokens:
                batches.append(batch)
                batch, longest = [], 0
            batch.append(index)
            longest = max(longest, size)
        batches.append(batch)
        return batches

    def _own(self, order: np.ndarray) -> np.ndarray:
        """The pairs of ``order`` this rank batches: all of them when batches are dealt out (training),
        every R-th in length order when pairs are (evaluation)."""
        if self.even or self.num_replicas == 1:
            return order
        return self._by_length(order)[self.rank :: self.num_replicas]

    def _usable(self, n: int) -> int:
        """How many of ``n`` batches are dealt out: a multiple of ranks × group."""
        return n - n % (self.num_replicas * self.group)

    def epoch_batches(self) -> list[list[int]]:
        """The batches of the current epoch: all ranks', in the order they are dealt out (training), or
        this rank's own (evaluation)."""
        batches = self._pack(self._own(np.fromiter(self.sampler, dtype=np.int64, count=len(self.sizes))))
        if self.sampler.shuffle:
            permutation = torch.randperm(len(batches), generator=self.sampler.generator()).tolist()
            batches = [batches[i] for i in permutation]
        return batches[: self._usable(len(batches))] if self.even else batches

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.epoch_batches()
        if not self.even:
            yield from batches
            return
        remaining = batches[self._resumed_position() :]
        yield from remaining[: self._usable(len(remaining))][self.rank :: self.num_replicas]

    def __len__(self) -> int:
        """This rank's batches in a whole epoch."""
        if not self.even:
            return self.total
        return len(range(self.rank, self._usable(self.total), self.num_replicas))

    # -- resuming ---------------------------------------------------------------------------------
    def _resumed_position(self) -> int:
        """Batches of the current epoch that a checkpoint says were used (0 when not resuming it)."""
        if self._resume is not None and self._resume["epoch"] != self.sampler.epoch:
            self._resume = None  # that epoch is over
        return self._resume["position"] if self._resume is not None else 0

    def _by_side(self) -> bool:
        """Whether this epoch's pairs of one size are grouped by their longer side."""
        return self.longer_side is not None and self.sampler.epoch != self._by_size_epoch

    def _layout(self) -> dict[str, int]:
        layout = {"pairs": len(self.sizes), "max_tokens": self.max_tokens, "seed": self.sampler.seed}
        if self._by_side():  # a checkpoint of an aiayn that batched by size alone lacks it
            layout["by_side"] = 1
        if self.shapes is not None:  # a checkpoint of batches of any shape lacks it
            layout["shapes"] = self._shape_count
        return layout

    def state_dict(self, consumed: int) -> dict[str, int]:
        """The position in the epoch after this rank has used ``consumed`` of its batches (as the
        training loop counts them, also before a resume), as a position in all ranks' order."""
        start = self._resumed_position()
        counted = self._resume["consumed"] if self._resume is not None else 0
        position = start + (consumed - counted) * self.num_replicas
        return {"epoch": self.sampler.epoch, "position": position, "consumed": consumed, **self._layout()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue the checkpoint's epoch after its ``position``; a checkpoint of other data or
        batching settings restarts the epoch instead (its position would mean other batches). The
        checkpoint of an aiayn that batched by size alone finishes its epoch in those batches: the
        training loop counts the batches it already took, so a restart would skip as many."""
        self._by_size_epoch = None
        layout = {key: state.get(key) for key in ("pairs", "max_tokens", "seed", "by_side", "shapes")}
        grouped = self.longer_side is not None and layout["by_side"] in (None, 1)  # 1: by side, None: by size
        own = {"shapes": None, **self._layout(), "by_side": layout["by_side"] if grouped else None}
        if layout != own:
            log.warning(
                "the checkpoint's batches were made with %s, these with %s: its epoch restarts from the beginning",
                layout,
                self._layout(),
            )
            return
        self.set_epoch(state["epoch"])
        if self.longer_side is not None and layout["by_side"] is None:
            self._by_size_epoch = int(state["epoch"])
        self._resume = {key: int(state[key]) for key in ("epoch", "position", "consumed")}


class ResumableDataLoader(DataLoader):
    """A DataLoader over a :class:`TokenBudgetBatchSampler` whose position is saved in checkpoints.

    Lightning stores the ``state_dict`` of loaders that have one in every checkpoint and hands it back
    before iterating when a run resumes. Batches are fetched ahead of training, so the sampler cannot
    know how many were used; ``consumed`` (the training loop's count) tells it.
    """

    def __init__(self, *args: Any, consumed: Callable[[], int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.consumed = consumed

    def state_dict(self) -> dict[str, int]:
        return self.batch_sampler.state_dict(self.consumed())

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.batch_sampler.load_state_dict(state)
