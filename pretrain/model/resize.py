"""A larger vocabulary for a model started from a Hugging Face folder: new embedding and LM-head rows.

When `model.init_from` meets a tokenizer with more pieces than the folder's model (after
`ayumi tokenizer expand`), the embedding and the untied LM head grow to `model.vocab_size`. Base
rows are copied unchanged; the row of each new piece of the tokenizer is initialised by
`model.new_token_init`:
- `base_mean` (Swallow's recipe): the mean of the base rows of the pieces the *base* tokenizer
  splits the new piece's text into, so a new piece starts where the base model already "reads" it;
- `mean`: the mean of all base rows;
- `random`: normal(0, model.init_std), as a fresh model.
Rows past the tokenizer's last piece (padding to a GPU-friendly multiple, or a `model.vocab_size`
set above the tokenizer) get the mean of all base rows under every policy: no id ever selects them
in the data, and the mean keeps the softmax's normaliser close to the base model's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import Tensor

from pretrain.model.hf_import import NEW_TOKEN_INITS

SPACE = "\u2581"
"""SentencePiece's whitespace symbol (▁): a piece starting with it begins a word (a space precedes it)."""


def grown_rows(base: Tensor, new_size: int, new_count: int, policy: str, std: float, seed: int,
               splits: Sequence[Sequence[int]] = ()) -> Tensor:
    """`base` ([base_vocab, hidden]) grown to [new_size, hidden].

    Rows base_vocab .. base_vocab+new_count-1 are the tokenizer's new pieces and follow `policy`
    (`splits[k]`: the base ids of new piece k, needed by base_mean; a piece with an empty split
    starts at the mean); the rows after them are padding and get the mean of all base rows.
    """
    if policy not in NEW_TOKEN_INITS:
        raise ValueError(f"model.new_token_init={policy!r}: choose one of {', '.join(NEW_TOKEN_INITS)}")
    base_vocab = base.shape[0]
    if not 0 <= new_count <= new_size - base_vocab:
        raise ValueError(f"{new_count} new pieces do not fit between the base's {base_vocab} rows and {new_size}")
    source = base.float()
    mean = source.mean(dim=0)
    grown = torch.empty(new_size, base.shape[1], dtype=torch.float32)
    grown[:base_vocab] = source
    grown[base_vocab:] = mean
    if policy == "random":
        generator = torch.Generator().manual_seed(seed)
        grown[base_vocab:base_vocab + new_count] = torch.randn(new_count, base.shape[1], generator=generator) * std
    elif policy == "base_mean":
        if len(splits) < new_count:
            raise ValueError(f"base_mean needs the base split of each of the {new_count} new pieces, got {len(splits)}")
        for offset, split in enumerate(splits[:new_count]):
            ids = [i for i in split if 0 <= i < base_vocab]
            if ids:
                grown[base_vocab + offset] = source[ids].mean(dim=0)
    return grown.to(base.dtype)


def piece_surfaces(model_file: str | Path, first: int) -> list[str]:
    """The text of each piece from id `first` on, as it appears in the piece (▁ as a space)."""
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=str(model_file))
    return [processor.id_to_piece(i).replace(SPACE, " ") for i in range(first, processor.get_piece_size())]


def surface_encoder(model_file: str | Path) -> Callable[[str], list[int]]:
    """The base tokenizer's ids for a piece's surface text, exactly as the base reads that text inside a document.

    A plain `encode` treats its argument as a whole text: it adds SentencePiece's dummy prefix (a ▁
    before the first word), so a mid-word piece such as 'の' would come back as ['▁', 'の'] and be
    averaged as its word-initial form, and 'ly' as '▁ly'. Turning `add_dummy_prefix` off in the
    model's normalizer_spec gives the split of the text as it stands, with a ▁ only where the piece
    has one (its leading space). `remove_extra_whitespaces` goes off too: it would strip that
    leading space (nmt_nfkc bases) before the split. Everything else of the base's normalizer
    (its NFKC or identity rule, the space-to-▁ escape) stays, since it is how the base reads text.
    """
    import sentencepiece as spm

    from tokenizer.merge import load_proto

    proto = load_proto(model_file)
    proto.normalizer_spec.add_dummy_prefix = False
    proto.normalizer_spec.remove_extra_whitespaces = False
    processor = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    return lambda text: list(processor.encode(text))


def base_splits(new_model: str | Path, base_model: str | Path, first: int) -> list[list[int]]:
    """For each piece of `new_model` from id `first` on: the base tokenizer's ids of its surface text."""
    encode = surface_encoder(base_model)
    return [encode(text) for text in piece_surfaces(new_model, first)]


class GrownWeights:
    """An HFWeights whose embedding and LM head come out grown to `vocab_size` (the rest as stored)."""

    GROWN = ("model.embed_tokens.weight", "lm_head.weight")

    def __init__(self, weights, vocab_size: int, new_count: int, policy: str, std: float, seed: int,
                 splits: Sequence[Sequence[int]] = ()):
        self.weights, self.vocab_size, self.new_count = weights, vocab_size, new_count
        self.policy, self.std, self.seed, self.splits = policy, std, seed, splits

    def tensor(self, name: str) -> Tensor:
        stored = self.weights.tensor(name)
        if name not in self.GROWN:
            return stored
        return grown_rows(stored, self.vocab_size, self.new_count, self.policy, self.std, self.seed, self.splits)
