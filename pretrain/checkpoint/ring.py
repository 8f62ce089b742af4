"""The run's checkpoints as one set: the long-term ones (`checkpoint.dir`) and the rollback ring beside them.

The ring (`<checkpoint.dir>/recovery`) holds cheap, frequent checkpoints (`stability.recovery.ring_interval`)
so that a rollback at least `rollback_steps` back is always possible; the stability policy says which of them
a rollback may still need, and the rest are deleted. Both folders are written by the same kind of
`Checkpointer` (same ranks, ZeRO stage, background writes). Every method is called by all ranks together;
deletions happen on rank 0 between barriers, and the list of steps is the same on every rank.

A rollback's checkpoint is verified like a resume's (pretrain/checkpoint/trust.py): a damaged one is set aside and
the newest older one that verifies is loaded instead. Right after a resume, while a stop would blame the checkpoint
resumed from, keep_last deletes nothing, and such a stop keeps nothing of the state (`discard_if_blamed`).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from common.files import write_text_atomic
from pretrain.checkpoint import paths
from pretrain.checkpoint.checkpointer import LATEST, Checkpointer, complete_tags, step_of, tag_for
from pretrain.checkpoint.layout import RING_DIR
from pretrain.checkpoint.trust import OWN_FIX, Loaded, load_trusted


class RunCheckpoints:
    """Long-term checkpoints and the rollback ring; `steps` lists every complete one (identical on all ranks)."""

    def __init__(self, long_term: Checkpointer, is_main: bool, barrier: Callable[[], None],
                 broadcast: Callable[[Any], Any], ring_interval: int = 0, stability=None, on_corrupt: str = "fallback"):
        self.long_term = long_term
        self.stability = stability
        """The run's stability machinery (pretrain.stability.recovery.StabilityMonitor): told the steps after every
        change (it picks rollback targets from them), asked which checkpoints keep_last must keep, and whether a stop
        blames the checkpoint the run resumed from."""
        self.on_corrupt = on_corrupt
        """checkpoint.on_corrupt: what a rollback does when its checkpoint is damaged."""
        self.resumed: Loaded | None = None
        """The checkpoint this session resumed from (note_resume)."""
        self.ring_interval = ring_interval
        """Steps between ring checkpoints; 0 = no ring (recovery off)."""
        self.ring = long_term.sibling(long_term.root / RING_DIR, keep_last=0)
        if stability is not None:
            long_term.protect = lambda step, steps: stability.policy.protected_checkpoints(step, steps, ring_interval > 0)
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
        if self.stability is not None:
            self.stability.set_checkpoints(self.steps)
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
                paths.discard(self.ring.root, self.ring.root / tag_for(old))
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

    def load(self, engine, step: int) -> Loaded:
        """Load checkpoint `step` for a rollback, verified and checked. A damaged one is set aside and the newest
        older one that verifies (and was not taken during an outlier episode: never a rollback target) is loaded
        instead (checkpoint.on_corrupt=fallback), or the run refused (refuse)."""
        bad = self.stability.policy.is_bad_checkpoint if self.stability is not None else (lambda older: False)
        steps = [step] + [older for older in reversed(self.steps) if older < step and not bad(older)]
        loaded = load_trusted(self.long_term, engine, [(self.root_of(k), tag_for(k)) for k in steps],
                              fallback=self.on_corrupt == "fallback", fix=OWN_FIX)
        if loaded.notes:
            self.refresh()
        return loaded

    def note_resume(self, loaded: Loaded) -> None:
        """This session resumed from `loaded` (the stability machinery hears of it too)."""
        self.resumed = loaded
        if self.stability is not None:
            self.stability.policy.note_resume(loaded.step, str(loaded.path))

    def discard_if_blamed(self, step: int) -> bool:
        """At a stability stop after `step` steps: when the stop blames the checkpoint the run resumed from, keep
        nothing of this state (no save; checkpoints written since the resume deleted; `latest` names that checkpoint
        again), so a damaged state never becomes the run's future. True when it did so."""
        if self.resumed is None or self.stability is None or not self.stability.policy.blames_checkpoint(step - 1):
            return False
        self.drain(prune=False)
        self.drop_after(self.resumed.step)
        if self._is_main and self.resumed.root == self.long_term.root:
            write_text_atomic(self.long_term.root / LATEST, self.resumed.tag + "\n")
        self._barrier()
        return True

    def drop_after(self, step: int) -> None:
        """Delete the checkpoints of an abandoned timeline (later than a rollback's target)."""
        if self._is_main:
            for root in self.roots:
                for tag in complete_tags(root):
                    if step_of(tag) > step:
                        paths.discard(root, root / tag)
        self._barrier()
        self.refresh()
