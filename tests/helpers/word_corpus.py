"""A toy language of 16 words: random lines of it, and a sentencepiece tokenizer trained on them, for the
translator's tests on random models (no corpus needed)."""

from __future__ import annotations

import random
from pathlib import Path

from aiayn.data.tokenizer import Tokenizer

WORDS = ["a", "man", "woman", "dog", "runs", "walks", "in", "the", "park", "street", "with", "red", "blue", "ball",
         "near", "house"]  # fmt: skip


def word_lines(count: int, seed: int, shortest: int = 3, longest: int = 12) -> list[str]:
    """``count`` random lines of ``shortest`` to ``longest`` words."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(shortest, longest))) for _ in range(count)]


def word_tokenizer(folder: Path) -> Tokenizer:
    """A 60-piece tokenizer of 300 random lines, its model in ``folder``."""
    return Tokenizer.train(word_lines(300, seed=0), 60, folder / "spm.model")
