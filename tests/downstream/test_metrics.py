"""downstream/metrics.py: exact match after NFKC, character F1 on Japanese answers (worked by hand), acc with ties
to the first choice, and acc_norm dividing by a choice's length in characters (lm-eval's acc_norm)."""
from __future__ import annotations

import math

import pytest

from downstream.metrics import char_f1, choice_scores, cut_at_stop, exact_match, mean, mean_stderr


def test_exact_match_treats_full_width_and_half_width_forms_alike():
    assert exact_match("ＡＢＣ１２３", "ABC123") == 1.0  # full-width letters and digits: NFKC folds them
    assert exact_match("ｶﾀｶﾅ", "カタカナ") == 1.0  # half-width katakana
    assert exact_match(" 東京\n", "東京") == 1.0  # surrounding whitespace
    assert exact_match("東京", "京都") == 0.0
    assert exact_match("2", "２") == 1.0 and exact_match("2", "3") == 0.0


def test_char_f1_on_japanese_answers_by_hand():
    # "東京都" vs "東京": common {東, 京} = 2; precision 2/3, recall 2/2; F1 = 2·(2/3)·1 / (2/3 + 1) = 0.8
    assert char_f1("東京都", "東京") == pytest.approx(0.8)
    # "きょうと" vs "とうきょう": as multisets {き,ょ,う,と} and {と,う×2,き,ょ}; common 4 (one う);
    # precision 4/4, recall 4/5; F1 = 2·1·0.8 / 1.8 = 8/9 (order does not matter, counts do)
    assert char_f1("きょうと", "とうきょう") == pytest.approx(8 / 9)
    assert char_f1("大阪", "東京") == 0.0
    assert char_f1("ＡＢ", "AB") == 1.0  # after NFKC
    assert char_f1("", "") == 1.0 and char_f1("", "東京") == 0.0 and char_f1("東京", " ") == 0.0


def test_acc_ties_go_to_the_first_choice():
    assert choice_scores([-1.0, -1.0, -2.0], ["a", "b", "c"], gold=0)["acc"] == 1.0
    assert choice_scores([-1.0, -1.0, -2.0], ["a", "b", "c"], gold=1)["acc"] == 0.0
    assert choice_scores([-3.0, -2.0, -2.0], ["a", "b", "c"], gold=1)["acc"] == 1.0


def test_acc_norm_divides_by_the_length_in_characters_not_bytes():
    # "東京" is 2 characters (6 UTF-8 bytes), "abc" 3: per character -1.5 vs -1.33 picks "abc"; per byte it would
    # be -0.5 vs -1.33 and pick "東京". acc (unnormalised) picks "東京".
    scores = choice_scores([-3.0, -4.0], ["東京", "abc"], gold=1)
    assert scores == {"acc": 0.0, "acc_norm": 1.0}
    # ties under normalisation go to the first choice too: -2/1 == -4/2
    assert choice_scores([-2.0, -4.0], ["a", "bb"], gold=0)["acc_norm"] == 1.0


def test_cut_at_stop_and_mean():
    assert cut_at_stop("答え\n次の質問", ["\n"]) == "答え"
    assert cut_at_stop("a。b\nc", ["\n", "。"]) == "a"  # the earliest stop, whichever is listed first
    assert cut_at_stop("no stop", ["\n", ""]) == "no stop"
    assert mean([1.0, 0.0, 0.0, 1.0]) == 0.5 and math.isnan(mean([]))


@pytest.mark.parametrize("values", [[1.0, 0.0, 1.0, 1.0, 0.0], [0.0] * 7 + [1.0] * 3, [-3.25, -1.5, -8.0, -2.125],
                                    [0.8, 1.0, 0.25]])
def test_standard_error_is_lm_evals_mean_stderr(values):
    """acc and exact_match (0/1), loglik (sums of log-probabilities), char_f1 (in [0, 1]): all means, so all get
    lm-eval's mean_stderr; for 0/1 scores that is sqrt(p (1 - p) / (n - 1))."""
    lm_eval_metrics = pytest.importorskip("lm_eval.api.metrics", reason="the test extra installs lm-eval")
    assert mean_stderr(values) == pytest.approx(lm_eval_metrics.mean_stderr(values), rel=1e-12)
    if set(values) <= {0.0, 1.0}:
        p = mean(values)
        assert mean_stderr(values) == pytest.approx(math.sqrt(p * (1 - p) / (len(values) - 1)), rel=1e-12)


def test_one_value_has_no_standard_error():
    assert math.isnan(mean_stderr([1.0])) and math.isnan(mean_stderr([]))
