"""model.fp8 (pretrain/model/fp8.py, pretrain/startup/checks.py) on the CPU through torchao's emulation.

The conversion touches exactly the blocks' Linear layers whose sizes divide by 16; a short real training run follows
model.fp8=off's losses; a checkpoint moves between FP8 and non-FP8 engines with its weights, master weights and Adam
states restored bit for bit (ZeRO 1 and 2); and FP8 is refused where it cannot run (a CPU without emulation, a GPU
below compute capability 8.9, ZeRO-3, tensor parallelism), before any rank starts.
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from pretrain.config import ConfigError, compose_config, to_object
from pretrain.model.config import ModelConfig, model_problems
from pretrain.model.fp8 import convert_to_fp8, fp8_layer_names
from pretrain.model.llama import Llama
from pretrain.startup.checks import check_fp8, fp8_device_problem, fp8_setup_problems
from tests.helpers import REPO, run_one_rank_script, run_training, tiny_overrides, train_losses, write_tiny_corpus

BLOCK_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def test_conversion_touches_the_blocks_linears_and_nothing_else():
    """The debug model (hidden 64, MLP 176, kv 32: all divide by 16): every Linear of every block, not the embedding
    or the LM head; the parameters are the same tensors under the same names, and no buffer is added."""
    torch.manual_seed(0)
    model = Llama(ModelConfig())
    before = dict(model.state_dict(keep_vars=True))
    converted = convert_to_fp8(model, "tensorwise", emulate=True)
    expected = [f"model.layers.{i}.{name}" for i in range(2) for name in BLOCK_LINEARS]
    assert sorted(converted) == sorted(expected)
    assert sorted(fp8_layer_names(model)) == sorted(expected)
    assert type(model.model.embed_tokens) is nn.Embedding and type(model.lm_head).__name__ == "LMHead"
    after = dict(model.state_dict(keep_vars=True))
    assert list(after) == list(before) and all(after[k] is before[k] for k in before)


def test_a_linear_whose_sizes_do_not_divide_by_16_stays_as_it_is():
    """MLP width 72: gate, up (out 72) and down (in 72) keep nn.Linear; the attention projections convert."""
    model = Llama(ModelConfig(intermediate_size=72))
    converted = convert_to_fp8(model, "rowwise", emulate=True)
    assert sorted(converted) == sorted(f"model.layers.{i}.{name}" for i in range(2) for name in BLOCK_LINEARS[:4])
    assert type(model.model.layers[0].mlp.up_proj) is nn.Linear


def test_off_converts_nothing_and_an_unknown_recipe_is_named():
    model = Llama(ModelConfig())
    assert convert_to_fp8(model, "off") == [] and fp8_layer_names(model) == []
    assert model_problems(ModelConfig(fp8="delayed")) == [
        "model.fp8='delayed': choose one of off, tensorwise, rowwise"]
    assert ModelConfig(fp8="False").fp8 == "off"  # YAML's unquoted `fp8: off`


# -- refusals ---------------------------------------------------------------------------------------------------
def test_cpu_without_emulation_is_refused_and_with_it_allowed():
    line = fp8_device_problem("tensorwise", emulate=False, gpus=[])
    assert line.startswith("model.fp8=tensorwise needs an NVIDIA GPU of compute capability 8.9+")
    assert "this run trains on the CPU" in line and "\n" not in line
    assert fp8_device_problem("tensorwise", emulate=True, gpus=[]) is None
    assert fp8_device_problem("off", emulate=False, gpus=[]) is None


def test_a_gpu_below_compute_capability_8_9_is_refused_naming_it():
    a100 = ("NVIDIA A100-SXM4-80GB", (8, 0))
    line = fp8_device_problem("rowwise", emulate=False, gpus=[a100])
    assert "GPU 0, NVIDIA A100-SXM4-80GB, has compute capability 8.0" in line and "\n" not in line
    assert fp8_device_problem("rowwise", emulate=False, gpus=[("NVIDIA L4", (8, 9)), ("NVIDIA H100", (9, 0))]) is None
    assert "GPU 1, NVIDIA RTX A6000, has compute capability 8.6" in fp8_device_problem(
        "tensorwise", emulate=False, gpus=[("NVIDIA H200", (9, 0)), ("NVIDIA RTX A6000", (8, 6))])


def test_zero3_and_tensor_parallelism_are_refused_with_a_reason():
    cfg = to_object(compose_config(["experiment=cpu_tiny", "model.vocab_size=512", "model.fp8=tensorwise",
                                    "model.fp8_emulate=true"]))
    assert fp8_setup_problems(cfg) == []
    check_fp8(cfg, "cpu")  # emulated on the CPU: allowed
    zero3 = replace(cfg, deepspeed=replace(cfg.deepspeed, zero_stage=3))
    assert [p.split(" (")[0] for p in fp8_setup_problems(zero3)] == [
        "model.fp8=tensorwise is not supported with deepspeed.zero_stage=3"]
    tp = replace(cfg, parallel=replace(cfg.parallel, tensor=2))
    assert "AutoTP replaces the blocks' Linear layers" in fp8_setup_problems(tp)[0]
    real = replace(cfg, model=replace(cfg.model, fp8_emulate=False))
    with pytest.raises(ConfigError, match="this run trains on the CPU"):
        check_fp8(real, "cpu")


@pytest.mark.slow
def test_ayumi_train_refuses_fp8_on_the_cpu_before_any_rank_starts(tmp_path):
    """`ayumi train` on this CPU machine: one line, exit status 2, no rank started (no run dir)."""
    import subprocess
    import sys

    from tests.helpers import cpu_env

    corpus = write_tiny_corpus(tmp_path / "corpus")
    proc = subprocess.run([sys.executable, "-m", "pretrain.tools.cli", "train",
                           *tiny_overrides(corpus, tmp_path / "runs", "model.fp8=rowwise")],
                          cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "model.fp8=rowwise needs an NVIDIA GPU of compute capability 8.9+" in proc.stderr + proc.stdout
    assert not (tmp_path / "runs").exists()


# -- training ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_short_fp8_run_follows_the_non_fp8_one(tmp_path):
    """The real trainer, 2 ranks, ZeRO-2, 16 steps from the same seed and data: tensorwise and rowwise FP8
    (emulated) follow model.fp8=off step by step within FP8's rounding, and the loss falls."""
    corpus = write_tiny_corpus(tmp_path / "corpus")
    common = ["deepspeed=zero2", "deepspeed.precision=bf16", "train.max_steps=16", "checkpoint.interval=0",
              "train.eval_interval=0"]
    losses = {}
    for recipe in ("off", "tensorwise", "rowwise"):
        proc = run_training(tiny_overrides(corpus, tmp_path / recipe, *common, f"model.fp8={recipe}",
                                           "model.fp8_emulate=true"), launcher="fork")
        assert proc.returncode == 0, proc.stdout[-6000:]
        losses[recipe] = train_losses(tmp_path / recipe / "cpu_tiny")
        if recipe != "off":
            assert f"FP8 ({recipe}, torchao's emulation, for tests): 14 Linear layers" in proc.stdout
    base = losses["off"]
    assert sorted(base) == list(range(1, 17)) and base[16] < 0.8 * base[1]
    for recipe in ("tensorwise", "rowwise"):
        gaps = [abs(losses[recipe][s] - base[s]) / base[s] for s in base]
        print(recipe, "largest relative loss gap to model.fp8=off:", max(gaps))
        assert all(math.isfinite(x) for x in losses[recipe].values())
        assert max(gaps) < 0.03, (recipe, gaps)
        assert losses[recipe] != base  # FP8 did round something


RESUME_CHECK = r"""
import json, sys, tempfile, torch
from pathlib import Path
sys.path.insert(0, {repo!r})
from pretrain.config import compose_config, to_object
from pretrain.engine.distributed import exit_process, init_distributed
from pretrain.engine.train_engine import TrainEngine
from pretrain.model.fp8 import convert_to_fp8, fp8_layer_names
from pretrain.model.llama import Llama

dist = init_distributed("cpu")
ids = torch.randint(0, 512, (4, 65), generator=torch.Generator().manual_seed(1))

def engine_for(stage, recipe):
    cfg = to_object(compose_config(["experiment=cpu_tiny", "model.vocab_size=512", f"deepspeed.zero_stage={{stage}}",
                                    "deepspeed.precision=bf16", f"model.fp8={{recipe}}", "model.fp8_emulate=true"]))
    torch.manual_seed(0)
    model = Llama(cfg.model)
    convert_to_fp8(model, recipe, emulate=True)
    return TrainEngine(model, cfg, dist), len(fp8_layer_names(model))

def train(engine, steps):
    for _ in range(steps * engine.grad_accum):
        engine.backward(engine.forward(ids[:, :-1], ids[:, 1:]).loss)
        engine.micro_step()

def state(engine):
    # The module's bf16 weights, DeepSpeed's fp32 masters, and every Adam state tensor in the optimizer's order.
    out = {{"w/" + k: v.detach().clone() for k, v in engine.module.state_dict().items()}}
    out.update({{"m/" + k: v for k, v in engine.full_fp32_params().items()}})
    opt = engine.client_optimizer
    for g, group in enumerate(opt.param_groups):
        for p, param in enumerate(group["params"]):
            for key, value in opt.state[param].items():
                out[f"o/{{g}}/{{p}}/{{key}}"] = value.detach().clone() if torch.is_tensor(value) else torch.tensor(value)
    return out

def same(a, b):
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)

result = {{}}
root = Path(tempfile.mkdtemp())
for stage in (1, 2):
    off, _ = engine_for(stage, "off")
    train(off, 2)
    off.save(root, f"off{{stage}}", {{}})
    saved_off = state(off)
    fp8, layers = engine_for(stage, "tensorwise")
    fp8.load(root, f"off{{stage}}")
    into_fp8 = same(saved_off, state(fp8))
    train(fp8, 1)
    fp8.save(root, f"fp8{{stage}}", {{}})
    saved_fp8 = state(fp8)
    back, _ = engine_for(stage, "off")
    back.load(root, f"fp8{{stage}}")
    result[stage] = dict(layers=layers, into_fp8=into_fp8, back=same(saved_fp8, back_state := state(back)),
                         moved=not same(saved_off, saved_fp8), keys=len(back_state))
print("RESULT " + json.dumps(result))
exit_process(0)
"""


@pytest.mark.slow
def test_a_checkpoint_moves_into_fp8_and_back_exactly():
    """ZeRO 1 and 2, bf16, one rank: a model.fp8=off checkpoint loads into an FP8 engine with its weights, fp32
    master weights and Adam states equal bit for bit; one FP8 step later, that checkpoint loads back into an engine
    without FP8, equal again. The files are the same format either way (the same DeepSpeed load reads both)."""
    result = run_one_rank_script(RESUME_CHECK.format(repo=str(REPO)))
    for stage in ("1", "2"):
        found = result[stage]
        assert found["layers"] == 14, found
        assert found["into_fp8"] and found["back"] and found["moved"], found
        assert found["keys"] > 40, found  # weights, masters and Adam states were all compared
