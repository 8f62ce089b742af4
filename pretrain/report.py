"""`ayumi report RUN_DIR`: PNG plots and a markdown/HTML summary of a run, from its jsonl files alone.

    ayumi report runs/cpu_tiny                # writes runs/cpu_tiny/report/
    ayumi report runs/cpu_tiny --smooth 50    # EMA over ~50 logged steps (0 = raw lines only)

Reads `metrics.jsonl`, `events.jsonl` and (if present) `config.yaml`; never the checkpoints, W&B
or DeepSpeed, so it runs anywhere, on a finished run or one still writing (a cut last line is
skipped). Output, replaced as a whole so a reader never sees half a report:

    report/loss.png        train loss (total, per domain), val loss per domain, event lane; x = tokens
    report/optim.png       LR; grad norm (log) with the clip threshold; fp16 loss scale when logged
    report/throughput.png  tokens/s, step time, MFU when logged
    report/summary.md      run, progress, final/best losses, stages, events, files, W&B sync
    report/summary.html    the same, with the PNGs embedded

Rollbacks: after a spike the trainer reloads an earlier checkpoint, so steps and tokens repeat in
metrics.jsonl (e.g. 154 then 81). Every record that a later rollback replaced is *abandoned*; the
plots draw the continued timeline solid and each abandoned stretch dashed and faded, branching
off where it started, so the spike that caused the rollback stays visible without tangling the
curves. Summary numbers (final, best) come from the continued timeline only.
"""
from __future__ import annotations

import argparse
import html
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from pretrain.metrics import EVENTS_FILE, METRICS_FILE, format_count, format_duration
from common.files import replace_dir

REPORT_DIR = "report"
CONFIG_FILE = "config.yaml"
FIGSIZE_WIDTH = 12.0  # inches; at DPI this is ~1300 px: readable on a laptop and in a PR comment
DPI = 110
MAX_PLOT_POINTS = 4000  # per line; longer series are min/max-decimated so spikes survive
LAST_N = 10  # "mean of the last N logged values" in the loss table: one step alone is noisy

# Distinct marker per event kind (also the order of the event lane, top to bottom).
EVENT_STYLE: dict[str, tuple[str, str]] = {
    "spike": ("^", "tab:red"),
    "rollback": ("X", "tab:purple"),
    "recovered": ("o", "tab:green"),
    "skip_update": ("v", "tab:orange"),
    "batches_skipped": (">", "tab:brown"),
    "loss_scale_reset": ("s", "tab:pink"),
    "fault_injected": ("*", "0.35"),
    "stage_switch": ("|", "tab:blue"),
    "domain_repetition": ("d", "tab:cyan"),
    "signal_stop": ("P", "black"),
}
# Events drawn on the loss/optimizer panels too (the others live in the event lane only).
ALARM_EVENTS = ("spike", "rollback", "skip_update", "loss_scale_reset")


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


def is_train_record(row: dict[str, Any]) -> bool:
    return "train/loss" in row or "tokens" in row


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
        # Validation rows carry no tokens: they are logged right after the train row of their step.
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


def stage_boundaries(records: list[Record], events: list[dict[str, Any]]) -> list[Stage]:
    """Where each curriculum stage begins: stage_switch events, else changes of `curriculum/stage`."""
    by_index: dict[int, Stage] = {}
    for event in events:
        if event.get("event") == "stage_switch" and not event["_abandoned"]:
            index = int(event.get("stage", len(by_index) + 1))
            name = str(event.get("stage_name", f"stage {index}"))
            # The first stage begins at 0 whatever step its event was logged at.
            tokens = 0.0 if index == 1 else float(event.get("tokens", 0))
            by_index[index] = Stage(index, name, tokens, int(event.get("step", 0)))
    if by_index:
        return [by_index[i] for i in sorted(by_index)]
    stages: list[Stage] = []
    for record in records:
        value = record.values.get("curriculum/stage")
        if value is not None and not record.abandoned and (not stages or stages[-1].index != int(value)):
            tokens = 0.0 if not stages else record.tokens
            stages.append(Stage(int(value), f"stage {int(value)}", tokens, record.step))
    return stages


# -- numbers ----------------------------------------------------------------------------------------
def ema(values: np.ndarray, window: int) -> np.ndarray:
    """Bias-corrected exponential moving average over ~`window` points; NaNs are stepped over."""
    if window <= 1:
        return values.copy()
    alpha = 2.0 / (window + 1)
    out = np.empty_like(values)
    mean = weight = 0.0
    for i, value in enumerate(values):
        if math.isfinite(value):
            mean = (1 - alpha) * mean + alpha * value
            weight = (1 - alpha) * weight + alpha
        out[i] = mean / weight if weight else math.nan
    return out


def auto_window(num_points: int) -> int:
    """A smoothing window that shows the trend at any run length (~1/40 of the points)."""
    return int(min(500, max(1, num_points // 40)))


def decimate(x: np.ndarray, y: np.ndarray, limit: int = MAX_PLOT_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """At most ~`limit` points, keeping each bucket's min and max so a one-step spike still shows."""
    if len(x) <= limit:
        return x, y
    bucket = math.ceil(len(x) / (limit // 2))
    keep: list[int] = []
    for start in range(0, len(x), bucket):
        chunk = y[start:start + bucket]
        if np.isfinite(chunk).any():
            keep += sorted({start + int(np.nanargmin(chunk)), start + int(np.nanargmax(chunk))})
        else:
            keep.append(start)
    index = np.array(keep)
    return x[index], y[index]


def robust_limits(values: np.ndarray, log: bool = False, low_q: float = 0.0,
                  high_q: float = 1.0) -> tuple[float, float] | None:
    """y-limits from quantiles of the finite values, with a margin; None when there is nothing to show."""
    values = values[np.isfinite(values)]
    if log:
        values = values[values > 0]
    if not len(values):
        return None
    low, high = float(np.quantile(values, low_q)), float(np.quantile(values, high_q))
    if log:
        return low / 1.3, high * 1.3
    margin = (high - low) * 0.06 or abs(high) * 0.1 or 1.0
    return low - margin, high + margin


def use_log_scale(values: np.ndarray) -> bool:
    """Log y when a positive series spans more than 10x (early loss would hide the late curve)."""
    values = values[np.isfinite(values)]
    return bool(len(values)) and values.min() > 0 and values.max() / values.min() > 10


# -- plotting ---------------------------------------------------------------------------------------
@dataclass
class PlotContext:
    """What every panel shares: stage lines, alarm events, smoothing, the x range."""
    stages: list[Stage]
    events: list[dict[str, Any]]
    window: int
    x_max: float


def short_count(value: float) -> str:
    """Tick labels: 20000 -> '20k', 1500000 -> '1.5M' (format_count's '20.00k' is for tables)."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.3g}"


def tokens_formatter():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda value, _: short_count(value))


def new_figure(rows: int, heights: list[float]):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, 1, sharex=True, figsize=(FIGSIZE_WIDTH, sum(heights)), dpi=DPI,
                             gridspec_kw={"height_ratios": heights}, layout="constrained", squeeze=False)
    return fig, list(axes[:, 0])


def plot_series(ax, data: Series, label: str, color: str, window: int, draw_raw: bool = True,
                step_style: bool = False) -> None:
    """Raw line light behind its EMA (solid); abandoned stretches dashed and faded, unsmoothed."""
    if len(data.x):
        x, y = decimate(data.x, data.y)
        kind = {"drawstyle": "steps-post"} if step_style else {}
        if window > 1 and draw_raw:
            # Decimated raw lines become a band: lighter, so the EMA stays the thing to read.
            ax.plot(x, y, color=color, alpha=0.25 if len(x) == len(data.x) else 0.15, linewidth=0.8, **kind)
            smooth_x, smooth_y = decimate(data.x, ema(data.y, window))
            ax.plot(smooth_x, smooth_y, color=color, linewidth=1.8, label=label, **kind)
        else:
            ax.plot(x, y, color=color, linewidth=1.5, label=label, **kind)
    for piece_x, piece_y in data.abandoned:
        ax.plot(piece_x, piece_y, color=color, alpha=0.45, linewidth=1.0, linestyle="--")


def draw_stages(ax, stages: list[Stage], label: bool) -> None:
    """Vertical lines where stages begin; names along the top of the first panel."""
    for stage in stages:
        if stage.tokens > 0:
            ax.axvline(stage.tokens, color="tab:blue", linestyle=":", linewidth=1.2, alpha=0.8)
        if label:
            # Inside the panel, under the top edge: above it is the title's place.
            ax.text(stage.tokens, 0.985, f" stage {stage.index}: {stage.name}", transform=ax.get_xaxis_transform(),
                    fontsize=9, color="tab:blue", va="top", ha="left",
                    bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.7, "pad": 1}, zorder=6)


def draw_alarm_lines(ax, events: list[dict[str, Any]]) -> None:
    """Faint vertical lines at spikes, rollbacks, skipped updates and scale resets."""
    for event in events:
        if event.get("event") in ALARM_EVENTS:
            _, color = EVENT_STYLE[event["event"]]
            ax.axvline(float(event.get("tokens", 0)), color=color, linewidth=0.8,
                       alpha=0.2 if event["_abandoned"] else 0.45)


def finish_axis(ax, title: str, ylabel: str, legend: bool = True) -> None:
    ax.set_title(title, loc="left", fontsize=11, fontweight="bold", pad=9)  # room for markers on the edge
    if ax.get_yscale() == "log" and getattr(ax.yaxis.get_transform(), "base", None) == 10:
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        # Plain numbers (0.5, 2, 6) read faster than 5x10^-1. Over a narrow range label the 2s and 5s
        # between the decades too, or the axis would show one number or none.
        plain = FuncFormatter(lambda value, _: f"{value:g}")
        ax.yaxis.set_major_formatter(plain)
        low, high = ax.get_ylim()
        if high / low < 300:
            ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
            ax.yaxis.set_minor_formatter(plain)
        else:
            ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)


def finish_figure(fig, axes, ctx: PlotContext, path: Path) -> None:
    axes[-1].xaxis.set_major_formatter(tokens_formatter())
    axes[-1].set_xlabel("tokens trained")
    axes[-1].set_xlim(0, ctx.x_max * 1.01 or 1)
    fig.savefig(path, dpi=DPI)
    import matplotlib.pyplot as plt

    plt.close(fig)


def domain_colors(domains: list[str]) -> dict[str, str]:
    """The same color for a domain in every panel (train and val)."""
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
               "tab:olive", "tab:cyan", "tab:gray"]
    return {name: palette[i % len(palette)] for i, name in enumerate(domains)}


def plot_loss(timeline: Timeline, ctx: PlotContext, path: Path) -> None:
    train_keys = timeline.keys_with_prefix("train/loss/")
    val_keys = timeline.keys_with_prefix("val/", "/loss")
    domains = sorted({k.split("/")[2] for k in train_keys} | {k.split("/")[1] for k in val_keys})
    colors = domain_colors(domains)
    has_val = bool(val_keys)
    heights = [4.2] + ([2.8] if has_val else []) + ([lane_height(ctx.events)] if ctx.events else [])
    fig, axes = new_figure(len(heights), heights)
    ax_train = axes[0]
    total = timeline.series("train/loss")
    plot_series(ax_train, total, "total", "black", ctx.window)
    for key in train_keys:
        plot_series(ax_train, timeline.series(key), key.split("/")[2], colors[key.split("/")[2]], ctx.window)
    zoom_note = fit_to_kept(ax_train, [total] + [timeline.series(k) for k in train_keys], zoom_x_max=ctx.x_max)
    mark_alarms(ax_train, ctx.events, total)
    draw_rollback_arrows(ax_train, ctx.events)
    smooth_note = f", EMA over {ctx.window} steps (raw light)" if ctx.window > 1 else ""
    finish_axis(ax_train, f"Train loss{smooth_note}{zoom_note}", "loss (nats/token)")
    if has_val:
        ax_val = axes[1]
        val_series = [timeline.series(k) for k in val_keys]
        for key, data in zip(val_keys, val_series):
            name = key.split("/")[1]
            plot_series(ax_val, data, name, colors.get(name, "black"), 1)
            if len(data.x) <= 60:  # a dot per eval while they can still be told apart
                ax_val.scatter(data.x, data.y, color=colors.get(name, "black"), s=12, zorder=3)
        zoom_note = fit_to_kept(ax_val, val_series, zoom_x_max=ctx.x_max)
        finish_axis(ax_val, f"Validation loss per domain{zoom_note}", "loss (nats/token)")
    if ctx.events:
        plot_event_lane(axes[-1], ctx.events)
    for index, ax in enumerate(axes):
        draw_stages(ax, ctx.stages, label=index == 0)
    finish_figure(fig, axes, ctx, path)


ZOOM_PAST = 0.1  # a zoomed loss axis leaves out the first 10% of the run


def zoom_values(all_series: list[Series], x_max: float) -> np.ndarray | None:
    """The values to fit when the first ZOOM_PAST of the run would take most of a linear axis.

    A pretraining loss falls from ~11 to ~3 in the first few percent and then moves by tenths:
    fitted to everything, the part that matters is a flat line. None when no zoom is needed.
    """
    later = [s.y[np.isfinite(s.y) & (s.x >= ZOOM_PAST * x_max)] for s in all_series]
    later = np.concatenate(later) if later else np.array([])
    kept = np.concatenate([s.finite() for s in all_series])
    if len(later) < 10:
        return None
    low, high = float(later.min()), float(later.max())
    return later if kept.max() - high > high - low else None


def fit_to_kept(ax, all_series: list[Series], log: bool | None = None, zoom_x_max: float = 0.0) -> str:
    """Fit y to the continued timeline; an abandoned stretch that goes above is clipped, its peak labelled.

    `log=None` chooses: log scale when the values span more than 10x. With `zoom_x_max` (the
    run's last x) a linear axis may zoom past the start (zoom_values); returns a note for the title.
    """
    kept = np.concatenate([s.finite() for s in all_series]) if all_series else np.array([])
    log = use_log_scale(kept) if log is None else log
    if log:
        ax.set_yscale("log")
    zoomed = zoom_values(all_series, zoom_x_max) if zoom_x_max and not log and len(kept) else None
    limits = robust_limits(kept if zoomed is None else zoomed, log=log)
    if limits is None:
        return ""
    ax.set_ylim(*limits)
    note = "" if zoomed is None else (f"; y zoomed past the first {ZOOM_PAST:.0%} of tokens "
                                      f"(start, up to {kept.max():.3g}, off the top)")
    # One label per abandoned stretch (the highest of its lines), so domain lines do not stack labels.
    peaks: dict[int, tuple[float, float]] = {}
    for data in all_series:
        for index, (piece_x, piece_y) in enumerate(data.abandoned):
            finite = np.isfinite(piece_y)
            if finite.any() and piece_y[finite].max() > limits[1]:
                at = int(np.argmax(np.where(finite, piece_y, -np.inf)))
                if piece_y[at] > peaks.get(index, (0.0, -math.inf))[1]:
                    peaks[index] = (piece_x[at], piece_y[at])
    for x, y in peaks.values():
        ax.annotate(f"off scale: {y:.3g}", (x, limits[1]), xytext=(5, -11), textcoords="offset points",
                    ha="left", fontsize=8, color="0.3")
    return note


def mark_alarms(ax, events: list[dict[str, Any]], total: Series) -> None:
    """Spike / rollback / skipped-update markers on the train loss curve, with their own legend entries."""
    # Look an event's loss up on its own timeline: a NaN step that was rolled back must not land on
    # the replayed (finite) loss at the same tokens.
    loss_at: dict[bool, dict[float, float]] = {False: {}, True: {}}
    for abandoned, pieces in ((False, [(total.x, total.y)]), (True, total.abandoned)):
        for x, y in pieces:
            for xx, yy in zip(x, y):
                if math.isfinite(yy):  # the spike itself is the highest loss logged at those tokens
                    loss_at[abandoned][xx] = max(loss_at[abandoned].get(xx, -math.inf), yy)
    top = ax.get_ylim()[1]
    to_axes = ax.transData + ax.transAxes.inverted()
    labelled = set()
    for event in events:
        kind = event.get("event")
        if kind not in ALARM_EVENTS:
            continue
        marker, color = EVENT_STYLE[kind]
        x = float(event.get("tokens", 0))
        # NaN losses and off-scale spikes sit on the top edge, where they cannot be missed.
        y = loss_at[bool(event["_abandoned"])].get(x, top)
        y_axes = 1.0 if y >= top else float(to_axes.transform((x, y))[1])
        ax.scatter([x], [y_axes], marker=marker, color=color, s=70, zorder=7, edgecolors="white", linewidths=0.6,
                   transform=ax.get_xaxis_transform(), clip_on=False, alpha=0.55 if event["_abandoned"] else 1.0,
                   label=kind.replace("_", " ") if kind not in labelled else None)
        labelled.add(kind)
    if any(e.get("_abandoned") for e in events):
        ax.plot([], [], color="0.4", linestyle="--", alpha=0.6, label="rolled back\n(abandoned)")


def draw_rollback_arrows(ax, events: list[dict[str, Any]]) -> None:
    """An arrow from each rollback back to where training resumed, near the top of the panel."""
    pending = None
    for event in events:
        if event.get("event") == "rollback":
            pending = event
        elif event.get("event") == "recovered" and pending is not None:
            start, end = float(pending.get("tokens", 0)), float(event.get("tokens", 0))
            step = event.get("to_step", event.get("step"))
            ax.annotate("", xy=(end, 0.8), xytext=(start, 0.8), xycoords=ax.get_xaxis_transform(),
                        arrowprops={"arrowstyle": "->", "color": "tab:purple", "lw": 1.4})
            ax.text((start + end) / 2, 0.84, f"rolled back to step {step}", transform=ax.get_xaxis_transform(),
                    ha="center", va="bottom", fontsize=8, color="tab:purple")
            pending = None


def lane_height(events: list[dict[str, Any]]) -> float:
    return 0.6 + 0.28 * len({e.get("event") for e in events})


def plot_event_lane(ax, events: list[dict[str, Any]]) -> None:
    """One row per event kind: when every spike, rollback, skip, stage switch ... happened."""
    known = [k for k in EVENT_STYLE if any(e.get("event") == k for e in events)]
    kinds = known + sorted({str(e.get("event")) for e in events} - set(known))
    for row, kind in enumerate(kinds):
        marker, color = EVENT_STYLE.get(kind, ("o", "0.5"))
        for abandoned in (False, True):
            xs = [float(e.get("tokens", 0)) for e in events if e.get("event") == kind and e["_abandoned"] == abandoned]
            if xs:
                ax.scatter(xs, [row] * len(xs), marker=marker, color=color, s=90 if marker == "|" else 60,
                           linewidths=2.5 if marker == "|" else 1.0, alpha=0.35 if abandoned else 1.0, zorder=3)
    ax.set_yticks(range(len(kinds)), [k.replace("_", " ") for k in kinds], fontsize=9)
    ax.set_ylim(len(kinds) - 0.5, -0.5)
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_title("Events (faded: on a timeline later rolled back)", loc="left", fontsize=11, fontweight="bold")


def plot_optim(timeline: Timeline, ctx: PlotContext, path: Path) -> None:
    scale = timeline.series("opt/loss_scale")
    heights = [2.6, 3.4] + ([2.2] if scale else [])
    fig, axes = new_figure(len(heights), heights)
    lr = timeline.series("opt/lr")
    plot_series(axes[0], lr, "LR", "tab:blue", 1)
    fit_to_kept(axes[0], [lr], log=False)
    axes[0].ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    finish_axis(axes[0], "Learning rate (after schedule, stage re-warmup and recovery cool-down)", "LR", legend=False)
    grad = timeline.series("opt/grad_norm")
    plot_series(axes[1], grad, "grad norm (before clipping)", "tab:red", ctx.window)
    clip = timeline.series("opt/clip_threshold")
    if clip:
        plot_series(axes[1], clip, "clip threshold", "black", 1, step_style=True)
    fit_to_kept(axes[1], [grad, clip], log=True)
    finish_axis(axes[1], "Gradient norm (log scale)", "L2 norm")
    if scale:
        plot_series(axes[2], scale, "loss scale", "tab:purple", 1, step_style=True)
        axes[2].set_yscale("log", base=2)
        finish_axis(axes[2], "fp16 loss scale (log2 scale)", "scale", legend=False)
    for index, ax in enumerate(axes):
        draw_stages(ax, ctx.stages, label=index == 0)
        draw_alarm_lines(ax, ctx.events)
    finish_figure(fig, axes, ctx, path)


def plot_throughput(timeline: Timeline, ctx: PlotContext, path: Path) -> None:
    # Continued timeline only: the rolled-back stretch ran at the same speed and would only add noise.
    rate, step_time, mfu = (continued(timeline.series(key))
                            for key in ("perf/tokens_per_s", "perf/step_time", "perf/mfu"))
    mfu = replace(mfu, y=mfu.y * 100)  # percent
    heights = [3.0, 3.0] + ([2.4] if mfu else [])
    fig, axes = new_figure(len(heights), heights)
    plot_series(axes[0], rate, "tokens/s", "tab:green", ctx.window)
    axes[0].yaxis.set_major_formatter(tokens_formatter())
    # The first steps (compilation, warm caches) and checkpoint saves would flatten the rest.
    for ax, data in ((axes[0], rate), (axes[1], step_time)) + (((axes[2], mfu),) if mfu else ()):
        limits = robust_limits(data.finite(), low_q=0.01, high_q=0.99)
        if limits:
            ax.set_ylim(max(0.0, limits[0]), limits[1])
    rate_note = f"median {format_count(float(np.median(rate.finite())))} tokens/s" if len(rate.finite()) else ""
    finish_axis(axes[0], f"Throughput ({rate_note}; y clipped to the 1-99% range)", "tokens/s (all ranks)",
                legend=False)
    plot_series(axes[1], step_time, "step time", "tab:brown", ctx.window)
    finish_axis(axes[1], "Step time", "seconds per step", legend=False)
    if mfu:
        plot_series(axes[2], mfu, "MFU", "tab:purple", ctx.window)
        finish_axis(axes[2], "Model FLOPs utilization", "MFU (%)", legend=False)
    for index, ax in enumerate(axes):
        draw_stages(ax, ctx.stages, label=index == 0)
    finish_figure(fig, axes, ctx, path)


# -- summary ---------------------------------------------------------------------------------------
# The summary is a list of blocks rendered twice (markdown and HTML), so the two never disagree.
Block = tuple[str, Any]  # ("h1"|"h2"|"p"|"code"|"img"|"list", text) or ("table", (header, rows))


def fmt_loss(value: float | None) -> str:
    return "–" if value is None or not math.isfinite(value) else f"{value:.4f}"


def loss_rows(timeline: Timeline) -> list[list[str]]:
    """Final, mean of the last few, and best value of every loss, on the continued timeline."""
    keys = (["train/loss"] + timeline.keys_with_prefix("train/loss/") + timeline.keys_with_prefix("val/", "/loss")
            + (["val/loss"] if "val/loss" in timeline.keys else []))
    rows = []
    for key in keys:
        data = timeline.series(key)
        finite = np.isfinite(data.y)
        if not finite.any():
            continue
        best = int(np.argmin(np.where(finite, data.y, np.inf)))
        # Evals are sparse: a mean over the last N of them would span much of the run.
        tail = fmt_loss(float(data.y[finite][-LAST_N:].mean())) if key.startswith("train/") else "–"
        rows.append([f"`{key}`", fmt_loss(float(data.y[finite][-1])), tail,
                     fmt_loss(float(data.y[best])), f"{int(data.steps[best]):,}", format_count(data.x[best])])
    return rows


def run_status(run_dir: Path, config: dict[str, Any], last_tokens: float, events: list[dict[str, Any]]) -> str:
    planned = float((config.get("train") or {}).get("tokens") or 0)
    age = time.time() - (run_dir / METRICS_FILE).stat().st_mtime
    updated = f"metrics.jsonl last written {format_age(age)} ago"
    if planned and last_tokens >= planned:
        return f"finished ({updated})"
    if any(e.get("event") == "signal_stop" for e in events):
        return f"stopped by a signal; resume to continue ({updated})"
    progress = f"{100 * last_tokens / planned:.1f}% of {format_count(planned)} planned tokens" if planned else ""
    return f"running or stopped early{': ' + progress if progress else ''} ({updated})"


def format_age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{max(seconds, 0):.0f} s"


def overview_rows(run_dir: Path, config: dict[str, Any], timeline: Timeline, events: list[dict[str, Any]],
                  metrics_file: JsonlFile) -> list[list[str]]:
    records = timeline.records
    kept = [r for r in records if not r.abandoned and is_train_record(r.values)]
    last = kept[-1] if kept else None
    step_times = [float(r.values["perf/step_time"]) for r in records if "perf/step_time" in r.values]
    rates = [float(r.values["perf/tokens_per_s"]) for r in kept if "perf/tokens_per_s" in r.values]
    skips = [e for e in events if e.get("event") == "skip_update"]
    kept_skips = sum(1 for e in skips if not e["_abandoned"])
    rollbacks = sum(1 for e in events if e.get("event") == "rollback")
    rows = [
        ["status", run_status(run_dir, config, last.tokens if last else 0.0, events)],
        ["last step", f"{last.step:,}" if last else "–"],
        ["tokens trained", f"{format_count(last.tokens)} ({int(last.tokens):,})" if last else "–"],
        ["train compute time", f"{format_duration(sum(step_times))} (sum of step times, rolled-back steps included)"],
        ["median throughput", f"{format_count(float(np.median(rates)))} tokens/s" if rates else "–"],
        ["rollbacks", f"{rollbacks} ({sum(r.abandoned for r in records):,} logged records abandoned)"],
        ["updates skipped", f"{kept_skips} on the continued timeline, {len(skips)} in all (skip_update events)"],
    ]
    if metrics_file.partial_last_line:
        rows.append(["note", "the last line of metrics.jsonl is incomplete (run still writing?) and was skipped"])
    if metrics_file.corrupt_lines:
        rows.append(["warning", f"{len(metrics_file.corrupt_lines)} unreadable line(s) in metrics.jsonl skipped: "
                                f"{metrics_file.corrupt_lines[:10]}"])
    return rows


def event_blocks(events: list[dict[str, Any]], max_events: int) -> list[Block]:
    if not events:
        return [("p", "No events recorded (events.jsonl is missing or empty).")]
    counts: dict[str, int] = {}
    for event in events:
        counts[str(event.get("event"))] = counts.get(str(event.get("event")), 0) + 1
    blocks: list[Block] = [("p", "Counts: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + ".")]
    rows = [[str(e.get("time", "")).replace("T", " "), f"{int(e.get('step', 0)):,}",
             format_count(float(e.get("tokens", 0))), str(e.get("event")),
             "rolled back" if e["_abandoned"] else "", str(e.get("message", ""))]
            for e in events[:max_events]]
    blocks.append(("p", "Timeline \"rolled back\": the event happened on a stretch that a later rollback replaced."))
    blocks.append(("table", (["time", "step", "tokens", "kind", "timeline", "message"], rows)))
    if len(events) > max_events:
        blocks.append(("p", f"… {len(events) - max_events:,} more in `{EVENTS_FILE}` (`--max-events` shows more)."))
    return blocks


def file_rows(run_dir: Path) -> list[list[str]]:
    rows = []
    for name, what in ((METRICS_FILE, "one JSON object per log step / eval"), (EVENTS_FILE, "events, one per line"),
                       (CONFIG_FILE, "the resolved config"), ("deepspeed_config.json", "the DeepSpeed JSON used")):
        path = run_dir / name
        if path.exists():
            rows.append([f"`{name}`", f"{path.stat().st_size / 1024:,.1f} KiB", what])
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir():
        rows.append(["`checkpoints/`", f"{sum(1 for _ in checkpoints.iterdir())} entries", "checkpoint tags"])
    return rows


def wandb_blocks(run_dir: Path) -> list[Block]:
    offline = sorted((run_dir / "wandb").glob("offline-run-*")) if (run_dir / "wandb").is_dir() else []
    found = (f"{len(offline)} offline W&B run folder(s) here." if offline
             else "No offline W&B run in this run dir (logging=none, or W&B was online).")
    return [("p", f"{found} To upload and open an offline run in the W&B UI:"),
            ("code", f"wandb sync {run_dir}/wandb/offline-run-*")]


def summary_blocks(run_dir: Path, config: dict[str, Any], timeline: Timeline, events: list[dict[str, Any]],
                   stages: list[Stage], metrics_file: JsonlFile, max_events: int) -> list[Block]:
    name = str(config.get("name") or run_dir.name)
    blocks: list[Block] = [("h1", f"Run report: {name}"),
                           ("p", f"Run dir `{run_dir}`, made {time.strftime('%Y-%m-%d %H:%M:%S')} "
                                 f"from `{METRICS_FILE}` and `{EVENTS_FILE}`."),
                           ("table", (["run", ""], overview_rows(run_dir, config, timeline, events, metrics_file))),
                           ("h2", "Losses"),
                           ("p", f"On the continued timeline (rolled-back steps excluded); the mean is over the "
                                 f"last {LAST_N} logged train steps."),
                           ("table", (["metric", "final", f"mean last {LAST_N}", "best", "best at step",
                                       "best at tokens"], loss_rows(timeline))),
                           ("img", ("loss.png", "train and validation loss"))]
    if stages:
        blocks += [("h2", "Curriculum stages"),
                   ("table", (["stage", "name", "begins at tokens", "step"],
                              [[str(s.index), s.name, format_count(s.tokens), f"{s.step:,}"] for s in stages]))]
    blocks += [("h2", "Optimizer"), ("img", ("optim.png", "learning rate, grad norm, loss scale")),
               ("h2", "Throughput"), ("img", ("throughput.png", "tokens per second and step time")),
               ("h2", "Events"), *event_blocks(events, max_events),
               ("h2", "Files"), ("table", (["file", "size", "what"], file_rows(run_dir))),
               ("h2", "W&B"), *wandb_blocks(run_dir)]
    return blocks


def md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(blocks: list[Block]) -> str:
    out: list[str] = []
    for kind, content in blocks:
        if kind == "h1":
            out.append(f"# {content}")
        elif kind == "h2":
            out.append(f"## {content}")
        elif kind == "p":
            out.append(content)
        elif kind == "code":
            out.append(f"```\n{content}\n```")
        elif kind == "img":
            out.append(f"![{content[1]}]({content[0]})")
        elif kind == "table":
            header, rows = content
            lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(md_cell(c) for c in row) + " |" for row in rows]
            out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def html_inline(text: str) -> str:
    """Escape, then turn `code` spans (the only markdown the blocks use) into <code>."""
    parts = html.escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


HTML_STYLE = """body{font-family:system-ui,sans-serif;max-width:1340px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.8em 0}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left;
vertical-align:top}th{background:#f3f3f3}img{max-width:100%;border:1px solid #ddd;margin:.5em 0}
pre{background:#f6f6f6;padding:.6em}code{background:#f6f6f6}"""


def render_html(blocks: list[Block]) -> str:
    title = next((content for kind, content in blocks if kind == "h1"), "ayumi run report")
    out = ["<!doctype html>", "<html><head><meta charset='utf-8'>", f"<title>{html.escape(title)}</title>",
           f"<style>{HTML_STYLE}</style></head><body>"]
    for kind, content in blocks:
        if kind in ("h1", "h2", "p"):
            out.append(f"<{kind}>{html_inline(content)}</{kind}>")
        elif kind == "code":
            out.append(f"<pre><code>{html.escape(content)}</code></pre>")
        elif kind == "img":
            out.append(f"<img src='{html.escape(content[0])}' alt='{html.escape(content[1])}'>")
        elif kind == "table":
            header, rows = content
            out.append("<table><tr>" + "".join(f"<th>{html_inline(h)}</th>" for h in header) + "</tr>")
            out += ["<tr>" + "".join(f"<td>{html_inline(c)}</td>" for c in row) + "</tr>" for row in rows]
            out.append("</table>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


# -- the command ------------------------------------------------------------------------------------
@dataclass
class Report:
    out_dir: Path
    files: list[str]


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


def write_atomically(out_dir: Path, write: Callable[[Path], None]) -> None:
    """Write into a temp dir beside `out_dir`, then swap it in: readers see the old or the new report."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        write(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; a report is meant to be shared
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def make_report(run_dir: Path, out_dir: Path | None = None, smooth: int | None = None,
                max_events: int = 200) -> Report:
    """Plots and summaries for `run_dir` into `out_dir` (default RUN_DIR/report); returns what was written."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    run_dir = run_dir.resolve()
    out_dir = (out_dir or run_dir / REPORT_DIR).resolve()
    metrics_file, timeline, events = load_run(run_dir)
    config = read_config(run_dir)
    stages = stage_boundaries(timeline.records, events)
    num_train = len(timeline.series("train/loss").x)
    window = auto_window(num_train) if smooth is None else max(1, smooth)
    ctx = PlotContext(stages, events, window, x_max=max((r.tokens for r in timeline.records), default=1.0))
    blocks = summary_blocks(run_dir, config, timeline, events, stages, metrics_file, max_events)
    files = ["loss.png", "optim.png", "throughput.png", "summary.md", "summary.html"]

    def write(tmp: Path) -> None:
        plot_loss(timeline, ctx, tmp / "loss.png")
        plot_optim(timeline, ctx, tmp / "optim.png")
        plot_throughput(timeline, ctx, tmp / "throughput.png")
        (tmp / "summary.md").write_text(render_markdown(blocks))
        (tmp / "summary.html").write_text(render_html(blocks))

    write_atomically(out_dir, write)
    return Report(out_dir, files)


def parse_args(argv: list[str]) -> argparse.Namespace:
    from common.conf import config_help

    parser = argparse.ArgumentParser(prog="ayumi report", description=__doc__.split("\n\n")[0], epilog=config_help(
        "no config from conf/: RUN_DIR's metrics.jsonl, events.jsonl and config.yaml (the run's resolved config)",
        overrides=False))
    parser.add_argument("run_dir", type=Path, help="the run dir (holds metrics.jsonl, events.jsonl)")
    parser.add_argument("--out", type=Path, default=None, help="output dir (default RUN_DIR/report)")
    parser.add_argument("--smooth", type=int, default=None,
                        help="EMA window in logged steps; 0 or 1 = no smoothing (default: ~1/40 of the run)")
    parser.add_argument("--max-events", type=int, default=200, help="events listed in the summary table")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        report = make_report(args.run_dir, args.out, args.smooth, args.max_events)
    except ReportError as err:
        print(f"ayumi report: {err}", file=sys.stderr)
        return 2
    print(f"report written to {report.out_dir}/: {', '.join(report.files)}")
    print(f"open {report.out_dir / 'summary.html'} in a browser, or read {report.out_dir / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
