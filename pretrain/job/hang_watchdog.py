"""Hang watchdog: a job whose ranks stop making progress ends itself with a report, instead of waiting
inside a collective until the process-group timeout (tens of minutes) with nothing said.

Mechanism (policy lives in `HangConfig`):
- The trainer calls `beat(step, phase)` as it goes (each step, before the step's all-reduce, around
  checkpoints and evaluation). That only stores two numbers.
- A daemon thread per rank writes `RUN_DIR/hang/heartbeat_rankNNNNN.json` every few seconds (host, pid,
  step, phase, when it last made progress, when the thread last ran) and compares the time since this
  rank's last progress with the timeout: `hang.timeout_s`, or when 0, max(`min_timeout_s`, 20 x the
  median step time); `checkpoint_timeout_s` while saving and `startup_timeout_s` before the first step
  ends (compilation, the first batch). A rank blocked in a collective keeps its thread running (the
  collectives release the GIL), so every rank still alive notices at about the same moment. In those
  longer phases the step timeout applies as soon as another rank's thread has been silent that long
  (that rank is stopped or dead, and the save or evaluation cannot end).
- On a timeout a rank dumps its own Python stack (faulthandler), and the first rank there writes the
  report. It waits for the stacks of the ranks that did not arrive, which their own watchdogs dump (a
  SIGSTOPped rank on its host is resumed with SIGCONT so its watchdog can; the job ends right after
  anyway); a rank on its host whose stack does not appear is asked with SIGUSR2, on which faulthandler
  writes it from the signal handler. The report, `RUN_DIR/hang/report.txt`, holds every rank's host,
  pid, last step and phase, seconds since its progress and since its thread last ran, its process
  state, which ranks did not arrive, and the stacks. It appends a `hang` event to events.jsonl and
  exits with EXIT_HANG, which schedulers can requeue on; a restart resumes from the last checkpoint.
  On NCCL the launcher scripts also make torch dump its flight recorder on timeout
  (`TORCH_NCCL_TRACE_BUFFER_SIZE`, launch/env.sh).
- `process_group_timeout_s` is what the trainer gives `init_process_group`: longer than every watchdog
  timeout, so the watchdog always speaks first.
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import statistics
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from common.status import HANG
from pretrain.job.exit_status import record_exit
from pretrain.ranges import Range, at_least

EXIT_HANG = HANG
"""Exit status of a rank the watchdog ended (common/status.py: every ayumi command's statuses)."""
HANG_DIR = "hang"
REPORT = "report.txt"
DUMP_SIGNAL = signal.SIGUSR2
REPORTER_GRACE_S = 5.0
"""A rank that does not write the report waits this long before leaving, so the report can gather its stack."""


@dataclass
class HangConfig:
    """The hang and straggler watchdog (pretrain/job/hang_watchdog.py)."""

    enabled: bool = True
    """Watch every rank's progress and end a hung job with a report and exit status 4."""
    timeout_s: float = 0.0
    """Seconds without progress that make a hang; 0 = max(min_timeout_s, 20 x the median step time)."""
    min_timeout_s: float = 300.0
    """The smallest automatic timeout (torchtitan aborts after 100 s; a busy cluster's I/O can stall longer)."""
    startup_timeout_s: float = 1800.0
    """The timeout until the first step ends (compilation, the first batch, loading a checkpoint)."""
    checkpoint_timeout_s: float = 1800.0
    """The timeout while a checkpoint is being saved or loaded (a 70B model's save takes minutes)."""
    heartbeat_s: float = 5.0
    """How often each rank's thread writes its heartbeat file and checks the timeout."""
    straggler_interval: int = 50
    """Every this many steps, per-rank step times (min/median/max, slowest rank) go to metrics; 0 = off."""
    straggler_ratio: float = 1.5
    """A rank whose time is at least this many times the median is slow..."""
    straggler_reports: int = 3
    """...and an event when it is the slow one this many reports in a row."""
    inject_delay_s: float = 0.0
    """Fault drill: rank inject_rank sleeps this long in every step (makes a straggler); 0 = off."""
    inject_rank: int = 1
    """Fault drill: the rank inject_delay_s slows down."""

    RANGES: ClassVar[dict[str, Range]] = {
        "timeout_s": at_least(0, "0 = automatic"), "min_timeout_s": at_least(1), "startup_timeout_s": at_least(1),
        "checkpoint_timeout_s": at_least(1), "heartbeat_s": at_least(0.1), "straggler_interval": at_least(0, "0 = off"),
        "straggler_ratio": at_least(1), "straggler_reports": at_least(1), "inject_delay_s": at_least(0),
        "inject_rank": at_least(0),
    }
    """Allowed values, checked before any rank starts (pretrain/ranges.py)."""


def process_group_timeout_s(cfg: HangConfig) -> float:
    """The collectives' own timeout: beyond every watchdog timeout, so the watchdog always ends a hang first."""
    longest = max(cfg.timeout_s, cfg.min_timeout_s, cfg.startup_timeout_s, cfg.checkpoint_timeout_s)
    return longest + 600.0


class HangWatchdog:
    """One per rank; `start()` once the process group exists, `beat()` from the trainer, `stop()` at the end."""

    def __init__(self, cfg: HangConfig, run_dir: Path, rank: int, world_size: int):
        self.cfg = cfg
        self.dir = Path(run_dir) / HANG_DIR
        self.run_dir = Path(run_dir)
        self.rank, self.world_size = rank, world_size
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._step, self._phase = 0, "startup"
        self._progress_mono, self._progress_wall = time.monotonic(), time.time()
        self._step_times: deque[float] = deque(maxlen=50)
        self._last_train_beat: tuple[int, float] | None = None
        self._first_step_done = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ayumi-hang-watchdog", daemon=True)
        self._stack_file = None

    # -- the trainer's side -------------------------------------------------------------------------
    def start(self) -> "HangWatchdog":
        if not self.cfg.enabled:
            return self
        self.dir.mkdir(parents=True, exist_ok=True)
        report = self.dir / REPORT
        if self.rank == 0 and report.exists():  # an earlier job's hang: keep it, under its own time
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(report.stat().st_mtime))
            report.rename(report.with_name(f"report_{stamp}.txt"))
        self._stack_file = open(self.stack_path(self.rank), "w")
        faulthandler.register(DUMP_SIGNAL, file=self._stack_file, all_threads=True)
        self._write_heartbeat()
        self._thread.start()
        return self

    def beat(self, step: int, phase: str) -> None:
        """Progress: `phase` of step `step` has begun ("train step" starts a step; the step times come from those)."""
        now = time.monotonic()
        if phase == "train step":
            last = self._last_train_beat
            if last is not None and step == last[0] + 1:
                self._step_times.append(now - last[1])
                self._first_step_done = True
            self._last_train_beat = (step, now)
        self._step, self._phase = step, phase
        self._progress_mono, self._progress_wall = now, time.time()

    @contextmanager
    def phase(self, step: int, name: str):
        """A phase with its own timeout (checkpoint save/load, evaluation); progress again when it ends."""
        previous = self._phase
        self.beat(step, name)
        try:
            yield
        finally:
            self._phase = previous
            self._progress_mono, self._progress_wall = time.monotonic(), time.time()
            self._last_train_beat = None  # the next step's time would include this phase

    def stop(self) -> None:
        self._stop.set()
        if self._stack_file is not None:
            faulthandler.unregister(DUMP_SIGNAL)
            self._stack_file.close()
            self._stack_file = None

    # -- the thread -----------------------------------------------------------------------------------
    def timeout(self) -> float:
        """The current phase's timeout: checkpoints, start-up and evaluation have their own, longer ones."""
        cfg = self.cfg
        if "checkpoint" in self._phase:
            return cfg.checkpoint_timeout_s
        if not self._first_step_done or "evaluation" in self._phase:  # validation and downstream alike
            return max(cfg.startup_timeout_s, cfg.timeout_s)
        return self.step_timeout()

    def step_timeout(self) -> float:
        """hang.timeout_s, or max(min_timeout_s, 20 x the median step time) (min_timeout_s before a step ends)."""
        cfg = self.cfg
        if cfg.timeout_s > 0:
            return cfg.timeout_s
        return max(cfg.min_timeout_s, 20 * statistics.median(self._step_times or [0.0]))

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.heartbeat_s):
            self._write_heartbeat()
            stalled = time.monotonic() - self._progress_mono
            if stalled > self.timeout() or (stalled > self.step_timeout() and self._peer_silent_for(self.step_timeout())):
                self._hang(stalled)
                return

    def _peer_silent_for(self, limit: float) -> bool:
        """Whether another rank's heartbeat thread has not run for `limit` seconds: that rank is stopped, dead or
        frozen, not slow (a save or an evaluation keeps a live rank's thread beating), so a long phase's timeout
        (a checkpoint's 30 min) need not run out while this rank waits for it in a collective. The heartbeat
        files are read only once this rank has stalled past the step timeout."""
        now = time.time()
        return any(beat and now - beat.get("alive_at", now) > limit
                   for rank, beat in self._heartbeats().items() if rank != self.rank)

    def stack_path(self, rank: int) -> Path:
        return self.dir / f"stack_rank{rank:05d}.txt"

    def heartbeat_path(self, rank: int) -> Path:
        return self.dir / f"heartbeat_rank{rank:05d}.json"

    def _write_heartbeat(self) -> None:
        record = {"rank": self.rank, "host": self.host, "pid": self.pid, "step": self._step, "phase": self._phase,
                  "progress_at": self._progress_wall, "alive_at": time.time()}
        path = self.heartbeat_path(self.rank)
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(record))
            os.replace(tmp, path)
        except OSError:
            pass  # a full or vanished run dir must not kill a training rank

    # -- a hang -----------------------------------------------------------------------------------------
    def _hang(self, stalled: float) -> None:
        """Dump this rank's stack; the first rank to claim the report (a stopped rank resumed to dump its
        stack finds it claimed) gathers the others' and writes it; then leave with EXIT_HANG."""
        # Recorded first, for `ayumi train`: the hang is why the job ends, whatever a rank resumed to dump its
        # stack says later (a stopped rank's save then fails on the connection this one closes).
        record_exit(EXIT_HANG)
        try:
            faulthandler.dump_traceback(file=self._stack_file, all_threads=True)
            self._stack_file.flush()
            report = self._claim_report()
            if report is None:
                # Leaving at once would make the launcher tear the job down while the reporting rank still
                # gathers the stacks (this one's included).
                time.sleep(REPORTER_GRACE_S)
            else:
                beats = self._heartbeats()
                missing = self._not_arrived(beats)
                with os.fdopen(report, "w") as handle:
                    handle.write(self._report_table(stalled, beats, missing))  # on disk before anything else
                    handle.flush()
                    self._gather_stacks(beats, missing)
                    handle.write(self._report_stacks(beats))
                self._append_event(stalled, missing)
        finally:
            os._exit(EXIT_HANG)  # the main thread is stuck in a collective: leave from here

    def _claim_report(self):
        try:
            return os.open(self.dir / REPORT, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return None  # another rank reports (on a shared run dir, possibly on another host)

    def _heartbeats(self) -> dict[int, dict]:
        beats = {}
        for rank in range(self.world_size):
            try:
                beats[rank] = json.loads(self.heartbeat_path(rank).read_text())
            except (OSError, ValueError):
                beats[rank] = {}
        return beats

    def _not_arrived(self, beats: dict[int, dict]) -> list[int]:
        """Ranks whose thread fell silent (stopped, gone) or that are behind the furthest progress."""
        now = time.time()
        furthest = max(((b.get("step", -1), b.get("phase") == "all-reduce") for b in beats.values() if b), default=(0, False))
        missing = []
        for rank, beat in beats.items():
            silent = not beat or now - beat.get("alive_at", 0) > 3 * self.cfg.heartbeat_s
            behind = beat and (beat.get("step", -1), beat.get("phase") == "all-reduce") < furthest
            if silent or behind:
                missing.append(rank)
        return missing

    def _gather_stacks(self, beats: dict[int, dict], missing: list[int]) -> None:
        """Wait for the stacks of the ranks that did not arrive.

        Each rank's own watchdog thread dumps its stack when it sees the stall, from Python with the GIL held,
        so the other threads' frames hold still; a stopped rank on this host is resumed (SIGCONT) so that its
        thread can. Only a rank on this host whose stack has not appeared after a heartbeat and 2 s more is sent
        SIGUSR2, on which faulthandler dumps from the signal handler: the last resort (for a rank whose watchdog
        cannot run), since that dump reads the other threads' frames while they run, and a resumed rank once
        crashed in it (SIGSEGV), which made the launcher end the reporting rank before the report was whole."""
        import psutil

        local = {}
        for rank in missing:
            beat = beats.get(rank) or {}
            if beat.get("host") != self.host or rank == self.rank:
                continue
            try:
                process = psutil.Process(int(beat["pid"]))
                if process.status() == psutil.STATUS_STOPPED:
                    process.send_signal(signal.SIGCONT)
                local[rank] = process
            except (psutil.Error, KeyError, ValueError):
                pass
        waiting = [rank for rank in missing if rank != self.rank]
        deadline = time.monotonic() + self.cfg.heartbeat_s + 2.0
        while waiting and time.monotonic() < deadline:
            time.sleep(0.1)
            waiting = [rank for rank in waiting if not self._has_stack(rank)]
        asked = False
        for rank in waiting:
            try:
                local[rank].send_signal(DUMP_SIGNAL)
                asked = True
            except (KeyError, psutil.Error):
                pass
        time.sleep(2.0 if asked else 0.2)  # the dumps in progress finish

    def _has_stack(self, rank: int) -> bool:
        try:
            return self.stack_path(rank).stat().st_size > 0
        except OSError:
            return False

    def _process_state(self, beat: dict) -> str:
        import psutil

        if not beat:
            return "no heartbeat"
        if beat.get("host") != self.host:
            return f"on {beat.get('host')}"
        try:
            return psutil.Process(int(beat["pid"])).status()
        except psutil.Error:
            return "gone"

    def _report_table(self, stalled: float, beats: dict[int, dict], missing: list[int]) -> str:
        now = time.time()
        lines = [f"ayumi hang report: rank {self.rank} on {self.host} made no progress for {stalled:.0f} s "
                 f"(timeout {self.timeout():.0f} s) in step {self._step}, {self._phase}",
                 f"written {time.strftime('%Y-%m-%dT%H:%M:%S')}; exit status {EXIT_HANG}; restart the job to resume from "
                 "the last checkpoint", "",
                 f"did not arrive: {', '.join(f'rank {r}' for r in missing) or 'none found (every rank waits)'}", "",
                 "rank  host                 pid      step  phase                      progress  thread   state"]
        for rank, beat in sorted(beats.items()):
            progress = f"{now - beat['progress_at']:.0f} s ago" if beat else "-"
            alive = f"{now - beat['alive_at']:.0f} s ago" if beat else "-"
            lines.append(f"{rank:<5} {str(beat.get('host', '?')):<20} {str(beat.get('pid', '?')):<8} "
                         f"{str(beat.get('step', '?')):<5} {str(beat.get('phase', '?')):<26} {progress:<9} {alive:<8} "
                         f"{self._process_state(beat)}")
        return "\n".join(lines) + "\n"

    def _report_stacks(self, beats: dict[int, dict]) -> str:
        lines = []
        for rank in sorted(beats):
            path = self.stack_path(rank)
            text = path.read_text() if path.exists() else ""
            lines += ["", f"--- stack of rank {rank} ({'from ' + path.name if text.strip() else 'not available'})",
                      text.strip()]
        return "\n".join(lines) + "\n"

    def _append_event(self, stalled: float, missing: list[int]) -> None:
        """The `hang` event, written by whichever rank reports (rank 0 may be the one that hangs)."""
        record = {"step": self._step, "tokens": None, "event": "hang",
                  "message": f"no progress for {stalled:.0f} s in step {self._step} ({self._phase}); did not arrive: "
                             f"{missing}; report: {self.dir / REPORT}; exiting with status {EXIT_HANG}",
                  "ranks_missing": missing, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        try:
            with open(self.run_dir / "events.jsonl", "a") as events:
                events.write(json.dumps(record) + "\n")
        except OSError:
            pass
        print(f"[event] hang at step {self._step}: {record['message']}", flush=True)


class StragglerMonitor:
    """Per-rank step times, gathered every `straggler_interval` steps: min/median/max and the slowest rank.

    A rank's own time is what it spends before the step's first collective it cannot pass alone: loading
    its batch and its forward passes (the backward's reductions make every rank wait for the slowest,
    so the step time itself is the same everywhere)."""

    def __init__(self, cfg: HangConfig, gather):
        self.cfg, self._gather = cfg, gather
        self._own: list[float] = []
        self._slow_streak: dict[int, int] = {}

    def record(self, seconds: float) -> None:
        self._own.append(seconds)

    def due(self, step: int) -> bool:
        return self.cfg.straggler_interval > 0 and step > 0 and step % self.cfg.straggler_interval == 0

    def report(self) -> tuple[dict[str, float], str | None]:
        """(metrics, an event message when a rank has been slow straggler_reports times in a row); collective."""
        mine = statistics.median(self._own) if self._own else 0.0
        self._own = []
        times = self._gather(mine)
        median = statistics.median(times)
        slowest = max(range(len(times)), key=lambda r: times[r])
        metrics = {"perf/rank_time_min": min(times), "perf/rank_time_median": median, "perf/rank_time_max": times[slowest],
                   "perf/slowest_rank": float(slowest)}
        slow = {r for r, t in enumerate(times) if median > 0 and t >= self.cfg.straggler_ratio * median}
        self._slow_streak = {r: self._slow_streak.get(r, 0) + 1 for r in slow}
        message = None
        for rank, streak in self._slow_streak.items():
            if streak == self.cfg.straggler_reports:
                message = (f"rank {rank} is a straggler: {times[rank] * 1000:.0f} ms per step of its own work vs a median "
                           f"of {median * 1000:.0f} ms ({times[rank] / median:.1f}x) for {streak} reports in a row")
        return metrics, message
