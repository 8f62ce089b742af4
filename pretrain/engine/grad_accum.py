"""fp32 sums of a bf16 model's micro-batch gradients where DeepSpeed would sum them in bf16.

A step of N micro-batches adds N gradients. In bf16 every addition rounds the running sum to
8 significant bits, so the error grows with N and small micro-batch gradients are swamped by
the sum (Megatron sums in fp32 for that reason). Who can sum in fp32 depends on the ZeRO stage
(DeepSpeed 0.19, `deepspeed.runtime.engine._do_optimizer_sanity_check`):

- ZeRO 2-3 reduce each micro-batch's gradient into a partition buffer, and take
  `data_types.grad_accum_dtype` for that buffer: DeepSpeed does it (pretrain/engine/train_engine.py renders it).
- ZeRO 0-1 keep whole gradients in `param.grad`, which autograd sums in the parameter's dtype,
  and reduce them at the last micro-batch. DeepSpeed refuses fp32 there at stage 0
  (NotImplementedError) and at stage 1 swaps in another optimizer, BF16_Optimizer: other
  checkpoint files and overflow handling, and in ayumi's engine gradients about 5x too large at
  grad accum 8 (it clears the bf16 gradients between micro-batches from a hook on the forward's
  output tensors, and DeepSpeed does not look inside LlamaOutput). So ayumi sums them itself,
  here: `Fp32GradAccumulator`, and DeepSpeed's checkpoints, grad norms and update path stay as
  they were.
"""
from __future__ import annotations

from typing import Iterable

import torch


def fp32_accumulation_by(precision: str, grad_accum_dtype: str, zero_stage: int) -> str | None:
    """Who sums micro-batch gradients in fp32 beyond what DeepSpeed does by default.

    "deepspeed" (ZeRO 2-3, from the rendered `data_types`), "ayumi" (ZeRO 0-1, Fp32GradAccumulator),
    or None: fp32 runs sum in fp32 anyway, fp16 runs keep DeepSpeed's fp16 path, and
    grad_accum_dtype=bf16 asks for DeepSpeed's bf16 sums.
    """
    if precision != "bf16" or grad_accum_dtype != "fp32":
        return None
    return "deepspeed" if zero_stage >= 2 else "ayumi"


class Fp32GradAccumulator:
    """Keeps a bf16 model's gradients in fp32 between the micro-batches of a step.

    After each non-final micro-batch's backward, a hook moves every parameter's fresh bf16
    gradient into its fp32 sum and clears `param.grad`, so autograd never adds in bf16. In the
    final micro-batch's backward the hook adds the last gradient and writes the fp32 sum, rounded
    once, into `param.grad`, where DeepSpeed reduces and steps as it always does: checkpoints,
    grad norms and the update gate see what they saw before. The sums are zero again at every
    step boundary: the next step's first micro-batch overwrites them (no zeroing pass), so a checkpoint
    (always taken between steps) needs nothing from here.

    The hooks must run before any hook DeepSpeed adds (ZeRO-1 reduces the last micro-batch's
    gradients from its own hook). The engine builds this after `deepspeed.initialize`, on the
    parameters the engine holds (AutoTP replaces the ones tensor parallelism cuts), with `first=True`:
    each hook is moved ahead of the hooks already on its parameter.
    """

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]], first: bool = False):
        named = [(name, p) for name, p in named_params if p.requires_grad]
        self.params = [p for _, p in named]
        self.sums: dict[int, torch.Tensor] = {}
        self.boundary = False
        self._seen: set[int] = set()
        """Parameters whose gradient arrived in the current backward."""
        self._pending: set[int] = set()
        """Parameters whose sum holds gradients of earlier micro-batches of this step."""
        self._names = {id(p): name for name, p in named}
        self._hooks = [p.register_post_accumulate_grad_hook(self._take) for p in self.params]
        if first:
            for param, handle in zip(self.params, self._hooks):
                run_first(param, handle)

    def allocate(self) -> None:
        """One fp32 sum per parameter, on the parameter's device (call once the engine has placed them); a step's
        first micro-batch overwrites it, so it is never read uninitialised."""
        self.sums = {id(p): torch.empty(p.shape, dtype=torch.float32, device=p.device) for p in self.params}

    def begin_backward(self, boundary: bool) -> None:
        """Call before each micro-batch's backward; `boundary` for the step's last micro-batch."""
        self.boundary = boundary
        self._seen.clear()

    def end_backward(self) -> None:
        """Call after each backward: at the boundary every earlier gradient must have been written back."""
        if self.boundary:
            missing = self._pending - self._seen
            if missing:
                names = ", ".join(sorted(self._names[key] for key in missing))
                raise RuntimeError(f"fp32 gradient accumulation: {names} got gradients in earlier micro-batches "
                                   "but none in the step's last one, so its sum never reached DeepSpeed; "
                                   "set deepspeed.grad_accum_dtype=bf16 for a model with such parameters")
            self._pending.clear()

    @torch.no_grad()
    def _take(self, param: torch.nn.Parameter) -> None:
        key = id(param)
        if key in self._seen:
            # A second arrival would add the written-back sum to itself (reentrant checkpointing
            # can do that); ayumi's model uses non-reentrant checkpointing only.
            raise RuntimeError(f"fp32 gradient accumulation: {self._names[key]} received two gradients in one "
                               "backward; use non-reentrant activation checkpointing or deepspeed.grad_accum_dtype=bf16")
        self._seen.add(key)
        total = self.sums[key]
        if key in self._pending:
            total.add_(param.grad)  # bf16 -> fp32 is exact
        else:
            total.copy_(param.grad)  # the step's first micro-batch: no zeroing pass over the sums
        if self.boundary:
            param.grad.copy_(total)  # the one rounding to bf16
        else:
            self._pending.add(key)
            param.grad = None


def run_first(param: torch.nn.Parameter, handle) -> None:
    """Make the post-accumulate-grad hook behind `handle` the first of `param`'s to run.

    torch runs these hooks in the order of the tensor's `_post_accumulate_grad_hooks` (an OrderedDict
    keyed by the handle's id, torch >= 2.1) and offers no `prepend`; DeepSpeed registers its own with
    the same call (deepspeed.utils.torch.register_grad_hook).
    """
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    if hooks is None or handle.id not in hooks:
        raise RuntimeError("fp32 gradient accumulation cannot order its hooks on this torch version; "
                           "set deepspeed.grad_accum_dtype=bf16")
    hooks.move_to_end(handle.id, last=False)
