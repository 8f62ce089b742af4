"""`ayumi train` refuses what it can before any rank starts, through the real entry (`python -m pretrain.tools.cli train`):
a `model.init_from` folder whose tensors disagree with its config.json, from the safetensors headers (no rank, no torch).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, cpu_env, tiny_overrides, write_tiny_corpus
from tests.pretrain.model.test_hf_import import save_random_llama
from tests.pretrain.tools.test_train_config_errors import ayumi_train, imported, messages

SHORT = ["train.max_steps=4", "train.eval_interval=0", "checkpoint.save_final=false"]


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("sharded, change, problem", [
    (False, {"num_hidden_layers": 3}, "tensors missing from its safetensors: model.layers.2."),
    (True, {"intermediate_size": 192}, "model.layers.0.mlp.gate_proj.weight has shape (176, 64), the model needs (192, 64)"),
])
def test_init_from_tensors_that_disagree_with_its_config_are_refused_before_any_rank_starts(tmp_path, sharded, change,
                                                                                             problem):
    """config.json says one shape, the safetensors hold another (one file, or shards listed by an index)."""
    corpus = write_tiny_corpus(tmp_path / "corpus")
    base = tmp_path / "base"
    save_random_llama(base, **({"max_shard_size": "100KB"} if sharded else {}))
    assert (base / "model.safetensors.index.json").is_file() == sharded
    edit_config(base, **change)
    proc = ayumi_train(tmp_path, *tiny_overrides(corpus, tmp_path / "runs", f"model.init_from={base}", *SHORT),
                       importtime=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = messages(proc.stderr)
    assert line.startswith(f"ayumi train: model.init_from={base}: ") and problem in line, line
    assert proc.stdout == "" and not (tmp_path / "runs").exists()  # no "+ torchrun" line: no rank started
    assert not {"torch", "deepspeed", "safetensors"} & imported(proc.stderr)  # the headers, read as bytes


@pytest.mark.slow
def test_a_folder_that_fits_passes_the_check_and_trains(tmp_path):
    """The other side of the check: shards listed by an index, a tied (absent) lm_head and a vocabulary grown to
    576 rows (the folder's 512 and padding) are all accepted, and the ranks train from the folder."""
    corpus = write_tiny_corpus(tmp_path / "corpus")
    base = tmp_path / "base"
    save_random_llama(base, tie=True, max_shard_size="100KB")
    proc = ayumi("train", *tiny_overrides(corpus, tmp_path / "runs", f"model.init_from={base}", "model.vocab_size=576",
                                          "deepspeed.precision=fp32", "train.max_steps=1", "train.eval_interval=0"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (tmp_path / "runs" / "cpu_tiny" / "checkpoints" / "latest").read_text().strip() == "step_0000001"


def ayumi(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pretrain.tools.cli", *args], cwd=REPO, env=cpu_env(),
                          capture_output=True, text=True, timeout=300)
