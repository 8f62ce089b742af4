"""Micro-batches for this rank from a global sample stream, assembled ahead in a thread.

The stream is a pure function of the global sample index (`source.get(g) -> (tokens, domain)`),
and the only state is how many global samples were consumed. Step s's global batch is samples
[consumed, consumed + global_batch); rank r takes a contiguous slice of it, micro-batch by
micro-batch. The same samples form each global batch whatever the data-parallel size, so a run
can resume on a different number of ranks and see the same data.

A curriculum stage with longer samples (its seq_len = f x train.seq_len) counts each of them as f
global indices (`source.sample_slots`): its micro batch holds micro_batch / f samples of f times the
length, so a step trains the same number of tokens in the same number of micro-batches.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from pretrain.stream import micro_batch_firsts, micro_batch_samples


class SampleSource(Protocol):
    """A global, deterministic sample stream (data.packed.ShuffledDomains, the curriculum's mixer)."""

    domain_names: list[str]

    def get(self, global_index: int) -> tuple[np.ndarray, int]: ...

    def sample_slots(self, global_index: int) -> int:
        """Global indices one sample spans at `global_index` (1 unless a curriculum stage has longer samples)."""


@dataclass
class MicroBatch:
    input_ids: torch.Tensor
    """[micro_batch, seq_len] int64 inputs."""
    labels: torch.Tensor
    """[micro_batch, seq_len] int64 targets (inputs shifted by one)."""
    domains: torch.Tensor
    """[micro_batch] index into the source's domain_names, for per-domain loss."""
    first_sample: int
    """Global index of the first sample (for events and debugging)."""


class BatchLoader:
    """Yields the micro-batches of each optimizer step for one rank."""

    def __init__(self, source: SampleSource, micro_batch: int, grad_accum: int, rank: int, world_size: int,
                 device: torch.device, prefetch: int = 2):
        self.source = source
        self.micro_batch = micro_batch
        self.grad_accum = grad_accum
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.global_batch = micro_batch * grad_accum * world_size
        self.consumed_samples = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ayumi-loader") if prefetch > 0 else None
        self._prefetch = prefetch
        self._pending: dict[int, Future] = {}

    # -- assembly -------------------------------------------------------------------------------
    # The layout (which global indices each micro batch holds) is pretrain/stream.py's, which `ayumi batch` reads too.
    def _assemble(self, first: int) -> tuple[np.ndarray, np.ndarray]:
        indices = micro_batch_samples(self.source, first, self.micro_batch)
        samples, domains = zip(*(self.source.get(index) for index in indices))
        return np.stack(samples).astype(np.int64, copy=False), np.asarray(domains, dtype=np.int64)

    def _step_arrays(self, consumed: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
        out = []
        for first in micro_batch_firsts(consumed, self.rank, self.micro_batch, self.grad_accum):
            tokens, domains = self._assemble(first)
            out.append((first, tokens, domains))
        return out

    def _to_batches(self, arrays) -> list[MicroBatch]:
        batches = []
        pin = self.device.type == "cuda"
        for first, tokens, domains in arrays:
            tensor = torch.from_numpy(tokens)
            if pin:
                tensor = tensor.pin_memory()
            tensor = tensor.to(self.device, non_blocking=True)
            batches.append(MicroBatch(tensor[:, :-1], tensor[:, 1:], torch.from_numpy(domains), first))
        return batches

    def _request(self, consumed: int) -> None:
        if self._pool is not None and consumed not in self._pending:
            self._pending[consumed] = self._pool.submit(self._step_arrays, consumed)

    def next_step(self) -> list[MicroBatch]:
        """The micro-batches of the next optimizer step; advances the position by one global batch."""
        consumed = self.consumed_samples
        future = self._pending.pop(consumed, None)
        arrays = future.result() if future is not None else self._step_arrays(consumed)
        self.consumed_samples += self.global_batch
        # Keep `prefetch` steps in flight ahead of the one just taken.
        for ahead in range(self._prefetch):
            self._request(self.consumed_samples + ahead * self.global_batch)
        return self._to_batches(arrays)

    def skip(self, num_batches: int) -> None:
        """Advance past `num_batches` global batches without reading them."""
        self.consumed_samples += num_batches * self.global_batch
        self._drop_pending()

    def _drop_pending(self) -> None:
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])
        self._drop_pending()

    def close(self) -> None:
        self._drop_pending()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
