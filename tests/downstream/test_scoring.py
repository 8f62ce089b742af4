"""downstream/scoring.py with a tiny random ayumi Llama and a real tokenizer: batched log-likelihoods equal a
hand computation over one unbatched forward pass whatever the batch size or rank count, and greedy generation
equals a plain argmax loop, ending each sequence at its stop."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from downstream.prompts import encode_pair
from downstream.scoring import Share, greedy_continuations, loglikelihoods
from pretrain.model.config import ModelConfig
from pretrain.model.llama import Llama

CPU = torch.device("cpu")
PAIRS = [("Question: Which city is the capital of Japan?\nAnswer:", " Tokyo"),
         ("Question: Which city is the capital of Japan?\nAnswer:", " a small village by the sea"),
         ("吾輩は猫である。名前は", "まだ無い。"),
         ("The function returns", " a list."),
         ("今日は天気が良いので、", "公園を散歩しました。")]


@pytest.fixture(scope="module")
def model() -> Llama:
    torch.manual_seed(0)
    return Llama(ModelConfig(max_seq_len=64, init_std=0.1)).eval()


def logits_fn(model):
    return lambda ids: model(ids).logits


def requests(tokenizer, eos: int) -> list[tuple[list[int], list[int]]]:
    out = []
    for context, continuation in PAIRS:
        context_ids, continuation_ids = encode_pair(tokenizer, context, continuation)
        out.append(([eos] + context_ids, continuation_ids))
    return out


@torch.no_grad()
def by_hand(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """One unbatched forward pass over context + continuation (less its last token): the log-probability of each
    continuation token at the position before it, summed; and whether each is the argmax there."""
    logits = model(torch.tensor([context + continuation[:-1]])).logits[0].float()
    scores = F.log_softmax(logits, dim=-1)[len(context) - 1:]
    target = torch.tensor(continuation)
    return scores.gather(1, target[:, None]).sum().item(), bool((scores.argmax(-1) == target).all())


@torch.no_grad()
def greedy_by_hand(model, context: list[int], steps: int) -> list[int]:
    ids = list(context)
    for _ in range(steps):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].float().argmax()))
    return ids[len(context):]


def test_logliks_equal_a_hand_computation_whatever_the_batch_size(model, tokenizer):
    reqs = requests(tokenizer, tokenizer.eod_id)
    one = loglikelihoods(logits_fn(model), reqs, Share(), 1, CPU)
    three = loglikelihoods(logits_fn(model), reqs, Share(), 3, CPU, pad_id=3)
    hand = [by_hand(model, c, k) for c, k in reqs]
    # fp32 sums of log-probabilities, up to -142 here, where one ulp is 1.5e-5: 1e-5, or a few ulps of the sum.
    assert [ll for ll, _ in one] == pytest.approx([ll for ll, _ in three], rel=1e-6, abs=1e-5)
    assert [ll for ll, _ in three] == pytest.approx([ll for ll, _ in hand], rel=1e-6, abs=1e-5)
    assert [g for _, g in one] == [g for _, g in three] == [g for _, g in hand]
    assert all(ll < 0 for ll, _ in one)


def test_the_greedy_flag_is_true_exactly_for_the_models_own_continuation(model, tokenizer):
    context = [tokenizer.eod_id] + tokenizer.encode("吾輩は猫である。")
    own = greedy_by_hand(model, context, 3)
    other = own[:2] + [(own[2] + 1) % model.cfg.vocab_size]
    [(own_ll, own_greedy), (other_ll, other_greedy)] = loglikelihoods(
        logits_fn(model), [(context, own), (context, other)], Share(), 2, CPU)
    assert (own_greedy, other_greedy) == (True, False)
    assert own_ll > other_ll


def test_greedy_continuations_equal_a_step_by_step_argmax_loop(model, tokenizer):
    texts = ("吾輩は", "Question: What is 2+2?\nAnswer:", "a")
    contexts = [[tokenizer.eod_id] + tokenizer.encode(text) for text in texts]
    hand = [greedy_by_hand(model, c, 6) for c in contexts]
    got = greedy_continuations(logits_fn(model), contexts, 6, lambda ids: False, Share(), 2, CPU)
    assert got == hand


def test_greedy_continuations_stop_at_the_stop_string(model, tokenizer):
    contexts = [[tokenizer.eod_id] + tokenizer.encode(text) for text in ("吾輩は", "The function returns", "東京は")]
    hand = [greedy_by_hand(model, c, 8) for c in contexts]
    # The stop string: the text of a token the first context's continuation reaches after a step or two.
    k = next(k for k in range(1, 8) if tokenizer.decode(hand[0][k:k + 1]).strip()
             and tokenizer.decode(hand[0][k:k + 1]) not in tokenizer.decode(hand[0][:k]))
    stop = tokenizer.decode(hand[0][k:k + 1])

    def cut(ids: list[int]) -> list[int]:  # up to and including the token that completes the stop string
        return next((ids[:n] for n in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:n])), ids)

    got = greedy_continuations(logits_fn(model), contexts, 8, lambda ids: stop in tokenizer.decode(ids), Share(), 3,
                               CPU)
    assert got[0] == hand[0][:k + 1] and len(got[0]) < 8
    assert got == [cut(ids) for ids in hand]


class ThreadRanks:
    """`size` data-parallel ranks as threads of this process: Share.sum is a real all-reduce over them."""

    def __init__(self, size: int):
        self.size, self.parts = size, [None] * size
        self.barrier = threading.Barrier(size, timeout=60)  # a rank that fails breaks it: the others raise too

    def share(self, rank: int) -> Share:
        def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = tensor.clone()
            self.barrier.wait()
            total = sum(self.parts)
            self.barrier.wait()  # everyone has read the parts before the next call overwrites them
            return total
        return Share(rank, self.size, all_reduce)

    def run(self, fn) -> list:
        """fn(share) on every rank at once; each rank's result (a rank's exception is raised here)."""
        results: list = [None] * self.size

        def rank(r: int) -> None:
            try:
                results[r] = fn(self.share(r))
            except BaseException as err:  # noqa: BLE001 (handed to the test's thread)
                results[r] = err
                self.barrier.abort()

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results


def test_every_rank_gets_every_result_whatever_the_rank_count(model, tokenizer):
    """5 requests over 2 and 3 ranks (uneven shares: the short ones run padding repeats, not recorded)."""
    reqs = requests(tokenizer, tokenizer.eod_id)
    single = loglikelihoods(logits_fn(model), reqs, Share(), 2, CPU)
    contexts = [c for c, _ in reqs]

    def stop_at_4(ids: list[int]) -> bool:  # rows end unevenly: those whose first new token is odd after 4
        return len(ids) >= 4 and ids[0] % 2 == 1

    single_greedy = greedy_continuations(logits_fn(model), contexts, 6, stop_at_4, Share(), 2, CPU)
    assert sorted({len(ids) for ids in single_greedy}) == [4, 6]
    for size in (2, 3):
        ranks = ThreadRanks(size)
        for result in ranks.run(lambda share: loglikelihoods(logits_fn(model), reqs, share, 2, CPU)):
            assert [ll for ll, _ in result] == pytest.approx([ll for ll, _ in single], rel=1e-6, abs=1e-5)
            assert [g for _, g in result] == [g for _, g in single]
        ranks = ThreadRanks(size)
        assert ranks.run(lambda share: greedy_continuations(logits_fn(model), contexts, 6, stop_at_4, share, 2,
                                                            CPU)) == [single_greedy] * size


def test_batches_are_never_padded_past_the_models_context(tokenizer):
    """A model of 18 positions (not a multiple of 8): a request that needs all 18 is scored, though rounding the
    batch up to a multiple of 8 would give 24, which the model refuses."""
    torch.manual_seed(1)
    model = Llama(ModelConfig(max_seq_len=18)).eval()
    context = [tokenizer.eod_id] + tokenizer.encode("Question: Which city is the capital of Japan?")[:14]
    continuation = tokenizer.encode(" Tokyo is")[:4]
    assert len(context) + len(continuation) - 1 == 18
    [(loglik, _)] = loglikelihoods(logits_fn(model), [(context, continuation)], Share(), 2, CPU, max_len=18)
    assert loglik == pytest.approx(by_hand(model, context, continuation)[0], abs=1e-5)
    short = context[:16]  # 16 + 3 new tokens - 1 = 18 positions at the last step
    assert greedy_continuations(logits_fn(model), [short], 3, lambda ids: False, Share(), 1, CPU,
                                max_len=18) == [greedy_by_hand(model, short, 3)]
