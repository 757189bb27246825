"""model.compile=true runs the same model through torch.compile, with the same checkpoints."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from aiayn.config.compose import compose_run_config
from aiayn.config.plan import ModuleSettings, module_settings

# Every layer runs the same code (a loop over identical layers), and compile and trace time grow with
# the unrolled graph: one layer each side proves for all what two would, in half the time.
ONE_LAYER = ("model.n_layers=1",)


def tiny_settings(*overrides: str) -> ModuleSettings:
    return module_settings(compose_run_config(["model=tiny", "logger=none", *overrides]))


def tiny_batch(vocab_size: int) -> dict[str, Any]:
    torch.manual_seed(1)
    src = torch.randint(4, vocab_size, (3, 7))
    src[0, 5:] = 0  # padding: the source mask is used
    tgt = torch.randint(4, vocab_size, (3, 6))
    lengths = torch.tensor([[5, 6], [7, 6], [7, 6]]).numpy()
    return {"src": src, "tgt_in": tgt, "tgt_out": tgt.roll(-1, 1), "lengths": lengths, "target_rows": torch.arange(18)}


@pytest.mark.slow
def test_compiled_module_keeps_parameter_names_and_trains_as_eager_does() -> None:
    settings = tiny_settings("model.compile=true", "model.dropout=0.0", *ONE_LAYER)
    assert settings.compile is True and "compile" not in settings.model.to_dict()
    torch.manual_seed(0)
    compiled = settings.build().train()
    eager = dataclasses.replace(settings, compile=False).build().train()
    assert list(compiled.state_dict()) == list(eager.state_dict())
    eager.load_state_dict(compiled.state_dict())
    batch = tiny_batch(settings.model.vocab_size)
    losses = [module.training_loss(batch)[0] for module in (compiled, eager)]
    torch.testing.assert_close(losses[0], losses[1])
    for loss in losses:
        loss.backward()
    for (name, a), (_, b) in zip(compiled.named_parameters(), eager.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_the_training_forward_compiles_into_one_graph() -> None:
    settings = tiny_settings("model.dropout=0.1", *ONE_LAYER)
    model = settings.build().train().model
    batch = tiny_batch(settings.model.vocab_size)
    explained = torch._dynamo.explain(model)(batch["src"], batch["tgt_in"])
    assert explained.graph_break_count == 0, explained.break_reasons


def test_model_compile_must_be_a_boolean() -> None:
    with pytest.raises(ValueError, match=r"model.compile=maybe must be true or false"):
        tiny_settings("model.compile=maybe")
