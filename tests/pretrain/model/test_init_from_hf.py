"""Continued pretraining's start: 2 ranks (torchrun) begin from a random transformers LlamaForCausalLM folder
under ZeRO-0, 1, 2 and 3 (ZeRO-3 partitioned as built, from a folder shaped like Llama 3.2's: llama3 RoPE
scaling and tied embeddings; ZeRO-2 from a folder saved in shards, with model.safetensors.index.json). The
first step's loss equals transformers' loss on the same global batch (fp32, 1e-5 relative), and `ayumi export
hf` of the step-0 checkpoint gives back its tensors and its RoPE parameters."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from data.domains import open_run_data
from data.packed import ShuffledDomains
from pretrain.config import config_from_args
from pretrain.model.hf_import import read_hf_config, rope_settings
from tests.helpers import REPO, cpu_env, run_training, tiny_overrides, train_losses
from tests.pretrain.model.test_hf_import import save_random_llama
from tests.pretrain.model.test_rope_scaling import SCALINGS

pytestmark = pytest.mark.slow
LLAMA3_ROPE = SCALINGS["llama3"]
"""Llama 3.1-3.3's RoPE scaling, its original length cut to 16 of the tiny model's 128 positions so that it matters."""


def first_batch(corpus: Path, overrides: list[str]) -> torch.Tensor:
    """The run's first global batch (the same samples ayumi's loader takes), inputs and targets."""
    cfg = config_from_args(overrides)
    _, train, _ = open_run_data(corpus, None, cfg.train.seq_len, cfg.model.vocab_size)
    source = ShuffledDomains(train, seed=cfg.train.seed)
    return torch.stack([torch.from_numpy(source.get(g)[0].astype("int64")) for g in range(cfg.train.global_batch_size)])


def transformers_loss(model, corpus: Path, overrides: list[str]) -> float:
    """Mean next-token loss of the run's first global batch."""
    batch = first_batch(corpus, overrides)
    with torch.no_grad():
        logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1)).item()


@pytest.mark.parametrize("zero", ["zero0", "zero1", "zero2", "zero3"])
def test_first_step_matches_transformers_and_step_0_exports_the_same_tensors(corpus, tmp_path, zero):
    sharded = {"max_shard_size": "100KB"} if zero == "zero2" else {}  # several files + an index, as large models ship
    # ZeRO-1 and ZeRO-3 start from folders shaped like Llama 3.1's (untied) and 3.2's (tied): llama3 RoPE scaling.
    # They train 20 steps, and the last checkpoint's export computes what ayumi computed (below).
    llama3 = zero in ("zero1", "zero3")
    model = save_random_llama(tmp_path / "base", tie=(zero == "zero3"), seed=7,
                              rope_scaling=LLAMA3_ROPE if llama3 else None, **sharded)
    files = sorted(p.name for p in (tmp_path / "base").glob("*.safetensors"))
    assert (len(files) > 1) == bool(sharded) == (tmp_path / "base" / "model.safetensors.index.json").is_file(), files
    overrides = tiny_overrides(corpus, tmp_path / "runs", f"deepspeed={zero}", "deepspeed.precision=fp32",
                               f"model.init_from={tmp_path / 'base'}", "model.z_loss=0",
                               f"train.max_steps={20 if llama3 else 1}", "train.eval_interval=0",
                               "checkpoint.save_initial=true")
    run = run_training(overrides, nproc=2, launcher="fork")
    assert run.returncode == 0, run.stdout[-4000:]
    ours = train_losses(tmp_path / "runs" / "cpu_tiny")[1]
    theirs = transformers_loss(model, corpus, overrides)
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert theirs > 5.5  # a random model near log(512) = 6.24: the comparison is not between two trivial numbers

    out = export_checkpoint(tmp_path / "runs" / "cpu_tiny" / "checkpoints" / "step_0000000", tmp_path / "exported")
    from safetensors.torch import load_file

    exported = load_file(out / "model.safetensors")
    original = {name: t for name, t in model.state_dict().items() if name in exported}
    assert set(exported) == set(original) and len(original) >= len(model.state_dict()) - 1  # a tied lm_head is dropped
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    assert rope_settings(read_hf_config(out)) == rope_settings(read_hf_config(tmp_path / "base"))
    if llama3:
        trained = export_checkpoint(tmp_path / "runs" / "cpu_tiny" / "checkpoints" / "step_0000020", tmp_path / "last")
        assert_export_computes_as_ayumi(trained, corpus, overrides)


def export_checkpoint(checkpoint: Path, out: Path) -> Path:
    export = subprocess.run([sys.executable, "-m", "pretrain.tools.cli", "export", "hf", str(checkpoint), str(out)],
                            cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stdout + export.stderr
    return out


def assert_export_computes_as_ayumi(folder: Path, corpus: Path, overrides: list[str]) -> None:
    """transformers' logits for the exported folder equal ayumi's Llama's with the same tensors (within 1e-5), on the
    run's first batch: the trained weights, the llama3 tables and the tying all survive the export."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from pretrain.model.llama import Llama

    theirs = LlamaForCausalLM.from_pretrained(folder).eval()
    ours = Llama(config_from_args(overrides).model).eval()  # the run's model, not one read back from the export
    assert ours.cfg.rope_scaling.type == "llama3"
    missing, _ = ours.load_state_dict(load_file(folder / "model.safetensors"), strict=False)
    assert set(missing) <= {"lm_head.weight"} and (not missing or ours.cfg.tie_embeddings)
    batch = first_batch(corpus, overrides)[:, :-1]
    with torch.no_grad():
        ours_logits, theirs_logits = ours(batch), theirs(input_ids=batch).logits
    ours_logits = getattr(ours_logits, "logits", ours_logits)
    assert (ours_logits - theirs_logits).abs().max().item() <= 1e-5 * max(1.0, theirs_logits.abs().max().item())
