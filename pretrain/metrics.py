"""Metrics out of the trainer: console lines, `metrics.jsonl`, `events.jsonl`, and W&B.

This is the only module that imports `wandb` (docs/design.md). Only rank 0 logs; other ranks get a
`NullLogger`. Metric names carry a prefix per concern (`train/loss`, `opt/lr`, `perf/tokens_per_s`, ...;
the README's "Metrics, W&B and the report" lists them) so W&B groups panels by prefix. A restarted run continues the same W&B run id (kept in the run dir)
and its jsonl files are cut back to the resumed step, so nothing is counted twice.
"""
from __future__ import annotations

import json
import math
import sys
import time
import uuid
from pathlib import Path
from typing import Any, TextIO

from curriculum.plan import human_count as format_count  # noqa: F401  (one number format everywhere)
from pretrain.config import AyumiConfig

METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"
WANDB_ID_FILE = "wandb_run_id"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a run's .jsonl file (METRICS_FILE, EVENTS_FILE) in the order written; a line cut by a crash is
    skipped. The report reads them with its own count of bad lines (pretrain/tools/report/timeline.py)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
EVAL_CURVE_FILE = "eval/downstream.json"
"""Where `ayumi eval RUN_DIR --all` writes the run's downstream curve (every checkpoint scored after training),
relative to the run dir; `ayumi report` reads it back."""
# Events worth a W&B alert (an e-mail/Slack ping when the run is online).
ALERT_EVENTS = {"spike": "WARN", "rollback": "WARN", "recovered": "INFO", "loss_scale_reset": "WARN",
                "loss_scale_alarm": "WARN", "stop": "ERROR", "stability_stop": "ERROR", "checkpoint_corrupt": "WARN"}
EVENT_COLUMNS = ["step", "tokens", "event", "message"]
LOGGED_AT_STEP = "logged_at_step"
"""An event's field when its `step` names another step than the run's when it was written (a damaged checkpoint's
own step, logged where the run resumed): the run's step then. Cutting events.jsonl back on a resume and W&B's step
go by it, so such an event stays with the stretch of the run that wrote it."""


def format_duration(seconds: float) -> str:
    """`4.2s`, `12s`, `3m05s`, `2h07m`: tenths below ten seconds, whole units above."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    if seconds < 10:  # rounded to whole seconds, a short span reads as none ("41.6% of the run ... 0s in all")
        return f"{seconds:.1f}s"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def console_line(step: int, total_steps: int, metrics: dict[str, Any], eta_s: float) -> str:
    """One progress line: readable in a terminal and greppable in a log file."""
    width = len(str(total_steps))
    parts = [f"step {step:>{width}}/{total_steps}"]
    if "train/loss" in metrics:
        parts.append(f"loss {metrics['train/loss']:.4f}")
    if "opt/lr" in metrics:
        parts.append(f"lr {metrics['opt/lr']:.2e}")
    if metrics.get("opt/grad_norm") is not None:
        parts.append(f"gnorm {metrics['opt/grad_norm']:.3f}")
    if metrics.get("opt/loss_scale") is not None:
        parts.append(f"scale {metrics['opt/loss_scale']:.0f}")
    if "perf/tokens_per_s" in metrics:
        parts.append(f"{format_count(metrics['perf/tokens_per_s'])} tok/s")
    if metrics.get("perf/mfu") is not None:
        parts.append(f"mfu {100 * metrics['perf/mfu']:.1f}%")
    if "perf/step_time" in metrics:
        parts.append(f"{metrics['perf/step_time']:.3f} s/step")
    if "tokens" in metrics:
        parts.append(f"{format_count(metrics['tokens'])} tok")
    parts.append(f"ETA {format_duration(eta_s)}")
    return " | ".join(parts)


def truncate_jsonl(path: Path, max_step: int) -> None:
    """Keep only the records with step <= max_step (a resumed run rewrites what follows)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if timeline_step(json.loads(line)) <= max_step:
                kept.append(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


def timeline_step(record: dict[str, Any]) -> int:
    """The run's step when a metrics or events record was written: its `step`, or LOGGED_AT_STEP when it has one."""
    return int(record.get(LOGGED_AT_STEP, record.get("step", 0)))


class NullLogger:
    """What ranks other than 0 get: every call does nothing."""

    def log(self, step: int, metrics: dict[str, Any], console: bool = True) -> None: ...
    def event(self, kind: str, step: int, tokens: int, message: str = "", **fields: Any) -> None: ...
    def histogram(self, step: int, name: str, counts, edges) -> None: ...
    def info(self, message: str) -> None: ...
    def set_progress(self, total_steps: int, start_step: int) -> None: ...
    def summary(self, values: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class MetricsLogger(NullLogger):
    """Rank 0's logger: console, jsonl files, and optionally W&B."""

    def __init__(self, cfg: AyumiConfig, run_dir: Path, resolved_config: dict[str, Any], resume_step: int | None,
                 stream: TextIO | None = None):
        self.cfg = cfg
        self.run_dir = run_dir
        self.stream = stream or sys.stdout
        if resume_step is not None:
            truncate_jsonl(run_dir / METRICS_FILE, resume_step)
            truncate_jsonl(run_dir / EVENTS_FILE, resume_step)
        self._metrics = open(run_dir / METRICS_FILE, "a", buffering=1)
        self._events = open(run_dir / EVENTS_FILE, "a", buffering=1)
        self._wandb_run = self._start_wandb(resolved_config) if cfg.logging.wandb.enabled else None
        self._total_steps = 0
        self._start_step = 0
        self._start_time = time.perf_counter()
        self._last_step = -1
        self._wandb_step = -1
        self._event_rows: list[list[Any]] = []

    def _wandb_step_for(self, step: int) -> int:
        """W&B needs a step that never decreases; after a rollback the trainer's step does."""
        if step != self._last_step:
            self._wandb_step = max(step, self._wandb_step + 1)
            self._last_step = step
        return self._wandb_step

    def _start_wandb(self, resolved_config: dict[str, Any]):
        import wandb

        settings = self.cfg.logging.wandb
        if settings.mode == "disabled":
            return None
        id_file = self.run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        return wandb.init(
            project=settings.project, entity=settings.entity, group=settings.group, tags=list(settings.tags),
            name=settings.name or self.cfg.name, id=run_id, resume="allow", mode=settings.mode,
            dir=str(self.run_dir), config=resolved_config,
            # ayumi prints its own progress; W&B capturing stdout would duplicate and slow it.
            settings=wandb.Settings(console="off", quiet=True, x_disable_stats=False),
        )

    def set_progress(self, total_steps: int, start_step: int) -> None:
        self._total_steps = total_steps
        self._start_step = start_step
        self._start_time = time.perf_counter()

    def _eta(self, step: int) -> float:
        done = step - self._start_step
        if done <= 0:
            return float("nan")
        per_step = (time.perf_counter() - self._start_time) / done
        return per_step * (self._total_steps - step)

    def log(self, step: int, metrics: dict[str, Any], console: bool = True) -> None:
        clean = {key: value for key, value in metrics.items() if value is not None}
        self._metrics.write(json.dumps({"step": step, **clean}) + "\n")
        if self._wandb_run is not None:
            self._wandb_run.log({**clean, "trainer/step": step}, step=self._wandb_step_for(step))
        if console and self.cfg.logging.console:
            self.info(console_line(step, self._total_steps, clean, self._eta(step)))

    def event(self, kind: str, step: int, tokens: int, message: str = "", **fields: Any) -> None:
        record = {"step": step, "tokens": tokens, "event": kind, "message": message, **fields,
                  "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        self._events.write(json.dumps(record, default=str) + "\n")
        logged_at = timeline_step(record)
        where = f"logged at step {logged_at}, " if logged_at != step else ""
        self.info(f"[event] {kind} at step {step} ({where}{format_count(tokens)} tokens)"
                  f"{': ' + message if message else ''}")
        if self._wandb_run is not None:
            self._wandb_event(kind, step, tokens, message, logged_at)

    def _wandb_event(self, kind: str, step: int, tokens: int, message: str, logged_at: int) -> None:
        import wandb

        self._event_rows.append([step, tokens, kind, message])
        # The whole table each time: W&B shows the latest version of a logged table.
        self._wandb_run.log({f"events/{kind}": 1, "events/table": wandb.Table(columns=EVENT_COLUMNS,
                                                                              data=self._event_rows)},
                            step=self._wandb_step_for(logged_at))  # W&B's steps follow the run's
        if kind in ALERT_EVENTS:
            try:
                self._wandb_run.alert(title=f"ayumi {self.cfg.name}: {kind} at step {step}", text=message or kind,
                                      level=getattr(wandb.AlertLevel, ALERT_EVENTS[kind]))
            except Exception as err:  # alerts need a live connection; offline runs keep the event row
                self.info(f"(W&B alert not sent: {err})")

    def histogram(self, step: int, name: str, counts, edges) -> None:
        if self._wandb_run is not None:
            import wandb

            self._wandb_run.log({name: wandb.Histogram(np_histogram=(counts, edges))},
                                step=self._wandb_step_for(step))

    def info(self, message: str) -> None:
        print(message, file=self.stream, flush=True)

    def summary(self, values: dict[str, Any]) -> None:
        if self._wandb_run is not None:
            for key, value in values.items():
                self._wandb_run.summary[key] = value

    def close(self) -> None:
        self._metrics.close()
        self._events.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
