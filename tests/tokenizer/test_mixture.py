"""The unigram merge: EM and loss-based pruning of the candidate pool on the share-weighted mixture."""
from __future__ import annotations


import numpy as np
import pytest

from tokenizer.mixture import best_split_score, domain_weights, prune_pass


def _proto(pieces: list[tuple[str, float]]):
    """A unigram ModelProto holding only NORMAL pieces (what prune_pass looks at)."""
    from tokenizer.proto import pb

    proto = pb().ModelProto()
    for piece, score in pieces:
        proto.pieces.add(piece=piece, score=score, type=pb().ModelProto.SentencePiece.NORMAL)
    return proto


def test_weights_follow_characters_at_0_and_shares_at_1():
    chars = {"ja": 1_000, "en": 3_000}
    shares = {"ja": 3, "en": 1}
    joint_like = domain_weights(chars, shares, 0.0)
    assert joint_like["ja"] == pytest.approx(joint_like["en"])  # every character counts the same
    by_share = domain_weights(chars, shares, 1.0)
    mass = {d: by_share[d] * chars[d] for d in chars}
    assert mass["ja"] / mass["en"] == pytest.approx(3.0)  # the domains' total weight is their share
    half = domain_weights(chars, shares, 0.5)
    # geometric mean: ja (1/4 of the characters, 3/4 of the shares) and en (3/4, 1/4) weigh the same
    assert half["ja"] * chars["ja"] / (half["en"] * chars["en"]) == pytest.approx(1.0)


def test_best_split_excludes_the_piece_itself():
    ids = {"a": 0, "b": 1, "ab": 2, "abc": 3, "c": 4}
    scores = [-1.0, -1.0, -1.5, -2.0, -3.0]
    assert best_split_score("abc", ids, scores, exclude=3, max_len=3) == pytest.approx(-4.5)  # "ab" + "c"
    assert best_split_score("ab", ids, scores, exclude=2, max_len=3) == pytest.approx(-2.0)
    assert best_split_score("xy", ids, scores, exclude=-1, max_len=3) is None


def test_prune_drops_unused_then_cheapest_and_keeps_characters_and_protected():
    proto = _proto([("a", -1.0), ("b", -1.0), ("c", -2.0),
                    ("ab", -1.2),    # used a lot, its split costs 0.8 more per use: expensive to lose
                    ("bc", -2.5),    # used little, its split is only 0.5 worse: cheap to lose
                    ("ca", -3.0),    # unused: free to lose
                    ("\t\t", -9.0)])  # unused but protected (an indentation run)
    weighted = np.array([10, 10, 10, 100, 1, 0, 0], dtype=float)
    dropped = prune_pass(proto, weighted, keep=5, protected={"\t\t"})
    left = [p.piece for p in proto.pieces]
    assert dropped == 2 and left == ["a", "b", "c", "ab", "\t\t"]
    assert prune_pass(proto, weighted[[0, 1, 2, 3, 6]], keep=5, protected=set()) == 0


@pytest.mark.slow
def test_build_cuts_the_pool_to_the_exact_size_and_share_weight_moves_pieces(corpus, tmp_path):
    """A real build: the pool (twice each domain's share) ends at exactly total_vocab; raising share_weight
    gives Japanese, whose configured share is far above its share of the sample's characters, more pieces
    and better held-out compression."""
    import json

    import sentencepiece as spm

    from tests.tokenizer.conftest import TINY_SIZES, tiny_overrides
    from tokenizer.build import build_tokenizer
    from tokenizer.cli import compose, to_object
    from tokenizer.merge import indentation_pieces

    results = {}
    for weight in (0.0, 1.0):
        out = tmp_path / f"w{weight}"
        job = to_object(compose(tiny_overrides(corpus, out, **{
            "tokenizer.evaluate.baseline": "false", "tokenizer.merge.share_weight": weight,
            "tokenizer.domains.en.vocab_size": 400,
            "tokenizer.domains.code.vocab_size": 400, "tokenizer.domains.math.vocab_size": 400})))
        meta = build_tokenizer(job.tokenizer, out, log=lambda _: None)
        sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
        pieces = {sp.id_to_piece(i) for i in range(sp.get_piece_size())}
        assert sp.get_piece_size() == TINY_SIZES["total_vocab"]
        assert set(indentation_pieces(4, 16)) <= pieces and {"<", "s", ">", "/"} <= pieces
        domain_models = {d: spm.SentencePieceProcessor(model_file=str(out / "domains" / f"{d}.model")) for d in "ja en".split()}
        assert domain_models["ja"].get_piece_size() > TINY_SIZES["ja"], "the ja model is trained larger than its share (the pool)"
        evaluation = json.loads((out / "eval.json").read_text())["results"]["merged"]["domains"]
        results[weight] = (meta["pieces_by_domain"], evaluation["ja"]["chars_per_token"])
    (shares0, ja0), (shares1, ja1) = results[0.0], results[1.0]
    assert shares1["ja"] > shares0["ja"] and ja1 > ja0


@pytest.mark.slow
def test_counting_distinct_words_equals_encoding_the_lines(built):
    """The EM encodes each distinct word once; the counts must be those of encoding every line whole."""
    import sentencepiece as spm

    from tests.tokenizer.test_build import TRICKY_TEXTS
    from tokenizer.merge import load_proto
    from tokenizer.mixture import crosses_words, domain_counts, word_counts

    proto = load_proto(built / "tokenizer.model")
    assert not any(crosses_words(p.piece) for p in proto.pieces)
    lines = [line for text in TRICKY_TEXTS for line in text.split("\n") if line] * 3
    lines += ["  two  spaces  and a tab\tthere ", "x", "    indented(four)", "末尾 の 空白   "]
    sp = spm.SentencePieceProcessor(model_file=str(built / "tokenizer.model"))
    direct = np.bincount([i for ids in sp.encode(lines) for i in ids], minlength=len(proto.pieces))
    counted = domain_counts(proto, {"all": word_counts(lines, dummy_prefix=True)}, num_threads=1)["all"]
    assert np.array_equal(counted, direct)


def test_pool_covers_the_mixture_part_of_a_domain_whose_text_outweighs_its_share(tmp_path):
    """At share_weight 0 a domain with a small share but much text is given pieces by its characters, so its
    candidate pool must be sized by them; at share_weight 1 the shares alone decide."""
    from tokenizer.build import pool_sizes
    from tokenizer.cli import compose, to_object
    from tokenizer.config import fixed_pieces
    from tokenizer.sample import DomainSample

    cfg = to_object(compose(["tokenizer=demo_8k"])).tokenizer
    samples = {domain: DomainSample(domain, tmp_path / f"{domain}.txt", tmp_path / f"{domain}.jsonl", train_chars=chars)
               for domain, chars in {"ja": 1_000, "en": 1_000, "code": 1_000, "math": 7_000}.items()}
    fixed = fixed_pieces(cfg.specials)
    learned = {d: cfg.domains[d].vocab_size - fixed for d in samples}
    factor = cfg.merge.pool_factor
    cfg.merge.share_weight = 0.0
    by_chars = pool_sizes(cfg, samples)
    assert by_chars["math"] == fixed + round(factor * 0.7 * sum(learned.values()))  # 70% of the characters
    assert by_chars["ja"] == fixed + round(factor * learned["ja"])  # its share is above its 10% of the text
    cfg.merge.share_weight = 1.0
    assert pool_sizes(cfg, samples) == {d: fixed + round(factor * n) for d, n in learned.items()}


def test_the_sample_counts_the_characters_the_pools_are_sized_by(corpus, tmp_path):
    from tests.tokenizer.conftest import tiny_overrides
    from tokenizer.build import sample_all
    from tokenizer.cli import compose, to_object

    cfg = to_object(compose(tiny_overrides(corpus, tmp_path / "o"))).tokenizer
    for sample in sample_all(cfg, tmp_path / "work", log=lambda _: None).values():
        assert sample.train_chars == len(sample.train_path.read_text(encoding="utf-8")) > 0


def test_pool_options_reach_only_the_candidate_models():
    """merge.pool_options shape the domain (candidate) models; the joint baseline, the bench's bare training and
    BPE keep SentencePiece's schedule, and a domain's extra_options still win."""
    from tokenizer.cli import compose, to_object
    from tokenizer.train_spm import trainer_options

    cfg = to_object(compose(["tokenizer=demo_8k"])).tokenizer
    ja = cfg.domains["ja"]
    candidate = trainer_options(cfg, ja, 1000, candidates=True)
    assert candidate["shrinking_factor"] == 0.5 and candidate["hard_vocab_limit"] is False
    assert "shrinking_factor" not in trainer_options(cfg, ja, 1000) and "hard_vocab_limit" not in trainer_options(cfg, ja, 1000)
    ja.extra_options["num_sub_iterations"] = 2
    assert trainer_options(cfg, ja, 1000, candidates=True)["num_sub_iterations"] == 2
    cfg.model_type = "bpe"
    assert "shrinking_factor" not in trainer_options(cfg, ja, 1000, candidates=True)


@pytest.mark.slow
def test_pools_short_after_deduplication_are_retrained_larger(corpus, tmp_path):
    """Pools exactly the vocabulary's size (pool_factor 1) lose pieces to de-duplication across domains; the
    build retrains the domains whose samples have room, larger by the shortfall, instead of failing."""
    from tests.tokenizer.conftest import TINY_SIZES, tiny_overrides
    from tokenizer.build import build_tokenizer, piece_count
    from tokenizer.cli import compose, to_object

    out = tmp_path / "o"
    job = to_object(compose(tiny_overrides(corpus, out, **{
        "tokenizer.evaluate.baseline": "false", "tokenizer.merge.pool_factor": 1.0, "tokenizer.merge.share_weight": 1.0,
        "tokenizer.domains.en.vocab_size": 400, "tokenizer.domains.code.vocab_size": 400,
        "tokenizer.domains.math.vocab_size": 400})))
    logs: list[str] = []
    build_tokenizer(job.tokenizer, out, log=logs.append)
    assert any("pieces short after de-duplication: retraining" in line for line in logs), logs
    assert piece_count(out / "tokenizer.model") == TINY_SIZES["total_vocab"]
