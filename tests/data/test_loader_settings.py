"""The loader's settings: batch shapes, workers sized from the machine, prefetching, packing fields."""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl

from aiayn.config.compose import compose_run_config
from aiayn.config.plan import plan_run
from aiayn.data import Multi30kDataModule, limits
from aiayn.errors import ConfigError, FieldError


def datamodule(root: Path, cache: Path, **kwargs: object) -> Multi30kDataModule:
    dm = Multi30kDataModule(root=str(root), cache_dir=str(cache), vocab_size=1000, **kwargs)
    dm.prepare_data()
    dm.setup()
    return dm


class PaddedModule(pl.LightningModule):
    """A module whose attention runs under padding masks: it reads no packing fields."""

    packed_attention = False


def attached(dm: Multi30kDataModule, module: pl.LightningModule, devices: int = 1) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", devices=devices, logger=False, enable_checkpointing=False)
    trainer.strategy.connect(module)
    dm.trainer = trainer
    return trainer


def test_training_batches_take_the_shapes_of_their_table(corpus_root: Path, cache_dir: Path) -> None:
    dm = datamodule(corpus_root, cache_dir, max_tokens=400, batch_shapes=6)
    loader = dm.train_dataloader()
    table = loader.batch_sampler.shapes
    shapes = {(int(r), int(s), int(t)) for r, (s, t) in zip(table.rows, table.widths, strict=True)}
    made = [(b["src"].shape[0], b["src"].shape[1], b["tgt_in"].shape[1]) for b in loader]
    assert len(table) == 6 and len(set(made) - shapes) <= 1  # the short last batch
    assert all(rows % 8 == 0 for rows, _, _ in made if (rows, _, _) in shapes)
    assert all(rows * max(src, tgt) <= 400 for rows, src, tgt in made)
    assert dm.val_dataloader().batch_sampler.shapes is None  # evaluation batches as before


def test_a_padded_module_gets_batches_without_packing_fields(corpus_root: Path, cache_dir: Path) -> None:
    dm = datamodule(corpus_root, cache_dir)
    assert {"source_rows", "offsets"} <= next(iter(dm.train_dataloader())).keys()  # no module: all fields
    attached(dm, PaddedModule())
    assert not {"source_rows", "offsets"} & next(iter(dm.train_dataloader())).keys()


def test_null_workers_are_half_the_cpus_of_each_process_at_most_8(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "available_cpus", lambda: 16)
    assert [limits.loader_workers(n) for n in (1, 2, 8)] == [8, 4, 1]
    monkeypatch.setattr(limits, "available_cpus", lambda: 1)
    assert limits.loader_workers(1) == 0  # the process itself needs the one CPU


def test_loader_options_follow_the_workers(corpus_root: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "available_cpus", lambda: 12)
    dm = datamodule(corpus_root, cache_dir, num_workers=None, prefetch_factor=4)
    attached(dm, PaddedModule())
    options = dm._loader_options()
    assert (options["num_workers"], options["prefetch_factor"], options["persistent_workers"]) == (6, 4, True)
    dm.num_workers = 0  # DataLoader refuses a prefetch factor without workers
    assert dm._loader_options()["prefetch_factor"] is None


@pytest.mark.parametrize(
    ("key", "value"),
    [("prefetch_factor", 0), ("batch_shapes", 0), ("batch_shapes", 2.5), ("num_workers", -1)],
)
def test_bad_loader_settings_name_their_key(corpus_root: Path, tmp_path: Path, key: str, value: object) -> None:
    with pytest.raises(FieldError, match=rf"^{key}={value} must be a whole number >= \d") as refused:
        Multi30kDataModule(root=str(corpus_root), cache_dir=str(tmp_path), **{key: value})
    assert refused.value.field == key
    cfg = compose_run_config([f"data.{key}={value}", f"data.root={corpus_root}", f"data.cache_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=rf"^data\.{key}={value} must be a whole number >= \d"):
        plan_run(cfg)  # as aiayn-train names it
