"""DeepSpeed, in one place: distributed set-up, the rendered DeepSpeed config, and a small facade.

This is the only module that imports `deepspeed` (DESIGN.md). Everything DeepSpeed-specific that
the trainer needs (a step, the grad norm, the loss scale, saving and loading) is a method of
`TrainEngine`, so the trainer reads as plain training logic and the DeepSpeed quirks recorded in
`shared/DEEPSPEED_CPU.md` are handled here once.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

# DeepSpeed picks its accelerator when it is imported; on a machine without CUDA say "cpu"
# up front instead of letting it guess (and warn).
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402  (after DS_ACCELERATOR)
import torch.distributed as dist  # noqa: E402

from pretrain.config import (  # noqa: E402
    AyumiConfig, ConfigError, ParallelConfig, data_parallel_grad_accum, data_parallel_size,
)
from pretrain.grad_accum import Fp32GradAccumulator, fp32_accumulation_by  # noqa: E402
from pretrain.host_memory import keep_freed_memory_for_reuse  # noqa: E402
from pretrain.optim import param_groups  # noqa: E402
from pretrain.tensor_parallel import (autotp_partition_config, merge_shards, shard_dim,  # noqa: E402
                                     tensor_parallel_problems)


class _KnownOptimizerWarning(logging.Filter):
    """Drops DeepSpeed's "untested optimizer" warning, which every ZeRO run would print.

    ayumi hands ZeRO torch's AdamW (SkippableAdamW: the one place an update can be withheld) and
    sets `zero_allow_untested_optimizer` on purpose; the warning tells a user nothing to act on.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "untested optimizer" not in record.getMessage()


deepspeed.utils.logger.addFilter(_KnownOptimizerWarning())


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

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: the ranks of one tensor-parallel group share it (and their samples)."""
        return self.rank // self.tensor_parallel

    @property
    def dp_size(self) -> int:
        """Data-parallel size: how many different micro-batches one forward pass of the job sees."""
        return self.world_size // self.tensor_parallel

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


def init_distributed(device_preference: str = "auto", timeout_s: float | None = None,
                     tensor_parallel: int = 1) -> DistInfo:
    """Join (or create) the process group: NCCL on GPUs, gloo on CPU. `timeout_s` bounds every collective
    (pretrain.hang_watchdog.process_group_timeout_s: longer than the watchdog's, which speaks first).
    With `tensor_parallel` > 1 DeepSpeed's tensor- and data-parallel groups are made here too (init_tensor_parallel)."""
    _ensure_rank_env()
    device = pick_device(device_preference)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        # The shared-memory comm op costs a ~25 s JIT build and, with it, processes sometimes
        # abort at exit; plain gloo is fast enough for CPU runs (DEEPSPEED_CPU.md).
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        backend = "gloo"
        # 2 ranks on 2 cores: one intra-op thread each avoids oversubscription.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
        keep_freed_memory_for_reuse()  # no page faults on the step's big tensors (pretrain/host_memory.py)
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
    )
    if tensor_parallel > 1:
        init_tensor_parallel(info)
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


def _mpu(tensor_parallel: int):
    """DeepSpeed's groups module as the `mpu` of its config and engine under tensor parallelism (init_tensor_parallel)."""
    if tensor_parallel == 1:
        return None
    from deepspeed.utils import groups

    return groups


def _tensor_parallel_group():
    from deepspeed.utils import groups

    return groups.get_tensor_model_parallel_group()


def finalize_distributed() -> None:
    """barrier + destroy: with the shm op off this avoids the flaky abort at exit (DEEPSPEED_CPU.md)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def render_ds_config(cfg: AyumiConfig, world_size: int) -> dict[str, Any]:
    """DeepSpeed's JSON config, rendered from ayumi's config (the only place it is written).

    `deepspeed.precision` must already be concrete: `auto` is resolved per hardware and agreed by
    all ranks first (pretrain.train.settle_precision).
    """
    ds = cfg.deepspeed
    if ds.precision not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"deepspeed.precision={ds.precision!r} must be resolved to bf16, fp16 or fp32 before "
                         "DeepSpeed is configured (pretrain.train.settle_precision)")
    if problems := tensor_parallel_problems(cfg):  # again with the precision auto resolved to
        raise ValueError("; ".join(problems))
    grad_accum = data_parallel_grad_accum(cfg.train, data_parallel_size(cfg.parallel, world_size))
    config: dict[str, Any] = {
        "train_batch_size": cfg.train.global_batch_size,
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": cfg.optim.grad_clip,
        "steps_per_print": 10**12,  # ayumi logs; keep DeepSpeed's own step prints quiet
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": _zero_section(cfg),
    }
    if ds.precision == "bf16":
        config["bf16"] = {"enabled": True, "check_grad_overflow": ds.bf16_skip_nonfinite}
    elif ds.precision == "fp16":
        config["fp16"] = {
            "enabled": True,
            "loss_scale": 0,  # 0 = dynamic
            "initial_scale_power": ds.initial_scale_power,
            "loss_scale_window": ds.loss_scale_window,
            "hysteresis": ds.hysteresis,
            "min_loss_scale": ds.min_loss_scale,
        }
    if fp32_accumulation_by(ds.precision, ds.grad_accum_dtype, ds.zero_stage) == "deepspeed":
        # ZeRO 2-3 sum each micro-batch's reduced gradient into fp32 partitions. Not rendered
        # under ZeRO 0-1: stage 0 refuses it and stage 1 would swap in DeepSpeed's BF16_Optimizer;
        # ayumi sums there itself (pretrain/grad_accum.py).
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    if cfg.parallel.tensor > 1:
        # AutoTP cuts the layers pretrain/tensor_parallel.py names when the engine is built; the batch
        # figures above count data-parallel ranks (init_tensor_parallel hands DeepSpeed the groups).
        config["tensor_parallel"] = {"autotp_size": cfg.parallel.tensor, "vocab_parallel_lm_head": False,
                                     "partition_config": autotp_partition_config()}
    if ds.offload_optimizer:
        # Offloaded states need DeepSpeed's CPU Adam (built once, then cached).
        config["optimizer"] = {
            "type": "AdamW",
            "params": {
                "lr": cfg.optim.lr,
                "betas": [cfg.optim.beta1, cfg.optim.beta2],
                "eps": cfg.optim.eps,
                "weight_decay": cfg.optim.weight_decay,
            },
        }
    return config


def _zero_section(cfg: AyumiConfig) -> dict[str, Any]:
    ds = cfg.deepspeed
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.zero_stage == 0:
        return zero
    zero.update(overlap_comm=ds.overlap_comm, reduce_bucket_size=ds.reduce_bucket_size, contiguous_gradients=True)
    if ds.zero_stage in (1, 2):
        zero["allgather_bucket_size"] = ds.allgather_bucket_size
        zero["reduce_scatter"] = True
    if ds.zero_stage == 3:
        zero["stage3_prefetch_bucket_size"] = ds.stage3_prefetch_bucket_size
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if ds.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return zero


class SkippableAdamW(torch.optim.AdamW):
    """torch AdamW whose update can be withheld for a step, leaving weights and moments untouched.

    DeepSpeed calls this optimizer's `step()` on every rank at each accumulation boundary (on
    the fp32 partitions under ZeRO). Returning early there is the one place where an update can
    be skipped under every ZeRO stage and precision without touching DeepSpeed's internals: no
    NaN ever reaches Adam's moments, and the step counter of Adam does not advance.
    """

    def __init__(self, params, *, check_finite: bool = False, **kwargs):
        super().__init__(params, **kwargs)
        self.check_finite = check_finite
        """Skip when any gradient on any rank is inf/NaN (one tiny all-reduce per step)."""
        self.veto = False
        """Set by the trainer before the boundary step: skip this step's update."""
        self.gate = None
        """Optional callable asked inside the step (the grad norm is known by then): False withholds."""
        self._gate_answer: bool | None = None
        self.withheld = False
        """Whether the last boundary step's update (any sub-group) was withheld."""

    def _grads_finite_on_all_ranks(self) -> bool:
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        # One fused norm and one host sync for all gradients: inf/NaN anywhere makes it non-finite.
        local = bool(torch.isfinite(torch.stack([n.float() for n in torch._foreach_norm(grads)])).all()) if grads else True
        return not any_rank(not local)

    def _gate_allows(self) -> bool:
        # ZeRO-3 steps once per parameter sub-group: ask the gate once per optimizer step.
        if self._gate_answer is None:
            self._gate_answer = bool(self.gate()) if self.gate is not None else True
        return self._gate_answer

    def new_boundary(self) -> None:
        self.withheld = False
        self._gate_answer = None

    @torch.no_grad()
    def step(self, closure=None):
        if self.veto or (self.check_finite and not self._grads_finite_on_all_ranks()) or not self._gate_allows():
            self.withheld = True
            return None
        return super().step(closure)


def build_optimizer(model: torch.nn.Module, cfg: AyumiConfig, device: torch.device) -> torch.optim.Optimizer | None:
    """torch AdamW for DeepSpeed to wrap (None when DeepSpeed builds its own for offload).

    A client AdamW avoids DeepSpeed's CPU-Adam JIT build on CPU, and on CUDA torch's fused
    kernel is among the fastest Adam implementations.
    """
    if cfg.deepspeed.offload_optimizer:
        return None
    groups = param_groups(model.named_parameters(), cfg.optim.weight_decay)
    for group in groups:
        group.pop("name")
    return SkippableAdamW(
        groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay, fused=device.type == "cuda",
        # With the stability gate on, the detector sees a non-finite loss or grad norm itself.
        check_finite=cfg.stability.skip_nonfinite_loss and not cfg.stability.enabled,
    )


@dataclass
class StepResult:
    """What one optimizer step did."""

    applied: bool
    """False when DeepSpeed skipped the update (fp16 overflow, non-finite bf16 gradients)."""
    grad_norm: float | None
    """Global gradient L2 norm before clipping (None when unavailable)."""
    loss_scale: float | None
    """fp16 dynamic loss scale after the step (None in bf16/fp32)."""


def build_model(factory, cfg: AyumiConfig, dist_info: DistInfo, initial=None) -> torch.nn.Module:
    """The model from `factory(init_weights: bool)`, partitioned as it is built under ZeRO-3.

    With `deepspeed.zero3_init` on stage 3 every parameter is cut across ranks as soon as its
    module exists (deepspeed.zero.Init), so no rank ever holds the whole model: what makes a 7B+
    model fit nodes whose host memory cannot hold one copy per GPU. Each parameter is then
    gathered in turn, initialized on rank 0 by the model's own rule and scattered back. The
    parameters are visited in the same order and consume the same random numbers as
    `factory(init_weights=True)` does, so both ways give the same initial weights.

    `initial(name)`, when given, returns the starting tensor of each parameter instead (a Hugging
    Face folder, model.init_from): under ZeRO-3 only rank 0 reads it, one tensor at a time.
    """
    if cfg.deepspeed.zero_stage != 3 or not cfg.deepspeed.zero3_init:
        model = factory(init_weights=initial is None)
        if initial is not None:
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(initial(name))
        return model
    with deepspeed.zero.Init(config_dict_or_path=render_ds_config(cfg, dist_info.world_size)):
        model = factory(init_weights=False)
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if dist_info.is_main:
                if initial is None:
                    model.init_parameter(name, param)
                else:
                    with torch.no_grad():
                        param.copy_(initial(name))
    return model


class TrainEngine:
    """DeepSpeed's engine behind the handful of calls the trainer makes."""

    def __init__(self, model: torch.nn.Module, cfg: AyumiConfig, dist_info: DistInfo):
        self.cfg = cfg
        self.dist = dist_info
        self.ds_config = render_ds_config(cfg, dist_info.world_size)
        model.set_activation_checkpointing(cfg.deepspeed.activation_checkpointing)
        self.compiled = model.compile_for(cfg.model.compile, dist_info.device.type)
        self.grad_accum = self.ds_config["gradient_accumulation_steps"]
        self.tensor_parallel = dist_info.tensor_parallel
        optimizer = build_optimizer(model, cfg, dist_info.device)
        self.client_optimizer = optimizer  # ours (SkippableAdamW), under DeepSpeed's wrapper
        model_parameters = None
        if optimizer is None:
            model_parameters = [
                {k: v for k, v in group.items() if k != "name"}
                for group in param_groups(model.named_parameters(), cfg.optim.weight_decay)
            ]
        # With tensor parallelism DeepSpeed's groups (made in init_tensor_parallel) are its `mpu`: its batch
        # check then counts data-parallel ranks, and AutoTP cuts the model inside initialize. It re-points
        # our optimizer at the cut parameters itself.
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, model_parameters=model_parameters, config=self.ds_config,
            mpu=_mpu(self.tensor_parallel),
        )
        # On the parameters the engine holds (AutoTP replaced the ones it cut) and placed (their device);
        # its hooks go first, ahead of the gradient hooks ZeRO-1 added inside initialize.
        self.accumulator = self._fp32_accumulator(self.engine.module)
        self.precision = cfg.deepspeed.precision
        # The parameters tensor parallelism cut (AutoTP's replacements), named once here rather than every step.
        self._cut_params = [param for name, param in self.engine.module.named_parameters()
                            if self.tensor_parallel > 1 and shard_dim(name) is not None]
        self._cut_ids = frozenset(map(id, self._cut_params))
        # DeepSpeed 0.19's engine.backward() scales the loss only for ZeRO optimizers, yet its
        # stage-0 fp16 optimizer unscales the gradients in step(): unscaled gradients then come
        # out divided by the loss scale (no training) and overflow is never detected. Scale the
        # loss here in exactly the case DeepSpeed skips.
        from deepspeed.runtime.base_optimizer import ZeROOptimizer

        self._scale_loss_here = self.precision == "fp16" and not isinstance(self.optimizer, ZeROOptimizer)
        self._own_norm: float | None = None
        self._last_norm: float | None = None

    def _fp32_accumulator(self, model: torch.nn.Module) -> Fp32GradAccumulator | None:
        ds = self.cfg.deepspeed
        if self.grad_accum == 1 or fp32_accumulation_by(ds.precision, ds.grad_accum_dtype, ds.zero_stage) != "ayumi":
            return None  # one micro-batch per step has nothing to sum
        accumulator = Fp32GradAccumulator(model.named_parameters(), first=True)
        accumulator.allocate()
        return accumulator

    @property
    def grad_accum_dtype(self) -> str:
        """The dtype micro-batch gradients are summed in, as the start-of-run line reports it."""
        ds = self.cfg.deepspeed
        return "fp32" if fp32_accumulation_by(ds.precision, ds.grad_accum_dtype, ds.zero_stage) else ds.precision

    # -- training -----------------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def train(self) -> None:
        self.engine.train()

    def eval(self) -> None:
        self.engine.eval()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):
        return self.engine(input_ids, labels)

    def backward(self, loss: torch.Tensor) -> None:
        if self._scale_loss_here:
            loss = loss * self.loss_scale()
        boundary = self.engine.is_gradient_accumulation_boundary()
        # DeepSpeed 0.19 tells its ZeRO optimizer whether this micro-batch ends the step from a
        # backward hook on the forward's output tensors, and does not look inside LlamaOutput (a
        # dataclass): the optimizer would act on the previous micro-batch's answer (ZeRO-1 reduced
        # the first micro-batch on its own, one all-reduce too many per step). Tell it here.
        if hasattr(self.optimizer, "set_gradient_accumulation_boundary"):
            self.optimizer.set_gradient_accumulation_boundary(boundary)
        if self.accumulator is None:
            self.engine.backward(loss)
            return
        self.accumulator.begin_backward(boundary)
        self.engine.backward(loss)
        self.accumulator.end_backward()

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def micro_step(self) -> StepResult | None:
        """Call after every backward; at the accumulation boundary the optimizer steps."""
        boundary = self.engine.is_gradient_accumulation_boundary()
        norm = self._stage0_grad_norm() if boundary and self._needs_own_norm() else None
        self._own_norm = norm
        if boundary and self._cut_params and self.cfg.deepspeed.zero_stage == 0:
            self._mark_tensor_parallel_grads()
        self.engine.step()
        if not boundary:
            return None
        if norm is None:
            norm = self.engine.get_global_grad_norm()
        norm = None if norm is None else float(norm)
        return StepResult(applied=self.engine.was_step_applied(), grad_norm=norm, loss_scale=self.loss_scale())

    def _needs_own_norm(self) -> bool:
        # Stage 0 fp32 reports no norm at all and stage 0 fp16 reports it divided by the loss
        # scale (DEEPSPEED_CPU.md), so compute it from the gradients before DeepSpeed steps.
        return self.cfg.deepspeed.zero_stage == 0 and self.precision in ("fp32", "fp16")

    def _mark_tensor_parallel_grads(self) -> None:
        """Stage 0 bf16: DeepSpeed's optimizer (FP16_UnfusedOptimizer) takes the grad norm from the gradients,
        and counts a tensor on tensor-parallel ranks 1..T-1 only if it carries Megatron's `tensor_model_parallel`
        mark. AutoTP marks the cut parameters, not their gradients, so those ranks' shards were left out
        (1.656 instead of 1.841 on the tiny model) and clipping was too weak. The gradient gets its parameter's
        mark; DeepSpeed's `grad.to(dtype)` of the same dtype is the same tensor, so the mark reaches the norm."""
        for param in self._cut_params:
            if param.grad is not None:
                param.grad.tensor_model_parallel = True

    def _stage0_grad_norm(self) -> float:
        """sqrt(sum of squares): replicated gradients once, the tensor-parallel shards summed over their group."""
        replicated, cut = [], []
        for param in self.engine.module.parameters():
            if param.grad is not None:
                (cut if id(param) in self._cut_ids else replicated).append(param.grad)
        squares = torch.zeros(2, dtype=torch.float64, device=self.dist.device)
        for slot, grads in enumerate((replicated, cut)):
            if grads:
                squares[slot] = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]).double().square().sum()
        if cut:
            dist.all_reduce(squares[1:], group=_tensor_parallel_group())
        scale = self.loss_scale() or 1.0
        # backward() at the boundary has already averaged the gradients across data-parallel ranks, and
        # the shards' sum is all-reduced, so the norm is the same on every rank.
        return float(squares.sum().sqrt()) / scale

    def _whole(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (this rank's slice of parameter `name`) whole: gathered over the tensor-parallel group.

        Collective under tensor parallelism: every rank calls it for the same names in the same order."""
        dim = shard_dim(name)
        if self.tensor_parallel == 1 or dim is None:
            return tensor
        pieces = [torch.empty_like(tensor) for _ in range(self.tensor_parallel)]
        dist.all_gather(pieces, tensor.contiguous(), group=_tensor_parallel_group())
        return torch.cat(pieces, dim=dim)

    # -- knobs the stability machinery turns ----------------------------------------------------
    @property
    def can_withhold_updates(self) -> bool:
        """False with ZeRO-Offload, whose DeepSpeed CPU Adam cannot be vetoed."""
        return isinstance(self.client_optimizer, SkippableAdamW)

    def withhold_next_update(self, withhold: bool = True) -> None:
        """Skip (or not) the optimizer update of the coming boundary step."""
        if self.can_withhold_updates:
            self.client_optimizer.veto = withhold
            self.client_optimizer.new_boundary()

    def set_update_gate(self, gate) -> None:
        """`gate()` is asked inside each optimizer step, once DeepSpeed has the global grad norm
        (`current_grad_norm()`); returning False withholds that update. Same answer on all ranks."""
        if self.can_withhold_updates:
            self.client_optimizer.gate = gate

    def current_grad_norm(self) -> float | None:
        """The unclipped global grad norm of the step in progress (valid inside the gate)."""
        if self._own_norm is not None:
            return self._own_norm
        norm = getattr(self.optimizer, "_global_grad_norm", None)
        return None if norm is None else float(norm)

    def update_was_withheld(self) -> bool:
        return self.can_withhold_updates and self.client_optimizer.withheld

    def set_grad_clip(self, value: float) -> None:
        """Change the clipping threshold from the next step on (adaptive clipping)."""
        self.engine._config.gradient_clipping = float(value)
        if hasattr(self.optimizer, "clip_grad"):
            self.optimizer.clip_grad = float(value)

    def set_adam_hparams(self, eps: float | None = None, beta1: float | None = None) -> None:
        for group in self.optimizer.param_groups:
            if eps is not None:
                group["eps"] = eps
            if beta1 is not None:
                group["betas"] = (beta1, group["betas"][1])

    def named_full_grads(self):
        """(name, full unscaled gradient) of every parameter, under any ZeRO stage.

        Iterate on every rank after the last backward of a step and before `micro_step()`:
        under ZeRO-3 gathering a full gradient is collective.
        """
        from deepspeed.utils import safe_get_full_grad

        own_grads = self.cfg.deepspeed.zero_stage == 0 and self.precision != "bf16"
        scale = self.loss_scale() if self.precision == "fp16" else None
        for name, param in self.engine.module.named_parameters():
            grad = param.grad if own_grads else safe_get_full_grad(param)
            if grad is not None:
                grad = self._whole(name, grad)  # a tensor-parallel slice gathered: the same on every rank
                yield name, grad if scale is None else grad.float() / scale

    def full_fp32_params(self) -> dict[str, torch.Tensor]:
        """Full fp32 copies of every parameter (collective under ZeRO-3 and tensor parallelism; for update ratios
        and the fp32 evaluation)."""
        from deepspeed.utils import safe_get_full_fp32_param

        out = {}
        for name, param in self.engine.module.named_parameters():
            full = None if self.cfg.deepspeed.zero_stage == 0 else safe_get_full_fp32_param(param)
            # Stage 0 keeps no fp32 partition to gather; the module's own weights are the truth.
            out[name] = self._whole(name, (param.detach() if full is None else full.detach()).float()).clone()
        return out

    @property
    def skipped_steps(self) -> int:
        return int(self.engine.skipped_steps)

    # -- fp16 loss scale ---------------------------------------------------------------------
    def _scaler(self):
        scaler = getattr(self.optimizer, "loss_scaler", None)  # ZeRO 1-3
        if scaler is not None:
            return scaler
        return getattr(self.optimizer, "loss_scale_config", None)  # stage 0 FP16_Optimizer

    def loss_scale(self) -> float | None:
        if self.precision != "fp16":
            return None
        scaler = self._scaler()
        return None if scaler is None else float(scaler.cur_scale)

    def reset_loss_scale(self, value: float) -> None:
        """Set the fp16 loss scale (e.g. after a rollback restored a collapsed one)."""
        scaler = self._scaler()
        if self.precision != "fp16" or scaler is None:
            return
        scaler.cur_scale = float(value)
        if hasattr(scaler, "cur_hysteresis") and hasattr(scaler, "delayed_shift"):
            scaler.cur_hysteresis = scaler.delayed_shift

    # -- checkpoints --------------------------------------------------------------------------
    def save(self, root: Path, tag: str, client_state: dict[str, Any], collector=None) -> None:
        """Every rank writes its DeepSpeed shards under root/tag (no `latest`: the caller owns it).

        With a `collector` (pretrain.checkpoint_writer.StagingCollector) nothing is written: it
        stands in for DeepSpeed's checkpoint engine for this one call, every file DeepSpeed would
        write goes through its `save(state_dict, path)`, on every ZeRO stage (DeepSpeed 0.19.8
        `save_checkpoint` -> `_save_checkpoint` / `_save_zero_checkpoint`), and it stages a copy.
        """
        if collector is None:
            self.engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
            return
        real = self.engine.checkpoint_engine
        collector.inner = real
        self.engine.checkpoint_engine = collector
        try:
            self.engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
        finally:
            self.engine.checkpoint_engine = real

    def load(self, root: Path, tag: str, universal: bool = False) -> dict[str, Any]:
        """Load root/tag into this engine; `universal` for a folder made by `convert_to_universal`.

        DeepSpeed reads its `load_universal` setting at load time, so it is switched on for this
        one load only: the run's own checkpoints (rollbacks, later resumes) are regular ones.
        """
        config = self.engine._config
        previous = config.load_universal_checkpoint
        config.load_universal_checkpoint = universal
        # DeepSpeed 0.19's ZeRO-3 universal loader gives every param group group 0's
        # hyperparameters, so the norms would start being weight-decayed. They come from this
        # run's config anyway: keep them as they are.
        hparams = [{key: value for key, value in group.items() if key != "params"} for group in self.optimizer.param_groups]
        try:
            path, client_state = self.engine.load_checkpoint(
                str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=False,
            )
        finally:
            config.load_universal_checkpoint = previous
        if universal:
            for group, kept in zip(self.optimizer.param_groups, hparams):
                group.update(kept)
            # The same loader hands one `step` tensor to every group's state; AdamW increments
            # it in place per parameter, so shared it would advance once per group each step.
            for state in self.client_optimizer.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()
        if path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint {tag!r} under {root}")
        return client_state or {}


def convert_to_universal(tag_dir: Path, out_dir: Path) -> None:
    """Write DeepSpeed's universal form of a ZeRO 1-3 checkpoint folder to `out_dir` (atomically).

    A ZeRO checkpoint's optimizer state is cut for the data-parallel size that saved it; the
    universal form holds every parameter's fp32 weights and Adam moments whole, so any number of
    ranks can load it (shared/DEEPSPEED_CPU.md). DeepSpeed's converter runs in a child process:
    it starts worker pools of its own, which a process holding threads and a process group
    should not fork.
    """
    import subprocess
    import sys

    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Each extract worker holds one rank's optimizer shard in memory: a few, not one per core.
    extract_workers = max(1, min(4, (os.cpu_count() or 1) // 4))
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_dir),
               "--output_folder", str(partial), "--inject_missing_state", "--num_extract_workers", str(extract_workers),
               "--num_merge_workers", "1"]
    # The converter works on the CPU; keep it off the GPUs this job's ranks already fill.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if done.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise RuntimeError(f"converting {tag_dir} to a universal checkpoint failed (exit {done.returncode}):\n"
                           f"{done.stdout[-3000:]}")
    partial.rename(out_dir)


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


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


# -- consolidation for export -------------------------------------------------------------------
def consolidated_state_dict(root: Path, tag: str) -> dict[str, torch.Tensor]:
    """Full fp32 weights from a checkpoint of any ZeRO stage and tensor-parallel size, on CPU, without a
    process group: each tensor-parallel rank's slices merged (pretrain.tensor_parallel.merge_shards)."""
    return merge_shards(tensor_parallel_slices(root, tag))


def tensor_parallel_slices(root: Path, tag: str) -> list[dict[str, torch.Tensor]]:
    """Each tensor-parallel rank's fp32 weights of checkpoint root/tag, in rank order (one whole state without
    tensor parallelism)."""
    import tempfile

    tag_dir = Path(root) / tag
    tp = checkpoint_tensor_parallel(tag_dir)
    if tp == 1:
        return [_fp32_weights(tag_dir)]
    with tempfile.TemporaryDirectory(prefix="ayumi-tp-ranks-") as scratch:
        return [_fp32_weights(_tp_rank_view(tag_dir, rank, Path(scratch))) for rank in range(tp)]


_MP_RANK = re.compile(r"mp_rank_(\d+)")


def checkpoint_tensor_parallel(tag_dir: Path) -> int:
    """The tensor-parallel size a DeepSpeed checkpoint folder was saved with: DeepSpeed names every file with
    its `mp_rank_NN` (the tensor-parallel rank under AutoTP)."""
    ranks = {int(m.group(1)) for path in Path(tag_dir).glob("*_states.pt") if (m := _MP_RANK.search(path.name))}
    if not ranks:
        raise FileNotFoundError(f"{tag_dir} holds no DeepSpeed model states (mp_rank_00_model_states.pt)")
    return max(ranks) + 1


def _tp_rank_view(tag_dir: Path, tp_rank: int, scratch: Path) -> Path:
    """A folder in which tensor-parallel rank `tp_rank`'s files of `tag_dir` look like a checkpoint without
    tensor parallelism (named mp_rank_00, linked, not copied): DeepSpeed's zero_to_fp32 reads mp_rank_00 only."""
    view = scratch / f"tp{tp_rank}" / tag_dir.name
    view.mkdir(parents=True)
    rank_name = f"mp_rank_{tp_rank:02d}"
    for path in tag_dir.glob(f"*{rank_name}*_states.pt"):
        (view / path.name.replace(rank_name, "mp_rank_00")).symlink_to(path.resolve())
    return view


def _fp32_weights(tag_dir: Path) -> dict[str, torch.Tensor]:
    """The fp32 weights of a checkpoint folder without tensor parallelism, of any ZeRO stage."""
    if any(tag_dir.glob("*optim_states.pt")) and any(tag_dir.glob("zero_pp_rank_*")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    else:
        model_file = tag_dir / "mp_rank_00_model_states.pt"
        if not model_file.exists():
            raise FileNotFoundError(f"{tag_dir} holds no DeepSpeed model states (mp_rank_00_model_states.pt)")
        state = torch.load(model_file, map_location="cpu", weights_only=False)["module"]
    return {name: tensor.detach().float() for name, tensor in state.items()}


def save_ds_config(config: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(config, indent=2) + "\n")
