"""`ayumi report`: plots and summaries from a hand-written run dir shaped like the trainer's.

The run dir written here has what a real one has: per-domain train losses, evals without a
`tokens` key, a curriculum stage switch, fp16 loss scale, a NaN step, and a spike whose rollback
makes the steps (and tokens) go back, so metrics.jsonl repeats steps 41..55.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.tools.report import build as report
from pretrain.tools.report.plots import short_count
from pretrain.tools.report.timeline import Timeline, build_timeline, read_jsonl
from tests.helpers import REPO

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ("loss.png", "optim.png", "throughput.png")
TOKENS_PER_STEP = 512
DOMAINS = ("en", "ja")


def train_row(step: int, loss: float, *, fp16: bool = True, stage: int = 1, lr: float = 1e-3) -> dict:
    row = {"step": step, "train/loss": loss, "opt/lr": lr, "opt/grad_norm": 1.0 + 0.5 * math.sin(step),
           "opt/clip_threshold": 1.0, "opt/skipped_steps": 0, "perf/tokens_per_s": 20000.0 + 100 * (step % 7),
           "perf/step_time": 0.025, "tokens": step * TOKENS_PER_STEP, "curriculum/stage": stage}
    if fp16:
        row["opt/loss_scale"] = 65536.0 if step < 30 else 32768.0
    for offset, domain in enumerate(DOMAINS):
        row[f"train/loss/{domain}"] = loss + 0.2 * offset - 0.1
    return row


def event(step: int, kind: str, message: str, **fields) -> dict:
    return {"step": step, "tokens": step * TOKENS_PER_STEP, "event": kind, "message": message, **fields,
            "time": "2026-01-01T00:00:00"}


def downstream_row(step: int, rolled_back: bool) -> dict:
    """A downstream scoring as the trainer logs it: after its step's train row, with that step's tokens."""
    score = step / 100 + (0.9 if rolled_back else 0.0)  # above every kept score: must not count as the best
    return {"step": step, "tokens": step * TOKENS_PER_STEP, "eval/cloze_ja/exact_match": score,
            "eval/cloze_ja/loglik": -9.0 + score, "eval/cloze_en/exact_match": score / 2,
            "eval/cloze_en/loglik": -8.0 + score, "eval/downstream_seconds": 0.5, "eval/time_share": 0.02 + step / 4000}


def write_run(run_dir: Path, *, fp16: bool = True, with_val: bool = True, with_events: bool = True,
              partial_tail: bool = False, downstream_every: int = 0, val_tokens: bool = False) -> Path:
    """A 80-step run: stage 2 from step 30, NaN at step 35, spike at 55 -> rollback to 40, then on to 80.

    `downstream_every`: a downstream scoring every that many steps (and so one in the rolled-back stretch);
    `val_tokens`: validation rows carry their step's tokens, as the trainer writes them now."""
    run_dir.mkdir(parents=True)
    rows = []

    def train(step: int, loss: float, replay: bool = False) -> None:
        rows.append(train_row(step, loss, fp16=fp16, stage=1 if step < 30 else 2))
        if with_val and step % 20 == 0:  # evals are logged right after their step
            rows.append({"step": step, **{f"val/{d}/loss": loss + 0.1 + 0.2 * i for i, d in enumerate(DOMAINS)},
                         "val/loss": loss + 0.2, **({"tokens": step * TOKENS_PER_STEP} if val_tokens else {})})
        if downstream_every and step % downstream_every == 0:
            rows.append(downstream_row(step, rolled_back=not replay and step > 40))

    for step in range(1, 56):
        train(step, float("nan") if step == 35 else 6.0 * math.exp(-step / 30) + 1.0 + (5.0 if step >= 52 else 0))
    for step in range(41, 81):  # the replay after the rollback: steps and tokens repeat
        train(step, 6.0 * math.exp(-step / 30) + 0.95, replay=True)
    lines = [json.dumps(row) for row in rows]  # json writes NaN as the trainer does
    text = "\n".join(lines) + "\n"
    if partial_tail:
        text += '{"step": 81, "train/loss": 1.2, "tok'  # a run still writing its next line
    (run_dir / "metrics.jsonl").write_text(text)
    if with_events:
        events = [
            event(1, "stage_switch", "stage 1/2 'ja_heavy' begins at sample 0", stage=1, stage_name="ja_heavy"),
            event(30, "stage_switch", "stage 2/2 'en_heavy' begins at sample 240", stage=2, stage_name="en_heavy"),
            event(35, "skip_update", "non-finite loss (nan)"),
            event(52, "skip_update", "loss 7.9 is 300% above its baseline"),
            event(55, "spike", "spike (3 outliers in the last 10 steps)", spike_start=52),
            event(55, "rollback", "roll back to step 40; skip 10 batches"),
            event(40, "batches_skipped", "skipped 10 batch(es)", batches=10),
            event(40, "recovered", "rolled back to step 40 (recovery)", to_step=40),
        ]
        (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run_dir / "config.yaml").write_text("name: unit_run\ntrain:\n  tokens: 40960\n")
    return run_dir


def summary_of(run_dir: Path, *options: str) -> str:
    """`ayumi report RUN_DIR OPTIONS` in this process, which must succeed; the summary.md it wrote in RUN_DIR/report."""
    assert report.main([str(run_dir), *options]) == 0
    return (run_dir / "report" / "summary.md").read_text()


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert len(data) > 20_000, f"{path} is suspiciously small ({len(data)} bytes)"


def test_full_report_from_a_run_with_a_rollback(tmp_path):
    run_dir = write_run(tmp_path / "run")
    summary = summary_of(run_dir)
    out = run_dir / "report"
    for name in PLOTS:
        assert_png(out / name)
    # Events: every kind, with its step.
    for step, kind in [(35, "skip_update"), (55, "spike"), (55, "rollback"), (40, "recovered"),
                       (30, "stage_switch"), (40, "batches_skipped")]:
        assert any(line.startswith("|") and f"| {step} |" in line and f"| {kind} |" in line
                   for line in summary.splitlines()), (kind, step)
    # Final losses come from the continued timeline (step 80), not from the abandoned spike.
    final = 6.0 * math.exp(-80 / 30) + 0.95
    assert f"| `train/loss` | {final:.4f} |" in summary
    assert f"| `train/loss/ja` | {final + 0.1:.4f} |" in summary
    assert f"| `val/en/loss` | {final + 0.1:.4f} |" in summary
    assert f"| `val/ja/loss` | {final + 0.3:.4f} |" in summary
    assert "| status | finished" in summary and "| rollbacks | 1 (" in summary
    assert "en_heavy" in summary and "wandb sync" in summary
    html = (out / "summary.html").read_text()
    assert all(f"<img src='{name}'" in html for name in PLOTS)
    assert "rolled back to step 40 (recovery)" in html
    assert not list(run_dir.glob(".report*")), "temp dirs left behind"
    # No downstream scores, no downstream section or plot.
    assert "Downstream" not in summary and not list(out.glob("downstream_*"))


def test_stages_of_different_lengths_show_each_length(tmp_path):
    """A short-to-long curriculum: the stage_switch events carry each stage's seq_len, and the summary's stage
    table (and the plots' stage labels) name it; runs whose stages share a length keep the table as it was."""
    run_dir = write_run(tmp_path / "run")
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    for record in events:
        if record["event"] == "stage_switch":
            record["seq_len"] = 64 if record["stage"] == 1 else 256
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    summary = summary_of(run_dir)
    assert "| stage | name | begins at tokens | step | seq_len |" in summary
    assert "| 2 | en_heavy | " in summary and summary.split("| 2 | en_heavy | ")[1].split("\n")[0].endswith("| 256 |")
    assert "| stage | name | begins at tokens | step |\n" in summary_of(write_run(tmp_path / "plain"))


def test_rollback_marks_the_replaced_stretch_abandoned(tmp_path):
    records = build_timeline(read_jsonl(write_run(tmp_path / "run") / "metrics.jsonl").rows)
    abandoned = sorted({r.step for r in records if r.abandoned})
    assert abandoned == list(range(41, 56))  # step 40 (the checkpoint rolled back to) stays
    timeline = Timeline(records)
    loss = timeline.series("train/loss")
    assert list(loss.steps) == list(range(1, 81))  # one value per step on the continued timeline
    (piece_x, piece_y), = loss.abandoned
    assert piece_x[0] == 40 * TOKENS_PER_STEP  # drawn as a fork off the last kept point
    val = timeline.series("val/en/loss")
    assert list(val.steps) == [20, 40, 60, 80]
    assert val.x[1] == 40 * TOKENS_PER_STEP  # evals take the tokens of the step they follow


def test_downstream_scores_are_plotted_per_task_and_summarized(tmp_path, monkeypatch):
    """eval/<task>/<metric> rows (with tokens, as the trainer logs them): a plot per task with the stage
    boundaries, the last values and the time share in the summary; the train rows they follow stay kept."""
    from pretrain.tools.report import plots

    marked: list[list[tuple[int, float]]] = []
    real_draw_stages = plots.draw_stages

    def draw_stages(ax, stages, label):
        marked.append([(stage.index, stage.tokens) for stage in stages])
        real_draw_stages(ax, stages, label)

    monkeypatch.setattr(plots, "draw_stages", draw_stages)
    run_dir = write_run(tmp_path / "run", downstream_every=10, val_tokens=True)
    summary = summary_of(run_dir)
    out = run_dir / "report"
    for name in ("downstream_cloze_ja.png", "downstream_cloze_en.png", *PLOTS):
        assert_png(out / name)
    # Every panel of every plot marks the two stages (3 + 2 + 2 loss/optim/throughput panels, 2 per task).
    assert marked and all(stages == [(1, 0.0), (2, 30 * TOKENS_PER_STEP)] for stages in marked)
    assert len(marked) >= 3 + 2 + 2 + 2 * 2

    assert "## Downstream evaluation" in summary
    # Columns: last, its step, first, best, scorings; from the continued timeline (10..40, then 50..80 replayed):
    # the rolled-back step-50 score (1.4) is neither last nor best.
    assert "| cloze_ja | exact_match | 0.8000 | 80 | 0.1000 | 0.8000 | 8 |" in summary
    assert "| cloze_ja | loglik | -8.2000 | 80 | -8.9000 | -8.2000 | 8 |" in summary
    assert "| cloze_en | exact_match | 0.4000 | 80 | 0.0500 | 0.4000 | 8 |" in summary
    assert "| cloze_en | loglik | -7.2000 | 80 | -7.9000 | -7.2000 | 8 |" in summary
    assert f"Downstream time share: {100 * (0.02 + 80 / 4000):.1f}% of the run's wall time" in summary
    assert "in all (`eval/downstream_seconds`)" in summary
    html = (out / "summary.html").read_text()
    assert "<img src='downstream_cloze_ja.png'" in html and "<img src='downstream_cloze_en.png'" in html

    # Scoring and validation rows carry tokens but start no new segment: the train rows stay on the timeline.
    records = build_timeline(read_jsonl(run_dir / "metrics.jsonl").rows)
    assert sorted({r.step for r in records if r.abandoned}) == list(range(41, 56))
    timeline = Timeline(records)
    assert list(timeline.series("train/loss").steps) == list(range(1, 81))
    assert list(timeline.series("eval/cloze_ja/exact_match").steps) == [10, 20, 30, 40, 50, 60, 70, 80]


def test_running_run_with_a_cut_last_line_and_nothing_optional(tmp_path):
    """bf16 (no loss scale), no val, no events file, a half-written last line: still a report."""
    run_dir = write_run(tmp_path / "run", fp16=False, with_val=False, with_events=False, partial_tail=True)
    (run_dir / "config.yaml").write_text("name: unit_run\ntrain:\n  tokens: 1000000\n")
    out = tmp_path / "elsewhere" / "rep"  # --out: the run dir may be read-only
    assert report.main([str(run_dir), "--out", str(out), "--smooth", "0"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted([*PLOTS, "summary.md", "summary.html"])
    assert not (run_dir / "report").exists()
    for name in PLOTS:
        assert_png(out / name)
    summary = (out / "summary.md").read_text()
    assert "running or stopped early" in summary
    assert "last line of metrics.jsonl is incomplete" in summary
    assert "No events recorded" in summary and "val/" not in summary


def test_corrupt_middle_line_is_counted_not_hidden(tmp_path):
    run_dir = write_run(tmp_path / "run")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    lines[3] = lines[3][:20]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    parsed = read_jsonl(run_dir / "metrics.jsonl")
    assert parsed.corrupt_lines == [4] and not parsed.partial_last_line


def test_report_dir_is_replaced_as_a_whole(tmp_path):
    """A rerun swaps the whole dir; a write that fails leaves the previous report untouched."""
    out = tmp_path / "run" / "report"

    def write(version: str, fail: bool = False):
        def writer(tmp: Path) -> None:
            (tmp / "summary.md").write_text(version)
            if fail:
                raise RuntimeError("disk full")
        return writer

    report.write_atomically(out, write("v1"))
    (out / "stale.txt").write_text("from an older report")
    report.write_atomically(out, write("v2"))
    assert (out / "summary.md").read_text() == "v2" and not (out / "stale.txt").exists()
    with pytest.raises(RuntimeError):
        report.write_atomically(out, write("v3", fail=True))
    assert (out / "summary.md").read_text() == "v2"
    assert [p.name for p in out.parent.iterdir()] == ["report"]  # no temp or old dirs left


def test_missing_metrics_is_a_clear_exit_2(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "metrics.jsonl") in err
    assert not (tmp_path / "report").exists()


def test_metrics_without_a_train_step_yet_is_exit_2(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "val/en/loss": 6.2}\n')
    assert report.main([str(tmp_path)]) == 2
    assert "no training records yet" in capsys.readouterr().err


@pytest.mark.parametrize("value, text", [(0, "0"), (512, "512"), (20_000, "20k"), (1_500_000, "1.5M"),
                                         (2.25e9, "2.25B")])
def test_token_tick_labels(value, text):
    assert short_count(value) == text


def test_through_the_ayumi_cli(tmp_path):
    run_dir = write_run(tmp_path / "run", fp16=False)
    proc = subprocess.run([sys.executable, "-m", "pretrain.tools.cli", "report", str(run_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "summary.html" in proc.stdout
    assert (run_dir / "report" / "summary.md").exists()


def test_a_short_downstream_time_is_not_rounded_to_nothing(tmp_path):
    """Issue 39: a small run's report read "41.6% of the run's wall time … 0s in all": scorings of a fraction of a
    second each were summed, then rounded to whole seconds, while the share said they were much of the run."""
    run_dir = write_run(tmp_path / "run", downstream_every=10, val_tokens=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        if "eval/downstream_seconds" in row:
            row["eval/downstream_seconds"], row["eval/time_share"] = 0.06, 0.416
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    summary = summary_of(run_dir, "--smooth", "0")
    # Nine scorings (the rolled-back one at step 50 included: its time was spent): 0.54 s.
    assert ("Downstream time share: 41.6% of the run's wall time (`eval/time_share` at the last scoring); "
            "0.5s in all (`eval/downstream_seconds`).") in summary


def write_eval_curve(run_dir: Path) -> Path:
    """RUN_DIR/eval/downstream.json as `ayumi eval RUN_DIR --all` writes it: steps 20 and 80 scored, 40 damaged."""
    def scored(step: int, exact: float, loglik: float) -> dict:
        body = {"kind": "cloze", "metrics": {"exact_match": exact, "loglik": loglik}, "n": 4,
                "stderr": {"exact_match": 0.25, "loglik": None}, "examples": []}
        return {"label": f"step_{step:07d}", "step": step, "tasks": {"cloze_ja": body}}

    damaged = {"label": "step_0000040", "step": 40, "damaged": True,
               "error": "mp_rank_00_model_states.pt does not match the xxh3_128 checksum recorded at save"}
    curve = {"target": str(run_dir), "settings": {}, "scores": [scored(20, 0.25, -9.1), damaged,
                                                                 scored(80, 0.75, -8.3)]}
    (run_dir / "eval").mkdir()
    path = run_dir / "eval" / "downstream.json"
    path.write_text(json.dumps(curve))
    return path


def test_the_curve_ayumi_eval_all_wrote_is_in_the_report(tmp_path, capsys):
    """Issue 48, papercut: `ayumi report` showed the in-loop scores only, not the curve `ayumi eval RUN_DIR --all`
    wrote. Now a section with a row per checkpoint (value ± stderr, a damaged one marked and why) and a plot per
    task; a checkpoint saved after the curve is named with the command that scores it."""
    run_dir = write_run(tmp_path / "run", downstream_every=10, val_tokens=True)
    write_eval_curve(run_dir)
    (run_dir / "checkpoints" / "step_0000080").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_0000090").mkdir()
    summary = summary_of(run_dir)  # the real CLI on a real run's curve: tests/pretrain/test_downstream_cpu.py
    out = run_dir / "report"
    assert "eval_curve_cloze_ja.png" in capsys.readouterr().out
    assert_png(out / "eval_curve_cloze_ja.png")
    assert "## Downstream evaluation of the checkpoints" in summary
    assert "| checkpoint | step | tokens | cloze_ja exact_match (n=4) | cloze_ja loglik (n=4) |" in summary
    # Tokens from the continued timeline at the checkpoint's step (step 80: 80 x 512, after the rollback).
    assert "| step_0000020 | 20 | 10.24k | 0.2500 ± 0.2500 | -9.1000 ± N/A |" in summary
    assert "| step_0000040 | 40 | 20.48k | damaged | damaged |" in summary
    assert "| step_0000080 | 80 | 40.96k | 0.7500 ± 0.2500 | -8.3000 ± N/A |" in summary
    assert ("Left out of the curve: step_0000040 (mp_rank_00_model_states.pt does not match the xxh3_128 checksum "
            "recorded at save).") in summary
    assert (f"Saved after the curve was written, so not on it: step_0000090. Run `ayumi eval {run_dir.resolve()} "
            f"--all` again to score them.") in summary
    assert "| `eval/downstream.json` |" in summary
    assert "<img src='eval_curve_cloze_ja.png'" in (out / "summary.html").read_text()
    assert "## Downstream evaluation\n" in summary  # the in-loop section stays


def test_an_unreadable_curve_is_said_and_the_report_still_made(tmp_path):
    run_dir = write_run(tmp_path / "run")
    write_eval_curve(run_dir).write_text('{"scores": [{"step": 20, "tasks": ')
    summary = summary_of(run_dir)
    assert "`eval/downstream.json` could not be read (JSONDecodeError: " in summary
    assert f"Write it again with `ayumi eval {run_dir.resolve()} --all`." in summary
    assert not list((run_dir / "report").glob("eval_curve_*"))
