"""One job per run dir: a lock file that names its holder, and stale locks that are noticed.

Two jobs on one run dir (a requeued job beside the old one still running, the same `name=` started
twice) would interleave checkpoints, metrics and `latest`. The first job's rank 0 creates
`RUN_DIR/.ayumi.lock` exclusively (O_EXCL) with its host, pid, the process's start time and the
command; a second job refuses to start, naming the holder. The holder refreshes the file's time
every minute while it runs and removes it when it ends (however it ends, short of kill -9).

A lock left by a killed job is stale and taken over with a note: on the same host when its pid is
gone or now belongs to a process started at another time; on another host (a cluster's shared
filesystem) when it was not refreshed for `STALE_AFTER_S` — ten refresh periods.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import psutil

LOCK_NAME = ".ayumi.lock"
BOOKKEEPING = {"hang"}
"""What a job writes into its run dir before it has checked its plan (the hang watchdog's heartbeats)."""
REFRESH_S = 60.0
STALE_AFTER_S = 600.0


class RunDirLocked(RuntimeError):
    """Another live job holds the run dir."""


def _me() -> dict:
    process = psutil.Process()
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": process.create_time(),
            "command": " ".join(process.cmdline()[:6])[:300], "locked_at": time.strftime("%Y-%m-%dT%H:%M:%S")}


def read_lock(run_dir: Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / LOCK_NAME).read_text())
    except (FileNotFoundError, json.JSONDecodeError, OSError):
        return None


def stale_reason(holder: dict, lock_path: Path) -> str | None:
    """Why the lock's holder is gone (None: it may still run)."""
    if holder.get("host") == socket.gethostname():
        try:
            if psutil.Process(int(holder["pid"])).create_time() == holder.get("started"):
                return None
        except (psutil.Error, KeyError, ValueError, TypeError):
            pass
        return f"pid {holder.get('pid')} is no longer running on {holder.get('host')}"
    try:
        age = time.time() - lock_path.stat().st_mtime
    except OSError:
        return "the lock vanished"
    return f"not refreshed for {age:.0f} s (held on {holder.get('host')})" if age > STALE_AFTER_S else None


def holder_text(holder: dict) -> str:
    return (f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('locked_at')} "
            f"({holder.get('command', '?')})")


def check_unlocked(run_dir: Path) -> str | None:
    """The problem when a live job holds `run_dir` (for `ayumi train` before it starts anything)."""
    lock = Path(run_dir) / LOCK_NAME
    holder = read_lock(run_dir)
    if holder is None or stale_reason(holder, lock) is not None:
        return None
    return locked_message(run_dir, holder)


def locked_message(run_dir: Path, holder: dict) -> str:
    return (f"run dir {run_dir} is in use by another job: {holder_text(holder)}. Wait for it to end, stop it, or "
            f"start this one under another name= (if that job is gone, delete {Path(run_dir) / LOCK_NAME})")


class RunDirLock:
    """Held by rank 0 for the job's lifetime: `acquire()` then `release()` (also a context manager)."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.note = ""
        """What happened to a stale lock this one replaced (empty when none)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._created_dir = False

    def acquire(self) -> "RunDirLock":
        self._created_dir = not self.run_dir.exists()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # a stale lock removed by us or another starter: try again
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = read_lock(self.run_dir) or {}
                reason = stale_reason(holder, self.path) if holder else "unreadable"
                if reason is None:
                    raise RunDirLocked(locked_message(self.run_dir, holder)) from None
                self.note = f"took over a stale lock of {holder_text(holder)}: {reason}"
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as handle:
                handle.write(json.dumps(_me()) + "\n")
            self._thread = threading.Thread(target=self._refresh, name="ayumi-run-lock", daemon=True)
            self._thread.start()
            return self
        raise RunDirLocked(f"could not lock {self.path}: other jobs keep taking it")

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        holder = read_lock(self.run_dir)
        if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            self.path.unlink(missing_ok=True)
            if self._created_dir and {p.name for p in self.run_dir.iterdir()} <= BOOKKEEPING:
                # A start refused before anything was written (the plan, the data) leaves nothing behind.
                shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
