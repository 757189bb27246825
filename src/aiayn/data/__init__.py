"""Corpora, the joint BPE tokenizer, encoded-split caches and the token-budget batch sampler.

The data module is imported on first use: it pulls in Lightning, which tools that only need the
tokenizer (``aiayn-translate``) should not wait for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiayn.data.corpus import DataError
from aiayn.data.sampler import TokenBudgetBatchSampler
from aiayn.data.tokenizer import Tokenizer

if TYPE_CHECKING:
    from aiayn.data.datamodule import TranslationDataModule
    from aiayn.data.sources import Multi30kDataModule, TextDataModule, WMT14DataModule

DATA_MODULES = ("Multi30kDataModule", "WMT14DataModule", "TextDataModule")  # aiayn.data.sources
__all__ = [
    "DataError",
    "Multi30kDataModule",
    "TextDataModule",
    "TokenBudgetBatchSampler",
    "Tokenizer",
    "TranslationDataModule",
    "WMT14DataModule",
]


def __getattr__(name: str) -> Any:
    if name == "TranslationDataModule":
        from aiayn.data.datamodule import TranslationDataModule

        return TranslationDataModule
    if name in DATA_MODULES:
        from aiayn.data import sources

        return getattr(sources, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
