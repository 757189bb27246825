"""A spec is a name, not an import: a checkpoint's model naming a class aiayn does not hold is refused
before anything of it runs, until the user trusts that class in the process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from torch import nn

from aiayn.errors import FieldError
from aiayn.model import Transformer, TransformerConfig, register_component

TRAP = """import pathlib
pathlib.Path(__file__).with_name("imported").touch()
import torch
class Attention(torch.nn.Module):
    pass
"""


def test_a_spec_naming_a_class_nobody_trusted_is_refused_without_importing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "shared_trap.py").write_text(TRAP)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = TransformerConfig(vocab_size=10, n_layers=1, attention={"_target_": "shared_trap.Attention"})
    with pytest.raises(FieldError, match=r"^attention=shared_trap.Attention is neither one of aiayn's components"):
        Transformer(cfg)
    assert not (tmp_path / "imported").exists() and "shared_trap" not in sys.modules


class Plain(nn.Module):
    pass


class Norm(nn.LayerNorm):
    pass


def test_a_registered_class_is_built_and_must_be_a_module_of_its_kind() -> None:
    register_component(Plain)
    name = f"{Plain.__module__}.{Plain.__qualname__}"
    with pytest.raises(FieldError, match=r"is not a subclass of aiayn.model.positional.PositionalEncoding$"):
        Transformer(TransformerConfig(vocab_size=10, n_layers=1, positional={"_target_": name}))
    with pytest.raises(FieldError, match=r"^component=.* must be a torch.nn.Module class$"):
        register_component(dict)  # type: ignore[arg-type]


def test_a_class_is_trusted_by_the_name_a_package_re_exports_it_by() -> None:
    register_component(Norm, "my_package.Norm")
    model = Transformer(TransformerConfig(vocab_size=10, n_layers=1, norm={"_target_": "my_package.Norm"}))
    assert type(model.encoder[0].ffn_block.norm) is Norm


@pytest.mark.parametrize("target", ["nodot", "a.b\nc", "os.system; rm", "a." + "b" * 300])
def test_a_target_must_be_a_dotted_name(target: str) -> None:
    with pytest.raises(FieldError, match=r"^attention=.* must be null or a spec"):
        TransformerConfig(vocab_size=10, attention={"_target_": target})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("attention", "aiayn.model.attention.MultiHeadAttention"),
        ("norm", {"eps": 1e-5}),
        ("feed_forward", {"_target_": "x"}),
    ],
)
def test_a_spec_of_another_shape_is_refused_by_field(field: str, value: object) -> None:
    with pytest.raises(FieldError, match=rf"^{field}=.* must be null or a spec \{{_target_: package.module.Class"):
        TransformerConfig(vocab_size=10, **{field: value})
