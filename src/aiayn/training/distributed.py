"""What the DDP ranks of a run exchange: sums and maxima of a few numbers, and whole Python objects.

Every function is a collective under DDP: all ranks call it at the same point, or the run hangs. In a
single process each returns its own input. Tensors travel on ``device``, the one the process group
communicates on (the module's: a GPU under NCCL, the CPU under gloo).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def distributed() -> bool:
    """Whether this process is one of several DDP ranks."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def summed_over_ranks(values: Sequence[float] | torch.Tensor, device: torch.device | str = "cpu") -> list[float]:
    """Each of ``values`` summed over the ranks (in float64: token counts outgrow float32's integers)."""
    return _all_reduce(values, device, torch.distributed.ReduceOp.SUM)


def max_over_ranks(
    values: Sequence[float] | torch.Tensor, device: torch.device | str = "cpu", group: Any = None
) -> list[float]:
    """Each of ``values`` at its largest over the ranks: a flag any rank raised (1.0) reaches them all.
    ``group``: the process group to reduce over (:func:`host_group` for values that live on the host)."""
    return _all_reduce(values, device, torch.distributed.ReduceOp.MAX, group)


def host_group() -> Any:
    """A process group of all ranks whose collectives run on the CPU, for flags the host holds: exchanging
    them over NCCL would copy them to the GPU and back, and the copy back waits for every kernel queued
    before it (a host-device sync per call). ``None`` (the default group) where that already is gloo, or
    in a single process. A collective: every rank calls it at the same point."""
    if not distributed() or torch.distributed.get_backend() == "gloo":
        return None
    return torch.distributed.new_group(backend="gloo")


def device_max_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with each element at its largest over the ranks, in place on its device (the host does
    not wait for the values, unlike :func:`max_over_ranks`, which reads them)."""
    if distributed():
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return tensor


def _all_reduce(
    values: Sequence[float] | torch.Tensor, device: torch.device | str, op: Any, group: Any = None
) -> list[float]:
    if not distributed() or torch.distributed.get_world_size() == 1:
        # A single process reads its own values back: no float64 tensor on a device that may lack them (MPS).
        return [float(value) for value in (values.tolist() if isinstance(values, torch.Tensor) else values)]
    tensor = torch.as_tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(tensor, op=op, group=group)
    return tensor.tolist()


def gathered_from_ranks(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (as Lightning's checkpoint saving is: every rank builds the
    checkpoint, rank 0 writes it); ``[value]`` in a single process."""
    if not distributed():
        return [value]
    values: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(values, value)
    return values


def own_share(values: list[Any]) -> Any:
    """This rank's entry of :func:`gathered_from_ranks`'s list; rank 0's when the run was saved on fewer
    ranks than it resumes on."""
    rank = torch.distributed.get_rank() if distributed() else 0
    return values[rank] if rank < len(values) else values[0]
