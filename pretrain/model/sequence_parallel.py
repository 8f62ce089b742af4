"""Sequence parallelism (`parallel.sequence` = N, DeepSpeed Ulysses): what the model needs to know of it.

The N ranks of a sequence-parallel group read the same samples. Each embeds and runs its own slice of every
sequence, T/N consecutive tokens: norms, projections, the MLP and the loss see T/N tokens, so the activations
a rank keeps shrink by N. Attention needs the whole sequence: an all-to-all hands each rank all T tokens of
H/N heads, it attends, and a second all-to-all gives the heads back for its own tokens. That exchange is
DeepSpeed's `DistributedAttention`, installed by the engine (pretrain/engine/sequence_parallel.py: only the
engine imports DeepSpeed); this module holds the slicing, the group's loss weighting and the config rules.

Only training runs sliced. Evaluation (`model.eval()`: validation loss, downstream scoring) runs each
sequence whole on every rank of the group, as tensor parallelism's ranks repeat the same forward: no
gradients are kept there, and downstream scoring wants every position's logits on one rank.

The loss is token-weighted over the group: a rank sums its slice's token losses and divides by the whole
sequence's token count, times N, so the mean over the group's ranks (DeepSpeed averages gradients over
every rank) is the whole batch's mean loss, whatever share of ignored tokens each slice holds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the config checks run in the launcher, which imports no torch
    from torch import Tensor


@dataclass(frozen=True)
class SequenceSlice:
    """Which slice of each sequence this rank computes: rank `rank` of a group of `size`."""

    rank: int
    size: int

    def bounds(self, length: int) -> tuple[int, int]:
        """[start, end) of this rank's tokens in a sequence of `length` (a multiple of size, checked by the config)."""
        if length % self.size:
            raise ValueError(f"a sequence of {length} tokens does not split over parallel.sequence={self.size} "
                             "ranks; train.seq_len must be a multiple of it")
        share = length // self.size
        return self.rank * share, (self.rank + 1) * share

    def take(self, tokens: Tensor, dim: int = 1) -> Tensor:
        """This rank's slice of `tokens` along the sequence dimension `dim`."""
        start, end = self.bounds(tokens.shape[dim])
        return tokens.narrow(dim, start, end - start)


def sequence_parallel_problems(cfg: Any) -> list[str]:
    """Every reason `parallel.sequence` cannot train this config, one line each naming the field and the fix
    (hardware-free: the world size is checked by pretrain.config.data_parallel_size)."""
    n = cfg.parallel.sequence
    if n <= 1:
        return []
    model, problems = cfg.model, []
    if cfg.parallel.tensor > 1:
        problems.append(f"parallel.sequence={n} with parallel.tensor={cfg.parallel.tensor}: ayumi does not combine "
                        "them; use one of the two (sequence parallelism for long sequences, tensor parallelism "
                        "for wide layers)")
    fitting = [d for d in range(2, model.num_kv_heads + 1)
               if model.num_kv_heads % d == 0 and model.num_heads % d == 0]
    for field, value, what in (("num_heads", model.num_heads, "query heads"),
                               ("num_kv_heads", model.num_kv_heads, "key/value heads")):
        if value % n:
            problems.append(f"parallel.sequence={n} must divide model.{field}={value}: attention hands each rank "
                            f"an equal share of the {what}; this model takes parallel.sequence in {fitting or [1]}")
    if cfg.train.seq_len % n:
        problems.append(f"parallel.sequence={n} must divide train.seq_len={cfg.train.seq_len}: each rank takes "
                        f"an equal slice of every sequence; use a seq_len that is a multiple of {n}")
    if cfg.train.num_gpus and cfg.train.num_gpus % n:
        problems.append(f"train.num_gpus={cfg.train.num_gpus} must divide by parallel.sequence={n} (the GPUs form "
                        f"groups of {n}); plan for a multiple of {n} GPUs")
    return problems
