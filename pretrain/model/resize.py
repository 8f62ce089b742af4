"""A larger vocabulary for a model started from a Hugging Face folder: new embedding and LM-head rows.

When `model.init_from` meets a tokenizer with more pieces than the folder's model (after
`ayumi tokenizer expand`), the embedding and the untied LM head grow to `model.vocab_size`. Base
rows are copied unchanged; each new row is initialised by `model.new_token_init`:
- `base_mean` (Swallow's recipe): the mean of the base rows of the pieces the *base* tokenizer
  splits the new piece's text into, so a new piece starts where the base model already "reads" it;
- `mean`: the mean of all base rows;
- `random`: normal(0, model.init_std), as a fresh model.
Rows past the tokenizer's last piece (padding to a GPU-friendly multiple) get the mean of all
base rows: no id ever selects them in the data, and the mean keeps the softmax's normaliser
close to the base model's.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from pretrain.model.hf_import import NEW_TOKEN_INITS


def grown_rows(base: Tensor, new_size: int, new_pieces: Sequence[str], base_encode: Callable[[str], list[int]],
               policy: str, std: float, seed: int) -> Tensor:
    """`base` ([base_vocab, hidden]) grown to [new_size, hidden]; rows base_vocab.. follow `policy`.

    `new_pieces[k]` is the text of id base_vocab + k (SentencePiece's ▁ already turned into a space).
    """
    if policy not in NEW_TOKEN_INITS:
        raise ValueError(f"model.new_token_init={policy!r}: choose one of {', '.join(NEW_TOKEN_INITS)}")
    base_vocab = base.shape[0]
    source = base.float()
    mean = source.mean(dim=0)
    grown = torch.empty(new_size, base.shape[1], dtype=torch.float32)
    grown[:base_vocab] = source
    grown[base_vocab:] = mean
    if policy == "random":
        generator = torch.Generator().manual_seed(seed)
        count = min(len(new_pieces), new_size - base_vocab)
        grown[base_vocab:base_vocab + count] = torch.randn(count, base.shape[1], generator=generator) * std
    elif policy == "base_mean":
        for offset, text in enumerate(new_pieces[:new_size - base_vocab]):
            ids = [i for i in base_encode(text) if 0 <= i < base_vocab]
            if ids:
                grown[base_vocab + offset] = source[ids].mean(dim=0)
    return grown.to(base.dtype)


def piece_texts(model_file: str, first: int) -> list[str]:
    """Texts of the pieces from id `first` on (▁ as a space), from a SentencePiece model."""
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=model_file)
    return [processor.id_to_piece(i).replace("\u2581", " ") for i in range(first, processor.get_piece_size())]


def sentencepiece_encoder(model_file: str) -> Callable[[str], list[int]]:
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=model_file)
    return lambda text: processor.encode(text)


class GrownWeights:
    """An HFWeights whose embedding and LM head come out grown to `vocab_size` (the rest as stored)."""

    GROWN = ("model.embed_tokens.weight", "lm_head.weight")

    def __init__(self, weights, vocab_size: int, new_pieces: Sequence[str], base_encode: Callable[[str], list[int]] | None,
                 policy: str, std: float, seed: int):
        self.weights, self.vocab_size, self.new_pieces = weights, vocab_size, new_pieces
        self.base_encode, self.policy, self.std, self.seed = base_encode, policy, std, seed

    def tensor(self, name: str) -> Tensor:
        stored = self.weights.tensor(name)
        if name not in self.GROWN:
            return stored
        encode = self.base_encode or (lambda text: [])
        return grown_rows(stored, self.vocab_size, self.new_pieces, encode, self.policy, self.std, self.seed)
