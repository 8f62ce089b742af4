"""bench/document_attention.py: its two document-length regimes pack what they say (about 512-token documents; one
or two long documents a sample), and a tiny CPU run reports both against causal attention (the GPU run is the
same code with --device cuda)."""
from __future__ import annotations

import torch

from bench.document_attention import END, main, packed_batch, regime_lengths
from pretrain.model.documents import document_ids


def lengths_of(tokens: torch.Tensor) -> list[list[int]]:
    """Each row's document lengths in the inputs (tokens[:, :-1]); a row's last document may be cut off."""
    ids = document_ids(tokens[:, :-1], END)
    return [torch.bincount(row).tolist() for row in ids]


def test_the_regimes_pack_documents_of_their_lengths():
    seq = 4096
    short = lengths_of(packed_batch(8, seq, 1000, lengths=regime_lengths("short", seq, 512)))
    whole = [n for row in short for n in row[:-1]]  # the last of a row is cut off
    assert all(256 <= n <= 768 for n in whole) and 450 <= sum(whole) / len(whole) <= 575
    assert all(6 <= len(row) <= 17 for row in short)
    long = lengths_of(packed_batch(8, seq, 1000, seed=1, lengths=regime_lengths("long", seq, 512)))
    assert all(len(row) in (1, 2) for row in long) and {len(row) for row in long} == {1, 2}
    assert all(row[0] >= seq // 2 for row in long)


def test_a_tiny_cpu_run_reports_both_regimes(capsys):
    assert main(["--seq", "64", "--batch", "1", "--rounds", "2", "--short-mean", "8"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("RESULT")]
    assert [line.split()[1] for line in lines] == ["document_attention_cpu_short", "document_attention_cpu_long"]
    assert all("target=<=1.5" in line and " n=2 " in line for line in lines)
