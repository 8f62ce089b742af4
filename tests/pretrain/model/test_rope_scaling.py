"""RoPE scaling (linear, dynamic, yarn, llama3) and rope_theta, both ways, against transformers itself: a random
LlamaForCausalLM with the scaling is saved by transformers, read by model.init_from's config reader, built as
ayumi's Llama with its tensors, and its fp32 logits must equal transformers' within 1e-5; exported again, the
folder transformers loads gives the same logits and carries the same RoPE parameters.

(Training from such a folder, 2 ranks, and exporting its checkpoint: test_init_from_hf.py, whose ZeRO-3 case
starts from a Llama 3.2-like folder: llama3 scaling and tied embeddings.)"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pretrain.config import ConfigError, config_from_args
from pretrain.model.config import ModelConfig
from pretrain.model.hf_import import HFImportError, model_fields, read_hf_config, rope_settings
from pretrain.model.llama import Llama
from pretrain.tools.export import export_hf
from tests.pretrain.model.test_hf_import import SHAPE, save_random_llama

PEAKED = {"initializer_range": 0.1}
"""Weights large enough for peaked attention: a small error in the RoPE tables shows in the logits."""
SCALINGS = {  # as each family's config.json has it, shrunk to the tiny model's 128 positions
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn_mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16.0,
                    "beta_slow": 2.0, "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}
TOLERANCE = 1e-5


def save_hf_llama(folder: Path, scaling: dict | None, **changes):
    return save_random_llama(folder, rope_scaling=scaling, config={**PEAKED, **changes}).eval()


def ayumi_llama(folder: Path, hf_model, **changes) -> Llama:
    """ayumi's Llama as model.init_from builds it: the shape from config.json, the tensors copied in."""
    model = Llama(ModelConfig(**{**model_fields(read_hf_config(folder), folder), **changes})).eval()
    missing, unexpected = model.load_state_dict(hf_model.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return (out.logits if hasattr(out, "logits") else out).float()


def assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    worst = (ours - theirs).abs().max().item()
    assert worst <= TOLERANCE * max(1.0, theirs.abs().max().item()), worst


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_logits_equal_transformers_and_the_export_carries_the_scaling(tmp_path, kind):
    hf_model = save_hf_llama(tmp_path / "base", SCALINGS[kind])
    ours = ayumi_llama(tmp_path / "base", hf_model)
    assert ours.cfg.rope_scaling.type == SCALINGS[kind]["rope_type"]
    ids = torch.randint(0, SHAPE["vocab_size"], (2, SHAPE["max_position_embeddings"]), generator=torch.Generator().manual_seed(1))
    theirs = logits(hf_model, ids)
    assert_close(logits(ours, ids), theirs)
    if kind != "dynamic":  # the scaling changes the result here (dynamic is plain RoPE up to 128 tokens, below)
        plain = Llama(replace(ours.cfg, rope_scaling=type(ours.cfg.rope_scaling)())).eval()
        plain.load_state_dict(ours.state_dict())
        assert (logits(plain, ids) - theirs).abs().max().item() > 1e-3

    export_hf(ours.state_dict(), ours.cfg, tmp_path / "exported")
    written = read_hf_config(tmp_path / "exported")
    before, after = rope_settings(read_hf_config(tmp_path / "base")), rope_settings(written)
    assert {k: after[k] for k in before} == before  # every parameter transformers wrote comes back, equal
    assert written["max_position_embeddings"] == SHAPE["max_position_embeddings"]
    from transformers import LlamaForCausalLM

    again = LlamaForCausalLM.from_pretrained(tmp_path / "exported").eval()
    assert_close(logits(again, ids), theirs)


def test_dynamic_scaling_grows_theta_past_the_original_length(tmp_path):
    """A run that raises max_seq_len past config.json's 128 (allowed: the context grows): at 200 tokens theta is
    stretched for 200, as transformers does; the export keeps 128 as max_position_embeddings, where growth starts."""
    hf_model = save_hf_llama(tmp_path / "base", SCALINGS["dynamic"])
    ours = ayumi_llama(tmp_path / "base", hf_model, max_seq_len=256)
    assert ours.cfg.rope_scaling.original_max_seq_len == 128
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 200), generator=torch.Generator().manual_seed(2))
    theirs = logits(hf_model, ids)
    assert_close(logits(ours, ids), theirs)
    plain = Llama(replace(ours.cfg, rope_scaling=type(ours.cfg.rope_scaling)())).eval()
    plain.load_state_dict(ours.state_dict())
    assert (logits(plain, ids) - theirs).abs().max().item() > 1e-3
    export_hf(ours.state_dict(), ours.cfg, tmp_path / "exported")
    assert read_hf_config(tmp_path / "exported")["max_position_embeddings"] == 128


def test_the_transformers_4_spelling_reads_the_same(tmp_path):
    """transformers 4.x writes rope_theta beside rope_scaling (early files say "type"); 5.x writes rope_parameters."""
    save_hf_llama(tmp_path / "base", SCALINGS["llama3"])
    new = read_hf_config(tmp_path / "base")
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old["rope_theta"] = new["rope_parameters"]["rope_theta"]
    old["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in new["rope_parameters"].items()
                           if k != "rope_theta"}
    assert model_fields(old, tmp_path / "base") == model_fields(new, tmp_path / "base")
    assert model_fields(new, tmp_path / "base")["rope_scaling"] == {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_seq_len": 16}


@pytest.mark.parametrize("change, named", [
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0], "long_factor": [2.0]}},
     "RoPE scaling 'longrope' .ayumi computes plain RoPE and the linear, dynamic, yarn, llama3 scalings"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
])
def test_what_ayumi_does_not_compute_is_refused_by_name(tmp_path, change, named):
    save_hf_llama(tmp_path / "base", None)
    config = {**read_hf_config(tmp_path / "base"), **change}
    with pytest.raises(HFImportError, match=f"config.json: .*{named}"):
        model_fields(config, tmp_path / "base")


def test_a_context_extension_sets_rope_theta_scaling_and_a_longer_context(tmp_path):
    """model.rope_theta, model.rope_scaling.* and a larger model.max_seq_len may differ from config.json (the
    settings of a long-context stage); a shorter max_seq_len contradicts it, and a bad scaling is named."""
    save_hf_llama(tmp_path / "base", SCALINGS["llama3"])
    base = ["experiment=cpu_tiny", f"model.init_from={tmp_path / 'base'}"]
    cfg = config_from_args(base)
    assert (cfg.model.rope_theta, cfg.model.max_seq_len, cfg.model.rope_scaling.type) == (50000.0, 128, "llama3")
    cfg = config_from_args([*base, "model.max_seq_len=512", "model.rope_theta=1e6", "model.rope_scaling.type=yarn",
                            "model.rope_scaling.factor=4", "model.rope_scaling.original_max_seq_len=128"])
    scaling = cfg.model.rope_scaling
    assert (cfg.model.max_seq_len, cfg.model.rope_theta) == (512, 1e6)
    assert (scaling.type, scaling.factor, scaling.original_max_seq_len) == ("yarn", 4.0, 128)
    with pytest.raises(ConfigError, match=r"model.max_seq_len=64 contradicts .*the context can only grow"):
        config_from_args([*base, "model.max_seq_len=64"])
    with pytest.raises(ConfigError, match=r"model.rope_scaling.type='ntk': choose one of none, linear, dynamic, yarn"):
        config_from_args([*base, "model.rope_scaling.type=ntk"])


def test_the_exported_config_json_is_what_transformers_reads(tmp_path):
    """The exported folder's config.json, read back by transformers' own LlamaConfig: the same RoPE parameters
    in its rope_parameters as in the original's."""
    from transformers import LlamaConfig

    hf_model = save_hf_llama(tmp_path / "base", SCALINGS["yarn_mscale"])
    ours = ayumi_llama(tmp_path / "base", hf_model)
    export_hf(ours.state_dict(), ours.cfg, tmp_path / "exported")
    original = LlamaConfig.from_pretrained(tmp_path / "base").rope_parameters
    exported = LlamaConfig.from_pretrained(tmp_path / "exported").rope_parameters
    assert {k: exported.get(k) for k in original} == original
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
