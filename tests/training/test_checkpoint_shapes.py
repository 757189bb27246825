"""A checkpoint's stored model settings are compared with its weights before anything of their size is
built: a tiny file asking for a huge model ends in one line, without the memory it asks for."""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any

import pytest
import torch

from aiayn.errors import CheckpointError
from aiayn.training.checkpoints import average_checkpoints, check_tensor_sizes, load_model


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"n_layers": 4096}, "n_layers=4096 does not match the weights, which hold 2 encoder layers"),
        ({"d_ff": 2**22}, "weights[encoder.0.ffn.w1.weight]"),  # 2 x 2 x 2^22 x 64 floats: 4 GiB
        ({"max_positions": 2**26}, "max_positions=67108864 needs a position table"),  # 16 GiB of sinusoids
        ({"max_positions": 2**26, "positional": "rope"}, "max_positions=67108864 needs a position table"),
        ({"vocab_size": 2**24}, "weights[src_embed.weight]"),
        ({"n_heads": 2**16}, "weights[encoder.0.self_attn.qkv_proj.weight]"),
        ({"pad_id": 10**12}, "pad_id=1000000000000 must be a token id"),
        ({"d_model": "64"}, "d_model=64 must be a positive whole number"),
        ({"surprise": 1}, "unexpected keyword argument 'surprise'"),
        ({"dropout": 10**400}, "must be a probability"),
        ({"positional": "none", "max_positions": 10**30}, "max_positions=1000000000000000000000000000000 needs"),
    ],
)
def test_stored_settings_that_are_not_the_weights_end_in_one_line_without_their_memory(
    smoke_run_dir: Path, tmp_path: Path, settings: dict[str, Any], named: str
) -> None:
    checkpoint = torch.load(smoke_run_dir / "checkpoints" / "best.ckpt", weights_only=True)
    checkpoint["hyper_parameters"]["model"].update(settings)
    path = tmp_path / "huge.ckpt"
    torch.save(checkpoint, path)
    before = peak_rss_mib()
    with pytest.raises(CheckpointError) as refused:
        load_model(path)
    message = str(refused.value)
    assert "\n" not in message and str(path) in message and "hyper_parameters.model" in message, message
    assert named in message, message
    assert peak_rss_mib() - before < 256  # the file holds 1 MB of weights; the settings ask for GiBs


def test_a_checkpoint_whose_settings_are_its_weights_loads(smoke_run_dir: Path) -> None:
    model, tokenizer, config = load_model(smoke_run_dir / "checkpoints" / "best.ckpt")
    assert model.cfg.n_layers == 2 and tokenizer.vocab_size == model.cfg.vocab_size == 1000
    assert config["seed"] == 1


def test_an_expanded_tensor_is_refused_before_any_copy_of_it(smoke_run_dir: Path, tmp_path: Path) -> None:
    """``torch.zeros(1).expand(n)`` is saved as 4 bytes and loads as n numbers: with settings to match,
    every shape check passes, and building the model or averaging would allocate them all."""
    checkpoint = torch.load(smoke_run_dir / "checkpoints" / "best.ckpt", weights_only=True)
    checkpoint["hyper_parameters"]["model"]["d_ff"] = 2**24
    for layer in range(2):
        for side in ("encoder", "decoder"):
            prefix = f"model.{side}.{layer}.ffn."
            checkpoint["state_dict"][prefix + "w1.weight"] = torch.zeros(1).expand(2**24, 64)
            checkpoint["state_dict"][prefix + "w1.bias"] = torch.zeros(1).expand(2**24)
            checkpoint["state_dict"][prefix + "w2.weight"] = torch.zeros(1).expand(64, 2**24)
    path = tmp_path / "expanded.ckpt"
    torch.save(checkpoint, path)
    assert path.stat().st_size < 10 * 2**20  # a few MB on disk, 2^24 x 64 x 8 floats when built
    before = peak_rss_mib()
    for load in (load_model, lambda p: average_checkpoints([p, smoke_run_dir / "checkpoints" / "best.ckpt"])):
        with pytest.raises(CheckpointError, match=r"encoder\.0\.ffn\.w1\.weight is a tensor of \d+ numbers stored in"):
            load(path)
    assert peak_rss_mib() - before < 256


@pytest.mark.parametrize(
    "tensor",
    [
        lambda: torch.sparse_coo_tensor(torch.zeros(2, 1, dtype=torch.long), torch.ones(1), (10**6, 10**6)),
        lambda: torch.empty(10**6, 10**6, device="meta"),
    ],
    ids=["sparse", "meta"],
)
def test_a_tensor_that_is_not_a_dense_cpu_tensor_is_refused_wherever_it_is(
    smoke_run_dir: Path, tmp_path: Path, tensor: Any
) -> None:
    checkpoint = torch.load(smoke_run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    checkpoint["hyper_parameters"]["junk"] = tensor()
    path = tmp_path / "odd.ckpt"
    torch.save(checkpoint, path)
    # Refused before the load: the pickle calls a rebuild that aiayn's checkpoints never call.
    refused = (
        r"holds torch\._utils\._rebuild_(sparse_tensor|meta_tensor_no_storage) objects, not only tensors and plain"
    )
    for load in (load_model, lambda p: average_checkpoints([p, smoke_run_dir / "checkpoints" / "best.ckpt"])):
        with pytest.raises(CheckpointError, match=refused):
            load(path)
    with pytest.raises(CheckpointError, match=r"^checkpoint x: junk is a .* tensor on \w+; aiayn writes dense"):
        check_tensor_sizes({"junk": tensor()}, Path("x"))  # a checkpoint of the user's own input/output
