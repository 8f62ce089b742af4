"""Parameter/FLOP counts from the config, and the shipped presets in conf/model/."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from pretrain.model.config import ModelConfig
from pretrain.model.flops import count_parameters, flops_per_token, parameter_shapes
from pretrain.model.llama import Llama

PRESETS = Path(__file__).resolve().parents[3] / "conf" / "model"

MID = ModelConfig(name="mid", vocab_size=1000, hidden_size=192, intermediate_size=512, num_layers=3,
                  num_heads=6, num_kv_heads=2, max_seq_len=64)


@pytest.mark.parametrize("cfg", [
    ModelConfig(),
    ModelConfig(tie_embeddings=True),
    ModelConfig(qk_norm=True),
    MID,
    dataclasses.replace(MID, tie_embeddings=True),
], ids=["debug", "debug-tied", "debug-qknorm", "mid", "mid-tied"])
def test_counts_equal_the_built_model(cfg):
    model = Llama(cfg)
    params = dict(model.named_parameters())
    assert count_parameters(cfg) == sum(p.numel() for p in params.values())
    assert {n: tuple(p.shape) for n, p in params.items()} == parameter_shapes(cfg)
    embedding = params["model.embed_tokens.weight"].numel()
    assert count_parameters(cfg, include_embedding=False) == count_parameters(cfg) - embedding


def test_flops_per_token_by_hand():
    # debug config: hidden 64, 2 layers, 4 heads (head_dim 16), 2 kv heads, intermediate 176, vocab 512.
    cfg = ModelConfig()
    per_layer = 64 * 64 + 2 * (64 * 32) + 64 * 64 + 3 * (64 * 176)  # q, k+v, o, gate+up+down = 46,080
    matmul = 2 * per_layer + 512 * 64  # + lm_head = 124,928
    assert flops_per_token(cfg, 128) == 6 * 124_928 + 12 * 2 * 64 * 128 == 946_176
    # A tied lm_head is still a matmul: the FLOPs don't change.
    assert flops_per_token(dataclasses.replace(cfg, tie_embeddings=True), 128) == 946_176
    assert matmul == 124_928


def test_flops_of_llama2_7b_are_6n_plus_attention():
    cfg = load_preset("7b")
    norm_scales = (2 * 32 + 1) * 4096  # not matmul weights
    n_matmul = count_parameters(cfg, include_embedding=False) - norm_scales  # lm_head in, lookup out
    attention = 12 * 32 * 4096 * 4096  # ~14% on top of 6N at seq 4096
    assert flops_per_token(cfg, 4096) == 6 * n_matmul + attention


def load_preset(name: str) -> ModelConfig:
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(PRESETS / f"{name}.yaml"))
    return OmegaConf.to_object(merged)


def test_debug_preset_is_the_dataclass_defaults():
    assert load_preset("debug") == ModelConfig()


@pytest.mark.parametrize("name", ["debug", "125m", "1b", "7b"])
def test_preset_loads_and_states_its_parameter_count(name):
    cfg = load_preset(name)
    assert cfg.name == name
    first = (PRESETS / f"{name}.yaml").read_text().splitlines()[0]
    stated = re.search(r"([\d,]+) parameters", first)
    assert stated, f"{name}.yaml: first line should state the parameter count"
    assert int(stated.group(1).replace(",", "")) == count_parameters(cfg)


def test_7b_preset_is_llama2_7b():
    cfg = load_preset("7b")
    assert count_parameters(cfg) == 6_738_415_616  # meta-llama/Llama-2-7b-hf
    assert (cfg.max_seq_len, cfg.rope_theta, cfg.norm_eps, cfg.vocab_size) == (4096, 10000.0, 1e-5, 32000)


def test_preset_shapes_build_on_the_meta_device():
    # The real shapes construct (every divisibility check passes) without allocating memory.
    with torch.device("meta"):
        model = Llama(load_preset("1b"))
    assert sum(p.numel() for p in model.parameters()) == count_parameters(model.cfg)
