"""A run's jsonl files read back as one timeline: records, series, stages, abandoned stretches.

Rollbacks: after a spike the trainer reloads an earlier checkpoint, so steps and tokens repeat in
metrics.jsonl (e.g. 154 then 81). Every record that a later rollback replaced is *abandoned*; the
plots draw the continued timeline solid and each abandoned stretch dashed and faded. Summary numbers
(final, best) come from the continued timeline only. A cut last line (a run still writing) is skipped.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.metrics import EVENTS_FILE, METRICS_FILE
CONFIG_FILE = "config.yaml"


class ReportError(Exception):
    """A run dir the report cannot be made from (missing or empty metrics)."""


# -- reading --------------------------------------------------------------------------------------
@dataclass
class JsonlFile:
    rows: list[dict[str, Any]]
    partial_last_line: bool = False
    """The last line did not parse: a run still writing (normal), or a crash mid-write."""
    corrupt_lines: list[int] = field(default_factory=list)
    """1-based numbers of other lines that did not parse (reported, never silently dropped)."""


def read_jsonl(path: Path) -> JsonlFile:
    """Every JSON object line of `path`; a cut last line is skipped, other bad lines are counted."""
    if not path.exists():
        return JsonlFile(rows=[])
    lines = path.read_bytes().decode("utf-8", errors="replace").split("\n")
    out = JsonlFile(rows=[])
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)  # Python's json reads the NaN/Infinity the trainer writes
            if not isinstance(row, dict):
                raise ValueError("not an object")
        except ValueError:
            if number == last:
                out.partial_last_line = True
            else:
                out.corrupt_lines.append(number + 1)
            continue
        out.rows.append(row)
    return out


def read_config(run_dir: Path) -> dict[str, Any]:
    """config.yaml as a dict; {} when absent or unreadable (the report then names the run by its dir)."""
    path = run_dir / CONFIG_FILE
    if not path.exists():
        return {}
    try:
        import yaml

        loaded = yaml.safe_load(path.read_text())
    except Exception:  # a report must not fail on a config it only uses for labels
        return {}
    return loaded if isinstance(loaded, dict) else {}


# -- the timeline: records, rollbacks, abandoned stretches -----------------------------------------
@dataclass
class Record:
    """One metrics.jsonl line placed on the run's timeline."""
    order: int  # position in the file = wall-clock order
    step: int
    tokens: float
    values: dict[str, Any]
    segment: int = 0  # 0, then +1 after every rollback
    abandoned: bool = False  # replaced by a later segment that restarted at or before this step


EVAL_PREFIXES = ("val/", "eval/")
"""Keys of the evaluation rows: validation losses (`val/`) and downstream scores (`eval/`)."""


def is_eval_record(row: dict[str, Any]) -> bool:
    """A validation or downstream row: logged after the train row of its step, with that step (and tokens)."""
    return "train/loss" not in row and any(key.startswith(EVAL_PREFIXES) for key in row)


def is_train_record(row: dict[str, Any]) -> bool:
    # An evaluation row carries `tokens` too: counted as a train row, its step (equal to the last one) would
    # read as a rollback and abandon the train row it follows.
    return ("train/loss" in row or "tokens" in row) and not is_eval_record(row)


def build_timeline(rows: list[dict[str, Any]]) -> list[Record]:
    """Place rows on the timeline: segments split where the step goes back (a rollback)."""
    records: list[Record] = []
    segment_starts = [-math.inf]  # first step of each segment
    last_train_step, last_tokens = None, 0.0
    for order, row in enumerate(rows):
        step = int(row.get("step", 0))
        if is_train_record(row):
            if last_train_step is not None and step <= last_train_step:
                segment_starts.append(step)
            last_train_step = step
            last_tokens = float(row.get("tokens", last_tokens))
        # Evaluation rows follow the train row of their step; older validation rows carry no tokens: theirs.
        records.append(Record(order, step, float(row.get("tokens", last_tokens)), row, len(segment_starts) - 1))
    mark_abandoned(records, segment_starts)
    return records


def mark_abandoned(records: list[Record], segment_starts: list[float]) -> None:
    """A record is abandoned when a later segment restarted at or before its step."""
    # restart_after[k] = the lowest step any segment after k restarted at.
    restart_after = [math.inf] * len(segment_starts)
    for k in range(len(segment_starts) - 2, -1, -1):
        restart_after[k] = min(restart_after[k + 1], segment_starts[k + 1])
    for record in records:
        record.abandoned = record.step >= restart_after[record.segment]


@dataclass
class Series:
    """One metric: the continued timeline, plus the abandoned stretches (each with its branch point)."""
    key: str
    x: np.ndarray
    y: np.ndarray
    steps: np.ndarray
    abandoned: list[tuple[np.ndarray, np.ndarray]]

    def __bool__(self) -> bool:
        return bool(len(self.x) or self.abandoned)

    def finite(self) -> np.ndarray:
        return self.y[np.isfinite(self.y)]


def make_series(records: list[Record], key: str) -> Series:
    """`key` along the timeline, in one pass over the records."""
    kept: list[tuple[float, float, int]] = []
    pieces: list[tuple[np.ndarray, np.ndarray]] = []
    current: list[tuple[float, float]] = []
    for record in records:
        value = record.values.get(key)
        if value is None:
            continue
        if not record.abandoned:
            if current:
                pieces.append(tuple(np.array(col, dtype=float) for col in zip(*current)))
                current = []
            kept.append((record.tokens, float(value), record.step))
            continue
        if not current:  # branch off the last kept point before this stretch, so it reads as a fork
            branch = next((point for point in reversed(kept) if point[2] < record.step), None)
            if branch is not None:
                current.append(branch[:2])
        current.append((record.tokens, float(value)))
    if current:
        pieces.append(tuple(np.array(col, dtype=float) for col in zip(*current)))
    x, y, steps = (np.array(col, dtype=float) for col in zip(*kept)) if kept else (np.array([]),) * 3
    return Series(key, x, y, steps, pieces)


def continued(data: Series) -> Series:
    """The series without its abandoned stretches."""
    return replace(data, abandoned=[])


class Timeline:
    """The records, with each metric's Series built once (a long run has 10^5-10^6 records)."""

    def __init__(self, records: list[Record]):
        self.records = records
        self.keys = {key for record in records for key in record.values}
        self._series: dict[str, Series] = {}

    def series(self, key: str) -> Series:
        if key not in self._series:
            self._series[key] = make_series(self.records, key)
        return self._series[key]

    def keys_with_prefix(self, prefix: str, suffix: str = "") -> list[str]:
        """Sorted metric keys like `train/loss/<domain>` (prefix 'train/loss/')."""
        middle = {k: k[len(prefix):len(k) - len(suffix)] for k in self.keys
                  if k.startswith(prefix) and k.endswith(suffix)}
        return sorted(k for k, name in middle.items() if name and "/" not in name)  # not `val/loss` (the mean)


# -- events -------------------------------------------------------------------------------------
def mark_abandoned_events(events: list[dict[str, Any]]) -> None:
    """Like records: events of a timeline a later `recovered` rolled back over get `_abandoned`.

    Event steps mix conventions (some count the step being run, some the steps done), so this
    compares tokens, which every event carries as the trained tokens when it was written.
    """
    lowest_restart = math.inf
    for event in reversed(events):
        if event.get("event") == "recovered":
            event["_abandoned"] = float(event.get("tokens", 0)) > lowest_restart
            lowest_restart = min(lowest_restart, float(event.get("tokens", 0)))
        else:
            event["_abandoned"] = float(event.get("tokens", 0)) > lowest_restart


@dataclass
class Stage:
    index: int
    name: str
    tokens: float
    step: int
    seq_len: int = 0
    """Tokens per sample in the stage (0: not recorded, as in runs before stages had their own length)."""


def lengths_differ(stages: list[Stage]) -> bool:
    """Whether the stages trained at different sequence lengths (then plots and tables name each one's)."""
    return len({stage.seq_len for stage in stages if stage.seq_len}) > 1


def stage_boundaries(records: list[Record], events: list[dict[str, Any]]) -> list[Stage]:
    """Where each curriculum stage begins: stage_switch events, else changes of `curriculum/stage`."""
    by_index: dict[int, Stage] = {}
    for event in events:
        if event.get("event") == "stage_switch" and not event["_abandoned"]:
            index = int(event.get("stage", len(by_index) + 1))
            name = str(event.get("stage_name", f"stage {index}"))
            # The first stage begins at 0 whatever step its event was logged at.
            tokens = 0.0 if index == 1 else float(event.get("tokens", 0))
            by_index[index] = Stage(index, name, tokens, int(event.get("step", 0)), int(event.get("seq_len", 0)))
    if by_index:
        return [by_index[i] for i in sorted(by_index)]
    stages: list[Stage] = []
    for record in records:
        value = record.values.get("curriculum/stage")
        if value is not None and not record.abandoned and (not stages or stages[-1].index != int(value)):
            tokens = 0.0 if not stages else record.tokens
            stages.append(Stage(int(value), f"stage {int(value)}", tokens, record.step))
    return stages


def downstream_metrics(keys: set[str]) -> dict[str, list[str]]:
    """Each downstream task's metrics, from its `eval/<task>/<metric>` keys (tasks and metrics sorted); the
    run-wide `eval/downstream_seconds` and `eval/time_share` are not a task's."""
    tasks: dict[str, list[str]] = {}
    for key in sorted(keys):
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "eval" and parts[1] and parts[2]:
            tasks.setdefault(parts[1], []).append(parts[2])
    return tasks


def load_run(run_dir: Path) -> tuple[JsonlFile, Timeline, list[dict[str, Any]]]:
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.is_file():
        raise ReportError(f"{metrics_path} not found: RUN_DIR must be a run dir with a {METRICS_FILE} "
                          f"(e.g. runs/<name>, made by `ayumi train`)")
    metrics_file = read_jsonl(metrics_path)
    records = build_timeline(metrics_file.rows)
    if not any(is_train_record(r.values) for r in records):
        raise ReportError(f"{metrics_path} has no training records yet; run the report again after the first "
                          f"logged step")
    events = read_jsonl(run_dir / EVENTS_FILE).rows
    mark_abandoned_events(events)
    return metrics_file, Timeline(records), events
