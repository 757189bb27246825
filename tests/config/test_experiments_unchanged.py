"""The paper's experiments compose to what they composed to before the knobs beyond the paper existed.

``tests/assets/experiment_configs.json`` holds every ``experiment=paper/*``, ``table3/*`` and ``mini/*``
config as it composed then (resolved). A knob added for the CPU default (a schedule, weight decay, EMA,
BPE-dropout...) must reach them switched off, so that their numbers do not move.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from omegaconf import OmegaConf

from helpers.compose import composed_run
from helpers.runs import REPO

SNAPSHOT = json.loads((REPO / "tests" / "assets" / "experiment_configs.json").read_text())
# Keys added since the snapshot, each with the value that keeps the paper's behaviour.
ADDED = {
    "model.activation_dropout": 0.0,
    "model.packed_attention": False,  # how attention runs, not what it computes
    "optim.schedule": "noam",  # eq. 3, as before; the other optim keys below are off under it
    "optim.lr": None,
    "optim.min_lr": 0.0,
    "optim.decay_fraction": 0.2,
    "optim.weight_decay": 0.0,
    "ema.decay": None,
    "ema.start_step": 0,
    "checkpoint.average_every": None,
    "checkpoint.answer": "evaluated",  # step checkpoints at validations, as before
    "data.bpe_dropout": 0.0,
    "data.prefetch_factor": None,  # how fast batches come, not what they hold
    "data.batch_shapes": None,  # each batch padded to its own longest sentences, as before
    "cpu_bf16": False,  # fp32 on hardware=cpu whatever the CPU
    # How the step runs, not what it computes:
    "gc_every": 50,  # Python's garbage collection between steps
    "sdpa_backends": ["flash", "efficient", "math"],  # the attention kernels
    "micro_batch_cap": None,  # a cap on micro-batches: none
    "logger.wandb.artifacts": "none",  # how a run reports: no checkpoints uploaded
    "decoding.ensemble": "log_prob",  # how an ensemble's members combine: as before (one model: no matter)
    "decoding.mbr": None,  # no minimum Bayes risk decoding (a run cannot have it: aiayn-eval's)
    "decoding.mbr_nbest": None,
    "decoding.mbr_samples": 0,
    # The paper's components, by null specs, in stacks of n_layers:
    "model.encoder_layers": None,
    "model.decoder_layers": None,
    "model.attention": None,
    "model.feed_forward": None,
    "model.norm": None,
    **{
        f"val_decoding.{key}": value
        for key, value in (("ensemble", "log_prob"), ("mbr", None), ("mbr_nbest", None), ("mbr_samples", 0))
    },  # as decoding's (val_decoding=same)
}
# Sections added since the snapshot that copy a section of it: val_decoding=same validates as decoding says.
COPIES = {"val_decoding": "decoding"}
# Deliberate changes: (experiment, key) → the value it has now.
CHANGED = {
    ("table3/big", "checkpoint.evaluate"): "final",  # scored like every other row of Table 3
    # The paper's 25000 tokens per step as one micro-batch per device (8 GPUs: 3125 each, as before) rather
    # than 3125-token micro-batches accumulated on fewer devices.
    **{(name, "data.max_tokens"): None for name, config in SNAPSHOT.items() if config["tokens_per_step"] == 25000},
}


def flat(node: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys → leaf values (lists are leaves)."""
    if not isinstance(node, dict):
        return {prefix.removesuffix("."): node}
    items: dict[str, Any] = {}
    for key, value in node.items():
        items.update(flat(value, f"{prefix}{key}."))
    return items


def test_the_snapshot_covers_every_paper_table3_and_mini_experiment() -> None:
    files = {
        f"{family}/{path.stem}"
        for family in ("paper", "table3", "mini")
        for path in (REPO / "conf" / "experiment" / family).glob("*.yaml")
    }
    assert set(SNAPSHOT) == files and len(files) == 44


@pytest.mark.parametrize("experiment", sorted(SNAPSHOT))
def test_an_experiment_composes_as_before(experiment: str) -> None:
    before = flat(SNAPSHOT[experiment])
    copied = {
        f"{copy}.{key.removeprefix(source + '.')}": value
        for copy, source in COPIES.items()
        for key, value in before.items()
        if key.startswith(source + ".")
    }
    now = flat(OmegaConf.to_container(composed_run([f"experiment={experiment}"]), resolve=True))
    assert set(now) - set(before) == set(ADDED) | set(copied), "a new key: add it to ADDED with its paper value"
    assert set(before) - set(now) == set(), "a key is gone"
    changed = {key: value for (name, key), value in CHANGED.items() if name == experiment}
    expected = {**before, **ADDED, **copied, **changed}
    assert {key: value for key, value in now.items() if value != expected[key]} == {}
