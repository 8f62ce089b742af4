"""The report's PNG plots: loss, optimizer, throughput and downstream scores against tokens, with stages and
events marked.

Long series are min/max-decimated so spikes survive; axes zoom past the first 10% of the run so the
interesting part is readable; abandoned stretches (before a rollback) are drawn dashed and faded.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.metrics import format_count
from pretrain.tools.report.timeline import Series, Stage, Timeline, continued, lengths_differ
FIGSIZE_WIDTH = 12.0  # inches; at DPI this is ~1300 px: readable on a laptop and in a PR comment
DPI = 110
MAX_PLOT_POINTS = 4000  # per line; longer series are min/max-decimated so spikes survive

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
    "config_change": ("D", "tab:olive"),
}
# Events drawn on the loss/optimizer panels too (the others live in the event lane only).
ALARM_EVENTS = ("spike", "rollback", "skip_update", "loss_scale_reset")
LINE_EVENTS = (*ALARM_EVENTS, "config_change")
"""Events marked by a faint vertical line on every panel: the alarms, and a resume that changed the config (an
extended run's LR curve shows where its length changed)."""


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
    lengths = lengths_differ(stages)
    for stage in stages:
        if stage.tokens > 0:
            ax.axvline(stage.tokens, color="tab:blue", linestyle=":", linewidth=1.2, alpha=0.8)
        if label:
            # Inside the panel, under the top edge: above it is the title's place.
            text = f" stage {stage.index}: {stage.name}" + (f" (seq {stage.seq_len})" if lengths else "")
            ax.text(stage.tokens, 0.985, text, transform=ax.get_xaxis_transform(),
                    fontsize=9, color="tab:blue", va="top", ha="left",
                    bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.7, "pad": 1}, zorder=6)


def draw_alarm_lines(ax, events: list[dict[str, Any]]) -> None:
    """Faint vertical lines at spikes, rollbacks, skipped updates, scale resets and config changes."""
    for event in events:
        if event.get("event") in LINE_EVENTS:
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
        if event.get("_verdict"):  # `ayumi replay` judged it: data-driven, state-driven, ...
            ax.annotate(event["_verdict"], (x, y_axes), xycoords=ax.get_xaxis_transform(), xytext=(4, 6),
                        textcoords="offset points", fontsize=7, color=color, annotation_clip=False)
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


# -- downstream scores ------------------------------------------------------------------------------
def downstream_plot_name(task: str) -> str:
    """The PNG of one downstream task: `downstream_<task>.png` (a task name is a file's stem: made file-safe)."""
    return f"downstream_{re.sub(r'[^A-Za-z0-9_.-]+', '_', task)}.png"


def plot_downstream(timeline: Timeline, ctx: PlotContext, task: str, metrics: list[str], path: Path) -> None:
    """One panel per metric of `task` (`eval/<task>/<metric>`): a point per scoring, stages and alarms marked."""
    fig, axes = new_figure(len(metrics), [2.8] * len(metrics))
    for ax, metric in zip(axes, metrics):
        data = timeline.series(f"eval/{task}/{metric}")
        # Scorings are sparse (every eval.downstream.interval steps): unsmoothed, a dot on each.
        plot_series(ax, data, metric, "tab:green", 1)
        ax.scatter(data.x, data.y, color="tab:green", s=16, zorder=3)
        fit_to_kept(ax, [data], log=False)
        last = data.finite()
        note = f" (last {last[-1]:.4g})" if len(last) else ""
        finish_axis(ax, f"{task}: {metric}{note}", metric, legend=False)
    for index, ax in enumerate(axes):
        draw_stages(ax, ctx.stages, label=index == 0)
        draw_alarm_lines(ax, ctx.events)
    finish_figure(fig, axes, ctx, path)
