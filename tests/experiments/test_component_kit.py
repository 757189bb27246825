"""The component kit passes every built-in component and a user's own class written outside the package,
and fails a component that breaks the contract, naming the check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

import aiayn
from aiayn.errors import ConfigError
from aiayn.experiments.component_kit import ComponentCheckError
from aiayn.model import register_component
from aiayn.model.attention import MultiHeadAttention
from aiayn.model.feed_forward import FeedForward
from helpers.runs import REPO

ENTRIES = sorted((REPO / "conf" / "model").glob("*/*.yaml"))
USER_FOLDER = REPO / "tests" / "assets" / "user_components"


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> None:
    """The kit's model is tiny: threads would only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda path: f"{path.parent.name}/{path.stem}")
def test_every_built_in_component_passes_the_kit(entry: Path) -> None:
    report = aiayn.check_component(entry.parent.name, yaml.safe_load(entry.read_text()))
    assert report.failed == {} and len(report.passed) == 10


def test_a_users_own_attention_from_outside_the_package_passes_the_kit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(USER_FOLDER))  # PYTHONPATH=<your folder>: the kit imports the class
    spec = yaml.safe_load((USER_FOLDER / "conf" / "model" / "attention" / "qk_norm.yaml").read_text())
    report = aiayn.check_component("attention", spec, model={"positional": "rope"})
    assert report.passed[-1] == "export" and any("format=hf" in note for note in report.notes)


class ForgetsPadding(MultiHeadAttention):
    """Attends to padding as if it were words."""

    def forward(self, query, memory=None, key_padding_mask=None, **options):
        return super().forward(query, memory, None, **options)


class ForgetsTheCache(MultiHeadAttention):
    """Attends to the new position only when decoding incrementally."""

    def forward(self, query, memory=None, key_padding_mask=None, causal=False, cache=None, **options):
        return super().forward(query, memory, key_padding_mask, causal, None, **options)


class ForgetsPositions(MultiHeadAttention):
    """Never rotates or biases by position: a bag of words under RoPE, ALiBi or T5."""

    def forward(self, query, memory=None, key_padding_mask=None, causal=False, cache=None, packed=None, positions=None):
        return super().forward(query, memory, key_padding_mask, causal, cache, packed, None)


class SharesNothing(nn.Module):
    """A norm without parameters whose output grows with every call: neither deterministic nor resumable."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return nn.functional.layer_norm(x, x.shape[-1:]) * (1 + 1e-3 * self.calls)


@pytest.mark.parametrize(
    ("kind", "cls", "failing"),
    [
        ("attention", ForgetsPadding, {"padding"}),
        ("attention", ForgetsTheCache, {"cache"}),
        ("attention", ForgetsPositions, {"positions"}),
        ("norm", SharesNothing, {"determinism", "resume"}),
    ],
)
def test_a_component_that_breaks_the_contract_fails_the_check_it_breaks(kind: str, cls: type, failing: set) -> None:
    register_component(cls)
    with pytest.raises(ComponentCheckError) as caught:
        aiayn.check_component(kind, {"_target_": f"{cls.__module__}.{cls.__qualname__}"})
    assert failing <= set(caught.value.report.failed)
    assert all(f"\n{name}: " in str(caught.value) for name in failing)


def test_the_kit_imports_the_class_it_is_given_or_says_why_it_cannot() -> None:
    with pytest.raises(ConfigError, match=r"^attention._target_=nowhere.Attention cannot be imported \("):
        aiayn.check_component("attention", {"_target_": "nowhere.Attention"})
    assert aiayn.check_component("feed_forward", FeedForward).passed[0] == "shapes"  # the class itself
