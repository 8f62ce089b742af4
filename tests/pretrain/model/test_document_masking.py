"""model.attention=document: in a packed sample each token attends only within its own document, so each document's
per-token losses equal those of the document run alone (with model.restart_positions, its positions from 0 too;
without, RoPE is relative and they still equal within fp32 rounding). The kernels themselves (flash varlen on CUDA,
SDPA with a dense mask elsewhere) and their choice are tested in test_document_kernels.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pretrain.model.config import ModelConfig, ModelConfigError
from pretrain.model.documents import dense_mask, document_ids, positions_in_document, span_sum
from pretrain.model.flops import flops_per_token
from pretrain.model.llama import Llama

END = 1
DOCUMENTS = [[5, 9, 17, 33, END], [40, 41, 7, 7, 8, 100, 3, END], [200, 201, END], [77, 78, 79, 80, 81, 82]]
"""Three whole documents and the start of a fourth, packed into one 22-token sample (the last, cut off, has no end)."""


def tiny(**changes) -> Llama:
    torch.manual_seed(0)
    fields = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  max_seq_len=64, init_std=0.1)
    return Llama(ModelConfig(**{**fields, **changes})).eval()


def token_losses(model: Llama, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(inputs).logits.float()
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)


def packed_sample() -> tuple[torch.Tensor, torch.Tensor]:
    """inputs and labels (the next token) of the packed sample; the sample's last token has label 0."""
    tokens = torch.tensor([t for doc in DOCUMENTS for t in doc] + [0])
    return tokens[None, :-1], tokens[None, 1:]


def test_documents_and_positions_are_found_from_the_end_tokens():
    inputs, _ = packed_sample()
    documents = document_ids(inputs, END)
    assert documents[0].tolist() == [0] * 5 + [1] * 8 + [2] * 3 + [3] * 6
    assert positions_in_document(documents)[0].tolist() == [*range(5), *range(8), *range(3), *range(6)]
    mask = dense_mask(documents)[0, 0]
    assert mask[6, 5] and not mask[5, 4] and not mask[6, 7] and mask[12, 5]
    # The attention work the MFU counts: each token covers its own document, 5^2 + 8^2 + 3^2 + 6^2 in all.
    assert span_sum(inputs, END).item() == 25 + 64 + 9 + 36
    assert flops_per_token(ModelConfig(), 22, span=134 / 22) < flops_per_token(ModelConfig(), 22)


@pytest.mark.parametrize("restart", [True, False])
def test_each_documents_losses_equal_the_document_alone(restart):
    model = tiny(attention="document", document_end_id=END, restart_positions=restart)
    inputs, labels = packed_sample()
    packed = token_losses(model, inputs, labels)[0]
    start = 0
    for doc in DOCUMENTS:
        alone = token_losses(model, inputs[:, start:start + len(doc)], labels[:, start:start + len(doc)])[0]
        piece = packed[start:start + len(doc)]
        if restart:
            assert torch.allclose(piece, alone, rtol=0, atol=2e-6), (piece - alone).abs().max()
        else:  # positions continue: RoPE's scores depend on distances only, so the same up to rounding
            assert torch.allclose(piece, alone, rtol=0, atol=2e-5), (piece - alone).abs().max()
        start += len(doc)
    plain = tiny()  # the same weights, plain causal attention: the later documents see the earlier ones
    crossing = token_losses(plain, inputs, labels)[0]
    assert (crossing[5:] - packed[5:]).abs().max() > 1e-2
    assert torch.equal(crossing[:5], packed[:5])  # the first document sees nothing before it either way


def test_a_model_without_its_end_token_is_refused():
    with pytest.raises(ModelConfigError, match="model.attention=document needs model.document_end_id"):
        tiny(attention="document")


@pytest.mark.slow
def test_two_ranks_train_with_document_masking_taking_the_end_token_from_the_data(tmp_path):
    """A 2-rank ZeRO-2 run of the tiny corpus (byte documents, each ending with the corpus's EOS) with
    model.attention=document and restart_positions: the end token comes from the data's manifest, and it trains."""
    from tests.helpers import EOS, read_jsonl, run_training, tiny_overrides, train_losses, write_tiny_corpus

    corpus = write_tiny_corpus(tmp_path / "corpus")
    proc = run_training(tiny_overrides(corpus, tmp_path / "runs", "deepspeed=zero2", "deepspeed.precision=fp32",
                                       "model.attention=document", "model.restart_positions=true",
                                       "train.max_steps=8", "train.eval_interval=0", "checkpoint.interval=0"), launcher="fork")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert f"attention within documents: a document ends with token {EOS} (the data's end-of-document id)" in proc.stdout
    losses = train_losses(tmp_path / "runs" / "cpu_tiny")
    assert sorted(losses) == list(range(1, 9)) and losses[8] < losses[1]
    # The keys a token's attention covers (the MFU's attention term): its document's length, at most the sample's.
    spans = [r["perf/attention_span"] for r in read_jsonl(tmp_path / "runs" / "cpu_tiny" / "metrics.jsonl")
             if "perf/attention_span" in r]
    assert len(spans) == 8 and all(0 < span <= 64 for span in spans) and min(spans) < 64, spans
