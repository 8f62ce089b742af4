"""DeepSpeed, in one place: distributed set-up, the rendered DeepSpeed config, and a small facade.

`pretrain/engine/` is the only folder that imports `deepspeed` (docs/design.md). Everything DeepSpeed-specific that
the trainer needs (a step, the grad norm, the loss scale, saving and loading) is a method of
`TrainEngine`, so the trainer reads as plain training logic and the DeepSpeed quirks recorded in
docs/deepspeed-on-cpu.md are handled here once.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

import deepspeed
import torch.distributed as dist

from common.safe_load import DEEPSPEED_GLOBALS, forced_weights_only
from common.safe_load import load as load_plain
from pretrain.config import (
    AyumiConfig,
)
from pretrain.engine.grad_accum import Fp32GradAccumulator, fp32_accumulation_by
from pretrain.engine.optimizer import param_groups
from pretrain.model.config import ModelConfig
from pretrain.model.llama import draw_each
from pretrain.model.tensor_parallel import shard_dim
from pretrain.engine.distributed import DistInfo, deepspeed_mpu, sequence_parallel_group, tensor_parallel_group
from pretrain.engine.ds_config import render_ds_config
from pretrain.engine.op_build import prepare_ops
from pretrain.engine.sequence_parallel import install_sequence_parallel
from pretrain.engine.optimizer import SkippableAdamW, build_optimizer


class _KnownOptimizerWarning(logging.Filter):
    """Drops DeepSpeed's "untested optimizer" warning, which every ZeRO run would print.

    ayumi hands ZeRO torch's AdamW (SkippableAdamW: the one place an update can be withheld) and
    sets `zero_allow_untested_optimizer` on purpose; the warning tells a user nothing to act on.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "untested optimizer" not in record.getMessage()


deepspeed.utils.logger.addFilter(_KnownOptimizerWarning())


@dataclass
class StepResult:
    """What one optimizer step did."""

    applied: bool
    """False when DeepSpeed skipped the update (fp16 overflow, non-finite bf16 gradients)."""
    grad_norm: float | None
    """Global gradient L2 norm before clipping (None when unavailable)."""
    loss_scale: float | None
    """fp16 dynamic loss scale after the step (None in bf16/fp32)."""


def forget_warm_up_step(optimizer) -> bool:
    """Undo the AdamW step DeepSpeed's stage-0 low-precision wrapper takes on zero gradients to create the
    optimizer states (FP16_UnfusedOptimizer.initialize_optimizer_states, DeepSpeed 0.19); True when it did.

    That step counts as Adam's first, so bias correction made the first real update 0.73x ZeRO-1's (1.45e-4
    against 1.98e-4 at lr 2e-4), and its weight decay shrank the fp32 master weights once: ZeRO-0 drifted
    1.76e-2 from ZeRO-1 over 30 bf16 steps on an H200. The moments it made are zeros; the step counts go
    back to 0 and the masters back to the weights they were copied from (the step never wrote to those),
    so ZeRO-0 starts where ZeRO 1-3 start.
    """
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if not isinstance(optimizer, FP16_UnfusedOptimizer):
        return False
    with torch.no_grad():
        for masters, weights in zip(optimizer.fp32_groups, optimizer.fp16_groups):
            for master, weight in zip(masters, weights):
                master.copy_(weight)
        for state in optimizer.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value):
                    value.zero_()
                elif key == "step":
                    state[key] = 0
    return True


def build_model(factory, cfg: AyumiConfig, dist_info: DistInfo, initial=None,
                from_checkpoint: bool = False) -> torch.nn.Module:
    """The model from `factory(init_weights=False)`, partitioned as it is built under ZeRO-3, and its initial weights.

    With `deepspeed.zero3_init` on stage 3 every parameter is cut across ranks as soon as its
    module exists (deepspeed.zero.Init), so no rank ever holds the whole model: what makes a 7B+
    model fit nodes whose host memory cannot hold one copy per GPU. Each parameter is then
    gathered in turn, initialized on rank 0 and scattered back. ZeRO 0-2 build the whole model on the CPU, where
    nothing is drawn (Llama skips the modules' own initializers), and DeepSpeed moves what is left there.

    The initial weights are drawn on the training device (`dist_info.device`), each parameter from its own
    generator seeded from (`cfg.train.seed`, its name) (Llama.init_parameter): the same seed gives the same
    weights at every ZeRO stage, on every rank, on any number of ranks, on devices of one type (a GPU's differ
    from a CPU's). Nothing is taken from the global generators. Under ZeRO-3 the gathered parameter lives on the
    device and is drawn in place; under ZeRO 0-2 each parameter's values are drawn on the device and become the
    parameter there (with tensor parallelism they are copied into the CPU model instead, which DeepSpeed cuts
    before it moves it: no GPU holds the whole model).

    `initial(name)`, when given, returns the starting tensor of each parameter instead (a Hugging
    Face folder, model.init_from): under ZeRO-3 only rank 0 reads it, one tensor at a time.
    `from_checkpoint`: a checkpoint load will overwrite every weight (a resume, checkpoint.load_from): nothing is
    drawn, read or gathered; the parameters are zeros (on the training device under ZeRO 0-2 without tensor
    parallelism), so nothing that reads them before the load meets uninitialized memory.
    """
    seed = cfg.train.seed
    device = torch.device(dist_info.device)
    if from_checkpoint:
        initial = None  # the checkpoint's weights replace model.init_from's too
    if cfg.deepspeed.zero_stage != 3 or not cfg.deepspeed.zero3_init:
        with torch.device("cpu"):  # where DeepSpeed expects it, even where a caller made another device the default
            model = factory(init_weights=False)
        if initial is not None:
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(initial(name))
            return model
        whole_on_cpu = dist_info.tensor_parallel > 1  # AutoTP cuts the CPU model; only the slices reach a GPU

        @torch.no_grad()
        def draw(name: str, param: torch.Tensor) -> None:
            # Drawn on the device (the values depend on its type); zeros for a load wherever the parameter stays.
            here = param.device.type == device.type or (from_checkpoint and whole_on_cpu)
            value = param if here else torch.empty(param.shape, dtype=param.dtype, device=device)
            if from_checkpoint:
                value.zero_()
            else:
                model.init_parameter(name, value, seed)
            if value is param:
                return
            if whole_on_cpu:
                param.copy_(value)
            else:
                param.data = value

        draw_each(list(model.named_parameters()), draw, on_cpu=device.type == "cpu")
        return model
    with deepspeed.zero.Init(config_dict_or_path=render_ds_config(cfg, dist_info.world_size)):
        model = factory(init_weights=False)
    if from_checkpoint:  # each rank's own partitions, no exchange
        with torch.no_grad():
            for param in model.parameters():
                getattr(param, "ds_tensor", param).zero_()
        return model
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if dist_info.is_main:  # only rank 0's values are kept: the others skip the draw
                with torch.no_grad():
                    if initial is None:
                        model.init_parameter(name, param, seed)  # on the device the gathered parameter lives on
                    else:
                        param.copy_(initial(name))
    return model


def place_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Move the buffers DeepSpeed left off the training device.

    Under ZeRO-3 DeepSpeed places the parameters itself (zero.Init, its partitioning) and never moves
    the module, so a buffer made on the CPU (the RoPE tables) stays there while the activations are on
    the GPU: the first forward fails with "found at least two devices". Only modules that hold buffers
    and no parameters of their own are moved (`to` would move the parameters too, which ZeRO-3 owns).
    Found by the first GPU run (bench/gpu_acceptance.py); on the CPU every tensor is on one device.
    """
    device = torch.device(device)
    for module in model.modules():
        buffers = list(module.buffers(recurse=False))
        if not buffers or list(module.parameters(recurse=False)):
            continue
        if any(b.device.type != device.type or (device.index is not None and b.device.index != device.index)
               for b in buffers):
            module.to(device)


class SafeLoadingEngine:
    """Stands in for DeepSpeed's checkpoint engine during a load: every file DeepSpeed reads through it (model states,
    optimizer states, on every ZeRO stage: DeepSpeed 0.19.8 `load_checkpoint`) is read with `weights_only=True`,
    DeepSpeed's few objects allowed (common.safe_load), where DeepSpeed's own engine passes `weights_only=False`. A
    file holding anything else raises common.safe_load.UnsafeFile naming it, before any of it is unpickled. Every
    other call goes to the real engine, `inner`."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def load(self, path: str, map_location=None):
        return load_plain(Path(path), DEEPSPEED_GLOBALS, map_location=map_location)

    def __getattr__(self, name: str):
        if name == "inner":  # not set yet (copying, pickling): never recurse
            raise AttributeError(name)
        return getattr(self.inner, name)


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
        if dist_info.sequence_parallel > 1:  # before the engine wraps the model: its layers exchange from step 1
            install_sequence_parallel(model, sequence_parallel_group(), dist_info.sp_rank, dist_info.sequence_parallel)
        prepare_ops(cfg.deepspeed.offload_optimizer)  # before DeepSpeed builds them, maybe behind a dead lock
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
            mpu=deepspeed_mpu(self.tensor_parallel),
        )
        place_buffers(self.engine.module, dist_info.device)
        forget_warm_up_step(self.optimizer)
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

    def own_names(self) -> set[str]:
        """The names of the model's parameters and buffers as built from this run's config: the only names a
        checkpoint's DeepSpeed files may use (pretrain.engine.checkpoint_formats.foreign_name)."""
        module = self.engine.module
        return {name for name, _ in module.named_parameters(remove_duplicate=False)} | \
            {name for name, _ in module.named_buffers(remove_duplicate=False)}

    def train(self) -> None:
        self.engine.train()

    def eval(self) -> None:
        self.engine.eval()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):
        return self.engine(input_ids, labels)

    def set_rope(self, model: ModelConfig) -> None:
        """Train with `model`'s RoPE from now on (a curriculum stage's, pretrain/stages.py): the tables are
        rebuilt, no weight changes."""
        llama = self.engine.module
        llama.cfg = replace(llama.cfg, rope_theta=model.rope_theta, rope_scaling=model.rope_scaling)
        llama.model.rotary_emb.retune(model.rope_theta, model.rope_scaling)

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The model's logits [B, T, V] for input_ids (downstream evaluation; collective under ZeRO-3 and TP)."""
        return self.engine(input_ids).logits

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
        # scale (docs/deepspeed-on-cpu.md), so compute it from the gradients before DeepSpeed steps.
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
            dist.all_reduce(squares[1:], group=tensor_parallel_group())
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
        dist.all_gather(pieces, tensor.contiguous(), group=tensor_parallel_group())
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

        A `collector` stands in for DeepSpeed's checkpoint engine for this one call: every file DeepSpeed
        would write goes through its `save(state_dict, path)`, on every ZeRO stage (DeepSpeed 0.19.8
        `save_checkpoint` -> `_save_checkpoint` / `_save_zero_checkpoint`). The checkpointer passes
        pretrain.checkpoint.async_writer.StagingCollector (stages a copy, writes nothing) or
        pretrain.checkpoint.integrity.HashingEngine (writes each file and hashes it on the way).
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

    def state_problem(self) -> str | None:
        """The first tensor of this rank's model or optimizer state that no step should start from, named: non-finite
        weights (the module's, or the optimizer's fp32 copy) or Adam moments, or a negative second moment. None when
        all are sound. Local: under ZeRO each rank checks its own partitions (pretrain.checkpoint.trust agrees).

        Checked after a checkpoint is loaded, before the first step: a checkpoint can match its checksums and still
        hold such a state (damaged before it was saved, or saved before checksums were recorded)."""
        names = {id(param): name for name, param in self.engine.module.named_parameters()}
        for name, param in self.engine.module.named_parameters():
            local = getattr(param, "ds_tensor", param)  # ZeRO-3: this rank's partition of it
            if local.numel() and not bool(torch.isfinite(local).all()):
                return f"weight {name} holds non-finite values"
        optimizer = self.client_optimizer or getattr(self.optimizer, "optimizer", self.optimizer)
        # The optimizer's state is keyed by the tensors it updates: the module's own under ZeRO-0 fp32, else the fp32
        # partitions ZeRO keeps (under ZeRO-3 not all of them sit in param_groups at once: the state has every one).
        for param, state in optimizer.state.items():
            what = names.get(id(param)) or f"an fp32 partition of {param.numel()} values on rank {self.dist.rank}"
            if param.numel() and not bool(torch.isfinite(param).all()):
                return f"fp32 weights of {what} hold non-finite values"
            for key in ("exp_avg", "exp_avg_sq"):
                moment = state.get(key)
                if torch.is_tensor(moment) and moment.numel() and not bool(torch.isfinite(moment).all()):
                    return f"Adam {key} of {what} holds non-finite values"
            second = state.get("exp_avg_sq")
            if torch.is_tensor(second) and bool((second < 0).any()):
                return f"Adam exp_avg_sq of {what} holds negative values (a second moment never is)"
        return None

    def load(self, root: Path, tag: str, universal: bool = False) -> dict[str, Any]:
        """Load root/tag into this engine; `universal` for a folder made by `convert_to_universal`.

        DeepSpeed reads its `load_universal` setting at load time, so it is switched on for this
        one load only: the run's own checkpoints (rollbacks, later resumes) are regular ones.
        Nothing read can run code: DeepSpeed's checkpoint engine is SafeLoadingEngine for the load, and the files its
        universal loader reads with torch.load directly are weights-only too (forced_weights_only).
        """
        config = self.engine._config
        previous = config.load_universal_checkpoint
        config.load_universal_checkpoint = universal
        # DeepSpeed 0.19's ZeRO-3 universal loader gives every param group group 0's
        # hyperparameters, so the norms would start being weight-decayed. They come from this
        # run's config anyway: keep them as they are.
        hparams = [{key: value for key, value in group.items() if key != "params"} for group in self.optimizer.param_groups]
        real = self.engine.checkpoint_engine
        self.engine.checkpoint_engine = SafeLoadingEngine(real)
        try:
            with forced_weights_only(DEEPSPEED_GLOBALS):
                path, client_state = self.engine.load_checkpoint(
                    str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=False,
                )
        finally:
            config.load_universal_checkpoint = previous
            self.engine.checkpoint_engine = real
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
