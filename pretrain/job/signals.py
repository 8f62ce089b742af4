"""How a job is asked to stop: SIGTERM/SIGINT, or the launcher gone.

`StopSignal` records the request; the trainer finishes its step, saves, and exits 0 (after all ranks agree
to stop, so every rank saves the same step). A second Ctrl-C means "now". The launcher watch
(`launcher_watch.py`) asks for the same stop when the process that started this rank has died.
"""
from __future__ import annotations

import signal
from typing import Any


from pretrain.job.launcher_watch import LauncherWatch


class StopSignal:
    """Records SIGTERM/SIGINT (or a launcher gone, pretrain/job/launcher_watch.py); the trainer finishes the
    step, saves, and exits 0."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.reason = ""
        """Why the stop was requested, for the event."""
        self._previous: dict[int, Any] = {}
        self._watch: LauncherWatch | None = None

    def install(self, handle_signals: bool = True) -> None:
        """Watch the launcher always; take over SIGTERM/SIGINT when `handle_signals` (checkpoint.save_on_signal)."""
        if handle_signals:
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        self._watch = LauncherWatch(self.request).start()

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C means "now"
        self.received = signum
        self.reason = f"{signal.Signals(signum).name} received"

    def request(self, reason: str) -> None:
        """Stop as on SIGTERM, for `reason` (called from the launcher watch's thread)."""
        if self.received is None:
            self.received = signal.SIGTERM
            self.reason = reason

    def restore(self) -> None:
        if self._watch is not None:
            self._watch.stop()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
