"""The model tools' plans: aiayn-eval's, aiayn-translate's and aiayn-export's config → their typed settings,
and the key a field's error is named by, whether the settings or the work below raise it."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiayn.config.compose import compose_config
from aiayn.config.settings import top_level_settings
from aiayn.config.tool_plans import TOOL_KEYS, plan_eval, plan_export, plan_translate, tool_keys
from aiayn.errors import ConfigError
from aiayn.export.folder import check_decoding, check_exportable
from aiayn.model import PAPER_DECODING, DecodingOptions, TransformerConfig


@pytest.mark.parametrize("command", ["eval", "translate", "export"])
def test_no_setting_of_a_tool_shares_a_name_with_a_field_named_by_another_key(command: str) -> None:
    assert not set(top_level_settings(command)) & set(TOOL_KEYS)


def test_eval_settings_are_typed_and_tuning_reads_the_validation_split(tmp_path: Path) -> None:
    checkpoint = tmp_path / "best.ckpt"
    settings = plan_eval(compose_config("eval", [f"checkpoint={checkpoint}", "tune.alpha=[0.6,1.0]", "device=cpu"]))
    assert settings.decode.checkpoint == (checkpoint,) and settings.decode.torch_device.type == "cpu"
    assert settings.texts.split == "val" and [options.alpha for options in settings.tune.settings] == [0.6, 1.0]
    assert plan_eval(compose_config("eval", [f"checkpoint={checkpoint}"])).texts.split == "test"


@pytest.mark.parametrize(
    ("command", "overrides", "message"),
    [
        ("eval", ["tune.alpha=[1.0]", "split=test"], r"^split=test is not the validation split"),
        ("eval", ["tune.alpha=[1.0]", "nbest=2"], r"^nbest=2 is for one setting"),
        ("eval", ["decoding.beam_size=2", "nbest=3"], r"^nbest=3 must be a whole number from 1 to the beam size \(2\)"),
        ("eval", ["data.root=''"], r"^data\.root='' must be a path or a name"),
        ("eval", ["device=floppy"], r"^device=floppy is not a device"),
        ("translate", ["buffer_lines=0"], r"^buffer_lines=0 must be a whole number >= 1"),
        ("translate", ["max_tokens=0"], r"^max_tokens=0 must be a whole number of source tokens >= 1"),
        ("translate", ["sdpa_backends=[fast]"], r"^sdpa_backends=\['fast'\] must be a list"),
        ("export", ["output=out", "format=hf", "quantization=int8"], r"^quantization=int8 is for format=ctranslate2"),
    ],
)
def test_a_bad_setting_is_named_by_its_key_before_any_model_is_loaded(
    command: str, overrides: list[str], message: str, tmp_path: Path
) -> None:
    plan = {"eval": plan_eval, "translate": plan_translate, "export": plan_export}[command]
    with pytest.raises(ConfigError, match=message):
        plan(compose_config(command, [f"checkpoint={tmp_path / 'missing.ckpt'}", *overrides]))


def test_what_the_work_refuses_later_is_named_by_its_key_too() -> None:
    """An engine's refusal of a decoding option, a format's of a model setting: fields of objects the
    work was given, named as the command's keys."""
    with (
        pytest.raises(ConfigError, match=r"^decoding\.length_penalty=gnmt with decoding\.alpha=0\.6 has no"),
        tool_keys(),
    ):
        check_decoding(PAPER_DECODING, 1, "CTranslate2")
    with pytest.raises(ConfigError, match=r"^decoding\.mbr=chrf is not decoded through CTranslate2"), tool_keys():
        check_decoding(DecodingOptions(mbr="chrf"), 1, "CTranslate2")
    rope = TransformerConfig(vocab_size=50, d_model=32, n_heads=4, positional="rope")
    with pytest.raises(ConfigError, match=r"^model\.positional=rope cannot be exported to format=hf"), tool_keys():
        check_exportable(rope, "hf")
