"""ayumi's multiple-choice scores against lm-evaluation-harness itself (the real `lm_eval` package, its `hf` model)
on one Hugging Face folder: a random transformers LlamaForCausalLM with the tokenizer files ayumi's exporter makes
from a small SentencePiece model. One task, English and Japanese questions, written as ayumi's JSONL and as an
lm-eval YAML task over the same lines. With prefix=none (lm-eval's way for a non-empty context) every choice's
log-likelihood is lm-eval's, and so are acc and acc_norm.

What makes them equal: lm-eval's context/continuation split (downstream/prompts.py encode_pair), no token before
the context, the same weights in ayumi's Llama, and the same ids from the SentencePiece library (ayumi) and from
the exported tokenizer.json read by transformers (lm-eval), checked first on every string lm-eval encodes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

from downstream.config import DownstreamConfig, TaskConfig
from downstream.evaluate import prepare_tasks, score_tasks
from downstream.scoring import Share
from pretrain.model.config import ModelConfig
from pretrain.model.hf_import import SAFETENSORS_FILE, model_fields, read_hf_config
from pretrain.model.llama import Llama
from tests.pretrain.model.test_hf_import import save_random_llama
from tokenizer.declared import load_declared_tokenizer
from tokenizer.export_hf import export_hf

lm_eval = pytest.importorskip("lm_eval", reason="the test extra installs lm-eval (pyproject.toml)")
pytest.importorskip("accelerate", reason="lm-eval's hf model imports accelerate: the test extra installs it")

TASK = "ayumi_parity"
DELIMITER = " "  # ayumi's multiple-choice delimiter and lm-eval's target_delimiter
# Short choices (at most ~10 tokens): a random model gives ~-6 per token, and float32 sums near -64 are exact to
# ~4e-6, well inside the 1e-5 asked of them.
QUESTIONS = [
    {"context": "Question: Which city is the capital of Japan?\nAnswer:", "choices": ["Tokyo", "Paris", "a village"],
     "gold": 0},
    {"context": "質問：日本で一番高い山はどれですか。\n答え：", "choices": ["富士山", "高尾山", "浅間山"], "gold": 0},
    {"context": "The function returns a new list of the items", "choices": ["sorted.", "in order."], "gold": 1},
    {"context": "吾輩は猫である。名前は", "choices": ["まだ無い。", "山田です。", "Tokyo"], "gold": 0},
    # trailing whitespace: both move it into every choice's continuation
    {"context": "Question: What does json.dumps return?\nAnswer: ", "choices": ["a string", "a file", "None"],
     "gold": 0},
    {"context": "今日は天気が良いので、", "choices": ["散歩した。", "雨だ。"], "gold": 0},
]
LM_EVAL_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: gold
target_delimiter: "{delimiter}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def write_jsonl(path: Path, lines: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
    return path


def test_choice_logliks_acc_and_acc_norm_equal_lm_eval(tmp_path, tokenizer_dir):
    folder = tmp_path / "hf"
    save_random_llama(folder)  # hidden 64, 2 layers, vocabulary 512, 128 positions
    export_hf(tokenizer_dir / "tokenizer.model", folder)

    # The ids first: lm-eval encodes with transformers' tokenizer from the folder, ayumi with SentencePiece.
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(folder)
    sp_tokenizer = load_declared_tokenizer(tokenizer_dir)
    texts = [q["context"].rstrip() for q in QUESTIONS] + [q["context"] + DELIMITER + c for q in QUESTIONS
                                                          for c in q["choices"]]
    differ = [t for t in texts if hf_tokenizer.encode(t) != sp_tokenizer.encode(t)]
    assert differ == [], "the exported tokenizer.json encodes these otherwise than SentencePiece"

    tasks = tmp_path / "lm_eval_tasks"
    data = write_jsonl(tmp_path / "lm_eval_data" / "docs.jsonl", QUESTIONS)
    tasks.mkdir()
    (tasks / f"{TASK}.yaml").write_text(LM_EVAL_YAML.format(task=TASK, data=data, cache=tmp_path / "hf_datasets",
                                                            delimiter=DELIMITER), encoding="utf-8")
    results = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={folder},dtype=float32", tasks=[TASK],
        task_manager=lm_eval.tasks.TaskManager(include_path=str(tasks), include_defaults=False), log_samples=True,
        device="cpu", batch_size=4)
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    theirs = [[resp[0] for resp in s["filtered_resps"]] for s in samples]
    assert [s["arguments"] for s in samples] == [
        [(q["context"], DELIMITER + c) for c in q["choices"]] for q in QUESTIONS]  # the same requests as text

    hf = read_hf_config(folder)
    model = Llama(ModelConfig(**model_fields(hf, folder)))
    loaded = model.load_state_dict(safetensors.torch.load_file(folder / SAFETENSORS_FILE), strict=False)
    assert loaded.missing_keys == [] and loaded.unexpected_keys == []
    model.eval()
    task_file = write_jsonl(tmp_path / f"{TASK}.jsonl", QUESTIONS)
    cfg = DownstreamConfig(tasks=[TaskConfig(path=str(task_file), delimiter=DELIMITER)], prefix="none")
    for tokenizer in (sp_tokenizer, load_declared_tokenizer(folder)):  # SentencePiece, then the exported files
        prepared = prepare_tasks(cfg, tokenizer, model.cfg.max_seq_len, tokenizer.bos_id, tokenizer.eod_id)
        [scores] = score_tasks(prepared, lambda ids: model(ids).logits, tokenizer, Share(), 3, torch.device("cpu"),
                               end_ids=(tokenizer.eod_id,))
        ours = [row["logliks"] for row in scores.examples]
        gap = max(abs(a - b) for mine, lm in zip(ours, theirs) for a, b in zip(mine, lm, strict=True))
        assert gap <= 1e-5, f"{tokenizer.kind}: per-choice log-likelihoods differ from lm-eval's by up to {gap:.2e}"
        assert [(row["acc"], row["acc_norm"]) for row in scores.examples] == [(s["acc"], s["acc_norm"])
                                                                             for s in samples]
        assert scores.metrics == {"acc": results["results"][TASK]["acc,none"],
                                  "acc_norm": results["results"][TASK]["acc_norm,none"]}
