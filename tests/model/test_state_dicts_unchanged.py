"""The components changed how the model is built, not what the paper's settings build: every 0.1.0 model
(each positional encoding, post- and pre-LN, shared and separate embeddings) has the same weight names
and shapes, so its checkpoints load, and the same seed draws the same initial weights, so a run trains
as it did (tests/assets/state_dicts_0.1.0.json was written by aiayn 0.1.0)."""

from __future__ import annotations

import json

import pytest
import torch

from aiayn.model import Transformer, TransformerConfig
from helpers.runs import REPO

RECORDED = json.loads((REPO / "tests" / "assets" / "state_dicts_0.1.0.json").read_text())


@pytest.mark.parametrize("variant", RECORDED)
def test_a_0_1_0_model_has_the_same_weights_and_initial_values(variant: str) -> None:
    settings = {key: value for key, value in (item.split("=") for item in variant.split())}
    torch.manual_seed(0)
    model = Transformer(
        TransformerConfig(
            vocab_size=100, n_layers=1, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=4,
            positional=settings["positional"], norm_first=settings["norm_first"] == "True",
            share_embeddings=settings["share_embeddings"] == "True",
        )
    )  # fmt: skip
    assert {name: list(tensor.shape) for name, tensor in model.state_dict().items()} == RECORDED[variant]["weights"]
    squares = round(sum(p.double().pow(2).sum().item() for p in model.parameters()), 9)
    assert squares == RECORDED[variant]["sum_of_squares"]
