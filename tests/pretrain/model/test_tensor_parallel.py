"""Tensor parallelism without ranks: the layout, the config's refusals, the batch and memory arithmetic, the
loader's tensor-parallel groups, the rendered DeepSpeed config and the merge of shards (tests/pretrain/
engine/test_tensor_parallel_cpu.py trains it)."""
import math
import re

import pytest
import torch

from pretrain.config import ConfigError, ParallelConfig, check_config, compose_config, data_parallel_size, to_object
from pretrain.loader import BatchLoader
from pretrain.plan.memory import estimate_memory, format_memory, local_parameters, memory_shape
from pretrain.model.config import ModelConfig
from pretrain.model.flops import count_parameters, parameter_shapes
from pretrain.plan.hardware import Hardware
from pretrain.plan.run_plan import format_run_plan, run_plan
from pretrain.plan.hardware import planned_hardware
from pretrain.model.tensor_parallel import merge_shards, shard_dim, split_state
from tests.pretrain.test_loader import CountingSource, first_ids


def config(*overrides):
    return to_object(compose_config(["experiment=cpu_tiny", "model.vocab_size=512", *overrides]))  # no data to follow


def test_layout_cuts_every_projection_and_nothing_else():
    shapes = parameter_shapes(ModelConfig(qk_norm=True))
    cut = {name: shard_dim(name) for name in shapes if shard_dim(name) is not None}
    for name in shapes:
        leaf = name.split(".")[-2]
        expected = 0 if leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") else \
            1 if leaf in ("o_proj", "down_proj") else None
        assert shard_dim(name) == expected, name
    assert len(cut) == 7 * 2  # seven projections in each of the debug model's 2 blocks
    assert shard_dim("module._orig_mod.model.layers.0.mlp.down_proj.weight") == 1  # wrapper prefixes


def test_merge_undoes_the_cut_and_refuses_shards_that_do_not_belong_together():
    torch.manual_seed(0)
    whole = {name: torch.randn(shape) for name, shape in parameter_shapes(ModelConfig()).items()}
    shards = split_state(whole, 2)
    assert shards[0]["model.layers.0.self_attn.q_proj.weight"].shape == (32, 64)
    assert shards[1]["model.layers.0.mlp.down_proj.weight"].shape == (64, 88)
    merged = merge_shards(shards)
    assert all(torch.equal(merged[name], whole[name]) for name in whole)
    shards[1]["model.norm.weight"] = shards[1]["model.norm.weight"] + 1
    with pytest.raises(ValueError, match="model.norm.weight is replicated .* differs"):
        merge_shards(shards)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.tensor=3"], r"parallel.tensor=3 must divide model.num_heads=4: .* takes parallel.tensor in \[1, 2\]"),
    (["parallel.tensor=4"], "parallel.tensor=4 must divide model.num_kv_heads=2"),
    (["parallel.tensor=2", "model.intermediate_size=175"], "must divide model.intermediate_size=175"),
    (["parallel.tensor=2", "deepspeed=zero3"], "deepspeed.zero_stage=3: .* Fix: deepspeed=zero1 or zero2"),
    (["parallel.tensor=2", "deepspeed=zero1", "deepspeed.precision=fp16"], "tested with bf16 and fp32 only"),
    (["parallel.tensor=2", "deepspeed=zero2_offload"], "not tested with ZeRO-Offload"),
    (["parallel.tensor=2", "deepspeed=zero1", "train.num_gpus=3"], "train.num_gpus=3 must divide by parallel.tensor=2"),
    (["parallel.tensor=0"], "parallel.tensor=0 must be >= 1"),
])
def test_unsupported_combinations_are_one_line_naming_the_field_and_the_fix(overrides, message):
    """Each problem is one line (all of a config's problems are reported at once, a line each)."""
    with pytest.raises(ConfigError) as caught:
        check_config(config("deepspeed=zero1", *overrides))
    assert any(re.search(message, line) for line in str(caught.value).splitlines()), str(caught.value)


def test_supported_combinations_pass():
    for overrides in (["deepspeed=zero0", "deepspeed.precision=fp32"], ["deepspeed=zero0", "deepspeed.precision=bf16"],
                      ["deepspeed=zero1"], ["deepspeed=zero2"],
                      ["deepspeed=zero1", "model.qk_norm=true", "deepspeed.activation_checkpointing=full"]):
        check_config(config("parallel.tensor=2", *overrides))


def test_precision_auto_resolved_to_fp16_is_refused_when_deepspeed_is_configured():
    """`auto` passes the config check (it may become bf16), but where it resolves to fp16 (a GPU without bf16) the
    DeepSpeed config is not rendered for tensor parallelism."""
    from pretrain.engine.train_engine import render_ds_config

    cfg = config("parallel.tensor=2", "deepspeed=zero1", "deepspeed.precision=auto")
    check_config(cfg)
    cfg.deepspeed.precision = "fp16"  # what settle_precision writes on such a GPU
    with pytest.raises(ValueError, match="parallel.tensor=2 is tested with bf16 and fp32 only"):
        render_ds_config(cfg, world_size=2)


def test_data_parallel_size_is_ranks_over_tensor_parallel():
    assert data_parallel_size(ParallelConfig(tensor=2), 8) == 4
    assert data_parallel_size(ParallelConfig(tensor=1), 3) == 3
    with pytest.raises(ConfigError, match=r"parallel.tensor=4 must divide the 6 rank\(s\) of this job"):
        data_parallel_size(ParallelConfig(tensor=4), 6)


def test_a_tensor_parallel_group_reads_the_same_samples():
    """Ranks 0,1 | 2,3 of tensor-parallel 2 x data-parallel 2: a group's two ranks get identical micro-batches,
    and the two groups together see each global batch once (as 2 plain data-parallel ranks would)."""
    from pretrain.engine.train_engine import DistInfo

    infos = [DistInfo(rank, 4, rank, 4, torch.device("cpu"), tensor_parallel=2) for rank in range(4)]
    assert [(i.dp_rank, i.tp_rank, i.dp_size) for i in infos] == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    loaders = [BatchLoader(CountingSource(), 2, 2, i.dp_rank, i.dp_size, i.device, prefetch=0) for i in infos]
    for step in range(2):
        ids = [first_ids(loader.next_step()) for loader in loaders]
        assert ids[0] == ids[1] and ids[2] == ids[3]
        assert sorted(ids[0] + ids[2]) == list(range(step * 8, (step + 1) * 8))


def test_rendered_deepspeed_config_counts_data_parallel_ranks():
    from pretrain.engine.train_engine import render_ds_config

    cfg = config("parallel.tensor=2", "deepspeed=zero1", "deepspeed.precision=fp32")  # micro 4, global 8
    rendered = render_ds_config(cfg, world_size=4)  # 2 data-parallel ranks
    assert (rendered["train_batch_size"], rendered["train_micro_batch_size_per_gpu"],
            rendered["gradient_accumulation_steps"]) == (8, 4, 1)
    tp = rendered["tensor_parallel"]
    assert tp["autotp_size"] == 2 and tp["vocab_parallel_lm_head"] is False
    assert tp["partition_config"]["strict_mode"] and not tp["partition_config"]["use_default_specs"]
    assert "tensor_parallel" not in render_ds_config(config("deepspeed.precision=fp32"), world_size=2)
    with pytest.raises(ConfigError, match="parallel.tensor=2 must divide the 3 rank"):
        render_ds_config(cfg, world_size=3)


def test_memory_plan_counts_one_gpus_slice():
    """llama_1b_example at tensor-parallel 4 on its 8 GPUs: each GPU holds the embedding, LM head and norms
    whole and a quarter of every projection; ZeRO cuts the states over 8 / 4 = 2 data-parallel ranks;
    activations shrink."""
    cfg = to_object(compose_config(["experiment=llama_1b_example", "parallel.tensor=4"]))
    check_config(cfg)
    model = cfg.model
    h, layers = model.hidden_size, model.num_layers
    replicated = 2 * model.vocab_size * h + (2 * layers + 1) * h
    assert local_parameters(model, 4) == replicated + (count_parameters(model) - replicated) // 4
    hardware = planned_hardware(cfg)  # train.num_gpus=8, 80 GB each
    assert (hardware.data_parallel, hardware.tensor_parallel) == (2, 4)
    sliced = estimate_memory(memory_shape(cfg, hardware.data_parallel))
    whole = estimate_memory(memory_shape(to_object(compose_config(["experiment=llama_1b_example"])), 2))
    assert sliced.term("parameters") == 2 * local_parameters(model, 4) < whole.term("parameters")
    assert sliced.term("activations") < whole.term("activations")
    assert "tensor-parallel 4, 2 data-parallel ranks" in format_memory(sliced)
    run = run_plan(cfg, count_parameters(model), hardware, free_bytes=2**50)
    accum = cfg.train.global_batch_size // (cfg.train.micro_batch_size * 2)
    assert f"batch: global {cfg.train.global_batch_size} = micro {cfg.train.micro_batch_size} x grad accum {accum} " \
           "x 2 data-parallel rank(s), on 8 GPU(s) (tensor-parallel 4 x data-parallel 2)" in format_run_plan(run)


def test_cpu_plan_splits_ranks_into_groups():
    cfg = config("parallel.tensor=2", "deepspeed=zero1")
    run = run_plan(cfg, count_parameters(cfg.model), Hardware(2, None, "CPU", 2), free_bytes=2**40)
    assert "on 4 GPU(s) (tensor-parallel 2 x data-parallel 2)" in format_run_plan(run)
    assert math.isclose(run.memory.shape.grad_accum, 1)
