"""A run is planned once: the module trains with the settings objects the plan built and checked, and
its checkpoint holds them as the plain hyperparameters that checkpoints have always held."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch

from aiayn.config.compose import compose_run_config
from aiayn.config.plan import plan_run
from aiayn.errors import FieldError
from aiayn.model import DecodingOptions
from aiayn.training.schedule import OptimSettings


def test_the_module_is_built_from_the_plans_own_settings(tmp_path: Path) -> None:
    overrides = ["model=tiny", "logger=none", "data.vocab_size=1000", f"data.cache_dir={tmp_path}"]
    optim = ["optim.warmup=7", "optim.betas=[0.8,0.9]", "optim.label_smoothing=0.15"]
    plan = plan_run(compose_run_config([*overrides, *optim, "decoding=greedy"]))
    module = plan.module.build()
    assert module.model.cfg is plan.module.model  # not a second TransformerConfig made from the config
    assert module.optim is plan.module.optim and module.decoding is plan.module.decoding
    assert (module.optim.warmup, module.optim.betas, module.decoding.beam_size) == (7, (0.8, 0.9), 1)
    optimizer = module.configure_optimizers()["optimizer"]
    assert optimizer.defaults["betas"] == (0.8, 0.9) and optimizer.defaults["eps"] == 1e-9

    # What aiayn-eval, aiayn-export and averaging read back: plain data, loadable with weights_only=True.
    buffer = io.BytesIO()
    torch.save({"hyper_parameters": dict(module.hparams)}, buffer)
    buffer.seek(0)
    hyper = torch.load(buffer, weights_only=True)["hyper_parameters"]
    assert hyper["model"] == plan.module.model.to_dict() and hyper["model"]["vocab_size"] == 1000
    assert (hyper["warmup"], hyper["betas"], hyper["label_smoothing"]) == (7, [0.8, 0.9], 0.15)
    assert hyper["decoding"] == DecodingOptions(beam_size=1, alpha=0.0, max_len_offset=50).to_dict()
    assert (hyper["bos_id"], hyper["eos_id"], hyper["compile"]) == (2, 3, False)


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("label_smoothing", 1.0, "1.0"),
        ("betas", [0.9], "[0.9]"),
        ("eps", 0, "0"),
        ("warmup", 0, "0"),
        ("lr_scale", -1, "-1"),
    ],
)
def test_optimizer_settings_name_their_own_fields(field: str, value: object, shown: str) -> None:
    """The training layer knows its fields, not the config's keys (the config layer adds ``optim.``)."""
    with pytest.raises(FieldError, match=rf"^{field}={re.escape(shown)} must ") as raised:
        OptimSettings(**{field: value})
    assert (raised.value.field, raised.value.value) == (field, value)
