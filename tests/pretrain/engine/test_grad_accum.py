"""deepspeed.grad_accum_dtype: who sums a bf16 run's micro-batch gradients in fp32, and how.

ZeRO 2-3: DeepSpeed, from `data_types` in the rendered config. ZeRO 0-1: ayumi's
Fp32GradAccumulator, whose gradient at the step's last micro-batch must be the fp32 sum of every
micro-batch's own bf16 gradient, rounded once, under activation checkpointing and torch.compile.
The 2-rank DeepSpeed runs are in tests/pretrain/engine/test_grad_accum_cpu.py.
"""
from __future__ import annotations

import pytest
import torch

from pretrain.config import ConfigError, check_config, compose_config, to_object
from pretrain.engine.grad_accum import Fp32GradAccumulator, fp32_accumulation_by
from pretrain.model.config import ModelConfig
from pretrain.model.llama import Llama


def ds_config(*overrides: str, world_size: int = 2) -> dict:
    from pretrain.engine.train_engine import render_ds_config

    cfg = to_object(compose_config(["experiment=cpu_tiny", "model.vocab_size=512", "train.micro_batch_size=1",
                                    "train.global_batch_size=16", *overrides]))
    return render_ds_config(cfg, world_size)


def test_fp32_is_the_default_and_other_values_are_refused():
    cfg = to_object(compose_config(["experiment=cpu_tiny", "model.vocab_size=512"]))
    assert cfg.deepspeed.grad_accum_dtype == "fp32"
    cfg.deepspeed.grad_accum_dtype = "fp16"
    with pytest.raises(ConfigError, match=r"deepspeed.grad_accum_dtype=fp16 must be one of fp32, bf16"):
        check_config(cfg)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_rendered_data_types_per_stage_and_precision(stage):
    rendered = {(precision, dtype): ds_config(f"deepspeed.zero_stage={stage}", f"deepspeed.precision={precision}",
                                              f"deepspeed.grad_accum_dtype={dtype}")
                for precision in ("bf16", "fp16", "fp32") for dtype in ("fp32", "bf16")}
    assert all(config["gradient_accumulation_steps"] == 8 for config in rendered.values())
    # DeepSpeed honours data_types under ZeRO 2-3 only; under 0-1 ayumi sums (stage 0 would raise
    # NotImplementedError, stage 1 would swap in BF16_Optimizer).
    expected = {"grad_accum_dtype": "fp32"} if stage >= 2 else None
    assert rendered["bf16", "fp32"].get("data_types") == expected
    assert fp32_accumulation_by("bf16", "fp32", stage) == ("deepspeed" if stage >= 2 else "ayumi")
    # bf16 asked for, or a precision the field does not touch: DeepSpeed's default (the model's dtype).
    for key in [("bf16", "bf16"), ("fp16", "fp32"), ("fp16", "bf16"), ("fp32", "fp32"), ("fp32", "bf16")]:
        assert "data_types" not in rendered[key], key
        assert fp32_accumulation_by(*key, stage) is None
    # Nothing else in the config depends on the field.
    strip = {k: v for k, v in rendered["bf16", "fp32"].items() if k != "data_types"}
    assert strip == rendered["bf16", "bf16"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_keeps_the_same_owner(stage):
    offload = ["deepspeed.offload_optimizer=true"] + (["deepspeed.offload_param=true"] if stage == 3 else [])
    config = ds_config(f"deepspeed.zero_stage={stage}", "deepspeed.precision=bf16", *offload)
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert config.get("data_types") == ({"grad_accum_dtype": "fp32"} if stage >= 2 else None)


def tiny_bf16_llama(**model) -> Llama:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, max_seq_len=32, **model)
    return Llama(cfg).to(torch.bfloat16)


def accumulate(model: Llama, micro_batches: int = 4, *, pass_over: set[str] = frozenset()):
    """Runs one step's micro-batches through Fp32GradAccumulator; returns (the recorded micro-batch
    gradients per parameter, the gradients at the end, whether param.grad was empty in between)."""
    recorded: dict[str, list[torch.Tensor]] = {}
    for name, param in model.named_parameters():
        # Registered first, so it sees each micro-batch's own gradient before the accumulator takes it.
        param.register_post_accumulate_grad_hook(
            lambda p, name=name: recorded.setdefault(name, []).append(p.grad.clone()))
    accumulator = Fp32GradAccumulator(model.named_parameters())
    accumulator.allocate()
    ids = torch.randint(0, 128, (micro_batches, 1, 33), generator=torch.Generator().manual_seed(1))
    empty_between = True
    for micro in range(micro_batches):
        for name, param in model.named_parameters():
            param.requires_grad_(name not in pass_over or micro == 0)
        accumulator.begin_backward(boundary=micro == micro_batches - 1)
        (model(ids[micro, :, :-1], ids[micro, :, 1:]).loss / micro_batches).backward()
        accumulator.end_backward()
        if micro < micro_batches - 1:
            empty_between &= all(p.grad is None for p in model.parameters())
    return recorded, {name: p.grad for name, p in model.named_parameters()}, empty_between, accumulator


# The compiled cases run on any CPU. Their NaN gradients and segfault once seen as an AVX2-only CPU (an AVX-512 host
# with ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2) match inductor kernels reused across ISA settings, which
# pretrain/model/inductor_cache.py now prevents; on a real AVX2-only CPU both cases pass with either setting.
@pytest.mark.parametrize("setup", ["eager", "checkpoint_full", "checkpoint_attention", "tied", "compiled_blocks",
                                   pytest.param("compiled_full", marks=pytest.mark.slow)])  # ~15 s of inductor
def test_last_micro_batch_hands_on_the_fp32_sum_rounded_once(setup):
    model = tiny_bf16_llama(tie_embeddings=setup == "tied")
    if setup.startswith("checkpoint_"):
        model.set_activation_checkpointing(setup.removeprefix("checkpoint_"))
    if setup.startswith("compiled_"):
        torch._dynamo.reset()
        model.compile_for(setup.removeprefix("compiled_"), "cpu")
    recorded, grads, empty_between, _ = accumulate(model)
    assert empty_between, "autograd must never add micro-batch gradients in bf16"
    bf16_sums_differ = 0
    for name, grad in grads.items():
        assert len(recorded[name]) == 4, name  # one arrival per micro-batch
        fp32_sum = torch.stack([g.float() for g in recorded[name]]).sum(0)
        assert grad.dtype == torch.bfloat16 and torch.equal(grad, fp32_sum.to(torch.bfloat16)), name
        running = recorded[name][0]
        for g in recorded[name][1:]:
            running = running + g  # what autograd's bf16 accumulation gives
        bf16_sums_differ += int((running != grad).sum())
    assert bf16_sums_differ > 0, "the check cannot tell fp32 from bf16 accumulation on this model"


def test_the_next_step_sums_only_its_own_gradients():
    """Step 2's gradient is the fp32 sum of step 2's micro-batch gradients: nothing of step 1 carries over
    (its first micro-batch overwrites the sums; fails if it added to them)."""
    model = tiny_bf16_llama()
    recorded: dict[str, list[torch.Tensor]] = {}
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(
            lambda p, name=name: recorded.setdefault(name, []).append(p.grad.clone()))
    accumulator = Fp32GradAccumulator(model.named_parameters())
    accumulator.allocate()
    ids = torch.randint(0, 128, (2, 3, 1, 33), generator=torch.Generator().manual_seed(2))
    for step in range(2):
        recorded.clear()
        for micro in range(3):
            accumulator.begin_backward(boundary=micro == 2)
            (model(ids[step, micro, :, :-1], ids[step, micro, :, 1:]).loss / 3).backward()
            accumulator.end_backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)  # as the optimizer step leaves it
    for name, grad in grads.items():
        fp32_sum = torch.stack([g.float() for g in recorded[name]]).sum(0)
        assert torch.equal(grad, fp32_sum.to(torch.bfloat16)), name


def test_a_parameter_left_out_of_the_last_micro_batch_is_refused():
    model = tiny_bf16_llama()
    with pytest.raises(RuntimeError, match=r"lm_head.weight got gradients in earlier micro-batches but none in the step's "
                                           r"last one.*deepspeed.grad_accum_dtype=bf16"):
        accumulate(model, pass_over={"lm_head.weight"})


def test_a_second_gradient_in_one_backward_is_refused():
    param = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    accumulator = Fp32GradAccumulator([("w", param)])
    accumulator.allocate()
    accumulator.begin_backward(boundary=False)
    (param * 2).sum().backward()
    with pytest.raises(RuntimeError, match=r"w received two gradients in one backward"):
        # A second graph in the same backward window (what reentrant checkpointing would do).
        (param * 3).sum().backward()
