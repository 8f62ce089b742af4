"""The optimizer ayumi hands DeepSpeed and its parameter groups.

`SkippableAdamW` is torch's AdamW with the one place an update can be withheld (the stability gate).

The schedule itself is pretrain/plan/lr_schedule.py's (torch-free: the plan and the checks before launch compute
the same LR as the ranks).
"""
from __future__ import annotations

from typing import Iterable

import torch

from pretrain.config import AyumiConfig
from pretrain.engine.distributed import any_rank
from pretrain.model.llama import no_weight_decay


def param_groups(named_parameters: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict]:
    """Two AdamW groups: decayed matrices and undecayed norms/biases (named for telemetry)."""
    decay, no_decay = [], []
    for name, param in named_parameters:
        if not param.requires_grad:
            continue
        (no_decay if no_weight_decay(name, param) else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "name": "no_decay"})
    return groups


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


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
