"""The continued-pretraining recipe end to end on 2 CPU ranks (experiment=continue_ja), through the real CLIs:
a tiny random transformers Llama with an English BPE tokenizer -> `ayumi tokenizer expand` with a Japanese
model -> `ayumi data prepare` -> 20 steps (ZeRO-3, the 2-stage curriculum) -> `ayumi export hf`.

Checked: the vocabulary grew to the expanded tokenizer padded to 64; at step 0 the base rows are the base
model's and a new row is the mean of the base rows of its base-tokenizer split (Swallow); after training,
transformers' logits of the export equal ayumi's own forward pass on base-vocabulary text."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from tests.data.helpers import JA_PARAGRAPHS, english_texts, write_jsonl
from tests.helpers import REPO, cpu_env, run_training, train_losses
from tests.tokenizer.test_expand import FIXTURES, train

pytestmark = pytest.mark.slow


def ayumi(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "pretrain.cli", *args], cwd=REPO, env=cpu_env(),
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
    run = run_training(overrides, nproc=2)
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
    piece = expanded.id_to_piece(650).replace("\u2581", " ")
    split = base_tok.encode(piece)
    assert len(split) >= 1
    torch.testing.assert_close(embed[650], base_weights["model.embed_tokens.weight"][split].mean(dim=0))
    assert torch.equal(start["lm_head.weight"][:600], base_weights["lm_head.weight"])

    ayumi("export", "hf", str(checkpoints / "step_0000020"), str(tmp_path / "final"))
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "final").eval()
    from pretrain.model.config import ModelConfig
    from pretrain.model.llama import Llama

    ours = Llama(ModelConfig(vocab_size=960, hidden_size=64, intermediate_size=176, num_layers=2, num_heads=4,
                             num_kv_heads=2, max_seq_len=128, norm_eps=1e-6), init_weights=False)
    ours.load_state_dict(load_file(tmp_path / "final" / "model.safetensors"), strict=False)
    ours.eval()
    ids = torch.tensor([base_tok.encode(" ".join(english[-3:]))[:60]])  # not in the training data
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
        mine = ours(ids, return_logits=True).logits
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
