"""Ranks stop when their launcher is gone: no rank trains on as an orphan.

`kill -9` of `ayumi train`, `torchrun` or the `deepspeed` launcher (or a SIGTERM to the `deepspeed`
runner, which has no handler and dies at once) used to leave every rank training to the end of the
run, beside any job a scheduler started in its place. Each rank now watches the chain of launcher
processes above it (its parent and the ancestors above that whose command line names a launcher:
`deepspeed`, `torchrun`/`torch.distributed.run`, `ayumi`/`pretrain.tools.launch`), once a second from a
daemon thread. When one of them is gone (or its pid now belongs to another process), the rank
requests a stop exactly as SIGTERM does: all ranks agree at the next step, save, and exit 0. A
parent-death signal (prctl) would see only the direct parent, which for the `deepspeed` launcher is
its per-node `launch.py`, still alive after the runner above it was killed.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Callable

import psutil

LAUNCHER_MARKERS = ("deepspeed", "torchrun", "torch.distributed.run", "torch.distributed.launch", "ayumi",
                    "pretrain.tools.launch", "pretrain.tools.cli")
"""A command line with one of these names a launcher a rank depends on."""
POLL_SECONDS = 1.0


@dataclass(frozen=True)
class Watched:
    pid: int
    created: float
    name: str

    def alive(self) -> bool:
        try:
            return psutil.Process(self.pid).create_time() == self.created
        except psutil.Error:  # gone (or a zombie nobody reaps)
            return False


def _describe(process: psutil.Process) -> str:
    try:
        words = [os.path.basename(word) for word in process.cmdline()[:3]]
        return " ".join(words) or process.name()
    except psutil.Error:
        return str(process.pid)


def _is_launcher(process: psutil.Process) -> bool:
    try:
        command = " ".join(process.cmdline())
    except psutil.Error:
        return False
    return any(marker in command for marker in LAUNCHER_MARKERS)


def launcher_chain(process: psutil.Process | None = None) -> list[Watched]:
    """The parent, then each ancestor above it while it is a launcher (the chain a rank depends on)."""
    process = process or psutil.Process()
    chain: list[Watched] = []
    for index, ancestor in enumerate(process.parents()):
        if ancestor.pid <= 1 or (index > 0 and not _is_launcher(ancestor)):
            break
        try:
            chain.append(Watched(ancestor.pid, ancestor.create_time(), _describe(ancestor)))
        except psutil.Error:
            break
    return chain


class LauncherWatch:
    """Calls `on_gone(reason)` once, from a daemon thread, when a watched launcher process is gone."""

    def __init__(self, on_gone: Callable[[str], None], chain: list[Watched] | None = None,
                 poll_seconds: float = POLL_SECONDS):
        self.chain = launcher_chain() if chain is None else chain
        self._on_gone = on_gone
        self._poll = poll_seconds
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ayumi-launcher-watch", daemon=True)

    def start(self) -> "LauncherWatch":
        if self.chain:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self._poll):
            for watched in self.chain:
                if not watched.alive():
                    self._on_gone(f"its launcher {watched.name!r} (pid {watched.pid}) is gone")
                    return
