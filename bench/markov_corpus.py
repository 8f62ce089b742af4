"""Seeded Markov-chain text as token shards: learnable, and the same on every machine and at every commit.

Stability benches compare runs whose only difference is the event under test (an injected LR, a learning
rate past the edge). Their corpus must not change when the repository does, as the repository's own text
(bench/step_overhead.py's corpus, right for timing) does with every commit: a batch that happens to be
unusual at one commit is not at the next, and a clean run's verdict would follow the commit, not the code.

Each domain is a fixed sparse Markov chain over the vocabulary (`successors` next tokens per token,
Dirichlet(0.7) weights, drawn from the domain's seed): a model learns it from ln(vocab) down to the chain's
entropy (about 1.4 nats at 6 successors), and two domains differ in level as a curriculum's do.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

DOMAIN_SEEDS = {"chain_a": 100, "chain_b": 200}
"""The corpus's domains and their chains' seeds."""
DOCUMENT_TOKENS = 256  # tokens per document, EOS not counted


def markov_chain(vocab: int, seed: int, successors: int = 6) -> np.ndarray:
    """A vocab x vocab transition matrix with `successors` non-zero entries a row."""
    rng = np.random.default_rng(seed)
    probs = np.zeros((vocab, vocab))
    for token in range(vocab):
        nxt = rng.choice(vocab, successors, replace=False)
        probs[token, nxt] = rng.dirichlet(np.full(successors, 0.7))
    return probs


def sample_chain(rng: np.random.Generator, probs: np.ndarray, count: int, length: int) -> np.ndarray:
    """`count` walks of `length` tokens each, from uniformly drawn first tokens: shape (count, length)."""
    vocab = probs.shape[0]
    out = np.empty((count, length), dtype=np.int64)
    cumulative = probs.cumsum(1)
    token = rng.integers(0, vocab, count)
    for t in range(length):
        out[:, t] = token
        token = np.minimum((cumulative[token] < rng.random(count)[:, None]).sum(1), vocab - 1)
    return out


def write_markov_corpus(root: Path, vocab: int, tokens_per_domain: int, seed: int = 0) -> Path:
    """Token shards under `root` (a TokenRoot, one train shard per domain of DOMAIN_SEEDS).

    The chains use ids 0..vocab-2; the last id is the EOS that ends each document.
    """
    from data.token_root import TokenRoot

    eos = vocab - 1
    rng = np.random.default_rng(seed)
    documents = -(-tokens_per_domain // (DOCUMENT_TOKENS + 1))
    with TokenRoot(root, vocab_size=vocab, eos_id=eos, name="markov") as out:
        for domain, chain_seed in DOMAIN_SEEDS.items():
            walks = sample_chain(rng, markov_chain(vocab - 1, chain_seed), documents, DOCUMENT_TOKENS)
            with out.shard(domain, "train") as writer:
                for walk in walks:
                    writer.add_document(np.append(walk, eos))
    return root
