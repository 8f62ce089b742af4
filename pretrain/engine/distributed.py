"""Where a process sits in the job, and how ranks agree.

`init_distributed` joins (or creates) the process group: NCCL on GPUs, gloo on the CPU, DeepSpeed's
tensor- and data-parallel groups when `parallel.tensor` > 1. The small collectives below (`all_reduce_tensor`,
`any_rank`, `barrier`, `broadcast_object`) are how the trainer, the checkpointer and the stability machinery
make decisions that change control flow together: every rank takes the same branch.
"""
from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch

import deepspeed
import torch.distributed as dist

from pretrain.config import (
    ConfigError, ParallelConfig, data_parallel_size,
)
from pretrain.engine.host_memory import keep_freed_memory_for_reuse


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    tensor_parallel: int = 1
    """Ranks per tensor-parallel group (parallel.tensor); consecutive ranks form a group."""
    sequence_parallel: int = 1
    """Ranks per sequence-parallel group (parallel.sequence); consecutive ranks form a group."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def ranks_per_sample(self) -> int:
        """Ranks that read the same samples: a tensor- or a sequence-parallel group (never both)."""
        return self.tensor_parallel * self.sequence_parallel

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: the ranks of one tensor- or sequence-parallel group share it (and
        their samples)."""
        return self.rank // self.ranks_per_sample

    @property
    def dp_size(self) -> int:
        """Data-parallel size: how many different micro-batches one forward pass of the job sees."""
        return self.world_size // self.ranks_per_sample

    @property
    def sp_rank(self) -> int:
        """This rank's place in its sequence-parallel group: which slice of each sequence it computes."""
        return self.rank % self.sequence_parallel

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_parallel


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ensure_rank_env() -> None:
    """A plain `python -m pretrain.train` is a 1-rank job (DeepSpeed would otherwise try MPI)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def pick_device(preference: str) -> torch.device:
    if preference == "cpu":
        return torch.device("cpu")
    if preference == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=auto or cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def cpu_threads(local_world: int, environ: dict[str, str] | None = None) -> int:
    """torch's intra-op threads for one CPU rank: the cores divided by the ranks on the node, so that 2 ranks
    on 2 cores do not oversubscribe, unless `OMP_NUM_THREADS` says otherwise.

    torchrun sets `OMP_NUM_THREADS=1` by itself when it starts several ranks, so on several ranks a 1 may be
    its default and the division wins; any other value, and any value on one rank (torchrun sets none there),
    is the user's and is kept. Overriding a user's 1 costs dearly: two single-rank jobs side by side on two
    cores, each given 2 OpenMP threads, spin in OpenMP's barriers against each other and ran 40x slower."""
    environ = os.environ if environ is None else environ
    fair_share = max(1, (os.cpu_count() or 1) // max(1, local_world))
    try:
        asked = int(environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return fair_share
    if asked < 1 or (asked == 1 and local_world > 1):
        return fair_share
    return asked


def init_distributed(device_preference: str = "auto", timeout_s: float | None = None,
                     tensor_parallel: int = 1, sequence_parallel: int = 1) -> DistInfo:
    """Join (or create) the process group: NCCL on GPUs, gloo on CPU. `timeout_s` bounds every collective
    (pretrain.job.hang_watchdog.process_group_timeout_s: longer than the watchdog's, which speaks first).
    With `tensor_parallel` > 1 DeepSpeed's tensor- and data-parallel groups are made here too (init_tensor_parallel),
    with `sequence_parallel` > 1 the sequence-parallel groups (init_sequence_parallel)."""
    _ensure_rank_env()
    device = pick_device(device_preference)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        # The shared-memory comm op costs a ~25 s JIT build and, with it, processes sometimes
        # abort at exit; plain gloo is fast enough for CPU runs (docs/deepspeed-on-cpu.md).
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        backend = "gloo"
        torch.set_num_threads(cpu_threads(local_world))
        keep_freed_memory_for_reuse()  # no page faults on the step's big tensors (pretrain/engine/host_memory.py)
    if not dist.is_initialized():
        extra = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        deepspeed.init_distributed(dist_backend=backend, verbose=False, **extra)
    info = DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        local_world_size=local_world,
        device=device,
        tensor_parallel=tensor_parallel,
        sequence_parallel=sequence_parallel,
    )
    if tensor_parallel > 1:
        init_tensor_parallel(info)
    if sequence_parallel > 1:
        init_sequence_parallel(info)
    return info


def init_tensor_parallel(info: DistInfo) -> None:
    """DeepSpeed's tensor- and data-parallel process groups for AutoTP, made once, before the engine.

    The engine would make the same groups itself (DeepSpeedEngine._configure_tensor_parallel_states), but
    only after DeepSpeed's config has checked the batch against *all* ranks: made here and handed to
    deepspeed.initialize as its `mpu`, the config counts data-parallel ranks (train_batch_size = micro x
    grad accum x data-parallel size, as ayumi renders it). The mesh is (data, tensor): a tensor-parallel
    group is `tensor_parallel` consecutive ranks, which DistInfo.dp_rank assumes; checked here.
    """
    from deepspeed.utils import groups

    data_parallel_size(ParallelConfig(tensor=info.tensor_parallel), info.world_size)  # ConfigError unless they divide
    groups._init_tp_mesh_device(tensor_model_parallel_size=info.tensor_parallel)
    layout = (groups.get_data_parallel_rank(), groups.get_tensor_model_parallel_rank(),
              groups.get_data_parallel_world_size())
    if layout != (info.dp_rank, info.tp_rank, info.dp_size):
        raise RuntimeError(f"DeepSpeed placed rank {info.rank} at (data {layout[0]}, tensor {layout[1]}) of "
                           f"{layout[2]} data-parallel ranks; ayumi expects ({info.dp_rank}, {info.tp_rank}) of "
                           f"{info.dp_size}: the loader would feed a tensor-parallel group different samples")


_sequence_group = None


def init_sequence_parallel(info: DistInfo) -> None:
    """The sequence-parallel process groups: `sequence_parallel` consecutive ranks each, as DistInfo.dp_rank
    assumes. Every rank takes part in making every group (torch's rule for new_group); each keeps its own.

    DeepSpeed is not told of them: the ranks of a group compute different tokens of the same samples, so
    their gradients must be averaged like data-parallel ones, and ZeRO partitions over every rank, which is
    what DeepSpeed does for ranks it takes for data-parallel. Only attention's exchange uses the group."""
    global _sequence_group
    size = info.sequence_parallel
    data_parallel_size(ParallelConfig(sequence=size), info.world_size)  # ConfigError unless they divide
    for start in range(0, info.world_size, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= info.rank < start + size:
            _sequence_group = group


def sequence_parallel_group():
    """This rank's sequence-parallel group (init_sequence_parallel), None without sequence parallelism."""
    return _sequence_group


def deepspeed_mpu(tensor_parallel: int):
    """DeepSpeed's groups module as the `mpu` of its config and engine under tensor parallelism (init_tensor_parallel)."""
    if tensor_parallel == 1:
        return None
    from deepspeed.utils import groups

    return groups


def tensor_parallel_group():
    from deepspeed.utils import groups

    return groups.get_tensor_model_parallel_group()


def finalize_distributed() -> None:
    """barrier + destroy: every rank has finished its collectives, and torch forgets the process group.

    This alone does not make the process's end safe: gloo's worker threads outlive it (exit_process says why)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_process(status: int = 0) -> NoReturn:
    """End this rank's process with `status`: finalize_distributed, flush stdout and stderr, then `os._exit`.

    Call it last, once every file, logger and W&B run is closed: nothing after it runs, atexit handlers
    included. Python's own shutdown is skipped on purpose. gloo runs collectives on worker threads of its
    own (ProcessGroupGloo::runLoop), which drop their last reference to a finished collective (and, through
    a barrier, to the collectives before it) only after the caller's wait() has returned;
    destroy_process_group does not stop them (gloo has no shutdown), only C++ teardown does. Under load a
    worker can still hold a collective's tensors (under ZeRO-3, those of DeepSpeed's parameter all-gathers)
    when interpreter shutdown frees their Python objects; releasing them then needs the GIL, a thread that
    asks for it during shutdown is ended by Python with pthread_exit, and that unwind through a C++
    destructor is std::terminate: "terminate called without an active exception" (SIGABRT) after the work
    was done. torch gives no way to wait for those threads, so the process leaves without a shutdown for
    them to race (docs/deepspeed-on-cpu.md).
    """
    finalize_distributed()
    leave_now(status)


def leave_now(status: int) -> NoReturn:
    """Flush stdout and stderr, then `os._exit`: no Python shutdown (exit_process says why), and no barrier,
    so a rank that stops alone while the others are inside a collective can leave too."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


# -- distributed agreement ----------------------------------------------------------------------
def all_reduce_tensor(values: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """All-reduce a small tensor across ranks and return it on the CPU (one host transfer).

    Build it where it was computed: NCCL reduces on the GPU, gloo on the CPU; `.to` is a no-op
    when the tensor already sits on the backend's device.
    """
    if dist.is_initialized() and dist.get_world_size() > 1:
        on_gpu = dist.get_backend() == "nccl"
        values = values.to(torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu"))
        dist.all_reduce(values, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return values.cpu()


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on any rank (decisions that change control flow)."""
    return bool(all_reduce_tensor(torch.tensor([1.0 if flag else 0.0]), op="max").item() > 0)


def first_problem(problem: str | None) -> str | None:
    """The problem of the lowest rank that has one, on every rank (None when no rank has one): ranks that each
    checked a share (a checkpoint's files, their own partitions) take the same decision and name the same thing."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return problem
    world = dist.get_world_size()
    first = int(all_reduce_tensor(torch.tensor([float(dist.get_rank() if problem else world)]), op="min").item())
    return None if first == world else broadcast_object(problem, src=first)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]
