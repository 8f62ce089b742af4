"""FP8 training of the blocks' Linear layers through torchao's float8 (`model.fp8`).

`convert_to_fp8` swaps each eligible `nn.Linear` of the transformer blocks for torchao's `Float8Linear`
(`convert_to_float8_training` with a `Float8LinearConfig` of the recipe model.fp8 names): its forward casts the
input and the weight to float8 with a dynamic scale (one per tensor for tensorwise, one per row for rowwise) and
multiplies them with `torch._scaled_mm`; the backward does the same for the gradients. Kept as they are:

- the embedding and the LM head (torchao's and Transformer Engine's recipes keep them in bf16: the logits are
  where FP8's rounding would cost most loss, and the LM head is ayumi's fused head, not an nn.Linear);
- any Linear whose in or out size does not divide by 16 (`torch._scaled_mm` needs multiples of 16).

`Float8Linear` keeps the module's own `weight` parameter (the same tensor, its name unchanged) and holds no
buffer: the scales are made afresh each step. So the weights, DeepSpeed's fp32 master weights, the optimizer
states and the checkpoint files are exactly those of a model.fp8=off run, and a run resumes with FP8 switched
on or off. The conversion happens before `deepspeed.initialize` and before torch.compile (pretrain/train.py),
as torchao asks: its speed comes from compiling the casts into the neighbouring kernels.

torchao is imported only here and only when model.fp8 is on. The checks that refuse FP8 where it cannot run
(no GPU of compute capability 8.9+, ZeRO-3, tensor parallelism) are pretrain/startup/checks.py's, made before launch.
"""
from __future__ import annotations

import dataclasses
import logging

from torch import nn

FP8_DIVISOR = 16
"""Both sizes of a Linear must divide by this for torch._scaled_mm (the FP8 GEMM)."""

BLOCKS_PREFIX = "model.layers."
"""Where the transformer blocks live in ayumi's Llama (the embedding, final norm and LM head are outside)."""


def fp8_eligible(name: str, module: nn.Module) -> bool:
    """True for a Linear of a transformer block whose sizes FP8 GEMMs take (both divide by FP8_DIVISOR).

    `name` is the module's path in the model (`model.layers.0.mlp.up_proj`); the embedding and the LM head are
    outside model.layers (and not nn.Linear), so they never qualify."""
    return (isinstance(module, nn.Linear) and name.startswith(BLOCKS_PREFIX)
            and module.in_features % FP8_DIVISOR == 0 and module.out_features % FP8_DIVISOR == 0)


def float8_config(recipe: str, emulate: bool):
    """torchao's Float8LinearConfig for `recipe` (tensorwise or rowwise), with emulation when asked (tests)."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate) if emulate else config


def convert_to_fp8(model: nn.Module, recipe: str, emulate: bool = False) -> list[str]:
    """Swap the eligible Linear layers of `model` for torchao's Float8Linear in place; returns their names.

    `recipe` off converts nothing. Call it before DeepSpeed wraps the model and before torch.compile."""
    if recipe == "off":
        return []
    convert = import_float8()
    converted: list[str] = []

    def keep(module: nn.Module, name: str) -> bool:
        # torchao asks about every module on its way down; only the leaves it would swap are counted.
        chosen = fp8_eligible(name, module)
        if chosen:
            converted.append(name)
        return chosen

    convert(model, module_filter_fn=keep, config=float8_config(recipe, emulate))
    return converted


def import_float8():
    """torchao's `convert_to_float8_training`, imported quietly.

    torchao loads its compiled CUDA kernels on import and logs a warning for each that cannot load (every one
    on a CPU build of torch), and torch newer than 2.11 logs a deprecation notice for an enum torchao registers
    (torch.utils._pytree); float8 training needs none of those kernels, so the lines would only alarm."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        from torchao.float8 import convert_to_float8_training
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)
    return convert_to_float8_training


def fp8_layer_names(model: nn.Module) -> list[str]:
    """Names of the modules of `model` that run in FP8 (torchao's Float8Linear), for logs and tests."""
    return [name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"]
