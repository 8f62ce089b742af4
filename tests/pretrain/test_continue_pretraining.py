"""The continued-pretraining recipe end to end on 2 CPU ranks (experiment=continue_ja), through the real CLIs:
a tiny random transformers Llama with an English BPE tokenizer -> `ayumi tokenizer expand` with a Japanese
model -> `ayumi data prepare` -> 20 steps (ZeRO-3, the 2-stage curriculum) -> `ayumi export hf`.

Checked: the vocabulary grew to the expanded tokenizer padded to 64; at step 0 the base rows are the base
model's, each new row is the mean of the base rows of its base-tokenizer split (Swallow) and the padding rows
the mean of all base rows, the splits built from byte pieces, not by encoding (a mid-word piece gets no ▁
row); the curriculum switched stage where its budget says; after training, transformers' logits of the
export equal ayumi's forward pass with the step-20 checkpoint's own weights on base-vocabulary text."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from tests.data.helpers import JA_PARAGRAPHS, english_texts, write_jsonl
from tests.helpers import REPO, cpu_env, read_jsonl, run_training, train_losses
from tests.tokenizer.test_expand import FIXTURES, train

pytestmark = pytest.mark.slow


def ayumi(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "pretrain.tools.cli", *args], cwd=REPO, env=cpu_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_continue_ja_from_a_transformers_llama(tmp_path):
    import sentencepiece as spm
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    english = english_texts()
    japanese = [line for line in (FIXTURES / "ja.txt").read_text(encoding="utf-8").splitlines() if line.strip()]
    (tmp_path / "base_tok").mkdir()
    base_sp = train(tmp_path / "base_tok" / "tokenizer.model", english[:400], 600, "bpe")
    torch.manual_seed(3)
    base = tmp_path / "base"
    LlamaForCausalLM(LlamaConfig(vocab_size=600, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 bos_token_id=1, eos_token_id=2)).save_pretrained(base)
    shutil.copy(base_sp, base / "tokenizer.model")
    (tmp_path / "ja_tok").mkdir()
    source = train(tmp_path / "ja_tok" / "ja.model", japanese + JA_PARAGRAPHS, 700, "unigram")

    ayumi("tokenizer", "expand", str(base), str(source), "--vocab", "900", "--out", str(tmp_path / "tok"))
    ayumi("data", "prepare", "data=tiny", f"tokenizer_dir={tmp_path / 'tok'}", f"data.root={tmp_path / 'data'}",
          f"data.domains.en.inputs=[{write_jsonl(tmp_path / 'en.jsonl', english[:300])}]",
          f"data.domains.ja.inputs=[{FIXTURES / 'ja.txt'}]", "workers=1")

    overrides = ["experiment=continue_ja", f"model.init_from={base}", f"data.tokenizer_dir={tmp_path / 'tok'}",
                 f"data.root={tmp_path / 'data'}", f"run_root={tmp_path / 'runs'}", "logging=none",
                 "deepspeed.precision=fp32", "train.tokens=10240", "train.seq_len=64", "train.micro_batch_size=4",
                 "train.global_batch_size=8", "train.eval_interval=10", "train.eval_samples=8",
                 "curriculum.stages.0.tokens=8192", "curriculum.stages.1.tokens=2048",
                 "curriculum.default_max_repetition=100", "optim.warmup_steps=2", "checkpoint.interval=0",
                 ]
    run = run_training(overrides, nproc=2, launcher="fork")
    assert run.returncode == 0, run.stdout[-4000:]
    losses = train_losses(tmp_path / "runs" / "continue_ja")
    assert sorted(losses) == list(range(1, 21))

    checkpoints = tmp_path / "runs" / "continue_ja" / "checkpoints"
    ayumi("export", "hf", str(checkpoints / "step_0000000"), str(tmp_path / "step0"))
    start = load_file(tmp_path / "step0" / "model.safetensors")
    base_weights = load_file(base / "model.safetensors")
    embed = start["model.embed_tokens.weight"]
    assert embed.shape[0] == 960  # 900 pieces padded to a multiple of 64
    assert torch.equal(embed[:600], base_weights["model.embed_tokens.weight"])
    assert torch.equal(start["model.layers.1.mlp.down_proj.weight"], base_weights["model.layers.1.mlp.down_proj.weight"])
    expanded = spm.SentencePieceProcessor(model_file=str(tmp_path / "tok" / "tokenizer.model"))
    base_tok = spm.SentencePieceProcessor(model_file=str(base_sp))
    base_embed = base_weights["model.embed_tokens.weight"]
    checked = 0
    for new_id in range(600, 900):
        piece = expanded.id_to_piece(new_id)
        initial = piece.startswith("\u2581")
        body = piece[1:] if initial else piece
        if body and all(base_tok.piece_to_id(ch) == base_tok.unk_id() for ch in body):  # Japanese the base never saw
            # The base reads it as its UTF-8 bytes, with one ▁ only if the piece starts a word.
            split = [base_tok.piece_to_id("\u2581")] * initial + [
                base_tok.piece_to_id(f"<0x{byte:02X}>") for byte in body.encode("utf-8")]
            torch.testing.assert_close(embed[new_id], base_embed[split].mean(dim=0), msg=piece)
            checked += 1
    assert checked >= 250
    for pad_id in range(900, 960):
        torch.testing.assert_close(embed[pad_id], base_embed.mean(dim=0))
    assert torch.equal(start["lm_head.weight"][:600], base_weights["lm_head.weight"])

    events = read_jsonl(tmp_path / "runs" / "continue_ja" / "events.jsonl")
    # Stage 1 is 8,192 tokens = 128 samples of 64 = 16 steps of 8 samples: stage 2 starts at step 17.
    assert [(e["step"], e["stage"], e["stage_name"]) for e in events if e["event"] == "stage_switch"] == [
        (1, 1, "japanese"), (17, 2, "mix_back")]

    ayumi("export", "hf", str(checkpoints / "step_0000020"), str(tmp_path / "final"))
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "final").eval()
    from pretrain.checkpoint.checkpointer import META, model_config_from_meta
    from pretrain.engine.checkpoint_formats import consolidated_state_dict
    from pretrain.model.llama import Llama

    meta = json.loads((checkpoints / "step_0000020" / META).read_text())
    ours = Llama(model_config_from_meta(meta), init_weights=False)
    trained = consolidated_state_dict(checkpoints, "step_0000020")  # the run's own weights, not the export
    assert not torch.equal(trained["model.embed_tokens.weight"][:600], base_embed)  # 20 steps moved them
    ours.load_state_dict(trained)
    ours.eval()
    ids = torch.tensor([base_tok.encode(" ".join(english[-3:]))[:60]])  # not in the training data
    assert int(ids.max()) < 600
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
        mine = ours(ids, return_logits=True).logits
    assert mine.shape == theirs.shape == (1, 60, 960)
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
