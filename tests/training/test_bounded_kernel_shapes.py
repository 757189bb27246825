"""The default run's memory stays flat only if the shapes of its matrix products are few and their kernels
all kept: on the CPU oneDNN builds kernels for every new shape of a bf16 product and caches them, and a
cache that keeps dropping and rebuilding them fragments the heap (benchmarks/memory.py: the RSS grew by
~0.3 GB an epoch). Training projects a row count rounded up by ``projected_rows``, with the loss and
gradients of the real rows alone, the kernel caches are sized before the first product, and what the
decoding frees goes back to the kernel after each validation and test."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import aiayn.machine
import aiayn.training.module as training_module
from aiayn.machine import (
    DECODING_MMAP_THRESHOLD,
    DECODING_TRIM_THRESHOLD,
    KERNEL_CACHE_CAPACITY,
    KERNEL_CACHE_VARIABLES,
    retain_freed_memory,
    size_kernel_caches,
)
from aiayn.model import TransformerConfig
from aiayn.training.module import TranslationModule, projected_rows
from aiayn.training.schedule import OptimSettings
from helpers.batches import BOS, EOS, ragged_batch

CFG = TransformerConfig(vocab_size=64, n_layers=1, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8, dropout=0.0)


def test_the_output_projection_runs_on_projected_row_counts_with_the_real_rows_loss(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    module = TranslationModule(model=CFG, bos_id=BOS, eos_id=EOS, optim=OptimSettings(label_smoothing=0.1))
    projected: list[int] = []
    module.model.output_proj.register_forward_pre_hook(lambda _, args: projected.append(args[0].size(0)))
    rng = np.random.default_rng(0)
    real = []
    for _ in range(12):  # ragged batches of as many real target counts
        lengths = [(int(s), int(t)) for s, t in rng.integers(1, 12, size=(int(rng.integers(1, 6)), 2))]
        batch = ragged_batch(lengths, CFG.vocab_size)
        results = []
        for rounding in (projected_rows, int):  # int: the real rows alone, as before the padding
            monkeypatch.setattr(training_module, "projected_rows", rounding)
            module.zero_grad()
            loss, counted = module.training_loss(batch)
            loss.backward()
            results.append((loss.detach(), counted, [p.grad.clone() for p in module.parameters()]))
        (loss, counted, grads), (real_loss, real_counted, real_grads) = results
        real.append(real_counted)
        assert counted == real_counted == int(batch["lengths"][:, 1].sum())  # the per-token mean's count
        torch.testing.assert_close(loss, real_loss, rtol=1e-6, atol=0)
        for grad, real_grad in zip(grads, real_grads, strict=True):
            torch.testing.assert_close(grad, real_grad, rtol=1e-5, atol=1e-7)
    padded = projected[::2]
    assert padded == [-(-n // 16) * 16 for n in real]  # counts below 256 take multiples of 16
    assert len(set(padded)) < len(set(real))


def test_projected_row_counts_are_few_and_waste_at_most_a_sixteenth() -> None:
    real = np.arange(1, 1 << 17)
    projected = np.array([projected_rows(int(n)) for n in real])
    assert (projected >= real).all() and (projected - real < np.maximum(16, real / 16)).all()
    for octave in range(8, 17):  # 16 counts per doubling above 256, where rows of 16 would take up to 4096
        within = projected[(real > 1 << octave) & (real <= 2 << octave)]
        assert len(np.unique(within)) == 16
    # a 25000-token batch's target tokens over a run (fill 0.89-0.94 of ~12500): 2 counts, not 40
    assert len({projected_rows(n) for n in range(11125, 11750)}) == 2


def test_the_kernel_caches_are_sized_unless_the_environment_sizes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aiayn.machine, "set_malloc_thresholds", lambda *_: True)  # this process's heap stays
    for name in KERNEL_CACHE_VARIABLES:  # set, then removed: the test's end restores them as they were
        monkeypatch.setenv(name, "1")
        monkeypatch.delenv(name)
    monkeypatch.setenv(KERNEL_CACHE_VARIABLES[1], "64")  # a user's own setting
    assert retain_freed_memory()  # what aiayn-train calls before it trains
    assert [aiayn.machine.os.environ[name] for name in KERNEL_CACHE_VARIABLES] == [str(KERNEL_CACHE_CAPACITY), "64"]
    with pytest.raises(ValueError, match="at least 1"):
        size_kernel_caches(0)  # LRU_CACHE_CAPACITY=0 crashes PyTorch at its first bf16 product


RELEASE_PROBE = """
import gc, sys
from pathlib import Path
from aiayn.machine import release_freed_memory, set_malloc_thresholds

def rss_mb():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024

set_malloc_thresholds(2**31 - 1, 2**31 - 1)  # as aiayn-train keeps freed memory
blocks = [bytearray(1 << 20) for _ in range(300)]  # 300 MB in the heap, touched
pins = [bytearray(64) for _ in range(300)]  # small live blocks after them: the heap's top cannot shrink
start = rss_mb()
del blocks[:]
gc.collect()
kept = rss_mb()
released = release_freed_memory()
print(released, round(start), round(kept), round(rss_mb()), len(pins))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap: Linux only")
def test_released_memory_leaves_the_resident_set_and_kept_memory_does_not() -> None:
    """In a fresh process (the suite's own heap is no measure): 300 MB freed under aiayn-train's thresholds
    stay resident until release_freed_memory, then leave it."""
    done = subprocess.run([sys.executable, "-c", RELEASE_PROBE], capture_output=True, text=True, timeout=60, check=True)
    released, start, kept, after, _ = done.stdout.split()
    assert released == "True"
    assert int(kept) > int(start) - 30  # kept: freed, yet resident
    assert int(after) < int(kept) - 250  # released: ≥ 250 of the 300 MB gone


@pytest.mark.slow
def test_training_ends_by_returning_freed_memory_to_the_kernel_for_the_decoding() -> None:
    """aiayn-train retains freed memory for the training steps; the end of training hands it back to the
    kernel and lets the final validation and tests (beam search) return large blocks when freed. A process
    that never retained it keeps its thresholds."""
    probe = (
        "from aiayn import machine\n"
        "from aiayn.training.callbacks.garbage import FreedMemoryRelease\n"
        "FreedMemoryRelease().on_train_end(None, None)\n"
        "untouched = machine._malloc_thresholds\n"
        "machine.retain_freed_memory()\n"
        "retained = machine.retaining_freed_memory()\n"
        "FreedMemoryRelease().on_train_end(None, None)\n"
        "print(untouched, retained, machine.retaining_freed_memory(), machine._malloc_thresholds)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    decoding = (DECODING_MMAP_THRESHOLD, DECODING_TRIM_THRESHOLD)
    assert done.stdout.strip().split(maxsplit=3) == ["None", "True", "False", str(decoding)]
