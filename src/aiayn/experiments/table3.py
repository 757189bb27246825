"""The paper's Table 3 (En-De newstest2013, beam search, no checkpoint averaging): its columns as our config
keys, and the paper's perplexity, BLEU and parameter count for every row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from aiayn.config.compose import compose_run_config

# Table 3's columns: (heading, key of the composed config).
COLUMNS = (
    ("N", "model.n_layers"),
    ("d_model", "model.d_model"),
    ("d_ff", "model.d_ff"),
    ("h", "model.n_heads"),
    ("d_k", "model.d_k"),
    ("d_v", "model.d_v"),
    ("P_drop", "model.dropout"),
    ("ε_ls", "optim.label_smoothing"),
    ("positional", "model.positional"),
)
FAMILIES = ("table3", "mini")  # experiment=table3/<row> (WMT14, the paper's settings), mini/<row> (Multi30k)


@dataclass(frozen=True)
class PaperRow:
    """One row's results in the paper: dev perplexity (per wordpiece), dev BLEU, parameters ×10⁶ (the
    paper leaves it blank where it equals base's)."""

    ppl: float
    bleu: float
    params_millions: float | None


PAPER = {
    "base": PaperRow(4.92, 25.8, 65),
    "A1": PaperRow(5.29, 24.9, None),
    "A2": PaperRow(5.00, 25.5, None),
    "A3": PaperRow(4.91, 25.8, None),
    "A4": PaperRow(5.01, 25.4, None),
    "B1": PaperRow(5.16, 25.1, 58),
    "B2": PaperRow(5.01, 25.4, 60),
    "C1": PaperRow(6.11, 23.7, 36),
    "C2": PaperRow(5.19, 25.3, 50),
    "C3": PaperRow(4.88, 25.5, 80),
    "C4": PaperRow(5.75, 24.5, 28),
    "C5": PaperRow(4.66, 26.0, 168),
    "C6": PaperRow(5.12, 25.4, 53),
    "C7": PaperRow(4.75, 26.2, 90),
    "D1": PaperRow(5.77, 24.6, None),
    "D2": PaperRow(4.95, 25.5, None),
    "D3": PaperRow(4.67, 25.3, None),
    "D4": PaperRow(5.47, 25.7, None),
    "E": PaperRow(4.92, 25.7, None),
    "big": PaperRow(4.33, 26.4, 213),
}
ROWS = tuple(PAPER)


def select(cfg: DictConfig | dict[str, Any], key: str) -> Any:
    """``cfg`` at a dotted ``key`` (a plain dict, as read from a run's config.yaml, or a DictConfig)."""
    value: Any = cfg
    for part in key.split("."):
        value = value[part]
    return value


def columns_of(cfg: DictConfig | dict[str, Any]) -> tuple[Any, ...]:
    """A config's values in Table 3's columns."""
    return tuple(select(cfg, key) for _, key in COLUMNS)


def family_rows(family: str) -> dict[tuple[Any, ...], str]:
    """Table 3's columns of every ``<family>/<row>`` experiment, mapped to the row's name."""
    rows: dict[tuple[Any, ...], str] = {}
    for row in ROWS:
        rows.setdefault(columns_of(compose_run_config([f"experiment={family}/{row}"])), row)
    return rows
