"""`ayumi demo`: the whole pipeline on real multilingual text, on this machine, in minutes.

corpus (Debian man pages in Japanese, Jane Austen, the PARI/GP manual, the Python standard
library) -> merged 8k SentencePiece tokenizer -> token shards with validation splits -> the plan
-> a small Llama trained through a 4-stage curriculum with DeepSpeed (2 processes on CPU, or the
GPUs) with one injected loss spike that ayumi detects and recovers from -> per-domain evaluation
-> the run report and an offline W&B run. Each stage is cached, so a second demo only retrains.

A few Japanese and English documents are held out of the corpus before the tokenizer and the shards
see it; cloze tasks cut from them (demo/cloze.py) are scored while the model trains
(`eval.downstream`), and the report plots them.

`ayumi demo corpus` builds (or shows) just the corpus.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from common.conf import REPO_ROOT

EXPERIMENT = "demo"
TOKENIZER_PRESET = "demo_8k"
DATA_PRESET = "demo"
# Which corpus files train which tokenizer domain (ja_clean is a filtered subset of ja_raw).
TOKENIZER_INPUTS = {"ja": "ja_raw", "en": "en", "code": "code", "math": "math"}
HELDOUT_DIR = "demo_cloze"
"""Under the data root: the corpus files without the held-out documents, those documents, the cloze tasks."""


def data_root() -> Path:
    return Path(os.environ.get("AYUMI_DATA_ROOT", REPO_ROOT / ".cache")).resolve()


def run_root() -> Path:
    return Path(os.environ.get("AYUMI_RUN_ROOT", REPO_ROOT / "runs")).resolve()


class Stage:
    """Prints a numbered banner and the stage's duration."""

    def __init__(self, number: int, total: int, title: str):
        self.label = f"[{number}/{total}] {title}"

    def __enter__(self) -> "Stage":
        self.started = time.perf_counter()
        print(f"\n=== {self.label} ===", flush=True)
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            print(f"--- {self.label}: done in {time.perf_counter() - self.started:.0f}s", flush=True)


class DemoError(RuntimeError):
    """A demo stage failed; the message says which and what to look at."""


def check(status: int, what: str) -> None:
    if status != 0:
        raise DemoError(f"{what} failed (exit status {status}); the output above says why")


def build_corpus(corpus_dir: Path) -> dict[str, Path]:
    from demo.corpus import build_demo_corpus

    manifest = build_demo_corpus(corpus_dir)
    missing = manifest.get("missing") or {}
    if not manifest.get("complete"):
        raise DemoError(
            "the demo corpus is incomplete (" + ", ".join(sorted(missing)) + " unavailable). "
            "On a machine without apt-get, give your own JSONL files (one per domain, field `text`): "
            "ayumi demo corpus --use ja_raw=ja.jsonl --use en=en.jsonl --use math=math.jsonl --use code=code.jsonl"
        )
    return {domain: corpus_dir / f"{domain}.jsonl" for domain in ("ja_raw", "ja_clean", "en", "math", "code")}


def hold_out_documents(files: dict[str, Path], heldout_dir: Path) -> dict[str, Path]:
    """The corpus files the tokenizer and the shards read: `files` without the documents the cloze tasks use."""
    from demo.cloze import hold_out

    return hold_out(files, heldout_dir)


def build_cloze(files: dict[str, Path], tokenizer_dir: Path, heldout_dir: Path) -> dict[str, Path]:
    """The cloze task files (task name -> file), cut from the held-out documents with the demo's tokenizer."""
    from demo.cloze import build_cloze_tasks
    from tokenizer.declared import load_declared_tokenizer

    return build_cloze_tasks(heldout_dir, files, load_declared_tokenizer(tokenizer_dir))


def build_tokenizer(files: dict[str, Path], tokenizer_dir: Path) -> None:
    from tokenizer import load_tokenizer_info
    from tokenizer.cli import main as tokenizer_main

    try:
        info = load_tokenizer_info(tokenizer_dir)
        print(f"tokenizer: {tokenizer_dir} (cached, {info.vocab_size} pieces, sha256 {info.sha256[:12]}…)")
        return
    except Exception:
        pass  # not built yet (or incomplete): build it
    overrides = [f"tokenizer={TOKENIZER_PRESET}", f"output_dir={tokenizer_dir}", "overwrite=true"]
    overrides += [f"tokenizer.inputs.{domain}={files[source]}" for domain, source in TOKENIZER_INPUTS.items()]
    check(tokenizer_main(["build", *overrides]), "tokenizer build")


def prepare_shards(files: dict[str, Path], tokenizer_dir: Path, shards: Path) -> None:
    from data.cli import main as data_main

    overrides = [f"data={DATA_PRESET}", f"tokenizer_dir={tokenizer_dir}", f"data.root={shards}", "workers=2"]
    overrides += [f"data.domains.{domain}.inputs=[{path}]" for domain, path in files.items()]
    check(data_main(["prepare", *overrides]), "data prepare")


def training_overrides(shards: Path, tokenizer_dir: Path, runs: Path,
                       cloze_tasks: dict[str, Path] | None = None) -> list[str]:
    """The demo's training config: conf/experiment/demo.yaml with this demo's paths (and its cloze tasks)."""
    return [f"experiment={EXPERIMENT}", f"data.root={shards}", f"data.tokenizer_dir={tokenizer_dir}",
            f"run_root={runs}", *downstream_overrides(cloze_tasks or {})]


def downstream_overrides(tasks: dict[str, Path]) -> list[str]:
    """`eval.downstream.tasks=[{...}, ...]` for the cloze task files; none without tasks (demo.yaml's interval
    and max_examples then score nothing)."""
    from demo.cloze import task_configs

    if not tasks:
        return []
    entries = ["{" + ",".join(f"{key}:{hydra_quote(value)}" for key, value in entry.items()) + "}"
               for entry in task_configs(tasks)]
    return [f"eval.downstream.tasks=[{','.join(entries)}]"]


def hydra_quote(text: str) -> str:
    """A Hydra override's quoted string: a path may hold spaces, commas or quotes; "" stays a string."""
    return "'" + text.replace("'", "\\'") + "'"


def show_plan(overrides: list[str], run_dir: Path) -> None:
    from pretrain.tools.plan import main as plan_main

    # The demo trains afresh each time: a previous demo run is replaced before the plan, which would otherwise plan
    # its resume.
    if run_dir.exists():
        print(f"replacing the previous demo run in {run_dir}")
        shutil.rmtree(run_dir)
    check(plan_main(overrides), "ayumi plan")


def train(overrides: list[str]) -> None:
    from pretrain.tools.launch import main as launch_main

    check(launch_main(overrides), "training")


def report(run_dir: Path) -> None:
    from pretrain.tools.report.build import main as report_main

    check(report_main([str(run_dir)]), "ayumi report")


def summary(run_dir: Path, tokenizer_dir: Path, shards: Path, corpus_dir: Path, heldout_dir: Path,
            started: float) -> str:
    wandb_runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    lines = [
        "",
        f"ayumi demo finished in {(time.perf_counter() - started) / 60:.1f} min. What to open:",
        f"  report      {run_dir / 'report' / 'summary.html'}  (and summary.md, loss.png, optim.png, throughput.png,",
        "              downstream_cloze_ja.png, downstream_cloze_en.png)",
        f"  run dir     {run_dir}  (metrics.jsonl, events.jsonl, config.yaml, checkpoints/)",
        f"  W&B         {wandb_runs[-1] if wandb_runs else run_dir / 'wandb'}",
        f"              upload it with: wandb sync {wandb_runs[-1] if wandb_runs else '<offline-run dir>'}",
        f"  tokenizer   {tokenizer_dir}  (tokenizer.model, tokenizer.json, eval.json)",
        f"  shards      {shards}  (ayumi data inspect {shards})",
        f"  corpus      {corpus_dir}",
        f"  cloze tasks {heldout_dir}  (cloze_ja.jsonl, cloze_en.jsonl from held-out documents; train_inputs/ is the",
        "              corpus the tokenizer and the shards read, without them)",
        f"  HF export   ayumi export hf {run_dir} out/demo_hf",
        story(run_dir),
    ]
    return "\n".join(lines)


def story(run_dir: Path) -> str:
    """What the run's events.jsonl says happened to the injected spike, in one or two lines: the closing line
    must not claim a rollback that did not happen (on some machines a spike has gone unnoticed)."""
    from pretrain.tools.report.timeline import read_jsonl  # the report's reader: a cut last line is skipped

    events = read_jsonl(run_dir / "events.jsonl").rows
    kinds = [e["event"] for e in events]
    faults = [e["step"] for e in events if e["event"] == "fault_injected"]
    listed = "the report lists every event"
    switches = f"{kinds.count('stage_switch')} stage switches"
    if not faults:
        return f"Events: {switches}, no fault injected; {listed}."
    injected = f"a fault injected at step{'s' if len(faults) > 1 else ''} {_steps(faults)}"
    spike = next((e for e in events if e["event"] == "spike"), None)
    rollback = next((e for e in events if e["event"] == "rollback"), None)
    recovered = next((e for e in events if e["event"] == "recovered"), None)
    if spike is None:
        return (f"Events: {switches}, {injected}. It was NOT detected: no spike event, no rollback "
                f"(docs/stability.md says what the detector judges); {listed}.")
    if rollback is None or recovered is None:
        return (f"Events: {switches}, {injected}, detected as a spike at step {spike['step']} (began at "
                f"{spike.get('spike_start')}) but NOT rolled back{_why_not(events)}; {listed}.")
    return (f"Events: {switches}, {injected}, detected as a spike at step {spike['step']} (began at "
            f"{spike.get('spike_start')}), rolled back to step {rollback.get('to_step')} and recovered in "
            f"{recovered.get('latency_s', 0):.1f}s; {listed}.")


def _why_not(events: list[dict]) -> str:
    """Why a detected spike was not rolled back, when the events say: the run stopped instead."""
    stop = next((e for e in events if e["event"] == "stop"), None)
    return f": the run stopped at step {stop['step']}" if stop is not None else ""


def _steps(steps: list[int]) -> str:
    """"601-603" for consecutive steps, else "601, 640"."""
    steps = sorted(steps)
    if len(steps) > 1 and steps == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}-{steps[-1]}"
    return ", ".join(map(str, steps))


def main_demo(argv: list[str]) -> int:
    from common.conf import config_help

    reads = (f"conf/experiment/{EXPERIMENT}.yaml (training), conf/tokenizer/{TOKENIZER_PRESET}.yaml and "
             f"conf/data/{DATA_PRESET}.yaml, with paths under $AYUMI_DATA_ROOT (.cache) and $AYUMI_RUN_ROOT (runs)")
    parser = argparse.ArgumentParser(prog="ayumi demo", description=__doc__, epilog=config_help(reads, overrides=False),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    started = time.perf_counter()
    root, runs = data_root(), run_root()
    corpus_dir, tokenizer_dir = root / "demo_corpus", root / "tokenizers" / TOKENIZER_PRESET
    shards, run_dir, heldout_dir = root / "shards" / DATA_PRESET, runs / EXPERIMENT, root / HELDOUT_DIR
    try:
        with Stage(1, 6, "demo corpus: real Japanese, English, math and code text, a few documents held out"):
            files = hold_out_documents(build_corpus(corpus_dir), heldout_dir)
        with Stage(2, 6, "merged SentencePiece tokenizer (8k pieces)"):
            build_tokenizer(files, tokenizer_dir)
        with Stage(3, 6, "token shards with validation splits; cloze tasks from the held-out documents"):
            prepare_shards(files, tokenizer_dir, shards)
            cloze_tasks = build_cloze(files, tokenizer_dir, heldout_dir)
        overrides = training_overrides(shards, tokenizer_dir, runs, cloze_tasks)
        with Stage(4, 6, "the plan: stages, repetition, steps, disk"):
            show_plan(overrides, run_dir)
        with Stage(5, 6, "training: 4-stage curriculum, one injected spike, DeepSpeed"):
            train(overrides)
        with Stage(6, 6, "run report"):
            report(run_dir)
    except DemoError as err:
        print(f"\nayumi demo: {err}", file=sys.stderr)
        return 1
    print(summary(run_dir, tokenizer_dir, shards, corpus_dir, heldout_dir, started))
    return 0


def main(argv: list[str]) -> int:
    if argv and argv[0] == "corpus":
        from demo.corpus import main_corpus

        return main_corpus(argv[1:])
    return main_demo(argv)
