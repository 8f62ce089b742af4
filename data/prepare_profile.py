"""Where `ayumi data prepare`'s wall time goes, when asked: AYUMI_PREPARE_PROFILE=FILE.

Off by default (a null profile whose methods return at once). When the variable names a file, the run
writes there, as JSON, the parent's phases (start, the stream of chunks, finishing domains, closing
the pool, the overlap check and manifest), how the parent spent the stream (reading: cutting plain
jsonl into ranges, reading compressed files and other formats; waiting on workers; routing and
writing), and per worker the seconds it worked, its CPU seconds and its idle time. Idle is the time
between its items: sending a result, waiting for the next item. Workers note when each item
ran (the monotonic clock, shared by every process of the machine); the parent adds it up.
`bench/data_prepare_peers.py --profile` prints it for 1 and 2 workers.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

PROFILE_ENV = "AYUMI_PREPARE_PROFILE"


def timed_call(function, *args):
    """Run one work item in a worker and attach when it ran: (pid, start, end, CPU seconds)."""
    start, cpu = time.monotonic(), time.process_time()
    result = function(*args)
    return result._replace(timing=(os.getpid(), start, time.monotonic(), time.process_time() - cpu))


class PrepareProfile:
    """The counters of one run; every method does nothing unless `path` is set."""

    def __init__(self, path: str | None):
        self.path = path
        self.enabled = bool(path)
        self.started = time.monotonic()
        self.phases: dict[str, float] = {}
        self.stream: dict[str, float] = {"reading": 0.0, "waiting_on_workers": 0.0}
        self.items: list[tuple] = []  # (pid, start, end, cpu) per work item

    @classmethod
    def from_env(cls) -> "PrepareProfile":
        return cls(os.environ.get(PROFILE_ENV) or None)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Add the block's wall seconds to the phase `name`."""
        if not self.enabled:
            yield
            return
        start = time.monotonic()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.monotonic() - start

    def add(self, counter: str, seconds: float) -> None:
        """Add seconds to one of the stream's counters (reading, waiting_on_workers)."""
        if self.enabled:
            self.stream[counter] += seconds

    def item(self, timing: tuple | None) -> None:
        """Note one work item's timing (from timed_call)."""
        if self.enabled and timing is not None:
            self.items.append(timing)

    def summary(self) -> dict:
        """The figures written to the file: seconds, from the run's start."""
        wall = time.monotonic() - self.started
        workers = {}
        for pid, start, end, cpu in self.items:
            worker = workers.setdefault(pid, {"items": 0, "busy": 0.0, "cpu": 0.0, "first": start, "last": end})
            worker["items"] += 1
            worker["busy"] += end - start
            worker["cpu"] += cpu
            worker["first"], worker["last"] = min(worker["first"], start), max(worker["last"], end)
        rows = [{"items": w["items"], "busy": w["busy"], "cpu": w["cpu"], "first_item_at": w["first"] - self.started,
                 "idle_between_items": w["last"] - w["first"] - w["busy"], "done_at": w["last"] - self.started}
                for w in workers.values()]
        stream = {**self.stream, "finishing_domains": self.phases.get("finishing_domains", 0.0)}
        if "stream" in self.phases:  # the rest of the stream is the parent's routing and writing
            stream["routing_and_writing"] = self.phases["stream"] - sum(stream.values())
        return {"wall": wall, "phases": self.phases, "stream": stream, "workers": rows}

    def write(self) -> None:
        """Write the summary to the file named by AYUMI_PREPARE_PROFILE (nothing when off)."""
        if self.enabled:
            Path(self.path).write_text(json.dumps(self.summary(), indent=1) + "\n", encoding="utf-8")
