"""Collated batches of random pairs, for tests of what a training step computes on them."""

from __future__ import annotations

from typing import Any

import numpy as np

from aiayn.data.dataset import Collator

PAD, BOS, EOS = 0, 2, 3


def ragged_batch(lengths: list[tuple[int, int]], vocab: int) -> dict[str, Any]:
    """A collated batch of random pairs with these (source, target) lengths: padding on both sides."""
    rng = np.random.default_rng(0)
    items = [(i, rng.integers(4, vocab, s), rng.integers(4, vocab, t)) for i, (s, t) in enumerate(lengths)]
    return Collator(PAD, BOS, EOS)(items)
