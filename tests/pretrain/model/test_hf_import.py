"""model.init_from: a Hugging Face Llama folder's config.json becomes the model's shape and its safetensors the
weights at step 0. Checked against transformers itself: a random LlamaForCausalLM saved with save_pretrained."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pretrain.config import ConfigError, config_from_args
from pretrain.model.hf_import import HFImportError, HFWeights, model_fields, read_hf_config

SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=50000.0)


def save_random_llama(folder: Path, tie: bool = False, seed: int = 0, rope_scaling: dict | None = None,
                      config: dict | None = None, **save) -> "torch.nn.Module":
    """A random transformers LlamaForCausalLM of SHAPE (with `config`'s changes), saved to `folder`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**SHAPE, **(config or {})}, tie_word_embeddings=tie,
                                         rope_scaling=dict(rope_scaling) if rope_scaling else None))
    model.save_pretrained(folder, **save)
    return model


def test_config_json_becomes_the_model_shape(tmp_path):
    save_random_llama(tmp_path / "base", tie=True)
    fields = model_fields(read_hf_config(tmp_path / "base"), tmp_path / "base")
    assert {k: fields[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                                   "num_kv_heads", "max_seq_len", "rope_theta", "norm_eps", "tie_embeddings")} == {
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 176, "num_layers": 2, "num_heads": 4,
        "num_kv_heads": 2, "max_seq_len": 128, "rope_theta": 50000.0, "norm_eps": 1e-5, "tie_embeddings": True}


@pytest.mark.parametrize("change, named", [
    ({"model_type": "qwen2"}, "model_type='qwen2'"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"pretraining_tp": 2}, "pretraining_tp=2"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "RoPE scaling 'longrope'"),
    ({"rope_parameters": {"rope_type": "proportional", "rope_theta": 5e5}}, "RoPE scaling 'proportional'"),
    ({"head_dim": 32}, "head_dim=32"),
    ({"sliding_window": 4096}, "sliding_window=4096"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
])
def test_what_ayumi_would_compute_differently_is_refused_by_name(tmp_path, change, named):
    save_random_llama(tmp_path / "base")
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    config.update(change)
    with pytest.raises(HFImportError, match=f"config.json: .*{named}"):
        model_fields(config, tmp_path / "base")


def test_the_training_config_takes_the_shape_and_refuses_contradicting_overrides(tmp_path):
    save_random_llama(tmp_path / "base")
    base = f"model.init_from={tmp_path / 'base'}"
    cfg = config_from_args(["experiment=cpu_tiny", base, "model.hidden_size=64", "model.num_kv_heads=2"])
    assert (cfg.model.hidden_size, cfg.model.rope_theta, cfg.model.num_kv_heads, cfg.model.name) == (64, 50000.0, 2, "base")
    with pytest.raises(ConfigError) as err:
        config_from_args(["experiment=cpu_tiny", base, "model.hidden_size=128", "model.num_layers=4"])
    assert str(err.value).splitlines() == [
        "model.hidden_size=128 contradicts model.init_from's config.json (hidden_size = 64); drop the override "
        "(the shape comes from the folder)",
        "model.num_layers=4 contradicts model.init_from's config.json (num_layers = 2); drop the override "
        "(the shape comes from the folder)"]
    with pytest.raises(ConfigError, match="no such folder"):
        config_from_args(["experiment=cpu_tiny", f"model.init_from={tmp_path / 'nothing'}"])


def test_sharded_safetensors_read_tensor_by_tensor(tmp_path):
    model = save_random_llama(tmp_path / "base", max_shard_size="100KB")
    assert (tmp_path / "base" / "model.safetensors.index.json").is_file()
    weights = HFWeights(tmp_path / "base")
    assert len(set(weights.files.values())) > 1
    for name, tensor in model.state_dict().items():
        assert torch.equal(weights.tensor(name), tensor), name


def test_a_folder_without_safetensors_says_how_to_convert(tmp_path):
    """Older checkpoints ship pytorch_model.bin (a pickle): never loaded, the fix is named."""
    model = save_random_llama(tmp_path / "base")
    (tmp_path / "base" / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "base" / "pytorch_model.bin")
    with pytest.raises(HFImportError, match=r"no model.safetensors .*pytorch_model.bin: save it with safe_serialization"):
        HFWeights(tmp_path / "base")


def test_a_shape_mismatch_names_the_tensor(tmp_path):
    from pretrain.model.flops import parameter_shapes

    save_random_llama(tmp_path / "base")
    cfg = config_from_args(["experiment=cpu_tiny", f"model.init_from={tmp_path / 'base'}"])
    cfg.model.intermediate_size = 128
    with pytest.raises(HFImportError, match=r"model.layers.0.mlp.gate_proj.weight has shape \(176, 64\)"):
        HFWeights(tmp_path / "base").check(parameter_shapes(cfg.model), tied=False)
