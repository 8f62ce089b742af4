"""`ayumi report RUN_DIR`: PNG plots and a markdown/HTML summary of a run, from its jsonl files alone.

    ayumi report runs/cpu_tiny                # writes runs/cpu_tiny/report/
    ayumi report runs/cpu_tiny --smooth 50    # EMA over ~50 logged steps (0 = raw lines only)

Reads `metrics.jsonl`, `events.jsonl` and (if present) `config.yaml` and `eval/downstream.json`; never
the checkpoints, W&B or DeepSpeed, so it runs anywhere, on a finished run or one still writing (a cut
last line is skipped). Output, replaced as a whole so a reader never sees half a report:

    report/loss.png        train loss (total, per domain), val loss per domain, event lane; x = tokens
    report/optim.png       LR; grad norm (log) with the clip threshold; fp16 loss scale when logged
    report/throughput.png  tokens/s, step time, MFU when logged
    report/downstream_<task>.png  each downstream task's metrics (`eval/<task>/<metric>`), when the run scored any
    report/eval_curve_<task>.png  each task's scores per checkpoint, when `ayumi eval RUN_DIR --all` wrote
                           RUN_DIR/eval/downstream.json (the in-loop scores drawn behind)
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
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


from common.files import replace_dir
from pretrain.stability.replay import read_replays
from pretrain.tools.report.eval_curve import eval_curve_plot_name, plot_eval_curve, read_eval_curve
from pretrain.tools.report.plots import (PlotContext, auto_window, downstream_plot_name, plot_downstream, plot_loss,
                                         plot_optim, plot_throughput)
from pretrain.tools.report.render import render_html, render_markdown, summary_blocks
from pretrain.tools.report.timeline import ReportError, downstream_metrics, load_run, read_config, stage_boundaries

REPORT_DIR = "report"


# -- the command ------------------------------------------------------------------------------------
@dataclass
class Report:
    out_dir: Path
    files: list[str]


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


def note_verdicts(events: list[dict], replays: dict[int, dict]) -> None:
    """Each replayed spike's event gets its verdict (`_verdict`), for the loss plot to mark (`ayumi replay`)."""
    verdicts = {record["spike"]: record["verdict"] for record in replays.values()}
    spikes = [event for event in events if event.get("event") == "spike"]
    for number, event in enumerate(spikes, 1):
        if number in verdicts:
            event["_verdict"] = verdicts[number]


def make_report(run_dir: Path, out_dir: Path | None = None, smooth: int | None = None,
                max_events: int = 200) -> Report:
    """Plots and summaries for `run_dir` into `out_dir` (default RUN_DIR/report); returns what was written."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    run_dir = run_dir.resolve()
    out_dir = (out_dir or run_dir / REPORT_DIR).resolve()
    metrics_file, timeline, events = load_run(run_dir)
    replays = read_replays(run_dir)
    note_verdicts(events, replays)
    config = read_config(run_dir)
    stages = stage_boundaries(timeline.records, events)
    num_train = len(timeline.series("train/loss").x)
    window = auto_window(num_train) if smooth is None else max(1, smooth)
    ctx = PlotContext(stages, events, window, x_max=max((r.tokens for r in timeline.records), default=1.0))
    curve = read_eval_curve(run_dir, timeline)
    blocks = summary_blocks(run_dir, config, timeline, events, stages, metrics_file, max_events, curve, replays)
    downstream = downstream_metrics(timeline.keys)
    curve_tasks = curve.metrics() if curve is not None else {}
    files = ["loss.png", "optim.png", "throughput.png", *map(downstream_plot_name, downstream),
             *map(eval_curve_plot_name, curve_tasks), "summary.md", "summary.html"]

    def write(tmp: Path) -> None:
        plot_loss(timeline, ctx, tmp / "loss.png")
        plot_optim(timeline, ctx, tmp / "optim.png")
        plot_throughput(timeline, ctx, tmp / "throughput.png")
        for task, metrics in downstream.items():
            plot_downstream(timeline, ctx, task, metrics, tmp / downstream_plot_name(task))
        for task, metrics in curve_tasks.items():
            plot_eval_curve(curve, timeline, ctx, task, metrics, tmp / eval_curve_plot_name(task))
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
    from common.status import BAD_INPUT

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        report = make_report(args.run_dir, args.out, args.smooth, args.max_events)
    except ReportError as err:
        print(f"ayumi report: {err}", file=sys.stderr)
        return BAD_INPUT
    print(f"report written to {report.out_dir}/: {', '.join(report.files)}")
    print(f"open {report.out_dir / 'summary.html'} in a browser, or read {report.out_dir / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
