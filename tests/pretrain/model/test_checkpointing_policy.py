"""deepspeed.activation_checkpointing as a policy: none, full, every_K, attention, mlp. Every policy gives the same
loss and gradients; the activations kept for backward (bytes that autograd saves, counted with
saved_tensors_hooks) lie between none and full for every partial policy."""
from __future__ import annotations

import pytest
import torch

from pretrain.config import ConfigError, config_from_args
from pretrain.model.config import ModelConfig, checkpointing_plan
from pretrain.model.llama import Llama


def run(policy: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    torch.manual_seed(0)
    model = Llama(ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=256, num_layers=4, num_heads=4,
                              num_kv_heads=2, max_seq_len=64))
    model.set_activation_checkpointing(policy)
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1))
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(ids, ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, sum(saved)


def test_every_policy_gives_the_same_loss_and_gradients_with_less_kept_in_memory():
    results = {policy: run(policy) for policy in ("none", "mlp", "attention", "every_2", "full")}
    loss, grads, _ = results["none"]
    for policy, (other_loss, other_grads, _) in results.items():
        torch.testing.assert_close(other_loss, loss)
        for name in grads:
            torch.testing.assert_close(other_grads[name], grads[name], rtol=1e-5, atol=1e-7)
    kept = {policy: result[2] for policy, result in results.items()}
    for partial in ("mlp", "attention", "every_2"):  # steps between the two ends (their order depends on the shape)
        assert kept["none"] > kept[partial] > kept["full"], kept
    assert kept["full"] < kept["none"] / 5


def test_the_plan_per_block_and_the_config_check():
    assert checkpointing_plan("every_2", 5) == ["block", "", "block", "", "block"]
    assert checkpointing_plan(True, 2) == ["block", "block"] and checkpointing_plan("false", 2) == ["", ""]
    assert checkpointing_plan("mlp", 2) == ["mlp", "mlp"]
    tiny = ["experiment=cpu_tiny", "model.vocab_size=512"]  # no data root here for the vocabulary to follow
    assert config_from_args([*tiny, "deepspeed.activation_checkpointing=every_2"])
    with pytest.raises(ConfigError, match="activation_checkpointing='every_0': choose none, full, every_K"):
        config_from_args([*tiny, "deepspeed.activation_checkpointing=every_0"])


@pytest.mark.slow
def test_policies_under_zero3_on_two_ranks_give_the_same_losses(tmp_path):
    from tests.helpers import run_training, tiny_overrides, train_losses, write_tiny_corpus

    corpus = write_tiny_corpus(tmp_path / "data")
    losses = {}
    for policy in ("none", "mlp", "every_2"):
        overrides = tiny_overrides(corpus, tmp_path / policy, "deepspeed=zero3", "deepspeed.precision=fp32",
                                   f"deepspeed.activation_checkpointing={policy}", "train.max_steps=3",
                                   "train.eval_interval=0", "checkpoint.save_final=false")
        run = run_training(overrides, nproc=2, launcher="fork")
        assert run.returncode == 0, run.stdout[-3000:]
        losses[policy] = train_losses(tmp_path / policy / "cpu_tiny")
    assert sorted(losses["none"]) == [1, 2, 3]
    for policy in ("mlp", "every_2"):
        for step, loss in losses["none"].items():
            assert losses[policy][step] == pytest.approx(loss, rel=1e-5), policy
