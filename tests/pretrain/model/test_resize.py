"""Growing the vocabulary of a model started from a Hugging Face folder (pretrain/model/resize.py).

base_mean averages the base rows of the base tokenizer's split of each new piece *as it appears in the
piece*: a mid-word piece ('の') is split without SentencePiece's dummy ▁, a word-initial one ('▁の')
with its one ▁. The expected splits here are built from piece ids (byte pieces, whole pieces), not by
encoding, so they could not repeat a wrong encode. Also: the rows of `mean` and `random`, the padding
rows, and padding alone (a larger model.vocab_size, no new piece) through the trainer's own path."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pretrain.model.resize import GrownWeights, base_splits, grown_rows, surface_encoder
from tests.data.helpers import JA_PARAGRAPHS, english_texts
from tests.tokenizer.test_expand import FIXTURES, train
from tokenizer.merge import load_proto

SPACE = "\u2581"


@pytest.fixture(scope="module")
def english_bpe(tmp_path_factory) -> Path:
    """A Llama-2-style base: SentencePiece BPE with byte fallback, trained on English only."""
    return train(tmp_path_factory.mktemp("base") / "base.model", english_texts()[:400], 600, "bpe")


@pytest.fixture(scope="module")
def ja_source(tmp_path_factory) -> Path:
    japanese = [line for line in (FIXTURES / "ja.txt").read_text(encoding="utf-8").splitlines() if line.strip()]
    return train(tmp_path_factory.mktemp("ja") / "ja.model", japanese + JA_PARAGRAPHS, 700, "unigram")


def llama2_normalizer(model: Path, out: Path) -> Path:
    """`model` with Llama 2's normalizer_spec: identity rule, dummy prefix on, extra whitespace kept.

    With that spec a plain encode of ' の' gives '▁▁の' (dummy prefix + the piece's own space)."""
    proto = load_proto(model)
    spec = proto.normalizer_spec
    spec.name, spec.precompiled_charsmap, spec.remove_extra_whitespaces = "identity", b"", False
    assert spec.add_dummy_prefix
    out.write_bytes(proto.SerializeToString())
    return out


def byte_ids(processor, text: str) -> list[int]:
    """The base's byte-fallback pieces of `text`, one per UTF-8 byte."""
    ids = [processor.piece_to_id(f"<0x{byte:02X}>") for byte in text.encode("utf-8")]
    assert processor.unk_id() not in ids
    return ids


@pytest.mark.parametrize("normalizer", ["nmt_nfkc", "llama2"])
def test_a_piece_is_split_as_it_appears_in_the_piece(english_bpe, tmp_path, normalizer):
    import sentencepiece as spm

    model = english_bpe if normalizer == "nmt_nfkc" else llama2_normalizer(english_bpe, tmp_path / "llama2.model")
    base = spm.SentencePieceProcessor(model_file=str(model))
    encode = surface_encoder(model)
    space = base.piece_to_id(SPACE)
    assert base.piece_to_id("の") == base.unk_id() and space != base.unk_id()
    assert encode("の") == byte_ids(base, "の")  # mid-word: its three bytes, no ▁ row in the mean
    assert encode(" の") == [space] + byte_ids(base, "の")  # word-initial: exactly one ▁
    assert encode(" 猫の") == [space] + byte_ids(base, "猫の")
    # English pieces the base holds whole: the mid-word 'ly' is 'ly', not '▁ly'; ' the' is '▁the'.
    for surface, piece in (("ly", "ly"), (" the", SPACE + "the")):
        assert base.piece_to_id(piece) != base.unk_id(), piece
        assert encode(surface) == [base.piece_to_id(piece)], surface


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_base_splits_of_an_expanded_tokenizer(ja_source, tmp_path, model_type):
    """Every new piece made of characters the base never saw is split into its bytes, plus one ▁ when the
    piece starts a word. (A BPE base takes single characters and two-piece merges only, so its new pieces
    are mid-word here; a unigram base also takes word-initial ones such as '▁吾輩'.)"""
    import sentencepiece as spm

    from tokenizer.expand import expand

    base_model = train(tmp_path / "base.model", english_texts()[:400], 600, model_type)
    expand(base_model, ja_source, 900, tmp_path / "tok")
    splits = base_splits(tmp_path / "tok" / "tokenizer.model", base_model, 600)
    new = spm.SentencePieceProcessor(model_file=str(tmp_path / "tok" / "tokenizer.model"))
    base = spm.SentencePieceProcessor(model_file=str(base_model))
    assert len(splits) == 300
    checked = {"mid-word": 0, "word-initial": 0}
    for offset, split in enumerate(splits):
        piece = new.id_to_piece(600 + offset)
        initial = piece.startswith(SPACE)
        body = piece[1:] if initial else piece
        if body and all(base.piece_to_id(ch) == base.unk_id() for ch in body):  # characters the base never saw
            assert split == [base.piece_to_id(SPACE)] * initial + byte_ids(base, body), piece
            checked["word-initial" if initial else "mid-word"] += 1
    assert checked["mid-word"] >= 50, checked
    assert checked["word-initial"] >= (1 if model_type == "unigram" else 0), checked


def base_rows(vocab: int = 10, hidden: int = 64) -> torch.Tensor:
    return torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0))


def test_base_mean_rows_and_padding():
    base = base_rows()
    grown = grown_rows(base, 16, 3, "base_mean", std=0.02, seed=1, splits=[[2, 5], [7], [1, 1, 4]])
    assert grown.shape == (16, 64)
    assert torch.equal(grown[:10], base)
    torch.testing.assert_close(grown[10], (base[2] + base[5]) / 2)
    torch.testing.assert_close(grown[11], base[7])
    torch.testing.assert_close(grown[12], (2 * base[1] + base[4]) / 3)
    for row in grown[13:]:  # padding: the mean of every base row
        torch.testing.assert_close(row, base.mean(dim=0))
    with pytest.raises(ValueError, match="base split of each of the 3 new pieces, got 2"):
        grown_rows(base, 16, 3, "base_mean", std=0.02, seed=1, splits=[[2], [3]])


def test_mean_rows_and_padding_are_the_mean_of_the_base_rows():
    base = base_rows()
    grown = grown_rows(base, 16, 4, "mean", std=0.02, seed=1)
    assert torch.equal(grown[:10], base)
    for row in grown[10:]:
        torch.testing.assert_close(row, base.mean(dim=0))


def test_random_rows_are_normal_with_init_std_and_padding_the_mean():
    base = base_rows(hidden=256)
    grown = grown_rows(base, 64, 40, "random", std=0.05, seed=3)
    new, padding = grown[10:50], grown[50:]
    assert torch.equal(grown[:10], base)
    assert new.std().item() == pytest.approx(0.05, rel=0.05)  # 10,240 draws
    assert abs(new.mean().item()) < 0.005
    assert (new - base.mean(dim=0)).abs().min(dim=1).values.max() > 0  # not the mean
    for row in padding:
        torch.testing.assert_close(row, base.mean(dim=0))
    assert torch.equal(grown_rows(base, 64, 40, "random", std=0.05, seed=3), grown)  # the seed decides
    assert not torch.equal(grown_rows(base, 64, 40, "random", std=0.05, seed=4)[10:50], new)


def test_the_dtype_is_kept_and_other_tensors_pass_through():
    class Stored:
        tensors = {"model.embed_tokens.weight": base_rows().bfloat16(), "model.norm.weight": torch.ones(64)}

        def tensor(self, name):
            return self.tensors[name]

    weights = GrownWeights(Stored(), 64, 0, "base_mean", std=0.02, seed=0)
    grown = weights.tensor("model.embed_tokens.weight")
    assert grown.dtype == torch.bfloat16 and grown.shape == (64, 64)
    assert weights.tensor("model.norm.weight") is Stored.tensors["model.norm.weight"]


def test_padding_alone_needs_no_tokenizer_pieces(tmp_path):
    """model.vocab_size above the base's with the base's own vocabulary in the data: only padding rows,
    which the default base_mean initialises to the base mean without asking for the new tokenizer."""
    from pretrain.config import config_from_args
    from pretrain.model.hf_import import HFImportError
    from pretrain.train import data_vocab_size, hf_initial_weights
    from tests.helpers import tiny_overrides, write_tiny_corpus
    from tests.pretrain.model.test_hf_import import save_random_llama

    model = save_random_llama(tmp_path / "base")  # vocab 512, as the tiny corpus
    corpus = write_tiny_corpus(tmp_path / "corpus")
    cfg = config_from_args(tiny_overrides(corpus, tmp_path / "runs", f"model.init_from={tmp_path / 'base'}",
                                          "model.vocab_size=576"))
    assert (cfg.model.vocab_size, cfg.model.new_token_init, cfg.data.tokenizer_dir) == (576, "base_mean", None)
    assert data_vocab_size(cfg) == 512
    tensor = hf_initial_weights(cfg, data_vocab_size(cfg))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        stored = model.state_dict()[name]
        grown = tensor(name)
        assert grown.shape == (576, 64)
        assert torch.equal(grown[:512], stored)
        for row in grown[512:]:
            torch.testing.assert_close(row, stored.mean(dim=0))
    # Ids above the base's in the data are new pieces: base_mean needs their tokenizer, and says so.
    with pytest.raises(HFImportError, match="base_mean needs the new tokenizer's pieces"):
        hf_initial_weights(cfg, 520)
