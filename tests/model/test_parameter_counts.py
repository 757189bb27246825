"""Parameter counts against Table 3's column, and aiayn-summary."""

from __future__ import annotations

import json
import subprocess

import pytest

from aiayn.cli.summary import summarize, with_override
from aiayn.config.compose import compose_config
from aiayn.model import Transformer, TransformerConfig, count_parameters, forward_flops


def paper_parameters(vocab: int = 37000, d_model: int = 512, d_ff: int = 2048, n_layers: int = 6) -> int:
    """A post-LN Transformer's parameters, counted by hand from §3: 63,082,496 for base at the paper's 37000
    tokens, 214,245,376 for big (d_model 1024, d_ff 4096)."""
    attention = 4 * (d_model * d_model + d_model)  # W^Q, W^K, W^V (all h heads) and W^O, each with a bias (§3.2.2)
    feed_forward = d_model * d_ff + d_ff + d_ff * d_model + d_model  # two linear maps with biases (§3.3)
    norm = 2 * d_model  # a LayerNorm's gain and bias, one per sub-layer (§3.1)
    encoder_layer = attention + feed_forward + 2 * norm
    decoder_layer = 2 * attention + feed_forward + 3 * norm  # self-attention and encoder-decoder attention
    return vocab * d_model + n_layers * (encoder_layer + decoder_layer)  # one embedding matrix, shared (§3.4)


@pytest.mark.parametrize(("model", "paper_millions"), [("base", 65), ("big", 213)])
def test_parameter_count_is_within_5_percent_of_table_3(model: str, paper_millions: float) -> None:
    summary = summarize(compose_config("summary", [f"model={model}", "data.vocab_size=37000"]))
    assert abs(summary["params"] / 1e6 - paper_millions) / paper_millions < 0.05
    assert summary["params"] == sum(summary["params_by_component"].values())
    assert summary["params_by_component"]["embeddings"] == 37000 * (512 if model == "base" else 1024)
    assert summary["params"] == (paper_parameters() if model == "base" else paper_parameters(d_model=1024, d_ff=4096))


def test_shared_embedding_is_one_matrix() -> None:
    shared = Transformer(TransformerConfig(vocab_size=1000, n_layers=1, d_model=32, d_ff=64, n_heads=2, d_k=16, d_v=16))
    assert shared.src_embed.weight is shared.tgt_embed.weight is shared.output_proj.weight
    separate = Transformer(
        TransformerConfig(
            vocab_size=1000, n_layers=1, d_model=32, d_ff=64, n_heads=2, d_k=16, d_v=16, share_embeddings=False
        )
    )
    assert count_parameters(separate) - count_parameters(shared) == 2 * 1000 * 32


def test_d_k_changes_parameters_as_row_b_says() -> None:
    """Rows B1/B2 shrink only W^Q and W^K: 58M and 60M in the paper's column."""
    for d_k, paper in ((16, 58), (32, 60)):
        summary = summarize(compose_config("summary", ["model=base", f"model.d_k={d_k}", "data.vocab_size=37000"]))
        assert abs(summary["params"] / 1e6 - paper) / paper < 0.05


def test_forward_flops_of_a_one_token_pair_are_twice_the_parameters() -> None:
    """One source token meets every encoder weight, one target token every decoder and output weight:
    2 FLOPs per parameter (the attention terms are negligible at length 1)."""
    cfg = TransformerConfig(vocab_size=37000)
    assert forward_flops(cfg, 1, 1) == pytest.approx(2 * paper_parameters(), rel=0.01)


@pytest.mark.slow
def test_summary_cli_prints_counts_and_ends_with_json_without_any_data() -> None:
    command = ["aiayn-summary", "model=base", "data.vocab_size=37000", "data.root=/nonexistent"]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["params"] == paper_parameters()
    assert "decoder" in out
    # 6 FLOPs per parameter per sentence pair, spread over a source and a target token, plus attention
    assert 3 * paper_parameters() < summary["train_flops_per_token"] < 3.3 * paper_parameters()


def test_summarys_own_sweep_folder_joins_the_users_overrides_wherever_the_flags_are() -> None:
    for argv in (["model=base", "--cfg", "job"], ["--cfg", "job", "model=base"], ["-m", "model=base,big", "seed=2"]):
        rebuilt = with_override(["aiayn-summary", *argv], "hydra.sweep.dir=/tmp/x")
        flags = [item for item in argv if "=" not in item]
        assert rebuilt == ["aiayn-summary", *flags, *[i for i in argv if "=" in i], "hydra.sweep.dir=/tmp/x"]
