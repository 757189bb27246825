"""The data modules of each kind of corpus, as the ``data`` config group names them: thin subclasses of
:class:`~aiayn.data.datamodule.TranslationDataModule` that take flat settings (``root``, the languages,
the files) and make the corpus: :class:`Multi30kDataModule`, :class:`WMT14DataModule` and
:class:`TextDataModule`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiayn.data.corpus import HuggingFaceTranslation, Multi30k, TextFiles, default_cache_dir
from aiayn.data.datamodule import TranslationDataModule
from aiayn.errors import FieldError


class Multi30kDataModule(TranslationDataModule):
    """Multi30k task 1 in one direction (``src_lang`` → ``tgt_lang`` among en, de, fr), from ``root``
    or, when unset, downloaded into ``<cache_dir>/multi30k`` on first use."""

    def __init__(
        self,
        src_lang: str = "en",
        tgt_lang: str = "de",
        root: str | None = None,
        val_split: str = "val",
        test_split: str = "test",
        **options: Any,
    ) -> None:
        cache = Path(options["cache_dir"]).expanduser() if options.get("cache_dir") else default_cache_dir()
        root_path = Path(root).expanduser() if root else None
        corpus = Multi30k(
            src_lang, tgt_lang, root=root_path, cache_dir=cache, val_split=val_split, test_split=test_split
        )
        super().__init__(corpus, **options)


class WMT14DataModule(TranslationDataModule):
    """WMT14 through Hugging Face ``datasets``: the ``wmt14`` configuration ``config`` (``de-en``,
    ``fr-en``), newstest2013 as validation and newstest2014 as test. ``root``: a local copy in the same
    layout (``save_to_disk`` folder, or Parquet/JSON files), else ``hub`` is downloaded once into the
    Hugging Face cache."""

    def __init__(
        self,
        src_lang: str = "en",
        tgt_lang: str = "de",
        config: str = "de-en",
        root: str | None = None,
        hub: str = "wmt/wmt14",
        splits: dict[str, str | None] | None = None,
        **options: Any,
    ) -> None:
        pair = set(config.split("-"))
        if {src_lang, tgt_lang} != pair:
            allowed = f"does not hold src_lang={src_lang} and tgt_lang={tgt_lang}; use the pair's config"
            raise FieldError("config", config, allowed)
        if root is not None and not Path(root).expanduser().exists():
            raise FieldError("root", root, "does not exist; give a local copy of WMT14 (or null: the Hub's)")
        splits = dict(splits or {"train": "train", "val": "validation", "test": "test"})
        corpus = HuggingFaceTranslation(src_lang, tgt_lang, path=root or hub, config=config, splits=splits)
        super().__init__(corpus, **options)


class TextDataModule(TranslationDataModule):
    """Your own parallel text: ``train``, ``val`` and (optionally) ``test`` are each a pair of aligned
    files ``[source, target]``, relative to ``root`` unless absolute."""

    def __init__(
        self,
        src_lang: str,
        tgt_lang: str,
        train: Sequence[str],
        val: Sequence[str],
        test: Sequence[str] | None = None,
        root: str | None = None,
        **options: Any,
    ) -> None:
        files = {"train": train, "val": val, "test": test}
        super().__init__(TextFiles(src_lang, tgt_lang, Path(root).expanduser() if root else None, files), **options)
