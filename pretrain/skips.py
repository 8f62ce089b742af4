"""Skipped data: the global sample ranges a recovery skipped, so that they are never trained on.

A rollback skips the batches around a spike (`stability.recovery.skip_batches`). The ranges live in the
global sample index space, in the checkpoint (the trainer's shared state) and also in the run dir
(`skipped_samples.json`, rank 0 writes it), so that resuming from a checkpoint older than a skip still jumps
over the skipped batches when the stream reaches them. The curriculum's mixer holds the same ranges, so its
cursors and stage boundaries do not move (the data after a skip is what it would have been).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from curriculum.mixer import SkipLedger, batches_due, merge_ranges

LEDGER_FILE = "skipped_samples.json"


class SkippedData:
    """The run's skipped ranges, the loader that moves past them and the ledger that keeps them."""

    def __init__(self, run_dir: Path, loader, mixer, is_main: bool):
        self.loader = loader
        self.mixer = mixer
        self.is_main = is_main
        self.ledger = SkipLedger(Path(run_dir) / LEDGER_FILE)
        self.ranges: list[tuple[int, int]] = [tuple(r) for r in self.ledger.load()]
        if mixer is not None:
            mixer.add_skips(self.ranges)

    def add(self, ranges: Iterable) -> None:
        """Merge `ranges` (from a checkpoint, or a new skip) into the run's, the mixer's included."""
        self.ranges = [tuple(r) for r in merge_ranges([*self.ranges, *[tuple(r) for r in ranges]])]
        if self.mixer is not None:
            self.mixer.add_skips(self.ranges)

    def due(self) -> int:
        """Global batches to skip now: the stream has reached a recorded range (after restoring an older position)."""
        return batches_due(self.ranges, self.loader.consumed_samples, self.loader.global_batch)

    def skip(self, num_batches: int) -> tuple[int, int, list]:
        """Move the stream past `num_batches` global batches: (first sample, end sample, the mixer's events)."""
        start = self.loader.consumed_samples
        self.loader.skip(num_batches)
        self.ranges = [tuple(r) for r in merge_ranges([*self.ranges, (start, self.loader.consumed_samples)])]
        events = self.mixer.skip(num_batches) if self.mixer is not None else []  # records the range in the mixer
        if self.is_main:
            self.ledger.save([list(r) for r in self.ranges])
        return start, self.loader.consumed_samples, events

    def forget_from(self, position: int) -> None:
        """Drop every range from stream `position` on, the mixer's too (a replay arm trains what it is fed: the
        spike's batches may lie in a range a later rollback skipped). The ledger on disk is the run's, untouched."""
        self.ranges = [r for r in self.ranges if r[1] <= position]
        if self.mixer is not None:
            self.mixer.skips = list(self.ranges)

    def state(self) -> list[list[int]]:
        return [list(r) for r in self.ranges]
