"""Corpora, the joint BPE tokenizer, encoded-split caches and the token-budget batch sampler."""

from aiayn.data.corpus import DataError
from aiayn.data.datamodule import Multi30kDataModule
from aiayn.data.sampler import TokenBudgetBatchSampler
from aiayn.data.tokenizer import Tokenizer

__all__ = ["DataError", "Multi30kDataModule", "TokenBudgetBatchSampler", "Tokenizer"]
