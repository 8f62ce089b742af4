"""A model's log-likelihoods and greedy continuations, batched and spread over data-parallel ranks.

The model is a function from token ids [B, T] to logits [B, T, V]. Sequences of a batch are padded on the
right: under causal attention a position never sees the padding after it, so each sequence's scores are
its own. Data-parallel rank r of W scores requests r, r+W, r+2W, ...; every rank runs the same number of
forward passes (a short share is padded with repeats that are not recorded), because under ZeRO-3 and
tensor parallelism a forward pass is collective. The results are summed over all ranks with a count per
request, so ranks that computed the same request (a tensor-parallel group) are averaged, not added, and every
rank ends with every result: the scores do not depend on the rank count.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

LogitsFn = Callable[[Tensor], Tensor]
"""Token ids [B, T] (long, on the model's device) to logits [B, T, V]."""


@dataclass
class Share:
    """This process's part of the scoring: its data-parallel rank, their number, and a sum over all ranks."""

    rank: int = 0
    size: int = 1
    sum: Callable[[Tensor], Tensor] = lambda tensor: tensor
    """Sums a float64 CPU tensor over every rank (all ranks call it together); the identity for one process."""


def _my_batches(count: int, share: Share, batch_size: int) -> list[list[int]]:
    """This rank's request indices in batches; -1 marks a padding repeat. Every rank gets as many batches."""
    mine = list(range(share.rank, count, share.size))
    batches = math.ceil(math.ceil(count / share.size) / batch_size) if count else 0
    mine += [-1] * (batches * batch_size - len(mine))
    return [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]


def _padded(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device, max_len: int = 0) -> Tensor:
    """Right-padded [B, T] ids; T rounded up to a multiple of 8 so that compiled models see few shapes, but never
    past max_len (the positions the model reads, when given: a model refuses a longer input)."""
    longest = max(len(r) for r in rows)
    width = -(-longest // 8) * 8
    if max_len:
        width = max(longest, min(width, max_len))
    out = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=torch.long)
    return out.to(device)


@torch.no_grad()
def loglikelihoods(logits_fn: LogitsFn, requests: Sequence[tuple[Sequence[int], Sequence[int]]], share: Share,
                   batch_size: int, device: torch.device, pad_id: int = 0,
                   max_len: int = 0, vocab: int | None = None) -> list[tuple[float, bool]]:
    """(sum of log p(continuation | context), whether greedy decoding gives exactly the continuation) per
    (context, continuation) request; every rank gets every result. max_len: the positions the model reads
    (0: no limit), which the padding never passes. The probabilities are the model's over all its rows; greedy
    decoding picks among the tokenizer's `vocab` ids only (a padded embedding's extra rows are no token)."""
    results = torch.zeros(len(requests), 3, dtype=torch.float64)  # loglik, greedy, count
    for batch in _my_batches(len(requests), share, batch_size):
        chosen = [requests[i if i >= 0 else batch[0]] for i in batch]  # a padding row repeats a real one
        inputs = [list(context) + list(continuation) for context, continuation in chosen]
        logits = logits_fn(_padded([row[:-1] for row in inputs], pad_id, device, max_len))
        for row, (index, (context, continuation)) in enumerate(zip(batch, chosen)):
            if index < 0:
                continue
            start = len(context) - 1  # logits at t predict token t + 1
            scores = F.log_softmax(logits[row, start:start + len(continuation)].float(), dim=-1).cpu()
            target = torch.tensor(list(continuation), dtype=torch.long)
            loglik = scores.gather(1, target[:, None]).sum().item()
            greedy = bool((scores[:, :vocab].argmax(dim=-1) == target).all())
            results[index] += torch.tensor([loglik, float(greedy), 1.0], dtype=torch.float64)
    results = share.sum(results)
    return [(float(r[0] / r[2]), bool(r[1] / r[2] > 0.5)) for r in results]


@torch.no_grad()
def greedy_continuations(logits_fn: LogitsFn, contexts: Sequence[Sequence[int]], max_new_tokens: int,
                         finished: Callable[[list[int]], bool], share: Share, batch_size: int,
                         device: torch.device, pad_id: int = 0, max_len: int = 0,
                         vocab: int | None = None) -> list[list[int]]:
    """Greedy continuation of each context, at most max_new_tokens, ended early once `finished(ids)` says so
    for every sequence of every rank's batch (the ranks agree each token, so forward passes stay in step).
    No KV cache: each new token runs the whole sequence again, which suits the short answers of qa tasks.
    max_len: as for loglikelihoods. Only the tokenizer's `vocab` ids are chosen."""
    results = torch.full((len(contexts), max_new_tokens + 1), 0.0, dtype=torch.float64)  # ids + 1, then count
    for batch in _my_batches(len(contexts), share, batch_size):
        rows = [list(contexts[i if i >= 0 else batch[0]]) for i in batch]
        new: list[list[int]] = [[] for _ in batch]
        done = [index < 0 for index in batch]
        for _ in range(max_new_tokens):
            logits = logits_fn(_padded([r + n for r, n in zip(rows, new)], pad_id, device, max_len))
            for row in range(len(batch)):
                if not done[row]:
                    last = len(rows[row]) + len(new[row]) - 1
                    new[row].append(int(logits[row, last, :vocab].float().argmax()))
                    done[row] = finished(new[row])
            still = share.sum(torch.tensor([float(not all(done))], dtype=torch.float64))
            if still.item() == 0:
                break
        for index, ids in zip(batch, new):
            if index >= 0:
                results[index, :len(ids)] = torch.tensor(ids, dtype=torch.float64) + 1
                results[index, -1] = 1.0
    results = share.sum(results)
    out = []
    for row in results:
        ids = (row[:-1] / row[-1]).round().long() - 1
        out.append([int(i) for i in ids if i >= 0])
    return out
