"""The report's summary as blocks (headings, tables, text), rendered to markdown and to HTML.

The summary holds the run and its progress, final and best losses per domain, the curriculum's stages,
the downstream scores (when the run scored tasks: eval.downstream; and each checkpoint's, when `ayumi eval
RUN_DIR --all` wrote its curve), the events, the files of the run dir and the W&B sync command.
"""
from __future__ import annotations

import html
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.metrics import EVAL_CURVE_FILE, EVENTS_FILE, METRICS_FILE, format_count, format_duration
from pretrain.stability.replay import read_replays
from pretrain.tools.report.attribution import attribution_blocks, replay_blocks
from pretrain.tools.report.eval_curve import CurvePoint, EvalCurve, eval_curve_plot_name, newer_checkpoints
from pretrain.tools.report.plots import downstream_plot_name
from pretrain.startup.record import HISTORY, read_history
from pretrain.startup.record import timeline as timeline_of_versions
from pretrain.startup.resume import short
from pretrain.tools.report.timeline import (CONFIG_FILE, JsonlFile, Stage, Timeline, downstream_metrics,
                                            is_train_record, lengths_differ)
LAST_N = 10  # "mean of the last N logged values" in the loss table: one step alone is noisy


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


def spike_blocks(events: list[dict[str, Any]]) -> list[Block]:
    """Per spike whose event recorded its batch (pretrain/step_samples.py's spike_batch_record): the batch's domain
    mix against the stage's weights, each domain's sample losses, and the highest-loss samples with their documents."""
    spikes = [e for e in events if e.get("event") == "spike" and e.get("batch_samples")]
    if not spikes:
        return []
    blocks: list[Block] = [("h2", "Spike batches"),
                           ("p", "The batch of the step each spike was called on. A rolled-back step was trained "
                                 "again on other data: `ayumi batch RUN_DIR --step N` shows the present one.")]
    for event in spikes:
        step, samples = int(event.get("step", 0)), event["batch_samples"]
        mix = ", ".join(f"{name} {100 * m['share']:.0f}%" + (f" (stage weight {100 * m['weight']:.0f}%)"
                                                              if m.get("weight") is not None else "")
                        for name, m in event.get("domain_mix", {}).items())
        first = int(event.get("batch_first_sample", 0))
        blocks.append(("p", f"Spike at step {step:,}{' (rolled back)' if event.get('_abandoned') else ''}: loss "
                            f"{fmt_loss(event.get('loss'))}; global samples from {first:,}; tokens by domain: {mix}."))
        by_domain: dict[str, list[float]] = {}
        for _, domain, loss in samples:
            by_domain.setdefault(str(domain), []).append(float(loss))
        blocks.append(("table", (["domain", "samples", "mean loss", "max loss"],
                                 [[name, str(len(losses)), fmt_loss(float(np.mean(losses))), fmt_loss(max(losses))]
                                  for name, losses in sorted(by_domain.items())])))
        rows = [[fmt_loss(s["loss"]), s["domain"], s["stream"], f"{s['index']:,}", str(s["rank"]), str(s["micro"]),
                 "; ".join(f"{d['shard']}:{d['document']}[{d['start']}:{d['stop']}]" for d in s["documents"])]
                for s in event.get("top_samples", [])]
        blocks.append(("table", (["loss", "domain", "stream", "sample", "rank", "micro", "documents (shard:doc[span])"],
                                 rows)))
    return blocks


def downstream_rows(timeline: Timeline, tasks: dict[str, list[str]]) -> list[list[str]]:
    """First, last and best value of every `eval/<task>/<metric>` on the continued timeline (all higher-better)."""
    rows = []
    for task, metrics in tasks.items():
        for metric in metrics:
            data = timeline.series(f"eval/{task}/{metric}")
            finite = np.isfinite(data.y)
            if not finite.any():
                continue
            values, steps = data.y[finite], data.steps[finite]
            rows.append([task, metric, fmt_loss(float(values[-1])), f"{int(steps[-1]):,}", fmt_loss(float(values[0])),
                         fmt_loss(float(values.max())), str(len(values))])
    return rows


def downstream_time(timeline: Timeline) -> str:
    """The time spent scoring: the seconds of every scoring (rolled-back ones included) and the last time share."""
    seconds = sum(float(r.values["eval/downstream_seconds"]) for r in timeline.records
                  if isinstance(r.values.get("eval/downstream_seconds"), (int, float)))
    shares = timeline.series("eval/time_share").finite()
    share = f"{100 * shares[-1]:.1f}% of the run's wall time (`eval/time_share` at the last scoring)" if len(shares) \
        else "time share not logged"
    return f"Downstream time share: {share}; {format_duration(seconds)} in all (`eval/downstream_seconds`)."


def downstream_blocks(timeline: Timeline) -> list[Block]:
    """The scores of the run's downstream tasks with a plot per task; nothing when the run scored none."""
    tasks = downstream_metrics(timeline.keys)
    if not tasks:
        return []
    blocks: list[Block] = [("h2", "Downstream evaluation"),
                           ("p", "Scored in the loop (`eval.downstream`), on the continued timeline: the last value, "
                                 "the first, the best (every metric is higher-better) and how many scorings."),
                           ("table", (["task", "metric", "last", "last at step", "first", "best", "scorings"],
                                      downstream_rows(timeline, tasks))),
                           ("p", downstream_time(timeline))]
    blocks += [("img", (downstream_plot_name(task), f"{task}: {', '.join(metrics)}")) for task, metrics in tasks.items()]
    return blocks


def curve_cell(point: CurvePoint, task: str, metric: str) -> str:
    """A checkpoint's `value ± stderr` as `ayumi eval` prints it; why there is none for one left out."""
    if point.error is not None:
        return "damaged" if point.damaged else "left out"
    score = point.scores.get(task, {}).get(metric)
    if score is None:
        return "–"
    return f"{score.value:.4f} ± {'N/A' if score.stderr is None else f'{score.stderr:.4f}'}"


def curve_rows(curve: EvalCurve, tasks: dict[str, list[str]]) -> tuple[list[str], list[list[str]]]:
    """(header, rows): a row per checkpoint, a column per task's metric, each headed with its n."""
    header = ["checkpoint", "step", "tokens"]
    for task, metrics in tasks.items():
        for metric in metrics:
            counts = sorted({score.n for _, score in curve.scored(task, metric)})
            header.append(f"{task} {metric} (n={'/'.join(map(str, counts)) or '–'})")
    rows = [[point.label, f"{point.step:,}", format_count(point.tokens)]
            + [curve_cell(point, task, metric) for task, metrics in tasks.items() for metric in metrics]
            for point in curve.points]
    return header, rows


def eval_curve_blocks(run_dir: Path, curve: EvalCurve | None) -> list[Block]:
    """The curve `ayumi eval RUN_DIR --all` wrote, with a plot per task; nothing when it wrote none."""
    if curve is None:
        return []
    blocks: list[Block] = [("h2", "Downstream evaluation of the checkpoints")]
    if curve.problem is not None:
        return blocks + [("p", f"`{EVAL_CURVE_FILE}` could not be read ({curve.problem}). Write it again with "
                               f"`ayumi eval {run_dir} --all`.")]
    tasks = curve.metrics()
    blocks += [("p", f"Scored after training by `ayumi eval RUN_DIR --all` (`{EVAL_CURVE_FILE}`): each "
                     "checkpoint's value ± its standard error, as `ayumi eval` prints it; n is the examples scored."),
               ("table", curve_rows(curve, tasks))]
    left_out = [point for point in curve.points if point.error is not None]
    if left_out:
        blocks.append(("p", "Left out of the curve: " + "; ".join(f"{p.label} ({p.error})" for p in left_out) + "."))
    newer = newer_checkpoints(run_dir, curve)
    if newer:
        blocks.append(("p", f"Saved after the curve was written, so not on it: {', '.join(newer)}. Run "
                            f"`ayumi eval {run_dir} --all` again to score them."))
    blocks += [("img", (eval_curve_plot_name(task), f"{task} per checkpoint: {', '.join(metrics)}"))
               for task, metrics in tasks.items()]
    return blocks


def config_history_blocks(run_dir: Path) -> list[Block]:
    """Which config trained which steps, when the run's config changed on a resume (nothing when it never did)."""
    versions = timeline_of_versions(read_history(run_dir))
    if len(versions) < 2:
        return []
    rows = []
    for version, following in zip(versions, [*versions[1:], None]):
        steps = f"{version.from_step + 1:,}–{following.from_step:,}" if following else f"{version.from_step + 1:,}–"
        changed = "; ".join(f"{c['key']}: {short(c['was'])} → {short(c['now'])}" for c in version.changes)
        rows.append([steps, version.written, changed or ("(the run's start)" if version.from_step == 0 else
                                                          "(its command line's overrides)")])
    return [("h2", "Config history"),
            ("p", f"Each resume that changed the config added a version to `{HISTORY}`; the steps each trained:"),
            ("table", (["steps", "recorded", "changed on resume"], rows))]


def file_rows(run_dir: Path) -> list[list[str]]:
    rows = []
    for name, what in ((METRICS_FILE, "one JSON object per log step / eval"), (EVENTS_FILE, "events, one per line"),
                       (CONFIG_FILE, "the resolved config"),
                       (HISTORY, "each version of the config and the step it trained from (append-only)"),
                       ("deepspeed_config.json", "the DeepSpeed JSON used"),
                       (EVAL_CURVE_FILE, "each checkpoint's downstream scores (`ayumi eval RUN_DIR --all`)")):
        path = run_dir / name
        if path.exists():
            rows.append([f"`{name}`", f"{path.stat().st_size / 1024:,.1f} KiB", what])
    scored = run_dir / "eval" / "downstream"
    if scored.is_dir():
        rows.append(["`eval/downstream/`", f"{sum(1 for _ in scored.iterdir())} files",
                     "what each downstream example got at each scoring"])
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
                   stages: list[Stage], metrics_file: JsonlFile, max_events: int,
                   curve: EvalCurve | None = None, replays: dict[int, dict[str, Any]] | None = None) -> list[Block]:
    """The summary's blocks; `replays`: the run's replay verdicts (read_replays), read here when not given."""
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
        lengths = lengths_differ(stages)  # a short-to-long schedule: each stage's sequence length too
        blocks += [("h2", "Curriculum stages"),
                   ("table", (["stage", "name", "begins at tokens", "step"] + (["seq_len"] if lengths else []),
                              [[str(s.index), s.name, format_count(s.tokens), f"{s.step:,}"]
                               + ([str(s.seq_len or "")] if lengths else []) for s in stages]))]
    blocks += downstream_blocks(timeline)
    blocks += eval_curve_blocks(run_dir, curve)
    blocks += config_history_blocks(run_dir)
    blocks += [("h2", "Optimizer"), ("img", ("optim.png", "learning rate, grad norm, loss scale")),
               ("h2", "Throughput"), ("img", ("throughput.png", "tokens per second and step time")),
               ("h2", "Events"), *event_blocks(events, max_events), *spike_blocks(events),
               *replay_blocks(read_replays(run_dir) if replays is None else replays), *attribution_blocks(run_dir, config, events),
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
