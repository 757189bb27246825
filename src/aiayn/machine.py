"""What this machine has and how a process runs on it: the CPUs a process may use, its rank among a
run's processes, the device names, whether the CPU multiplies bf16, the peak FLOP/s that MFU divides
by, and glibc's allocator settings for CPU training. A leaf: data, training, the config layer and the
commands use it. torch is imported by the functions that use it: the commands that only ask for their
process's rank here (``aiayn-sweep``) start without it."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiayn.errors import FieldError, whole

if TYPE_CHECKING:
    import torch

# Where the launchers (torchrun, SLURM's srun, LSF's jsrun, Lightning's DDP launcher) put a process's
# global rank, in the order Lightning reads them (lightning_fabric.utilities.rank_zero._get_rank):
# SLURM_PROCID is set in any SLURM job, also when SLURM does not start the ranks, so it comes late.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
GLIBC_DEFAULT_THRESHOLD = 128 * 1024
RETAINING_THRESHOLD = 2**31 - 1
# After training, decoding: its key/value caches grow by a step at a time, blocks the retained heap cannot
# reuse; blocks from 4 MiB up are mmapped and unmapped on free, and the heap is trimmed above 64 MiB.
DECODING_MMAP_THRESHOLD = 4 << 20
DECODING_TRIM_THRESHOLD = 64 << 20
_malloc_thresholds: tuple[int, int] | None = None  # what set_malloc_thresholds set last in this process
# oneDNN, which multiplies bf16 matrices on the CPU, builds kernels for every new shape of a product and
# keeps them in two least-recently-used caches, 1024 entries each by default: its own primitive cache
# and that of ideep, PyTorch's layer over it. Each reads its capacity from the environment once, when it
# is first used (LRU_CACHE_CAPACITY=0 crashes PyTorch 2.13).
KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
KERNEL_CACHE_CAPACITY = 4096


def available_cpus() -> int:
    """The CPUs this process may run on: a SLURM job's or a container's share, not the machine's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # macOS and Windows have no affinity masks
        return os.cpu_count() or 1


def process_rank() -> int:
    """This process's global rank among the processes of a run (0 outside DDP), as Lightning counts it:
    its ``rank_zero_only.rank`` once Lightning is loaded (its strategies set it as they start the ranks),
    else the launchers' environment (:data:`RANK_VARIABLES`), which is where Lightning's value starts from
    too. Read here rather than from Lightning so that the commands that do not train never import it:
    a single process has rank 0, and the ranks a launcher started have the variables."""
    rank_zero = sys.modules.get("lightning_utilities.core.rank_zero")
    lightning_rank = getattr(rank_zero.rank_zero_only, "rank", None) if rank_zero is not None else None
    if lightning_rank is not None:
        return lightning_rank
    return next((int(os.environ[name]) for name in RANK_VARIABLES if name in os.environ), 0)


# Dense peak tensor-core TFLOP/s per device from the vendors' data sheets (no structured sparsity), by
# the arithmetic a precision setting runs the matrix products in. The first name contained in the
# device name wins, so more specific names come first.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2},
    "V100": {"fp16": 125.0, "fp32": 15.7},
}


def matmul_precision(precision: str) -> str:
    """The arithmetic of the matrix products under a Lightning ``precision`` setting."""
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    import torch

    # fp32 matrix products run as TF32 on tensor cores unless the "highest" precision is asked for.
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def peak_flops(device_name: str, precision: str, override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one device, or None when neither ``override_tflops`` nor the table knows it."""
    if override_tflops is not None:
        return override_tflops * 1e12
    arithmetic = matmul_precision(precision)
    for name, peaks in PEAK_TFLOPS.items():
        if name in device_name:
            tflops = peaks.get(arithmetic)
            return tflops * 1e12 if tflops is not None else None
    return None


# CPU flags of matrix units that multiply bf16 in hardware (Intel Cooper Lake and later, AMD Zen 4 and
# later). Without them bf16 products are converted to fp32 and back, and autocast only adds work.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpuinfo_field(cpuinfo: str, name: str) -> str | None:
    """The value of the first ``name : value`` line of a /proc/cpuinfo text (None where it has none)."""
    for line in cpuinfo.splitlines():
        key, colon, value = line.partition(":")
        if colon and key.strip() == name:
            return value.strip()
    return None


@functools.cache
def read_cpuinfo() -> str:
    """This machine's /proc/cpuinfo ("" where there is none: macOS, Windows)."""
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.read_text() if cpuinfo.is_file() else ""


def lists_bf16_flags(cpuinfo: str) -> bool:
    """Whether the text of /proc/cpuinfo lists a flag of :data:`BF16_CPU_FLAGS`."""
    flags = (cpuinfo_field(cpuinfo, "flags") or "").split()
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def cpu_multiplies_bf16() -> bool:
    """Whether this machine's CPU has bf16 matrix instructions (False where there is no /proc/cpuinfo)."""
    return lists_bf16_flags(read_cpuinfo())


def cpu_precision(bf16: bool | str) -> str:
    """Lightning's precision for training on the CPU: ``bf16-mixed`` (bf16 autocast) for ``bf16`` true,
    ``32-true`` for false, and for ``"auto"`` bf16 autocast where :func:`cpu_multiplies_bf16`."""
    if bf16 == "auto":
        bf16 = cpu_multiplies_bf16()
    if not isinstance(bf16, bool):
        raise FieldError("cpu_bf16", bf16, "must be true, false or auto (bf16 where the CPU has it)")
    return "bf16-mixed" if bf16 else "32-true"


@functools.cache
def device_name(device: torch.device) -> str:
    """The GPU's marketing name, or the CPU model."""
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return cpuinfo_field(read_cpuinfo(), "model name") or platform.processor() or platform.machine()


@functools.cache
def _libc() -> Any:
    """The C library, loaded once (``find_library`` runs ``ldconfig``: not after every validation), or
    None where there is none to load (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _glibc_function(name: str) -> Any:
    """A function of glibc, or None where there is none (not Linux, another C library)."""
    return getattr(_libc(), name, None)


def set_malloc_thresholds(mmap_threshold: int, trim_threshold: int) -> bool:
    """glibc's ``mallopt`` for the two thresholds; False where there is no glibc (or it refuses)."""
    mallopt = _glibc_function("mallopt")
    if mallopt is None:
        return False
    global _malloc_thresholds
    mmap_set = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold))
    trim_set = bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))
    _malloc_thresholds = (mmap_threshold, trim_threshold) if mmap_set and trim_set else None
    return mmap_set and trim_set


def size_kernel_caches(capacity: int = KERNEL_CACHE_CAPACITY) -> None:
    """Let oneDNN's kernel caches (:data:`KERNEL_CACHE_VARIABLES`) hold ``capacity`` entries each, unless
    the environment sets them already. Takes effect only before the process's first bf16 matrix product.

    A CPU run multiplies in a bounded set of shapes: its training batches' (a few dozen row counts once
    the output projection's rows are padded, :func:`~aiayn.training.module.projected_rows`) and those of
    its validations' and tests' decoding (hundreds: their batches shrink as sentences finish). With the
    default capacity every validation pushed the training steps' kernels out, the steps built them
    again, and each kernel built in the middle of a step stayed in the heap between that step's tensors:
    the heap fragmented and the run's memory grew with every epoch (pytorch/pytorch#27971). Kept, the
    kernels are built once ("Memory of the default run" in benchmarks/RESULTS.md)."""
    if capacity < 1:
        raise ValueError(f"kernel cache capacity {capacity} must be at least 1")
    for name in KERNEL_CACHE_VARIABLES:
        os.environ.setdefault(name, str(capacity))


def retain_freed_memory() -> bool:
    """Keep large freed blocks in glibc's heap instead of returning them to the kernel, and keep every
    kernel a run builds (:func:`size_kernel_caches`), so that what the heap keeps stays what the steps
    reuse.

    Every training step allocates and frees logits of batch × length × vocabulary floats (100+ MB).
    By default glibc serves such blocks with mmap and unmaps them on free, so each step pays for
    fresh, zero-filled pages. Raising the mmap and trim thresholds makes the heap reuse them: training
    steps run 1.15x faster on a 2-core CPU (`benchmarks/allocator.py`, `benchmarks/RESULTS.md`).
    Returns whether the thresholds took effect (glibc on Linux only).
    """
    size_kernel_caches()
    return set_malloc_thresholds(RETAINING_THRESHOLD, RETAINING_THRESHOLD)


def retaining_freed_memory() -> bool:
    """Whether :func:`retain_freed_memory` set glibc's thresholds in this process, and nothing since."""
    return _malloc_thresholds == (RETAINING_THRESHOLD, RETAINING_THRESHOLD)


def return_freed_memory() -> bool:
    """After training: large freed blocks go back to the kernel again (:data:`DECODING_MMAP_THRESHOLD`), as
    the final validation's and the tests' beam search wants, whose caches the retained heap, full of the
    training's holes, could only grow around. Returns whether the thresholds took effect."""
    return set_malloc_thresholds(DECODING_MMAP_THRESHOLD, DECODING_TRIM_THRESHOLD)


def release_freed_memory() -> bool:
    """Give the free pages of glibc's heap back to the kernel (``malloc_trim``), wherever they lie in it.

    What :func:`retain_freed_memory` keeps is meant for the next training steps. Decoding (validations,
    tests) frees blocks of other sizes, in between the ones the steps reuse: kept, they would add to the
    process's resident memory after every validation. Called after each, it costs one pass over the
    heap's free blocks and the page faults of the pages the next steps touch again. Returns whether
    there was a glibc to ask."""
    malloc_trim = _glibc_function("malloc_trim")
    if malloc_trim is None:
        return False
    malloc_trim(0)
    return True


# trainer.devices and trainer.num_nodes, read once: which devices a run trains on and how many processes
# that makes, as Lightning counts them (its world_size). The config's checks, the SLURM environment, the
# multirun launcher's check and the sweep's placement ask Devices instead of reading the setting each
# their own way.
GPU_ACCELERATORS = ("gpu", "cuda")


@dataclass(frozen=True)
class Devices:
    """A run's devices: ``count`` per node (None: as many as the accelerator gives, ``auto``, or all it
    has, ``every``), the ``indices`` named (a list or ``"0,1"``; None: the first ``count``), and ``nodes``."""

    count: int | None
    indices: tuple[int, ...] | None = None
    every: bool = False  # -1: all the node's devices; otherwise None counts as Lightning's "auto"
    nodes: int = 1

    @classmethod
    def parse(cls, devices: Any, num_nodes: Any = 1) -> Devices:
        """``trainer.devices`` as Lightning takes it: a count >= 1 (or its digits), a list of indices or
        ``"0,1"``, ``-1`` or ``auto``; ``num_nodes`` >= 1. A :class:`~aiayn.errors.FieldError` otherwise."""
        if not whole(num_nodes if num_nodes is not None else 1, 1):
            raise FieldError("num_nodes", num_nodes, "must be a whole number >= 1")
        nodes = int(num_nodes or 1)
        if devices in ("auto", -1, "-1"):
            return cls(None, every=devices != "auto", nodes=nodes)
        if isinstance(devices, str) and devices.strip().isdigit():
            devices = int(devices)
        if isinstance(devices, int) and not isinstance(devices, bool):
            if devices < 1:
                raise FieldError("devices", devices, "must be a number of devices >= 1, -1 or auto (all)")
            return cls(devices, nodes=nodes)
        try:
            named = devices.split(",") if isinstance(devices, str) else list(devices)
            indices = tuple(int(index) for index in named if str(index).strip())
        except (TypeError, ValueError):
            raise FieldError("devices", devices, "must be a number of devices, a list of indices, -1 or auto") from None
        if not indices or any(index < 0 for index in indices):
            raise FieldError("devices", devices, "must be a number of devices, a list of indices, -1 or auto")
        return cls(len(indices), indices, nodes=nodes)

    @property
    def several(self) -> bool:
        """Certainly more than one process: several devices named or counted, ``-1``, or several nodes
        (``auto`` may be one device; Lightning decides)."""
        return (self.count or 0) > 1 or self.every or self.nodes > 1

    def per_node(self, accelerator: str) -> int:
        """The processes a node runs on ``accelerator`` (``cpu``, ``gpu``/``cuda`` or ``auto``), as
        Lightning counts them: ``auto`` is every GPU, or one process on the CPU; ``-1`` every GPU, or one
        process per core on the CPU."""
        if self.count is not None:
            return self.count
        import torch

        gpus = torch.cuda.device_count()
        on_gpu = accelerator in GPU_ACCELERATORS or (accelerator == "auto" and gpus > 0)
        if on_gpu:
            return gpus
        return (os.cpu_count() or 1) if self.every else 1  # Lightning's count of the cores, not the affinity's

    def world_size(self, accelerator: str) -> int:
        """The processes of the run: per node, times the nodes."""
        return self.per_node(accelerator) * self.nodes
