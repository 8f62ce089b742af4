"""DeepSpeed's JSON config, rendered from ayumi's config: the only place it is written.

The run dir keeps a copy (`deepspeed_config.json`) so a user can see exactly what DeepSpeed was told.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pretrain.config import (
    AyumiConfig, data_parallel_grad_accum, data_parallel_size,
)
from pretrain.engine.grad_accum import fp32_accumulation_by
from pretrain.model.tensor_parallel import autotp_partition_config, tensor_parallel_problems


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
        # DeepSpeed takes a sequence-parallel group's ranks for data-parallel ones (they average gradients like
        # them: pretrain/engine/distributed.py init_sequence_parallel), so its batch counts each sample N times.
        "train_batch_size": cfg.train.global_batch_size * cfg.parallel.sequence,
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
        # ayumi sums there itself (pretrain/engine/grad_accum.py).
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    if cfg.parallel.tensor > 1:
        # AutoTP cuts the layers pretrain/model/tensor_parallel.py names when the engine is built; the batch
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


def save_ds_config(config: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(config, indent=2) + "\n")
