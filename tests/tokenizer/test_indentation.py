"""Indentation after a newline costs one token per run at the common depths (1-4 tabs, 2-16 spaces),
in SentencePiece and the HF export alike, on a tokenizer built from real text (issue 14.3)."""
from __future__ import annotations

import pytest

from tokenizer.indentation import SPACE_DEPTHS, TAB_DEPTHS, indentation_costs, run_cost, summarize


def test_run_cost_counts_whitespace_pieces_before_the_text():
    assert run_cost(["\n", "\t", "\t", "return"], 1) == 2
    assert run_cost(["\n", "▁▁▁", "▁return"], 1) == 1  # the word's own "▁" is not indentation
    assert run_cost(["\n", "<0x09>", "<0x09>", "x"], 1) == 2  # tabs spelled as bytes count too


def test_indentation_costs_groups_runs_by_kind_and_depth():
    def per_char(text: str) -> list[str]:  # a "tokenizer" that spells every character alone
        return [c.replace(" ", "▁") for c in text]

    costs = indentation_costs(per_char, ["a\n\t\tb\n    c\n \tmixed\n\n"])
    assert dict(costs) == {("tab", 2): [2], ("space", 4): [4]}
    assert summarize(costs)["space4"] == {"runs": 1, "mean": 4.0, "over_one": 1.0}


def test_promote_runs_lifts_a_run_above_its_best_split():
    from tokenizer.merge import promote_runs
    from tokenizer.proto import pb

    proto = pb().ModelProto()
    normal = pb().ModelProto.SentencePiece.NORMAL
    for piece, score in (("▁", -2.0), ("▁▁", -11.0), ("▁▁▁", -3.0), ("x", -1.0)):
        proto.pieces.add(piece=piece, score=score, type=normal)
    assert promote_runs(proto, ["▁▁▁", "▁▁"], margin=0.125) == 1
    scores = {p.piece: p.score for p in proto.pieces}
    assert scores["▁▁"] == -3.875  # above "▁"+"▁" = -4
    assert scores["▁▁▁"] == -3.0  # already above its best split ("▁▁"+"▁" = -5.875): unchanged


@pytest.mark.slow
def test_built_tokenizer_spends_one_token_per_indentation_run(built):
    import sentencepiece as spm
    from tokenizers import Tokenizer

    sp = spm.SentencePieceProcessor(model_file=str(built / "tokenizer.model"))
    hf = Tokenizer.from_file(str(built / "tokenizer.json"))
    for kind, unit, depths in (("tab", "\t", TAB_DEPTHS), ("space", " ", SPACE_DEPTHS)):
        for depth in depths:
            text = "func f() {\n" + unit * depth + "return x\n}"
            pieces = sp.encode(text, out_type=str)
            start = pieces.index("\n") + 1
            assert run_cost(pieces, start) == 1, (kind, depth, pieces)
            if kind == "tab":
                assert pieces[start] == "\t" * depth, pieces  # the whole run, no "▁" in front
            assert hf.encode(text, add_special_tokens=False).ids == sp.encode(text), (kind, depth)
            assert sp.decode(sp.encode(text)) == text
