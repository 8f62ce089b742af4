"""The run's checkpoints as one set: the long-term ones (`checkpoint.dir`) and the rollback ring beside them.

The ring (`<checkpoint.dir>/recovery`) holds cheap, frequent checkpoints (`stability.recovery.ring_interval`)
so that a rollback at least `rollback_steps` back is always possible; the stability policy says which of them
a rollback may still need, and the rest are deleted. Both folders are written by the same kind of
`Checkpointer` (same ranks, ZeRO stage, background writes). Every method is called by all ranks together;
deletions happen on rank 0 between barriers, and the list of steps is the same on every rank.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Callable

from pretrain.checkpoint.checkpointer import Checkpointer, complete_tags, step_of, tag_for

RING_DIR = "recovery"


class RunCheckpoints:
    """Long-term checkpoints and the rollback ring; `steps` lists every complete one (identical on all ranks)."""

    def __init__(self, long_term: Checkpointer, is_main: bool, barrier: Callable[[], None],
                 broadcast: Callable[[Any], Any], ring_interval: int = 0,
                 on_change: Callable[[list[int]], None] | None = None):
        self.long_term = long_term
        self.on_change = on_change
        """Told the steps after every change (the stability policy picks rollback targets from them)."""
        self.ring_interval = ring_interval
        """Steps between ring checkpoints; 0 = no ring (recovery off)."""
        self.ring = long_term.sibling(long_term.root / RING_DIR, keep_last=0)
        self._is_main = is_main
        self._barrier = barrier
        self._broadcast = broadcast
        self.steps: list[int] = []

    @property
    def roots(self) -> tuple[Path, Path]:
        return self.long_term.root, self.ring.root

    def refresh(self) -> list[int]:
        """Steps of every complete checkpoint, long-term and ring (rank 0 lists, every rank hears)."""
        steps = None
        if self._is_main:
            steps = sorted({step_of(t) for root in self.roots for t in complete_tags(root)})
        self.steps = self._broadcast(steps)
        if self.on_change is not None:
            self.on_change(self.steps)
        return self.steps

    def save(self, engine, step: int, shared: dict, meta: dict) -> Path:
        path = self.long_term.save(engine, step, shared, meta)
        self.refresh()
        return path

    def save_ring(self, engine, step: int, shared: dict, meta: dict, to_delete: Callable[[list[int]], list[int]]) -> None:
        """A ring checkpoint at `step`; then the ring's checkpoints `to_delete(ring steps)` names are removed."""
        self.ring.save(engine, step, shared, meta)
        if self._is_main:
            for old in to_delete([step_of(tag) for tag in complete_tags(self.ring.root)]):
                shutil.rmtree(self.ring.root / tag_for(old), ignore_errors=True)
        self._barrier()
        self.refresh()

    def ring_due(self, step: int, total_steps: int) -> bool:
        """Whether to save a ring checkpoint after `step` steps (never at the end: the final save covers it)."""
        return self.ring_interval > 0 and step % self.ring_interval == 0 and step < total_steps

    def writing(self) -> bool:
        return self.long_term.pending_step is not None or self.ring.pending_step is not None

    def drain(self, prune: bool = True) -> list[tuple[Path, float]]:
        """Wait for background writes (all ranks); returns the folders published, with the seconds waited."""
        if not self.writing():
            return []
        start = time.perf_counter()
        done = [self.long_term.wait(prune=prune), self.ring.wait(prune=prune)]
        self.refresh()
        return [(path, time.perf_counter() - start) for path in done if path is not None]

    def root_of(self, step: int) -> Path:
        """Where checkpoint `step` lives (the long-term folder wins over the ring)."""
        for root in self.roots:
            if (root / tag_for(step) / "ayumi.json").is_file():
                return root
        raise FileNotFoundError(f"no complete checkpoint for step {step} under {self.long_term.root}")

    def load(self, engine, step: int) -> tuple[Path, dict]:
        root = self.root_of(step)
        shared, _ = self.long_term.load(engine, tag_for(step), root=root)
        return root, shared

    def drop_after(self, step: int) -> None:
        """Delete the checkpoints of an abandoned timeline (later than a rollback's target)."""
        if self._is_main:
            for root in self.roots:
                for tag in complete_tags(root):
                    if step_of(tag) > step:
                        shutil.rmtree(root / tag, ignore_errors=True)
        self._barrier()
        self.refresh()
