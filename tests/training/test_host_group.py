"""The ranks exchange host-side flags (a scheduler's signal) over a CPU process group, so that under NCCL
the exchange never copies to a GPU and back (a host-device sync at every step). Two real gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from aiayn.training.distributed import host_group, max_over_ranks


def _rank(rank: int, store: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        default = host_group()  # gloo already: the default group serves
        signal_seen = max_over_ranks([15.0 if rank == 1 else 0.0], "cpu", default)
        # Under NCCL (stood in for by the backend's name: no GPU here) a gloo group of the same ranks.
        real_backend = dist.get_backend
        dist.get_backend = lambda group=None: "nccl" if group is None else real_backend(group)
        try:
            side = host_group()
        finally:
            dist.get_backend = real_backend
        side_size = dist.get_world_size(side)
        side_backend = real_backend(side)
        over_side = max_over_ranks([float(rank + 3)], "cpu", side)
        Path(f"{results}.{rank}").write_text(
            f"{default is None} {signal_seen[0]} {side is not None} {side_size} {side_backend} {over_side[0]}"
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_flags_are_exchanged_on_the_cpu_over_every_rank(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path / "rank")), nprocs=2, join=True)
    for rank in (0, 1):
        assert (tmp_path / f"rank.{rank}").read_text() == "True 15.0 True 2 gloo 4.0"


def test_a_single_process_reads_its_own_flag() -> None:
    assert host_group() is None
    assert max_over_ranks(torch.tensor([2.0, 0.0])) == [2.0, 0.0]
