"""The GPUs a plan is checked against: the ones visible here, or the ones the config plans for.

Where the figures come from: the GPUs torch sees on this machine (their count and memory), else
`train.num_gpus` and `train.gpu_memory_gib` (a plan made on a login node for the cluster's GPUs). Without
either, memory is estimated but not checked. torch is imported only where an NVIDIA device exists, so a
CPU machine answers at once.
"""
from __future__ import annotations

import glob
import shutil
from dataclasses import dataclass
from typing import Any


GIB = 2**30
CPU_RANKS = 2
"""Processes `ayumi train` starts on a machine without GPUs (DeepSpeed on the CPU, gloo)."""


def gpu_count() -> int:
    """CUDA devices torch would see; answered without importing torch (~4 s) where no NVIDIA
    device or driver exists, so `ayumi train` on a CPU machine checks and launches at once."""
    if not _nvidia_present():
        return 0
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # torch missing or broken CUDA: treat as CPU
        return 0


def _nvidia_present() -> bool:
    return shutil.which("nvidia-smi") is not None or bool(glob.glob("/dev/nvidia[0-9]*"))


@dataclass
class Hardware:
    """The GPUs a plan is checked against."""

    data_parallel: int
    """Data-parallel ranks: GPUs / (tensor_parallel x sequence_parallel)."""
    gpu_bytes: int | None
    """Memory of one GPU; None: not known, memory is estimated but not checked."""
    where: str
    """Where the figures come from, for messages."""
    tensor_parallel: int = 1
    """GPUs per tensor-parallel group (parallel.tensor)."""
    device: str = "GPU"
    """What a rank runs on, for messages: "GPU", or "CPU rank" for CPU training."""
    sequence_parallel: int = 1
    """GPUs per sequence-parallel group (parallel.sequence)."""

    @classmethod
    def cpu(cls, ranks: int, tensor_parallel: int = 1, sequence_parallel: int = 1) -> "Hardware":
        """`ranks` CPU processes: the batch is checked against them, memory is not."""
        return cls(max(1, ranks // (tensor_parallel * sequence_parallel)), None, "CPU training: memory not checked",
                   tensor_parallel, "CPU rank", sequence_parallel)


def visible_gpus() -> tuple[int, int | None, str]:
    """(count, bytes of GPU 0, its name) of the GPUs torch sees here; torch is imported only where an
    NVIDIA device exists (pretrain.tools.launch.gpu_count)."""
    count = gpu_count()
    if not count:
        return 0, None, ""
    name, total_memory = gpu_properties(0)
    return count, total_memory, name


def gpu_properties(index: int) -> tuple[str, int]:
    """(name, memory in bytes) of CUDA device `index`: the one place ayumi reads them."""
    import torch

    props = torch.cuda.get_device_properties(index)
    return props.name, int(props.total_memory)


def gpu_capability(index: int) -> tuple[int, int]:
    """CUDA compute capability (major, minor) of device `index`: (9, 0) for an H100 or H200, (8, 0) for an A100."""
    import torch

    return tuple(torch.cuda.get_device_capability(index))


def visible_gpu_capabilities() -> list[tuple[str, tuple[int, int]]]:
    """(name, compute capability) of each GPU torch sees here; empty on a machine without an NVIDIA device
    (answered without importing torch, as gpu_count)."""
    return [(gpu_properties(index)[0], gpu_capability(index)) for index in range(gpu_count())]


def planned_hardware(cfg: Any, ranks: int | None = None) -> Hardware:
    """The GPUs to check against: those visible here (count and memory), else train.num_gpus and
    train.gpu_memory_gib; `ranks` when the caller knows the job's size. The data-parallel size is the GPUs
    over parallel.tensor x parallel.sequence (at least one such group is planned for). With no GPU visible and none
    planned (train.num_gpus=0, train.gpu_memory_gib=0), the plan is for what `ayumi train` starts here: CPU_RANKS
    CPU ranks, whose memory is not checked."""
    count, gpu_bytes, gpu_name = visible_gpus()
    tp, sp = cfg.parallel.tensor, cfg.parallel.sequence
    if not count and not cfg.train.num_gpus and cfg.train.gpu_memory_gib <= 0:
        return Hardware.cpu(ranks or CPU_RANKS, tp, sp)
    data_parallel = max(1, (ranks or cfg.train.num_gpus or count or 1) // (tp * sp))
    if gpu_bytes:
        return Hardware(data_parallel, gpu_bytes, f"this {gpu_name or 'GPU'}", tp, sequence_parallel=sp)
    if cfg.train.gpu_memory_gib > 0:
        return Hardware(data_parallel, int(cfg.train.gpu_memory_gib * GIB),
                        f"each GPU (train.gpu_memory_gib={cfg.train.gpu_memory_gib:g})", tp, sequence_parallel=sp)
    return Hardware(data_parallel, None, "train.gpu_memory_gib unset", tp, sequence_parallel=sp)