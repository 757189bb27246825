"""Impossible or inconsistent settings stop ``aiayn-train`` before any work: exit status 2 and one line on
stderr that names the key and the value, no traceback, and no run folder left behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from aiayn.machine import available_cpus
from helpers.runs import refusal, smoke_run


def base(root: Path, cache: Path) -> list[str]:
    return smoke_run(root, cache, "trainer.max_steps=1")


# (overrides, the key the message must name, the value it must show)
BAD_CONFIGS = [
    (["model.d_model=0"], "model.d_model", "0"),
    (["model.n_heads=-8"], "model.n_heads", "-8"),
    (["model.d_ff=0"], "model.d_ff", "0"),
    (["model.n_layers=0"], "model.n_layers", "0"),
    (["model.d_k=two"], "model.d_k", "two"),
    (["data.vocab_size=0"], "data.vocab_size", "0"),
    (["model.d_model=511"], "model.d_model", "511"),  # sinusoids come in pairs (§3.5)
    (["model.positional=rope", "model.d_k=63"], "model.d_k", "63"),
    (["model.dropout=1.0"], "model.dropout", "1.0"),
    (["model.attn_dropout=-0.1"], "model.attn_dropout", "-0.1"),
    (["model.activation_dropout=1"], "model.activation_dropout", "1"),
    (["checkpoint.answer=last"], "checkpoint.answer", "last"),
    (["checkpoint.answer=ema", "ema.decay=null"], "checkpoint.answer", "ema"),  # no EMA to answer with
    (["checkpoint.answer=averaged", "checkpoint.average_last=1"], "checkpoint.answer", "averaged"),
    (["model.positional=xpos"], "model.positional", "xpos"),
    (["model/attention=grouped_query", "model.attention.kv_heads=3"], "model.attention.kv_heads", "3"),  # of 4 heads
    (["model/feed_forward=swiglu", "model.feed_forward.activation=tanh"], "model.feed_forward.activation", "tanh"),
    (["model/norm=rms_norm", "+model.norm.center=true"], "model.norm.center", "true"),  # not RMSNorm's argument
    (["model.attention={{_target_:nowhere.Attention}}"], "model.attention._target_", "nowhere.Attention"),
    (["experiment=mini/E", "model/positional=t5"], "model.positional", "learned"),  # E sets it after the choice
    (["model.decoder_layers=0"], "model.decoder_layers", "0"),
    (["+model.heads=4"], "model.heads", "4"),
    (["data.max_tokens=100"], "data.max_tokens", "100"),  # data.max_len is 256
    (["data.max_len=0"], "data.max_len", "0"),
    (["data.eval_max_tokens=-1"], "data.eval_max_tokens", "-1"),
    (["model.positional=learned", "model.max_positions=64"], "data.max_len", "256"),
    (["trainer.devices={too_many}"], "trainer.devices", "{too_many}"),  # more processes than CPU cores
    (["trainer.devices=0"], "trainer.devices", "0"),
    (["data.root={tmp}/no-such-folder"], "data.root", "no-such-folder"),
    (["data.tgt_lang=en"], "data.tgt_lang", "en"),  # source and target are both English
    (["data.src_lang=xx"], "data.src_lang", "xx"),
    (["data=wmt14_en_de", "data.config=fr-en"], "data.config", "fr-en"),
    (["data=text"], "data.src_lang", "???"),
    (["optim.label_smoothing=1.5"], "optim.label_smoothing", "1.5"),
    (["optim.warmup=0"], "optim.warmup", "0"),
    (["optim.betas=[0.9]"], "optim.betas", "[0.9]"),
    (["+optim.warmpu=10"], "optim.warmpu", "10"),
    (["decoding.beam_size=0"], "decoding.beam_size", "0"),
    (["checkpoint.keep_last=2", "checkpoint.average_last=9"], "checkpoint.average_last", "9"),
    (["checkpoint.every_steps=0"], "checkpoint.every_steps", "0"),
    (["checkpoint.mode=maximize"], "checkpoint.mode", "maximize"),
    (["checkpoint.monitor=val/blue"], "checkpoint.monitor", "val/blue"),  # else found at the first validation
    (["name=${{oops}}"], "oops", "cannot be resolved"),  # an interpolation in the run folder's name
    (["tokens_per_step=10"], "tokens_per_step", "10"),
    (["data.max_tokens=null"], "data.max_tokens", "null"),  # the device's share of a tokens_per_step not set
    (["tokens_per_step=25000", "data.max_tokens=null", "micro_batch_cap=100"], "micro_batch_cap", "100"),  # < max_len
    (["tokens_per_step=25000", "micro_batch_cap=700"], "data.max_tokens", "800"),  # over the cap
    (["micro_batch_cap=0"], "micro_batch_cap", "0"),
    (["sdpa_backends=[flash,fast]"], "sdpa_backends", "fast"),
    (["sdpa_backends=[]"], "sdpa_backends", "[]"),
    (["gc_every=0"], "gc_every", "0"),
    (["callbacks=[{{_target_:collections.OrderedDict}}]"], "callbacks", "OrderedDict"),  # not a Lightning callback
    (["trainer.precision=bf17"], "trainer.precision", "bf17"),
    (["cpu_bf16=yes"], "cpu_bf16", "yes"),  # hardware=cpu's choice of bf16 autocast
    (["decoding=mbr"], "decoding.mbr", "chrf"),  # aiayn-eval's and aiayn-translate's: a run tests with its search
    (["trainer.max_steps=0"], "trainer.max_steps", "0"),
    (["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches", "0"),
    (["trainer.val_check_interval=0"], "trainer.val_check_interval", "0"),
    (["trainer.gradient_clip_val=-1"], "trainer.gradient_clip_val", "-1"),
    (["+trainer.max_step=10"], "trainer.max_step", "10"),
    (["data.num_workers=-1"], "data.num_workers", "-1"),
    (["data.tokenizer_sample=abc"], "data.tokenizer_sample", "abc"),
    (["+data.foo=1"], "data.foo", "1"),
    (["progress=loud"], "progress", "loud"),
    (["seed=abc"], "seed", "abc"),
    (["max_nonfinite_steps=0"], "max_nonfinite_steps", "0"),
    (["model.compile=maybe"], "model.compile", "maybe"),
    (["resume={tmp}/none.ckpt"], "resume", "none.ckpt"),
    (["resume=true"], "resume", "true"),  # no earlier run of this name
    (["logger=wandb", "logger.wandb.mode=loud"], "logger.wandb.mode", "loud"),
    # Hydra's own errors: an unknown config option, an unknown key
    (["model=huge"], "model/huge", "huge"),
    (["model.heads=4"], "model.heads", "4"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "key", "value"), BAD_CONFIGS, ids=lambda v: " ".join(v) if isinstance(v, list) else None
)
def test_a_bad_setting_stops_before_any_work_naming_the_key(
    overrides: list[str],
    key: str,
    value: str,
    corpus_root: Path,
    cache_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    monkeypatch.chdir(tmp_path)  # run folders go to ./outputs
    names = {"tmp": tmp_path, "too_many": available_cpus() + 1}
    overrides, value = [override.format(**names) for override in overrides], value.format(**names)
    line = refusal([*base(corpus_root, cache_dir), *overrides], monkeypatch, capsys)
    assert key in line and value in line, line
    assert "HYDRA_FULL_ERROR" not in os.environ  # set for Hydra only while the command runs


@pytest.mark.slow
def test_the_installed_command_exits_with_2_and_one_line(corpus_root: Path, cache_dir: Path, tmp_path: Path) -> None:
    """The real console script in its own process: the status a shell or a scheduler sees."""
    done = subprocess.run(
        [sys.executable, "-m", "aiayn.cli.train", *base(corpus_root, cache_dir), "model.dropout=1.5"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["aiayn-train: error: model.dropout=1.5 must be a probability in [0, 1)"]
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").glob("*/*"))


def test_a_validation_interval_longer_than_an_epoch_stops_in_one_line(
    corpus_root: Path, cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """How many batches an epoch holds is known once the corpus is encoded: a whole-batch interval that
    validations at the epochs' ends could never reach stops the run there, with the key and the fix
    (Lightning's own check raises with a traceback)."""
    monkeypatch.chdir(tmp_path)
    overrides = ["trainer.val_check_interval=1000", "trainer.check_val_every_n_epoch=1"]
    line = refusal([*base(corpus_root, cache_dir), *overrides], monkeypatch, capsys)
    assert line.startswith("trainer.val_check_interval=1000 is more than an epoch's ")
    assert "checkpoint.every_steps=N" in line
