"""The sinusoids of §3.5 and the rotary variant."""

from __future__ import annotations

import math

import torch

from aiayn.model.positional import RotaryEmbedding, SinusoidalPositionalEncoding


def test_sinusoidal_values_match_the_formula() -> None:
    d_model = 512
    table = SinusoidalPositionalEncoding(d_model, max_positions=128)(100)
    for pos in (0, 1, 7, 99):
        for i in (0, 1, 50, 255):
            angle = pos / 10000 ** (2 * i / d_model)
            assert math.isclose(table[pos, 2 * i].item(), math.sin(angle), abs_tol=1e-6)
            assert math.isclose(table[pos, 2 * i + 1].item(), math.cos(angle), abs_tol=1e-6)


def test_sinusoidal_grows_past_its_table_and_honours_offsets() -> None:
    encoding = SinusoidalPositionalEncoding(16, max_positions=4)
    long = encoding(10)
    assert long.shape == (10, 16)
    torch.testing.assert_close(encoding(3, offset=5), long[5:8])


def test_rotary_scores_depend_only_on_relative_position() -> None:
    rotary = RotaryEmbedding(d_k=8, max_positions=64)
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(qpos: int, kpos: int) -> float:
        return (rotary(q, qpos) * rotary(k, kpos)).sum().item()

    assert math.isclose(score(3, 1), score(13, 11), rel_tol=1e-4, abs_tol=1e-5)
    assert not math.isclose(score(3, 1), score(3, 2), rel_tol=1e-3)
    torch.testing.assert_close(rotary(q, 5).norm(), q.norm())  # a rotation keeps lengths
