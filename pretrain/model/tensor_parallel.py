"""Tensor parallelism's layout for ayumi's Llama: which weights are cut, along which dimension, and the rules.

DeepSpeed's AutoTP does the cutting and the communication (pretrain/engine/train_engine.py renders the layout
below into `tensor_parallel.partition_config`); this module holds what ayumi itself must know about
it, with no DeepSpeed import, so the config checks, the memory plan and the export share one truth:

- **column-parallel** (the output dimension, dim 0, is cut; the input is whole on every rank):
  q_proj, k_proj, v_proj (whole heads per rank), gate_proj, up_proj (a slice of the MLP width);
- **row-parallel** (the input dimension, dim 1, is cut; the partial outputs are all-reduced):
  o_proj, down_proj;
- **replicated**: the embedding, every RMSNorm, the LM head. Each tensor-parallel rank computes the
  same full activations there, so their gradients agree without communication; the QK-norm scales
  are the exception (they see only the rank's own heads), so AutoTP sums their gradients over the
  tensor-parallel group (`grad_allreduce`).

This is Megatron's layout without sequence parallelism and without a vocabulary-parallel head:
per block, two all-reduces in forward and two in backward over the tensor-parallel group.

Rank layout (DeepSpeed's `groups._init_tp_mesh_device`, a (data, tensor) mesh): the ranks of one
tensor-parallel group are consecutive, so global rank r is tensor-parallel rank r % T of data-parallel
rank r // T. The loader gives the ranks of one group the same samples (pretrain/loader.py).
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch only where tensors are merged: the config checks run in the launcher, which imports none
    import torch

COLUMN_WEIGHTS = (r".*\.self_attn\.[qkv]_proj\.weight$", r".*\.mlp\.(gate|up)_proj\.weight$")
"""Weights cut along their output dimension (dim 0)."""
ROW_WEIGHTS = (r".*\.self_attn\.o_proj\.weight$", r".*\.mlp\.down_proj\.weight$")
"""Weights cut along their input dimension (dim 1)."""
SUMMED_REPLICAS = (r".*\.self_attn\.[qk]_norm\.weight$",)
"""Replicated weights whose gradients differ per rank (they act on the rank's own heads) and are summed."""
REPLICATED_MODULES = (r"^lm_head\.weight$",)
"""2-D weights AutoTP would otherwise consider and must leave whole (the LM head: ayumi's chunked loss needs it)."""


def shard_dim(name: str) -> int | None:
    """The dimension tensor parallelism cuts parameter `name` along (0 or 1), None when it is replicated.

    `name` is a bare parameter name (`model.layers.3.mlp.down_proj.weight`); wrapper prefixes
    (`module.`, `_orig_mod.`) are ignored."""
    if any(re.match(pattern, name) for pattern in COLUMN_WEIGHTS):
        return 0
    if any(re.match(pattern, name) for pattern in ROW_WEIGHTS):
        return 1
    return None


def autotp_partition_config() -> dict[str, Any]:
    """DeepSpeed's `tensor_parallel.partition_config` for ayumi's Llama (DeepSpeed 0.19 AutoTPConfig).

    Explicit specs instead of DeepSpeed's heuristics: `use_default_specs: false` so nothing else is
    cut, and `strict_mode` so a 2-D weight the layout does not name (a new layer added to the model)
    stops the start instead of silently staying replicated.
    """
    return {
        "use_default_specs": False,
        "strict_mode": True,
        "layer_specs": [
            {"patterns": list(ROW_WEIGHTS), "partition_type": "row"},
            {"patterns": list(COLUMN_WEIGHTS), "partition_type": "column"},
            {"patterns": list(SUMMED_REPLICAS), "partition_type": "skip", "grad_allreduce": True},
            {"patterns": list(REPLICATED_MODULES), "partition_type": "skip"},
        ],
    }


def tensor_parallel_problems(cfg: Any) -> list[str]:
    """Every reason `parallel.tensor` cannot train this config, one line each naming the field and the fix.

    Hardware-free (the world size is checked where it is known: pretrain.config.data_parallel_size).
    """
    tp = cfg.parallel.tensor
    if tp <= 1:
        return []
    model, ds = cfg.model, cfg.deepspeed
    problems = []
    cut = (("num_heads", model.num_heads, "query heads"), ("num_kv_heads", model.num_kv_heads, "key/value heads"),
           ("intermediate_size", model.intermediate_size, "MLP columns"))
    fitting = [d for d in divisors(model.num_kv_heads) if all(value % d == 0 for _, value, _ in cut)]
    for field, value, what in cut:
        if value % tp:
            problems.append(f"parallel.tensor={tp} must divide model.{field}={value}: each rank holds an equal share "
                            f"of the {what}; this model takes parallel.tensor in {fitting}")
    if cfg.train.num_gpus and cfg.train.num_gpus % tp:
        problems.append(f"train.num_gpus={cfg.train.num_gpus} must divide by parallel.tensor={tp} (the GPUs form "
                        f"groups of {tp}); plan for a multiple of {tp} GPUs")
    if ds.zero_stage == 3:
        problems.append(f"parallel.tensor={tp} with deepspeed.zero_stage=3: DeepSpeed 0.19 trains it, but neither its "
                        "zero_to_fp32 nor its universal-checkpoint converter can read the checkpoints (the replicated "
                        "weights are cut over the tensor-parallel ranks too), so the run could not be exported or "
                        "resumed at another size. Fix: deepspeed=zero1 or zero2, or parallel.tensor=1 for ZeRO-3")
    if ds.precision == "fp16":
        problems.append(f"parallel.tensor={tp} is tested with bf16 and fp32 only (deepspeed.precision=fp16, or auto on "
                        "a GPU without bf16); use deepspeed.precision=bf16 (or fp32), or parallel.tensor=1 for fp16")
    if ds.offload_optimizer or ds.offload_param:
        problems.append(f"parallel.tensor={tp} is not tested with ZeRO-Offload; set deepspeed.offload_optimizer=false "
                        "and deepspeed.offload_param=false, or parallel.tensor=1 to offload")
    return problems


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# -- whole tensors from shards (export, telemetry) -----------------------------------------------------
def merge_shards(shards: list[dict[str, "torch.Tensor"]]) -> dict[str, "torch.Tensor"]:
    """One whole state dict from the state dicts of tensor-parallel ranks 0..T-1 (in rank order).

    Cut weights are concatenated along their `shard_dim`; replicated ones are taken from rank 0
    after checking every rank holds about the same (they are kept equal by construction, and were
    bitwise equal in every test; a real difference means the shards do not belong together).
    """
    import torch

    if len(shards) == 1:
        return dict(shards[0])
    names = list(shards[0])
    for rank, shard in enumerate(shards[1:], start=1):
        if set(shard) != set(names):
            raise ValueError(f"tensor-parallel rank {rank} holds other parameters than rank 0: "
                             f"{sorted(set(shard) ^ set(names))[:5]}")
    merged = {}
    for name in names:
        dim = shard_dim(name)
        pieces = [shard[name] for shard in shards]
        if dim is None:
            if not all(torch.allclose(pieces[0], piece, rtol=1e-4, atol=1e-6) for piece in pieces[1:]):
                raise ValueError(f"{name} is replicated under tensor parallelism but differs between the ranks' shards")
            merged[name] = pieces[0]
        else:
            merged[name] = torch.cat(pieces, dim=dim)
    return merged


def split_state(state: dict[str, "torch.Tensor"], tp: int) -> list[dict[str, "torch.Tensor"]]:
    """The inverse of merge_shards: rank t's slice of every cut weight, replicated ones whole (tests, tools)."""
    return [{name: (tensor if shard_dim(name) is None else tensor.chunk(tp, dim=shard_dim(name))[t].clone())
             for name, tensor in state.items()} for t in range(tp)]


def local_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The shape of parameter `name` on one tensor-parallel rank (memory plan)."""
    dim = shard_dim(name)
    if dim is None or tp <= 1:
        return tuple(shape)
    return tuple(size // tp if axis == dim else size for axis, size in enumerate(shape))
