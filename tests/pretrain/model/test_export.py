"""Hugging Face export: logits parity with transformers' LlamaForCausalLM, and the refusals."""
from __future__ import annotations

import dataclasses
import json
import sys
import subprocess
from pathlib import Path

import pytest
import torch

from pretrain.tools import export
from tests.helpers import REPO
from pretrain.tools.export import ExportError, export_hf, to_hf_config
from pretrain.model.config import ModelConfig
from pretrain.model.llama import Llama

transformers = pytest.importorskip("transformers")

TINY = ModelConfig(name="tiny", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512,
                   intermediate_size=176, max_seq_len=64)


def trained_like(cfg: ModelConfig, seed: int = 0) -> Llama:
    """Random init with non-trivial norm scales, so a misplaced norm weight would show in the logits."""
    torch.manual_seed(seed)
    model = Llama(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    return model


def hf_logits(out_dir: Path, ids: torch.Tensor, attn: str) -> torch.Tensor:
    hf = transformers.LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation=attn).eval()
    with torch.no_grad():
        return hf(ids).logits


@pytest.mark.parametrize("variant,attn", [
    ({}, "eager"),
    ({"tie_embeddings": True}, "sdpa"),
    ({"rope_theta": 500000.0, "num_kv_heads": 4}, "sdpa"),
], ids=["untied-eager", "tied-sdpa", "rope5e5-mha-sdpa"])
def test_hf_logits_match(tmp_path, variant, attn):
    cfg = dataclasses.replace(TINY, **variant)
    model = trained_like(cfg)
    out = export_hf(model.state_dict(), cfg, tmp_path / "hf", bos_id=1, eos_id=2)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(ids).logits
    theirs = hf_logits(out, ids, attn)
    assert (ours - theirs).abs().max().item() <= 1e-5
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] == cfg.tie_embeddings and config["architectures"] == ["LlamaForCausalLM"]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2


def test_tied_export_stores_one_matrix(tmp_path):
    from safetensors import safe_open

    cfg = dataclasses.replace(TINY, tie_embeddings=True)
    out = export_hf(trained_like(cfg).state_dict(), cfg, tmp_path / "hf")
    with safe_open(out / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()


def test_bf16_export_and_tokenizer_files(tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "tokenizer_config.json").write_text("{}")
    model = trained_like(TINY)
    out = export_hf(model.state_dict(), TINY, tmp_path / "hf", tokenizer_dir=tok, dtype=torch.bfloat16)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    from safetensors.torch import load_file

    weights = load_file(out / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert torch.equal(weights["model.norm.weight"], model.model.norm.weight.to(torch.bfloat16))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_qk_norm_cannot_be_exported_as_llama(tmp_path):
    cfg = dataclasses.replace(TINY, qk_norm=True)
    with pytest.raises(ExportError, match="qk_norm"):
        to_hf_config(cfg)
    with pytest.raises(ExportError, match="qk_norm"):
        export_hf(Llama(cfg).state_dict(), cfg, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_state_dict_must_match_the_config(tmp_path):
    state = trained_like(TINY).state_dict()
    with pytest.raises(ExportError, match="missing"):
        export_hf({k: v for k, v in state.items() if k != "model.norm.weight"}, TINY, tmp_path / "a")
    with pytest.raises(ExportError, match="unexpected"):
        export_hf({f"module.{k}": v for k, v in state.items()}, TINY, tmp_path / "b")
    with pytest.raises(ExportError, match="shape"):
        export_hf(state, dataclasses.replace(TINY, vocab_size=640), tmp_path / "c")
    assert list(tmp_path.iterdir()) == []


def test_non_empty_out_dir_needs_overwrite(tmp_path):
    state = trained_like(TINY).state_dict()
    out = tmp_path / "hf"
    out.mkdir()
    (out / "old.txt").write_text("keep me")
    with pytest.raises(ExportError, match="not empty"):
        export_hf(state, TINY, out)
    assert (out / "old.txt").read_text() == "keep me"
    export_hf(state, TINY, out, overwrite=True)
    assert not (out / "old.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no tmp or old folders left behind
    empty = tmp_path / "empty"
    empty.mkdir()
    export_hf(state, TINY, empty)  # an existing empty folder is fine


def test_crash_while_writing_leaves_no_output_folder(tmp_path, monkeypatch):
    import safetensors.torch

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        export_hf(trained_like(TINY).state_dict(), TINY, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []  # neither hf/ nor hf.tmp-*/


def test_cli_exports_a_checkpoint(tmp_path, monkeypatch, capsys):
    model = trained_like(TINY)
    seen = []

    def load_for_export(path):
        seen.append(Path(path))
        return model.state_dict(), TINY, {"bos_id": 1, "eos_id": 2}

    # The checkpoint reader answers with this model (the real one reads DeepSpeed files: tested in the 2-rank runs).
    import pretrain.checkpoint.checkpointer as checkpointer

    monkeypatch.setattr(checkpointer, "load_for_export", load_for_export)
    out = tmp_path / "hf"
    assert export.main(["hf", str(tmp_path / "ckpt"), str(out), "--dtype", "bf16"]) == 0
    assert seen == [tmp_path / "ckpt"] and (out / "model.safetensors").is_file()
    assert "wrote" in capsys.readouterr().out
    assert export.main(["hf", str(tmp_path / "ckpt"), str(out)]) == 2  # non-empty, no --overwrite: bad input
    assert "--overwrite" in capsys.readouterr().err
    assert export.main(["hf", str(tmp_path / "ckpt"), str(out), "--overwrite"]) == 0


def test_cli_refuses_a_folder_without_a_checkpoint_in_one_line(tmp_path):
    """Through the real `ayumi` entry point: one line naming the folder and what to give instead, exit 2."""
    done = subprocess.run([sys.executable, "-m", "pretrain.tools.cli", "export", "hf", str(tmp_path / "nonexistent" / "run"),
                           str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(f"ayumi export hf: no complete ayumi checkpoint at {tmp_path / 'nonexistent' / 'run'}")
    assert "give a run dir" in lines[0] and not (tmp_path / "out").exists()
