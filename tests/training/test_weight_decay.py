"""Decoupled weight decay (``optim.weight_decay`` > 0: AdamW): which parameters decay, by how much, and what a
resume does with the two parameter groups; 0 keeps the paper's plain Adam."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from aiayn.errors import CheckpointError
from aiayn.model import TransformerConfig
from aiayn.training.module import TranslationModule
from aiayn.training.restored_state import RestoredState
from aiayn.training.schedule import OptimSettings
from helpers.runs import smoke_run, train_in_process

# The weights of the linear maps of a one-layer model: the only parameters that decay.
LINEAR_WEIGHTS = {
    f"model.{name}.weight"
    for name in (
        "encoder.0.self_attn.qkv_proj",
        "encoder.0.self_attn.out_proj",
        "encoder.0.ffn.w1",
        "encoder.0.ffn.w2",
        "decoder.0.self_attn.qkv_proj",
        "decoder.0.self_attn.out_proj",
        "decoder.0.cross_attn.q_proj",
        "decoder.0.cross_attn.kv_proj",
        "decoder.0.cross_attn.out_proj",
        "decoder.0.ffn.w1",
        "decoder.0.ffn.w2",
    )
}


def module(weight_decay: float, **model: Any) -> TranslationModule:
    config = TransformerConfig(vocab_size=50, n_layers=1, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8, **model)
    optim = OptimSettings(schedule="inverse_sqrt", lr=0.5, warmup=1, weight_decay=weight_decay)
    return TranslationModule(model=config, bos_id=2, eos_id=3, optim=optim)


def group_names(module: TranslationModule, optimizer: torch.optim.Optimizer) -> list[set[str]]:
    names = {id(p): name for name, p in module.named_parameters()}
    return [{names[id(p)] for p in group["params"]} for group in optimizer.param_groups]


@pytest.mark.parametrize(
    ("model", "also_decayed"),
    [
        ({"positional": "learned"}, set()),  # tied: the output projection is the embedding, which does not decay
        ({"share_embeddings": False}, {"model.output_proj.weight"}),  # untied: a linear map of its own
    ],
)
def test_only_the_weights_of_linear_maps_decay_not_biases_layernorms_or_embeddings(
    model: dict[str, Any], also_decayed: set[str]
) -> None:
    built = module(0.1, **model)
    optimizer = built.configure_optimizers()["optimizer"]
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"] is True
    decayed, kept = group_names(built, optimizer)
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.0]
    assert decayed == LINEAR_WEIGHTS | also_decayed
    assert decayed | kept == {name for name, _ in built.named_parameters()} and not decayed & kept
    assert {"model.src_embed.weight", "model.encoder.0.ffn.w1.bias", "model.decoder.0.ffn_block.norm.weight"} <= kept
    assert ("model.positions.embedding.weight" in kept) == (model.get("positional") == "learned")


def test_without_weight_decay_the_optimizer_is_the_papers_adam_in_one_group() -> None:
    optimizer = module(0.0).configure_optimizers()["optimizer"]
    assert type(optimizer) is torch.optim.Adam and len(optimizer.param_groups) == 1
    assert optimizer.param_groups[0]["weight_decay"] == 0 and not optimizer.defaults["decoupled_weight_decay"]


def test_a_decayed_weight_with_a_zero_gradient_shrinks_by_lr_times_decay_times_itself() -> None:
    built = module(0.1)
    optimization = built.configure_optimizers()
    optimizer = optimization["optimizer"]
    lr = optimization["lr_scheduler"]["scheduler"].get_last_lr()[0]
    assert lr == 0.5  # step 1 of warmup 1: the peak
    before = {name: p.detach().clone() for name, p in built.named_parameters()}
    for p in built.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, p in built.named_parameters():
        if name in LINEAR_WEIGHTS:  # Adam's own update of a zero gradient is zero: only the decay moves it
            torch.testing.assert_close(before[name] - p.detach(), lr * 0.1 * before[name])
        else:
            assert torch.equal(p.detach(), before[name]), name


def checkpoint_of(built: TranslationModule) -> dict[str, Any]:
    """What a checkpoint holds of ``built``'s optimisation after one step, as Lightning writes it."""
    optimization = built.configure_optimizers()
    optimizer, scheduler = optimization["optimizer"], optimization["lr_scheduler"]["scheduler"]
    for p in built.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    scheduler.step()
    return {
        "pytorch-lightning_version": pl.__version__,
        "state_dict": built.state_dict(),
        "optimizer_states": [optimizer.state_dict()],
        "lr_schedulers": [scheduler.state_dict()],
    }


def test_a_resume_with_another_weight_decay_keeps_the_moments_and_decays_by_the_new_one(tmp_path: Path) -> None:
    checkpoint, path = checkpoint_of(module(0.1)), tmp_path / "last.ckpt"
    resumed = module(0.3)
    checkpoint = RestoredState(tmp_path, resumed)(checkpoint, path)
    resumed.on_load_checkpoint(checkpoint)
    optimizer = resumed.configure_optimizers()["optimizer"]
    moments = copy.deepcopy(checkpoint["optimizer_states"][0]["state"])
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])  # as Lightning restores it, after the hook
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.3, 0.0]
    assert len(moments) == len(list(resumed.parameters()))
    for index, moment in optimizer.state_dict()["state"].items():
        assert torch.equal(moment["exp_avg"], moments[index]["exp_avg"])


@pytest.mark.parametrize(("written", "resumed"), [(0.1, 0.0), (0.0, 0.1)])
def test_a_resume_that_turns_weight_decay_on_or_off_is_refused_in_one_line_naming_the_setting(
    written: float, resumed: float, tmp_path: Path
) -> None:
    checkpoint, path = checkpoint_of(module(written)), tmp_path / "last.ckpt"
    with pytest.raises(CheckpointError) as refused:
        RestoredState(tmp_path, module(resumed))(checkpoint, path)
    message = str(refused.value)
    assert "\n" not in message and str(path) in message and "optim.weight_decay" in message, message


def test_an_adam_group_with_coupled_weight_decay_is_still_refused(tmp_path: Path) -> None:
    """Adam's own ``weight_decay`` (an L2 term in the gradient) is a rule aiayn never writes, unlike AdamW's."""
    checkpoint, path = checkpoint_of(module(0.0)), tmp_path / "last.ckpt"
    RestoredState(tmp_path, module(0.0))(copy.deepcopy(checkpoint), path)
    checkpoint["optimizer_states"][0]["param_groups"][0]["weight_decay"] = 0.1
    with pytest.raises(CheckpointError, match=r"param_groups\[0\]\.weight_decay=0\.1 is not aiayn's"):
        RestoredState(tmp_path, module(0.0))(checkpoint, path)


def test_a_negative_weight_decay_stops_the_run_in_one_line_naming_the_key(
    corpus_root: Path, cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    assert train_in_process([*smoke_run(corpus_root, cache_dir), "optim.weight_decay=-0.1"], monkeypatch) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "aiayn-train: error: optim.weight_decay=-0.1 must be a number >= 0 (0: Adam, as the paper; > 0: AdamW's "
        "decoupled weight decay)"
    ]
