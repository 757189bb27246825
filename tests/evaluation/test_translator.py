"""Text in, text out: batching by length keeps the input order and the translations themselves."""

from __future__ import annotations

import pytest
import torch

from aiayn.config.build import decoding_options
from aiayn.data.tokenizer import Tokenizer
from aiayn.evaluation.translator import Translator
from aiayn.model import Transformer, TransformerConfig
from helpers.word_corpus import word_lines, word_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return word_tokenizer(tmp_path_factory.mktemp("spm"))


def random_translator(tokenizer: Tokenizer, max_tokens: int = 8192, **decoding: int | float) -> Translator:
    """A random model's translator; ``decoding`` as a user's ``decoding.*`` settings (checked as the CLI does)."""
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=tokenizer.vocab_size, n_layers=1, d_model=32, d_ff=64, n_heads=2, d_k=16, d_v=16, max_positions=64
    )
    return Translator(Transformer(cfg), tokenizer, decoding_options(decoding), max_tokens=max_tokens)


def test_batches_of_any_size_give_the_same_translations_in_input_order(tokenizer: Tokenizer) -> None:
    lines = word_lines(25, seed=1, shortest=1, longest=15)
    lines[3] = ""
    lines[17] = "   "
    one_batch = random_translator(tokenizer, max_tokens=100_000, max_len_offset=4).translate(lines)
    tiny_batches = random_translator(tokenizer, max_tokens=20, max_len_offset=4).translate(lines)
    one_by_one = [random_translator(tokenizer, max_len_offset=4).translate([line])[0] for line in lines]
    assert one_batch == tiny_batches == one_by_one
    assert one_batch[3] == one_batch[17] == ""  # empty in, empty out
    assert sum(bool(text) for text in one_batch) == 23
    streamed = random_translator(tokenizer, max_len_offset=4).translate_blocks(iter(lines), block=7)
    assert [found[0].text if found else "" for block in streamed for found in block] == one_batch


def test_bad_options_and_overlong_lines_are_refused(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match=r"decoding\.beam_size=0 must be"):
        random_translator(tokenizer, beam_size=0)
    with pytest.raises(ValueError, match=r"decoding\.alpha=-1 must be a number >= 0"):
        random_translator(tokenizer, alpha=-1)
    with pytest.raises(ValueError, match=r"line 2 has \d+ tokens; this model reads at most 63"):
        random_translator(tokenizer).translate(["a man", " ".join(["house"] * 80)])
    with pytest.raises(ValueError, match=r"line 5 has \d+ tokens"):  # counted across blocks of a stream
        lines = ["a man", "the dog", "red ball", "a house", " ".join(["house"] * 80)]
        list(random_translator(tokenizer).translate_blocks(iter(lines), block=2))
    with pytest.raises(ValueError, match=r"decoding\.alpha=nan must be a number >= 0"):
        random_translator(tokenizer, alpha=float("nan"))


def test_a_translator_allows_the_attention_kernels_it_is_given_cudnns_not_by_default(tokenizer: Tokenizer) -> None:
    """A process-wide switch of torch's, set when the translator is made (aiayn-translate and aiayn-eval
    pass their sdpa_backends setting); the translations are the same with any CPU kernel."""
    flags = {
        name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")
        for name in ("flash", "mem_efficient", "cudnn", "math")
    }
    before = {name: enabled() for name, enabled in flags.items()}
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        default = random_translator(tokenizer, max_len_offset=4)
        assert not torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
        lines = ["a man walks in the park", "the dog runs with a red ball"]
        translations = default.translate(lines)
        cfg = default.models[0].cfg
        math = Translator(Transformer(cfg), tokenizer, default.decoding, sdpa_backends=("math",))
        assert not torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
        math.models[0].load_state_dict(default.models[0].state_dict())
        assert math.translate(lines) == translations
        with pytest.raises(ValueError, match=r"^sdpa_backends=\['fast'\] must be a list of one or more of flash"):
            Translator(Transformer(cfg), tokenizer, sdpa_backends=["fast"])
    finally:
        for name, enabled in before.items():
            getattr(torch.backends.cuda, f"enable_{name}_sdp")(enabled)
