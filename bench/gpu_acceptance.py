"""Acceptance run on one GPU: ayumi's GPU paths measured and checked in one prepared command.

    python bench/gpu_acceptance.py --out OUT [--work DIR] [--budget 360] [--parts correctness,peer,...|all]
                                   [--demo-data DIR]
    python bench/gpu_acceptance.py --cpu-smoke --out OUT    # every part with tiny shapes on the CPU (the suite runs it)

Made for a GPU machine that is lent for minutes and has no package registry (docs/performance.md,
"Running on a machine without a registry"): nothing here is set up or debugged on the GPU. Each part
runs in processes of its own under its own time limit, inside one overall budget; a part that fails or
runs out of time is recorded and the next one starts. After every part the JSON record and the markdown
table in OUT are rewritten whole (a killed run still leaves every finished part), and the end of that
part's log is appended to OUT's parts.log. The run ends with the table and RESULT lines (bench/README.md)
for the figures that have targets.

Without --parts a GPU run runs the prepared command's parts (marked *; DEFAULT_PARTS), whose time limits fit the
default budget of 360 s on one H100 or H200 (docs/performance.md, "The prepared GPU command"); `--parts all` runs
every part, and so does --cpu-smoke unless --parts says otherwise. The parts in schedule order (letters as in
docs/performance.md):
  env              (a) GPU, driver, CUDA, torch, DeepSpeed; a dense bf16 GEMM 8192^3 against the datasheet peak
  correctness *    (d) a small model, 30 steps each, all runs at once: two seeded runs identical; the first step's
                   loss the same under ZeRO 0/1/2/3 (the same initial weights, <= 1e-7 relative); ZeRO 0/2/3
                   against ZeRO-1 (bf16) and against fp32 over every step; compiled blocks against eager; the
                   plain loss (whole logits) against the fused default; fp32 gradient accumulation over 4 micro batches against one
                   4x larger
  checkpoint_kill  (e) kill -9 while an asynchronous save is being written, resume: the losses equal an
                   uninterrupted run's
  stability        (f) an injected spike (LR x50) is detected, rolled back and its batches skipped
                   (these three run side by side: small models, mostly process start-up)
  long_context *   (h) document masking through the kernel ayumi picks (pretrain/model/documents.py): each packed
                   document's losses equal it alone; a step's time against causal attention (1b-like layers, seq
                   4096); llama3 RoPE scaling's logits against transformers'; a short-to-long curriculum (256 then
                   1024 tokens, compiled, document masking) trains at each stage's length
  peer *           (b) the peer: speed_1b_2048's model and tokens a step (8 x 4 x 2048) trained by a plain PyTorch
                   loop: transformers' LlamaForCausalLM (random init), torch.compile of the whole model, bf16
                   autocast over fp32 weights, fused AdamW, random token ids. Median tokens/s, MFU by the trainer's
                   FLOP count, max_memory_allocated; ayumi's speed_1b_2048 tokens/s over the peer's >= 1.25
  speed_1b_2048 *  (b, c) the 1b preset, seq 2048, micro 16 x accum 2 (65,536 tokens a step), compiled blocks, no
                   checkpointing: median tokens/s per GPU over timed steps after warm-up, MFU (the trainer's FLOP
                   count: 6 N_matmul + 12 L h s per token) >= 55%, the memory plan's peak within 10% of
                   torch.cuda.max_memory_allocated, and that <= 64.5 GiB
  speed_1b_4096 *  (b, c) the same at seq 4096, micro 8 x accum 2: MFU >= 55%, the plan within 10%
  speed_7b_layers * (b, c) Llama-2-7B's layers (4 of them), seq 2048, micro 16 x accum 2: MFU >= 58%, the plan
                   within 10%
  profile_1b *     (b) the 1b preset profiled for 2 steps: the kernels by GPU time and the share of the step the GPU
                   is busy, copied to OUT as profile_1b.txt (where the MFU goes)
  checkpoint_save  (e) the asynchronous save's blocked time against a synchronous save, 1b model (bench/checkpoint_async.py)
  demo_train       (g) the demo's training phase (`ayumi train experiment=demo`) on the GPU, timed; needs
                   --demo-data (the shards and tokenizer `ayumi demo` builds)
  speed_1b_plan    (b, c) the 1b preset with twice the micro batch and the checkpointing the memory plan picks for it
  speed_1b_plain_loss (b) the 1b preset with the plain loss (whole logits) against the fused default
  speed_1b_fp8     (i) speed_1b_2048 with model.fp8=tensorwise: tokens/s >= 1.15x speed_1b_2048's in the same run
  speed_7b_layers_fp8 (i) speed_7b_layers with model.fp8=tensorwise: tokens/s >= 1.25x speed_7b_layers's
  fp8_loss         (i) the 125m preset's layers, 300 steps of 16 x 512 tokens: bf16, FP8 tensorwise and rowwise from
                   the same seed and data; the last 50 steps' mean loss within 1% of bf16's, no stability event
                   (the FP8 command: --parts speed_1b_2048,speed_1b_fp8,speed_7b_layers,speed_7b_layers_fp8,fp8_loss)

Exit status: 0 when every part ran and passed, 1 otherwise (the table says which).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.result_form import machine_line, result_line  # noqa: E402  (first: it reads the load at the start)
from bench.gpu_speed import MEMORY_BAND, attention_kernels, kernel_choices, partial_of  # noqa: E402
from common.files import write_text_atomic  # noqa: E402


@dataclass(frozen=True)
class Part:
    key: str
    letter: str
    title: str
    limit_s: int
    """Wall-clock limit on one H100/H200, started fresh (caches cold). The CPU smoke run allows SMOKE_LIMIT_S."""


PARTS = {p.key: p for p in [
    Part("env", "a", "environment and a dense bf16 GEMM", 60),
    Part("correctness", "d", "correctness on the GPU (small model, 30 steps)", 45),
    Part("checkpoint_kill", "e", "kill -9 during an asynchronous write, then resume", 180),
    Part("stability", "f", "an injected spike: detected, rolled back, batches skipped", 180),
    Part("long_context", "h", "document masking, llama3 RoPE against transformers, short to long", 80),
    Part("peer", "b", "the peer: a plain PyTorch loop (transformers, torch.compile, autocast), 1b, seq 2048", 170),
    Part("peer_torchtitan", "b", "the second peer: torchtitan's Llama 3 model and trainer, 1b shape, seq 2048", 80),
    Part("speed_1b_2048", "b", "1b, seq 2048, compiled blocks, no checkpointing", 55),
    Part("speed_1b_4096", "b", "1b, seq 4096, compiled blocks, no checkpointing", 55),
    Part("speed_7b_layers", "b", "Llama-2-7B layers (4), seq 2048, compiled blocks", 55),
    Part("profile_1b", "b", "1b, seq 2048: the kernels by GPU time over 2 profiled steps (for tuning)", 45),
    Part("checkpoint_save", "e", "asynchronous vs synchronous save of the 1b model", 150),
    Part("demo_train", "g", "the demo's training phase", 180),
    Part("speed_1b_plan", "b", "1b, seq 2048, twice the micro batch, the plan's checkpointing", 150),
    Part("speed_1b_plain_loss", "b", "1b, seq 2048, the loss in one pass (model.loss_chunk_tokens=0)", 150),
    Part("speed_1b_fp8", "i", "1b, seq 2048, compiled blocks, FP8 tensorwise (model.fp8)", 55),
    Part("speed_7b_layers_fp8", "i", "Llama-2-7B layers (4), seq 2048, compiled blocks, FP8 tensorwise", 55),
    Part("fp8_loss", "i", "125m, 300 steps: bf16 against FP8 tensorwise and rowwise, same seed and data", 180),
]}
SCHEDULE = [["env"], ["correctness", "checkpoint_kill", "stability"], ["long_context"], ["peer"], ["speed_1b_2048"],
            ["speed_1b_4096"], ["speed_7b_layers"], ["profile_1b"], ["peer_torchtitan"], ["checkpoint_save"],
            ["demo_train"],
            ["speed_1b_plan"], ["speed_1b_plain_loss"], ["speed_1b_fp8"], ["speed_7b_layers_fp8"], ["fp8_loss"]]
"""Batches in order; the parts of one batch run at the same time (small models: the GPU is shared)."""
DEFAULT_PARTS = ["correctness", "long_context", "peer", "speed_1b_2048"]
"""The prepared GPU command (docs/performance.md): what the next GPU session must measure, most valuable first.
Their limits add up to 350 s, under DEFAULT_BUDGET_S with the driver's own start, sized from the H200 run of
2026-11-28 (correctness 28 s; long_context over 60 s; the peer's first whole-model compile 50.8 s a layout; speed_1b_2048
44.5 s). The other parts run by --parts."""
SESSION_PARTS = ["speed_7b_layers", "profile_1b", "peer_torchtitan"]
"""The second acceptance run of a lent session's script (bench/gpu_session.sh), after the prepared command: the 7B
layers' MFU, the profile (37.5 s on the H200) and the second peer. Their limits add up to 180 s (SESSION_BUDGET_S)."""
SESSION_BUDGET_S = 185
FP8_PARTS = ["speed_1b_2048", "speed_1b_fp8", "speed_7b_layers", "speed_7b_layers_fp8", "fp8_loss"]
"""The prepared FP8 command (`--parts` these, `--budget 410`; docs/performance.md): each FP8 speed part beside its bf16
part in the same run, and the loss comparison. Their limits add up to 400 s."""
DEFAULT_BUDGET_S = 360
SMOKE_LIMIT_S = 540
"""Each part's limit in the CPU smoke run: there it only stops a hung part (a CPU's time says nothing of a GPU's)."""
MIN_START_S = 20
"""A part is not started with less than this left of the budget."""
BF16_TOLERANCE = 0.02
"""Correctness: the largest relative loss difference allowed between two bf16 runs that differ in how they compute
(compiled kernels, the loss's path, accumulation: bf16 roundings from the first step on), over 30 steps of a small
model."""
ZERO_TOLERANCE = 0.005
"""ZeRO-0, -2 and -3 against ZeRO-1 over the 30 steps: the same fp32 master weights, fp32 Adam and bf16 gradients on
one rank, so only reduction order and gathers differ. In bf16 on an AVX512-BF16 CPU (this model, 30 steps): ZeRO-2
bit for bit, ZeRO-3 3.7e-4, ZeRO-0 4.7e-4; the tolerance leaves 10x that for the GPU's kernels. ZeRO-0 reached
1.76e-2 on an H200 (and on that CPU) while DeepSpeed 0.19's stage-0 wrapper (FP16_UnfusedOptimizer) counted the
AdamW step its constructor takes on zero gradients; the engine now undoes that step
(pretrain/engine/train_engine.forget_warm_up_step)."""
FIRST_STEP_TOLERANCE = 1e-7
"""Correctness: ZeRO 0-3's first-step losses, relative (identical in practice: the same initial weights, batch and
kernels on one rank)."""
FP32_TOLERANCE = 0.03
"""The same between a bf16 run and the fp32 run."""
PEAK_GEMM_TARGET = 0.70
"""The measured GEMM against the datasheet's dense bf16 peak: below this the machine itself is slow."""
ASYNC_TARGET = 0.10


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="results.json, results.md and parts.log go here")
    p.add_argument("--work", default=None, help="runs, corpora and logs (default: a temporary folder)")
    p.add_argument("--budget", type=int, default=DEFAULT_BUDGET_S,
                   help="seconds for the whole run (no part starts after)")
    p.add_argument("--parts", default=None,
                   help=f"comma-separated part keys, run in schedule order, or `all` "
                        f"(default: {','.join(DEFAULT_PARTS)}; with --cpu-smoke every part)")
    p.add_argument("--part-limit", action="append", default=[], metavar="KEY=SECONDS",
                   help="replace a part's time limit (repeatable), e.g. on a slower GPU")
    p.add_argument("--demo-data", default=None, help="folder holding shards/demo and tokenizers/demo_8k (demo_train)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU: checks the paths, not the figures")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# == driver ========================================================================================
def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    wanted = wanted_parts(args.parts, args.cpu_smoke)
    unknown = [k for k in wanted if k not in PARTS]
    if unknown:
        print(f"gpu_acceptance: unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}", file=sys.stderr)
        return 2
    try:
        args.limits = part_limits(args.part_limit)
    except ValueError as err:
        print(f"gpu_acceptance: {err}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="ayumi_acceptance_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    report = {"command": "python bench/gpu_acceptance.py " + " ".join(argv), "machine": machine_line(),
              "host": platform.node(), "cpu_smoke": args.cpu_smoke, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "budget_s": args.budget, "parts": {}}
    print(report["machine"], flush=True)
    print(expected_total(wanted, args), flush=True)
    deadline = time.monotonic() + args.budget
    for batch in SCHEDULE:
        keys = [k for k in batch if k in wanted]
        if keys:
            run_batch(keys, args, work, out, report, deadline)
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    write_report(out, report)
    print((out / "results.md").read_text(), flush=True)
    if args.cpu_smoke:
        print("[acceptance] --cpu-smoke: every part ran on the CPU; no RESULT (nothing measured on a GPU)")
    else:
        print("\n".join(result_lines(report["parts"])), flush=True)
    return 0 if all(r["status"] == "passed" for r in report["parts"].values()) else 1


def wanted_parts(parts: str | None, cpu_smoke: bool) -> list[str]:
    """The part keys asked for: --parts as given, every part for `all`, else the prepared command's (on a GPU) or
    every part (--cpu-smoke: the suite proves every path)."""
    if parts is None:
        return list(PARTS) if cpu_smoke else list(DEFAULT_PARTS)
    return list(PARTS) if parts == "all" else [k for k in parts.split(",") if k]


def expected_total(wanted: list[str], args) -> str:
    """One line before the run starts: the parts, their limits and the most the run can take (the limits of parts that
    run side by side overlap; the budget caps the sum)."""
    limit = (lambda key: args.limits.get(key, SMOKE_LIMIT_S)) if args.cpu_smoke else \
        (lambda key: args.limits.get(key, PARTS[key].limit_s))
    batches = [[key for key in batch if key in wanted] for batch in SCHEDULE]
    total = sum(max(limit(key) for key in batch) for batch in batches if batch)
    listed = ", ".join(f"{key} {limit(key):.0f} s" for batch in batches for key in batch)
    return (f"[acceptance] {len(wanted)} parts ({listed}): at most {min(total, args.budget):.0f} s "
            f"(limits {total:.0f} s, budget {args.budget} s)")


def part_limits(pairs: list[str]) -> dict[str, float]:
    """--part-limit KEY=SECONDS values, checked."""
    limits = {}
    for pair in pairs:
        key, _, seconds = pair.partition("=")
        if key not in PARTS or not seconds.replace(".", "", 1).isdigit():
            raise ValueError(f"--part-limit {pair!r}: expected KEY=SECONDS with KEY one of {', '.join(PARTS)}")
        limits[key] = float(seconds)
    return limits


def run_batch(keys: list[str], args, work: Path, out: Path, report: dict, deadline: float) -> None:
    """Start the batch's parts together, each under min(its limit, the budget left); wait for all."""
    left = deadline - time.monotonic()
    if left < MIN_START_S:
        for key in keys:
            report["parts"][key] = {"status": "skipped", "detail": f"not started: {left:.0f} s of the budget left"}
        write_report(out, report)
        return
    running = {}
    for key in keys:  # listed in schedule order now, whatever order they finish in
        report["parts"][key] = {"status": "running", "title": PARTS[key].title, "letter": PARTS[key].letter,
                                "detail": "started, not finished"}
        limit = args.limits.get(key, SMOKE_LIMIT_S if args.cpu_smoke else PARTS[key].limit_s)
        running[key] = start_part(key, args, work, min(limit, left))
        print(f"[acceptance] {key}: started (limit {min(limit, left):.0f} s, log {running[key]['log']})", flush=True)
    write_report(out, report)
    while running:
        time.sleep(0.5)
        for key in list(running):
            entry = running[key]
            timed_out = time.monotonic() > entry["deadline"]
            if entry["proc"].poll() is None and not timed_out:
                continue
            if timed_out and entry["proc"].poll() is None:
                os.killpg(entry["proc"].pid, signal.SIGKILL)
                entry["proc"].wait()
            report["parts"][key] = finish_part(key, entry, timed_out)
            del running[key]
            compare(report["parts"], key, args.cpu_smoke)
            print(f"[acceptance] {key}: {report['parts'][key]['status']} in {report['parts'][key]['seconds']:.0f} s",
                  flush=True)
            append_log(out / "parts.log", key, entry["log"])
            attachment = work / key / "attach.txt"
            if attachment.is_file():  # e.g. a profile: beside the results, under the part's name
                shutil.copyfile(attachment, out / f"{key}.txt")
            write_report(out, report)


def start_part(key: str, args, work: Path, limit: float) -> dict:
    part_dir = work / key
    part_dir.mkdir(parents=True, exist_ok=True)
    result, log = part_dir / "result.json", part_dir / "part.log"
    result.unlink(missing_ok=True)
    partial_path(result).unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(part_dir), "--work", str(part_dir),
           "--worker", key, "--result", str(result)]
    if args.cpu_smoke:
        cmd.append("--cpu-smoke")
    if args.demo_data:
        cmd += ["--demo-data", str(Path(args.demo_data).resolve())]
    handle = open(log, "w")
    # A session of its own: a part over its limit is killed with every process it started.
    proc = subprocess.Popen(cmd, cwd=REPO, env=part_env(args.cpu_smoke, key), stdout=handle, stderr=subprocess.STDOUT,
                            start_new_session=True)
    handle.close()
    return {"proc": proc, "log": log, "result": result, "started": time.monotonic(), "deadline": time.monotonic() + limit}


def part_env(cpu_smoke: bool, key: str = "") -> dict[str, str]:
    """A part's environment: the repository importable, W&B off, no rank variables of an enclosing launcher; the
    torchtitan part also sees the folder torchtitan is installed in (bench/torchtitan_peer.py: never ayumi's own
    environment)."""
    from bench.torchtitan_peer import site_folder

    titan = site_folder() if key == "peer_torchtitan" else None
    paths = [str(REPO), titan, os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, WANDB_MODE="disabled", WANDB_SILENT="true", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(path for path in paths if path))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        env.pop(key, None)
    if cpu_smoke:
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return env


def finish_part(key: str, entry: dict, timed_out: bool) -> dict:
    seconds = time.monotonic() - entry["started"]
    base = {"title": PARTS[key].title, "letter": PARTS[key].letter, "seconds": round(seconds, 1)}
    if entry["result"].is_file():
        result = json.loads(entry["result"].read_text())
        passed = all(check["ok"] for check in result.get("checks", []))
        status = "passed" if passed and not timed_out else ("timeout" if timed_out else "failed")
        return {**base, "status": status, **result}
    tail = entry["log"].read_text(errors="replace")[-1500:] if entry["log"].is_file() else ""
    status = "timeout" if timed_out else "error"
    failed = {**base, "status": status, "exit": entry["proc"].returncode, "log_tail": tail}
    partial = partial_path(entry["result"])
    if partial.is_file():  # what the part measured before it was stopped or failed
        result = json.loads(partial.read_text())
        how = f"stopped at its limit after {seconds:.0f} s" if timed_out else f"failed (exit {entry['proc'].returncode})"
        rows = [*result.get("rows", []), ["partial result", f"the part {how}: the rows above are what it finished",
                                          "", False]]
        return {**failed, **result, "rows": rows, "partial": True}
    return failed


def append_log(path: Path, key: str, log: Path) -> None:
    text = log.read_text(errors="replace") if log.is_file() else "(no log)"
    with open(path, "a") as handle:
        handle.write(f"\n===== {key} (last 6000 characters of {log}) =====\n{text[-6000:]}\n")


def write_report(out: Path, report: dict) -> None:
    """results.json and results.md, each replaced whole (a reader never sees half a file)."""
    write_json(out / "results.json", report)
    write_text_atomic(out / "results.md", markdown(report))


def markdown(report: dict) -> str:
    lines = [f"Command: `{report['command']}`  ", f"Machine: {report['machine']}  ", f"Started: {report['started']}", "",
             "| part | figure | value | target | ok |", "|---|---|---|---|---|"]
    for key, part in report["parts"].items():
        label = f"{part.get('letter', PARTS[key].letter)}. {key}"
        if not part.get("rows") or (part["status"] in ("skipped", "error", "running") and not part.get("partial")):
            detail = part.get("detail") or (part.get("log_tail", "").strip().splitlines() or ["no result"])[-1]
            lines.append(f"| {label} | {part['status']} | {detail[:160].replace('|', '/')} | | no |")
            continue
        for figure, value, target, ok in part["rows"]:
            ok_text = {True: "yes", False: "**no**", None: ""}[ok]
            cells = [str(c).replace("|", "/") for c in (figure, value, target)]
            lines.append(f"| {label} | {cells[0]} | {cells[1]} | {cells[2]} | {ok_text} |")
        if part["status"] == "timeout" and not part.get("partial"):
            lines.append(f"| {label} | timeout | stopped at its limit after {part['seconds']:.0f} s | | **no** |")
    return "\n".join(lines) + "\n"


def result_lines(parts: dict) -> list[str]:
    """RESULT lines for the figures with targets: the GEMM, each speed part's MFU and memory, ayumi's tokens/s
    against the peer's, document masking's step time against causal attention, the async save."""
    from bench.gpu_speed import result_lines as speed_lines

    lines = []
    env = parts.get("env", {}).get("figures", {})
    if env.get("peak_tflops"):
        lines.append(result_line("gpu_acceptance_gemm", env["gemm_tflops"], env["peak_tflops"],
                                 f">={PEAK_GEMM_TARGET:.2f}", unit="TFLOP/s"))
    for key in SPEED:
        figures = parts.get(key, {}).get("figures")
        if figures and figures.get("tokens_per_s") and "max_allocated" in figures:
            # Named by the part as well: two parts can share a shape, a sequence length and a policy.
            lines += speed_lines(SPEED[key]["shape"], f"seq{figures['seq_len']}",
                                 f"{figures['checkpointing']}_{key}", figures, judged=SPEED[key].get("judged", False))
    ours, peer = (parts.get(key, {}).get("figures") or {} for key in ("speed_1b_2048", "peer"))
    if ours.get("tokens_per_s") and peer.get("tokens_per_s"):
        # Judged on the ratio; never ok when the two trained different tokens a step or lengths.
        lines.append(result_line("gpu_acceptance_vs_peer", ours["tokens_per_s"], peer["tokens_per_s"],
                                 f">={PEER_TARGET}", unit="tok/s", ok=None if same_work(ours, peer) else False))
    titan = parts.get("peer_torchtitan", {}).get("figures") or {}
    if ours.get("tokens_per_s") and titan.get("tokens_per_s"):
        # Shown, not judged (a study): torchtitan is the field's reference loop, beside the plain recipe's bar.
        lines.append(result_line("gpu_acceptance_vs_torchtitan", ours["tokens_per_s"], titan["tokens_per_s"],
                                 f">={PEER_TARGET}", unit="tok/s", study=True))
    documents = parts.get("long_context", {}).get("figures")
    if documents and "document_step_ms" in documents:
        # ~512-token documents in 4096-token samples: the varlen kernel skips the attention between documents.
        lines.append(result_line("gpu_acceptance_document_masking", documents["document_step_ms"],
                                 documents["causal_step_ms"], "<=1.00", unit="ms"))
    if documents and "long_document_step_ms" in documents:
        # One or two documents a sample: the varlen kernel is causal attention's own, so no slower.
        lines.append(result_line("gpu_acceptance_document_masking_long", documents["long_document_step_ms"],
                                 documents["long_causal_step_ms"], "<=1.03", unit="ms"))
    for fp8, bf16, _, _, target in COMPARISONS[2:]:  # the FP8 speed parts against their bf16 parts
        ours, base = (parts.get(key, {}).get("figures") or {} for key in (fp8, bf16))
        if ours.get("tokens_per_s") and base.get("tokens_per_s"):
            lines.append(result_line(f"gpu_acceptance_{fp8}", ours["tokens_per_s"], base["tokens_per_s"],
                                     f">={target}", unit="tok/s"))
    fp8_loss = parts.get("fp8_loss", {}).get("figures")
    if fp8_loss and "tail" in fp8_loss:
        for recipe in ("tensorwise", "rowwise"):
            ratio = fp8_loss["tail"][recipe] / fp8_loss["tail"]["bf16"]
            lines.append(result_line(f"gpu_acceptance_fp8_loss_{recipe}", fp8_loss["tail"][recipe],
                                     fp8_loss["tail"]["bf16"], f"{1 - FP8_LOSS_TOLERANCE:g}..{1 + FP8_LOSS_TOLERANCE:g}",
                                     ratio=ratio))
    save = parts.get("checkpoint_save", {}).get("figures")
    if save:
        lines.append(result_line("gpu_acceptance_checkpoint_async", save["ours_ms"], save["base_ms"],
                                 f"<={ASYNC_TARGET:.2f}", unit="ms"))
    return lines


# == workers =======================================================================================
def run_worker(args: argparse.Namespace) -> int:
    work = Path(args.work)
    result = WORKERS[args.worker](args, work)
    write_json(Path(args.result), result)
    return 0


def partial_path(result: Path) -> Path:
    """Where a part's worker keeps what it has measured so far (beside its final result.json)."""
    return result.with_name("partial.json")


DIE_AFTER_PARTIAL = "AYUMI_ACCEPTANCE_DIE_AFTER_PARTIAL"
"""A fault drill for the driver: a part whose key this variable names is killed (SIGKILL, by itself) right after its
first partial result, as a part killed at its limit or by the kernel is (tests/bench/test_gpu_acceptance_smoke.py)."""


def write_partial(args, summary: dict) -> None:
    """A worker's result so far (figures, rows, checks, as at its end): a part stopped at its limit still reports it."""
    write_json(partial_path(Path(args.result)), summary)
    if os.environ.get(DIE_AFTER_PARTIAL) == args.worker:
        os.kill(os.getpid(), signal.SIGKILL)


def write_json(path: Path, value: dict) -> None:
    """`value` as JSON at `path`, replaced whole (the driver may read it at any moment)."""
    write_text_atomic(path, json.dumps(value, indent=1, default=str))


def check(name: str, ok: bool, detail: str) -> dict:
    print(f"[{'ok' if ok else 'FAILED'}] {name}: {detail}", flush=True)
    return {"name": name, "ok": bool(ok), "detail": detail}


# -- a. environment ----------------------------------------------------------------------------------
def worker_env(args, work: Path) -> dict:
    import importlib.metadata as md

    import torch

    from pretrain.model.flops import peak_flops_of

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    figures = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
               "deepspeed": md.version("deepspeed"), "transformers": md.version("transformers"),
               "cpus": os.cpu_count()}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        figures.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                       multiprocessors=props.multi_processor_count, driver=nvidia_smi("driver_version"))
    n, dtype = (8192, torch.bfloat16) if cuda else (256, torch.float32)
    device = "cuda" if cuda else "cpu"
    tflops = gemm_tflops(n, dtype, device)
    peak = peak_flops_of(figures["gpu"]) if cuda else None
    figures.update(gemm_n=n, gemm_dtype=str(dtype), gemm_tflops=tflops, peak_tflops=peak / 1e12 if peak else None)
    rows = [["GPU", f"{figures.get('gpu', 'cpu')} ({figures.get('gpu_memory_gib', '-')} GiB)", "", None],
            ["versions", f"driver {figures.get('driver', '-')}, CUDA {figures['cuda']}, torch {figures['torch']}, "
                         f"DeepSpeed {figures['deepspeed']}", "", None]]
    checks = []
    if peak:
        ratio = tflops * 1e12 / peak
        rows.append([f"bf16 GEMM {n}^3", f"{tflops:.0f} TFLOP/s = {100 * ratio:.0f}% of {peak / 1e12:.0f}",
                     f">={100 * PEAK_GEMM_TARGET:.0f}%", ratio >= PEAK_GEMM_TARGET])
        checks.append(check("gemm", ratio >= PEAK_GEMM_TARGET, f"{tflops:.0f} TFLOP/s, {100 * ratio:.0f}% of peak"))
    else:
        rows.append([f"{dtype} GEMM {n}^3 on {device}", f"{tflops:.3g} TFLOP/s", "", None])
    return {"figures": figures, "rows": rows, "checks": checks}


def nvidia_smi(field: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def gemm_tflops(n: int, dtype, device: str) -> float:
    """Dense matrix product n x n x n: the mean of 10 timed products after 3 warm-ups."""
    import torch

    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    sync()
    return 2 * n**3 * 10 / (time.perf_counter() - start) / 1e12


# -- b, c. speed and memory ------------------------------------------------------------------------------
SPEED = {
    "speed_1b_2048": {"shape": "1b", "seq": 2048, "checkpointing": "none", "micro": 16, "judged": True},
    "speed_1b_4096": {"shape": "1b", "seq": 4096, "checkpointing": "none", "micro": 8, "judged": True},
    "speed_7b_layers": {"shape": "7b_short", "seq": 2048, "checkpointing": "none", "micro": 16, "judged": True},
    "profile_1b": {"shape": "1b", "seq": 2048, "checkpointing": "none", "micro": 16, "steps": 2, "warmup": 2,
                   "extra": ["--profile", "{work}/attach.txt"]},
    "speed_1b_plan": {"shape": "1b", "seq": 2048, "checkpointing": "plan"},
    "speed_1b_plain_loss": {"shape": "1b", "seq": 2048, "checkpointing": "none",
                            "extra": ["--set", "model.loss_chunk_tokens=0"]},
    "speed_1b_fp8": {"shape": "1b", "seq": 2048, "checkpointing": "none", "micro": 16,
                     "extra": ["--set", "model.fp8=tensorwise"]},
    "speed_7b_layers_fp8": {"shape": "7b_short", "seq": 2048, "checkpointing": "none", "micro": 16,
                            "extra": ["--set", "model.fp8=tensorwise"]},
}
"""Speed parts: bench/gpu_speed.py's shape, sequence, checkpointing, micro batch on the GPU (pinned where a target
depends on it: 65,536 tokens a step at grad accum 2 on an H100 and an H200 alike; else the largest the plan fits),
timed and warm-up steps (default 6 and 3), extra arguments ({work}: the part's folder; a part's attach.txt is copied
to OUT as <part>.txt), and whether gpu_speed's MFU targets and memory ceiling judge it (`judged`; the others are
diagnostics: a profile, a knob tried). The memory plan's band judges every part."""


def worker_speed(args, work: Path) -> dict:
    """bench/gpu_speed.py for one shape: the trainer as a run builds it, timed per step after warm-up."""
    spec = SPEED[args.worker]
    cmd = [sys.executable, str(REPO / "bench" / "gpu_speed.py"), "--compile", "blocks",
           "--checkpointing", spec["checkpointing"], "--work", str(work),
           *[arg.format(work=work) for arg in spec.get("extra", [])]]
    if args.cpu_smoke:
        cmd += ["--cpu-smoke", "--steps", "2", "--warmup", "1", "--grad-accum", "1"]
        if "model.fp8=tensorwise" in spec.get("extra", []):  # no FP8 on a CPU: torchao's emulation, for the path
            cmd += ["--set", "model.fp8_emulate=true"]
    else:
        cmd += ["--shapes", spec["shape"], "--seq", str(spec["seq"]), "--steps", str(spec.get("steps", 6)),
                "--warmup", str(spec.get("warmup", 3)), "--grad-accum", "2",
                "--micro-batch", str(spec.get("micro", "auto"))]
    shape = "tiny" if args.cpu_smoke else spec["shape"]
    out = work / f"{shape}_blocks_{spec['checkpointing']}.json"
    partial = partial_of(out)
    proc = subprocess.Popen(cmd, cwd=REPO)
    seen = None
    while proc.poll() is None:  # gpu_speed rewrites its partial result after every step: pass it on
        time.sleep(1.0)
        if partial.is_file() and partial.stat().st_mtime_ns != seen:
            seen = partial.stat().st_mtime_ns
            write_partial(args, speed_summary(json.loads(partial.read_text()), spec["shape"], spec.get("judged", False)))
    if proc.returncode != 0:
        raise RuntimeError(f"bench/gpu_speed.py exited {proc.returncode}")
    return speed_summary(json.loads(out.read_text()), spec["shape"], spec.get("judged", False))


def speed_summary(res: dict, shape: str, judged: bool) -> dict:
    """The table's rows and the checks of one speed part: MFU and the memory ceiling where `judged` and gpu_speed
    has a target for the setting, the memory plan's band always."""
    from bench.gpu_speed import memory_ceiling, mfu_target

    tokens = res["tokens_per_s"]  # None in a partial result before the first timed step
    mfu = res.get("mfu")
    plan, measured = res["planned_peak"], res["max_allocated"]
    ratio = plan / measured if measured else None
    setting = (f"micro batch {res['micro_batch']} x seq {res['seq_len']} x accum {res['grad_accum']}, "
               f"checkpointing {res['checkpointing']}, compiled {res['compiled']}")
    rows = [["setting", setting, "", None],
            ["tokens/s per GPU (median step)",
             f"{tokens:,.0f} ({len(res['step_seconds'])} timed steps)" if tokens else "no timed step", "", None]]
    if res["warmup_seconds"]:
        rows.append(["first step (compilation)", f"{res['warmup_seconds'][0]:.1f} s", "", None])
    if res.get("startup_seconds"):
        rows.append(["start-up: process to trainer build / trainer build (model, init, engine)",
                     " / ".join(f"{res['startup_seconds'][key]:.1f} s" for key in ("process_to_build", "build_trainer")),
                     "", None])
    if res.get("kernels"):
        rows.append(["kernels chosen (document attention; fp32-output GEMM)", kernels_text(res["kernels"]), "", None])
    checks = []
    target = mfu_target(shape, res) if judged else None
    if mfu is not None:
        flop = (f"MFU ({res['flops_per_token'] / 1e9:.2f} GFLOP/token = 6 N_matmul + 12 L h s, "
                f"peak {res['peak_flops'] / 1e12:.0f} TFLOP/s)")
        rows.append([flop, f"{100 * mfu:.1f}%", f">={100 * target:.0f}%" if target else "",
                     mfu >= target if target else None])
        if target:
            checks.append(check("mfu", mfu >= target, f"{100 * mfu:.1f}% (target {100 * target:.0f}%)"))
    if ratio is not None:
        ok = MEMORY_BAND[0] <= ratio <= MEMORY_BAND[1]
        rows.append(["memory: plan / max allocated", f"{plan / 2**30:.1f} / {measured / 2**30:.1f} GiB = {ratio:.2f}",
                     f"{MEMORY_BAND[0]:.2f}..{MEMORY_BAND[1]:.2f}", ok])
        checks.append(check("memory_plan", ok, f"plan {plan / 2**30:.2f} GiB, measured {measured / 2**30:.2f} GiB"))
    ceiling = memory_ceiling(shape, res) if judged else None
    if ceiling is not None and measured:
        ok = measured / 2**30 <= ceiling
        rows.append([f"memory: max allocated at micro batch {res['micro_batch']}", f"{measured / 2**30:.1f} GiB",
                     f"<={ceiling} GiB", ok])
        checks.append(check("memory_ceiling", ok, f"max allocated {measured / 2**30:.2f} GiB, ceiling {ceiling} GiB"))
    return {"figures": res, "rows": rows, "checks": checks}


def kernels_text(kernels: dict) -> str:
    """gpu_speed's record of the kernels a run chose ({what: {device: {aspect: choice}}}), in one cell."""
    def per_device(choices: dict) -> str:
        return ", ".join(f"{device} " + " ".join(f"{aspect}={value}" for aspect, value in picked.items()
                                                if aspect != "why") for device, picked in choices.items())
    return "; ".join(f"{name}: {per_device(choices) or 'not used'}" for name, choices in kernels.items())


# -- b. the peer: the plain PyTorch recipe at speed_1b_2048's shape ------------------------------------------
PEER = {"shape": "1b", "seq": 2048, "layouts": [(8, 4), (16, 2)], "warmup": 2, "steps": 5}
"""On the GPU: speed_1b_2048's model, sequence length and tokens a step (65,536), in both layouts of them that fit the
recipe on one H100/H200: micro 8 x accum 4 and ayumi's micro 16 x accum 2. The faster one is the peer's figure. The
recipe keeps the whole [tokens x vocab] logits (bf16, an fp32 copy for the loss, its gradient: about 15 GiB at micro
16) beside fp32 weights, gradients and Adam moments (19 GB)."""
PEER_SMOKE = {"shape": "tiny", "seq": 64, "layouts": [(1, 2), (2, 1)], "warmup": 1, "steps": 2}
"""On the CPU: gpu_speed's tiny shape and the tokens a step of the smoke run's speed_1b_2048 (micro 2 x seq 64), both
layouts, eager: compiling the whole model takes ~40 s of a 2-core box for figures that mean nothing there (the
compiled path was run on the CPU by hand: one graph, no recompilation)."""
PEER_TARGET = 1.25
"""ayumi's speed_1b_2048 tokens/s over the peer's (issue 37): what ayumi's trainer must give over the plain recipe."""
PEER_ATTENTION = "ayumi_peer_causal"
"""The attention the peer registers with transformers (peer_attention): causal SDPA with GQA and no mask."""


def worker_peer(args, work: Path) -> dict:
    """The peer: speed_1b_2048's model trained the way a careful PyTorch user would write it, with no ayumi, DeepSpeed
    or data loader: transformers' LlamaForCausalLM of the same shape (random init, nothing downloaded, use_cache off),
    torch.compile of the whole model, causal SDPA with GQA and no materialised mask (peer_attention), bf16 autocast
    over fp32 weights, gradient clipping and fused AdamW with ayumi's optimizer settings, random token ids already on
    the device. Each layout of 65,536 tokens a step (PEER's) is timed: median tokens/s over the timed steps after
    warm-up, MFU by the trainer's FLOP count (pretrain/model/flops.py), torch.cuda.max_memory_allocated over the timed
    steps, and the attention kernels of one profiled step. The faster layout is the peer's figure. After each layout
    the part's partial result is rewritten (a part stopped at its limit keeps the layouts it finished)."""
    import torch

    from pretrain.model.flops import flops_per_token, peak_flops

    spec = PEER_SMOKE if args.cpu_smoke else PEER
    device = torch.device(device_of(args))
    cfg = peer_config(spec)
    attention = peer_attention()
    model, optimizer = peer_model(cfg, device, compiled=device.type == "cuda", attention=attention)
    flops, peak = flops_per_token(cfg.model, spec["seq"]), peak_flops(device)
    layouts = []
    for micro, accum in spec["layouts"]:
        layouts.append(peer_layout(model, optimizer, cfg, spec, micro, accum, device, flops, peak))
        write_partial(args, peer_summary(peer_figures(layouts, attention, device)))
    return peer_summary(peer_figures(layouts, attention, device))


def peer_layout(model, optimizer, cfg, spec: dict, micro: int, accum: int, device, flops: float, peak) -> dict:
    """One layout (micro x accum) of the peer's tokens a step: warm-up (compilation), timed steps, one profiled step."""
    import torch

    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.model.vocab_size, (micro, spec["seq"]), generator=generator).to(device)
               for _ in range(accum)]
    warmup = [peer_step(model, optimizer, batches, cfg.optim.grad_clip) for _ in range(spec["warmup"])]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timed = [peer_step(model, optimizer, batches, cfg.optim.grad_clip) for _ in range(spec["steps"])]
    max_allocated = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    kernels = attention_kernels(lambda: peer_step(model, optimizer, batches, cfg.optim.grad_clip), device)
    tokens_per_step = micro * accum * spec["seq"]
    tokens_per_s = tokens_per_step / statistics.median(seconds for seconds, _ in timed)
    return {"micro_batch": micro, "grad_accum": accum, "seq_len": spec["seq"], "tokens_per_step": tokens_per_step,
            "tokens_per_s": tokens_per_s, "step_seconds": [s for s, _ in timed],
            "warmup_seconds": [s for s, _ in warmup], "losses": [loss for _, loss in warmup + timed],
            "flops_per_token": flops, "peak_flops": peak, "mfu": tokens_per_s * flops / peak if peak else None,
            "max_allocated": max_allocated, "attention_kernels": kernels}


def peer_figures(layouts: list[dict], attention: str, device) -> dict:
    """The part's figures: the fastest layout's at the top (what ayumi is compared with), every layout under
    `layouts`."""
    import torch

    best = max(layouts, key=lambda layout: layout["tokens_per_s"])
    return {**best, "layouts": layouts, "attention": attention, "compiled": device.type == "cuda",
            "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"}


def peer_config(spec: dict):
    """ayumi's config for the peer's shape (gpu_speed's overrides for it): the model and the optimizer settings."""
    from bench.gpu_speed import SHAPES
    from pretrain.config import compose_config, to_object

    return to_object(compose_config([*SHAPES[spec["shape"]], f"model.max_seq_len={max(spec['seq'], 64)}"]))


def peer_attention() -> str:
    """Register causal SDPA with GQA and no mask with transformers, and return the name to ask for ("sdpa" when this
    transformers cannot register one).

    transformers' own "sdpa" builds a [B, 1, T, T] causal mask whenever it is traced, so under torch.compile of the
    whole model (torch < 2.14) SDPA gets a mask: the memory-efficient kernel over the full T x T, K/V repeated to
    every head, not flash. Training batches here have no padding, so `is_causal` is exact, and `enable_gqa` lets
    SDPA read the K/V heads as they are. The mask function returns None, so no mask is made at all."""
    import torch.nn.functional as F

    try:
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface
    except ImportError:
        return "sdpa"

    def causal_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    def no_mask(*args, **kwargs):
        return None

    AttentionInterface.register(PEER_ATTENTION, causal_sdpa)
    AttentionMaskInterface.register(PEER_ATTENTION, no_mask)
    return PEER_ATTENTION


def peer_model(cfg, device, compiled: bool, attention: str = "sdpa"):
    """LlamaForCausalLM of the shape ayumi's export maps cfg.model to, made on `device` in fp32, with no KV cache and
    the given attention, and its AdamW: decay on the matrices only, fused. Returns (the model to call, compiled or
    not; the optimizer)."""
    import torch
    from transformers import LlamaForCausalLM

    from pretrain.tools.export import to_hf_config

    torch.manual_seed(0)
    config = to_hf_config(cfg.model)
    config.use_cache = False  # training: a KV cache is never read
    config._attn_implementation = attention
    with device:  # drawn where it trains: 1.2 B parameters drawn on the host, then copied, cost seconds of the limit
        model = LlamaForCausalLM(config).train()
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": cfg.optim.weight_decay},
                                   {"params": vectors, "weight_decay": 0.0}], lr=cfg.optim.lr,
                                  betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps, fused=True)
    # dynamic=False: each layout's shape gets its own static graph, as ayumi's compiled blocks do.
    return (torch.compile(model, dynamic=False) if compiled else model), optimizer


def peer_step(model, optimizer, batches: list, grad_clip: float) -> tuple[float, float]:
    """One optimizer step over the micro batches (bf16 autocast, gradients summed in the fp32 weights' .grad):
    (wall seconds, the device synchronised at the end; the step's mean loss)."""
    import torch

    device = batches[0].device
    start = time.perf_counter()
    total = torch.zeros((), device=device)
    for ids in batches:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss / len(batches)  # transformers shifts the labels itself
        loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mean_loss = total.item()  # a host sync, as ayumi's logged loss is
    return time.perf_counter() - start, mean_loss


def peer_summary(figures: dict) -> dict:
    """The peer part's rows and its checks: the losses of every layout are finite (the recipe trained)."""
    rows = [["setting", f"LlamaForCausalLM, seq {figures['seq_len']}, "
                        f"{'torch.compile of the whole model' if figures['compiled'] else 'eager'}, attention "
                        f"{figures['attention']}, bf16 autocast over fp32 weights, fused AdamW, use_cache off", "", None]]
    finite = {}
    for layout in figures["layouts"]:
        name = f"micro {layout['micro_batch']} x accum {layout['grad_accum']}"
        chosen = " (the peer's figure: the faster)" if layout["micro_batch"] == figures["micro_batch"] else ""
        mfu = f", MFU {100 * layout['mfu']:.1f}%" if layout["mfu"] is not None else ""
        memory = f", max allocated {layout['max_allocated'] / 2**30:.1f} GiB" if layout["max_allocated"] else ""
        rows.append([f"{name}: tokens/s per GPU (median step){chosen}", f"{layout['tokens_per_s']:,.0f}{mfu}{memory}",
                     "", None])
        rows.append([f"{name}: first step{' (compilation)' if figures['compiled'] else ''}",
                     f"{layout['warmup_seconds'][0]:.1f} s", "", None])
        rows.append([f"{name}: attention kernels (one profiled step)",
                     ", ".join(layout["attention_kernels"][:3]) or "none found", "", None])
        losses = layout["losses"]
        finite[name] = all(math.isfinite(loss) for loss in losses)
        rows.append([f"{name}: loss (random tokens), first / last step", f"{losses[0]:.3f} / {losses[-1]:.3f}",
                     "finite", finite[name]])
    trained = check("peer_trained", all(finite.values()), ", ".join(f"{name}: losses {'finite' if ok else 'NOT finite'}"
                                                                    for name, ok in finite.items()))
    return {"figures": figures, "rows": rows, "checks": [trained]}


COMPARISONS = [
    ("speed_1b_2048", "peer", "tokens/s over the peer's (a plain PyTorch loop, part peer)", "vs_peer", PEER_TARGET),
    ("speed_1b_2048", "peer_torchtitan", "tokens/s over torchtitan's (its Llama 3 and trainer, part peer_torchtitan)",
     None, None),
    ("speed_1b_fp8", "speed_1b_2048", "tokens/s over bf16's (part speed_1b_2048)", "fp8_speedup", 1.15),
    ("speed_7b_layers_fp8", "speed_7b_layers", "tokens/s over bf16's (part speed_7b_layers)", "fp8_speedup", 1.25),
]
"""(part, the part it is compared with, the row's label, the check's name, the tokens/s ratio it must reach): ayumi
against the peer (issue 37: >= 1.25x), against torchtitan (shown, not judged: no check, no target), each FP8 speed
part against its bf16 part (issue 41: >= 1.15x at 1b, >= 1.25x at the 7B layers)."""


def compare(parts: dict, finished: str, cpu_smoke: bool) -> None:
    """The comparisons `finished` completes (the second of its two parts to finish adds each one)."""
    for key, other, label, check_name, target in COMPARISONS:
        if finished in (key, other):
            compare_speed(parts, key, other, label, check_name, target, cpu_smoke)


def compare_speed(parts: dict, key: str, other: str, label: str, check_name: str | None, target: float | None,
                  cpu_smoke: bool) -> None:
    """Once `key` and `other` have both run: key's tokens/s over other's as a row of `key`, judged on a GPU when there
    is a target and both trained the same tokens a step at the same length (a peer's figures say how many)."""
    ours, base = (parts.get(part, {}).get("figures") or {} for part in (key, other))
    if not ours.get("tokens_per_s") or not base.get("tokens_per_s"):  # a partial result may have none yet
        return
    entry = parts[key]
    ratio = ours["tokens_per_s"] / base["tokens_per_s"]
    same = "tokens_per_step" not in base or same_work(ours, base)
    ok = None if cpu_smoke or target is None else same and ratio >= target
    detail = (f"{ours['tokens_per_s']:,.0f} / {base['tokens_per_s']:,.0f} tokens/s = {ratio:.2f}"
              + ("" if same else " (NOT the same tokens a step and length: not comparable)"))
    entry["rows"].append([label, detail, f">={target}" if target else "shown", ok])
    if ok is not None:
        entry["checks"].append(check(check_name, ok, detail))
        if not ok and entry["status"] == "passed":
            entry["status"] = "failed"


# -- b. the second peer: torchtitan -----------------------------------------------------------------------------
TORCHTITAN = {"shape": "1b", "seq": 2048, "micro": 16, "accum": 2, "warmup": 3, "steps": 6}
"""On the GPU: speed_1b_2048's model (torchtitan's flavor of it), length and layout (16 x 2 x 2048 tokens a step)."""


def worker_peer_torchtitan(args, work: Path) -> dict:
    """The second peer (bench/torchtitan_peer.py): the shape check everywhere (torchtitan's model of ayumi's 1b preset
    against ayumi's, on the meta device); on a GPU also torchtitan's own trainer at speed_1b_2048's layout: median
    tokens/s, MFU by ayumi's FLOP count, max allocated, the attention kernels of one profiled step. A CPU trains
    nothing (torchtitan's trainer is CUDA-only)."""
    import torch

    from bench import torchtitan_peer
    from pretrain.model.flops import peak_flops

    cfg = peer_config(TORCHTITAN)
    shape = torchtitan_peer.shape_check(cfg.model, TORCHTITAN["seq"])
    summary = {"figures": {"shape": shape}, "rows": torchtitan_shape_rows(shape),
               "checks": [check("torchtitan_shape", shape["same_params"],
                                f"{shape['params_torchtitan']:,} parameters against ayumi's {shape['params_ayumi']:,}")]}
    write_partial(args, summary)
    if args.cpu_smoke or not torch.cuda.is_available():
        return torchtitan_config_rows(summary, torchtitan_peer.config_check(
            cfg, TORCHTITAN["seq"], TORCHTITAN["micro"], TORCHTITAN["accum"],
            TORCHTITAN["warmup"] + TORCHTITAN["steps"], str(work / "torchtitan")))
    peak = peak_flops(torch.device("cuda"))

    def progress(figures: dict) -> None:
        write_partial(args, torchtitan_summary(summary, figures, shape, peak))

    spec = TORCHTITAN
    figures = torchtitan_peer.train(cfg, spec["seq"], spec["micro"], spec["accum"], spec["warmup"], spec["steps"],
                                    str(work / "torchtitan"), progress)
    return torchtitan_summary(summary, figures, shape, peak)


def torchtitan_config_rows(summary: dict, config: dict) -> dict:
    """On a CPU: the trainer's config as built, and its one batch checked against the layout asked for."""
    spec = TORCHTITAN
    want = {"input": [spec["micro"], spec["seq"]], "positions": [spec["micro"], spec["seq"]],
            "labels": [spec["micro"], spec["seq"]]}
    training = config["training"]
    layout = (training["local_batch_size"], training["global_batch_size"], training["seq_len"])
    ok = config["batch"] == want and layout == (spec["micro"], spec["micro"] * spec["accum"], spec["seq"])
    rows = [*summary["rows"],
            ["trainer config (built, not trained: torchtitan's trainer runs on CUDA only)",
             f"micro {layout[0]}, global {layout[1]}, seq {layout[2]}, compiled {'+'.join(config['compile'])}, "
             f"bf16 compute: {training['mixed_precision_param']}", "", None],
            ["one batch of its data loader", ", ".join(f"{k} {v}" for k, v in config["batch"].items()),
             "micro x seq", ok]]
    checks = [*summary["checks"], check("torchtitan_config", ok, f"batch {config['batch']}, layout {layout}")]
    return {"figures": {**summary["figures"], "config": config}, "rows": rows, "checks": checks}


def torchtitan_shape_rows(shape: dict) -> list:
    """The shape check as table rows: parameters and FLOPs per token of both models."""
    return [["model", f"torchtitan Llama3Model, flavor {shape['flavor']}, attention {shape['attention']}", "", None],
            ["parameters: torchtitan / ayumi's 1b preset", f"{shape['params_torchtitan']:,} / {shape['params_ayumi']:,}",
             "equal", shape["same_params"]],
            ["FLOPs per token at seq 2048: torchtitan's count / ayumi's",
             f"{shape['flops_per_token_torchtitan'] / 1e9:.2f} / {shape['flops_per_token_ayumi'] / 1e9:.2f} GFLOP "
             "(MFU below uses ayumi's)", "", None]]


def torchtitan_summary(summary: dict, figures: dict, shape: dict, peak: float | None) -> dict:
    """The shape check's rows and checks with the training figures so far."""
    tokens = figures.get("tokens_per_s")
    figures = {**figures, "shape": shape, "flops_per_token": shape["flops_per_token_ayumi"], "peak_flops": peak,
               "mfu": tokens * shape["flops_per_token_ayumi"] / peak if tokens and peak else None, "compiled": True}
    rows = [*summary["rows"],
            ["setting", f"torchtitan Trainer: micro {figures['micro_batch']} x seq {figures['seq_len']} x accum "
                        f"{figures['grad_accum']}, FSDP2 on one rank (bf16 compute, fp32 parameters), compiled blocks "
                        "and loss, chunked loss, AdamW", "", None],
            ["trainer build (model, compile set-up, optimizer)", f"{figures['build_seconds']:.1f} s", "", None]]
    if figures["warmup_seconds"]:
        rows.append(["first step (compilation)", f"{figures['warmup_seconds'][0]:.1f} s", "", None])
    if tokens:
        mfu = f", MFU {100 * figures['mfu']:.1f}%" if figures["mfu"] else ""
        rows.append(["tokens/s per GPU (median step)", f"{tokens:,.0f} ({len(figures['step_seconds'])} timed "
                     f"steps){mfu}, max allocated {figures['max_allocated'] / 2**30:.1f} GiB", "", None])
    if figures.get("attention_kernels") is not None:
        rows.append(["attention kernels (one profiled step)", ", ".join(figures["attention_kernels"][:3]) or "none found",
                     "", None])
    checks = list(summary["checks"])
    if "losses_finite" in figures:
        checks.append(check("torchtitan_trained", figures["losses_finite"], f"losses {figures['losses']}"))
    return {"figures": figures, "rows": rows, "checks": checks}


def same_work(ours: dict, peer: dict) -> bool:
    """Whether ayumi's speed figures and the peer's come from the same tokens a step at the same sequence length."""
    return ours["seq_len"] == peer["seq_len"] and \
        ours["micro_batch"] * ours["grad_accum"] * ours["seq_len"] == peer["tokens_per_step"]


# -- training runs as a user starts them -------------------------------------------------------------
SMALL_GPU_MODEL = ["model=debug", "model.vocab_size=512", "model.hidden_size=256", "model.intermediate_size=688",
                   "model.num_layers=4", "model.num_heads=8", "model.num_kv_heads=4", "model.max_seq_len=256"]
"""The correctness model on the GPU: big enough that bf16 rounding shows, small enough to start in seconds."""
TINY_MODEL = ["model=debug", "model.vocab_size=512", "model.max_seq_len=64"]


def corpus(work: Path) -> Path:
    """Byte tokens of the repository's own text (bench/step_overhead.py): the same on every machine."""
    from bench.step_overhead import write_corpus
    from data.manifest import MANIFEST_NAME

    root = work / "corpus"
    if not (root / MANIFEST_NAME).is_file():
        write_corpus(root, 512, min_tokens=2_000_000)
    return root


def markov_corpus(work: Path) -> Path:
    """Two domains of seeded Markov-chain text (bench/markov_corpus.py): the same at every commit, unlike the
    repository's text, so a clean run's verdict depends on the code and the machine, not on the commit."""
    from bench.markov_corpus import write_markov_corpus
    from data.manifest import MANIFEST_NAME

    root = work / "markov_corpus"
    if not (root / MANIFEST_NAME).is_file():
        write_markov_corpus(root, 512, tokens_per_domain=1_000_000)
    return root


def run_overrides(work: Path, name: str, device: str, *extra: str, root: Path | None = None) -> list[str]:
    return [f"name={name}", f"run_root={work / 'runs'}", f"data.root={root or corpus(work)}", f"train.device={device}",
            "data.validation=false", "curriculum.default_max_repetition=inf", "logging=none", "logging.console_interval=10",
            "optim.warmup_steps=5", *extra]


def start_training(overrides: list[str], log: Path) -> subprocess.Popen:
    handle = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "pretrain.train", *overrides], cwd=REPO, stdout=handle,
                            stderr=subprocess.STDOUT, start_new_session=True)
    handle.close()
    return proc


def losses(run_dir: Path) -> dict[int, float]:
    """step -> train/loss of a run, read as the run report reads metrics.jsonl."""
    from pretrain.metrics import METRICS_FILE
    from pretrain.tools.report.timeline import read_jsonl

    return {r["step"]: r["train/loss"] for r in read_jsonl(run_dir / METRICS_FILE).rows if "train/loss" in r}


def events(run_dir: Path) -> list[dict]:
    """A run's events.jsonl records ([] when it has none)."""
    from pretrain.metrics import EVENTS_FILE
    from pretrain.tools.report.timeline import read_jsonl

    return read_jsonl(run_dir / EVENTS_FILE).rows


def wait_all(procs: dict[str, subprocess.Popen], work: Path) -> None:
    for name, proc in procs.items():
        if proc.wait() != 0:
            raise RuntimeError(f"training run {name} exited {proc.returncode}: "
                               + (work / f"{name}.log").read_text(errors="replace")[-3000:])


def device_of(args) -> str:
    return "cpu" if args.cpu_smoke else "cuda"


# -- d. correctness ----------------------------------------------------------------------------------
def correctness_variants(cpu_smoke: bool) -> dict[str, list[str]]:
    """Run name -> its overrides beside the base. `base` is bf16 ZeRO-1 eager, one micro batch of 8, with the
    default fused LM-head loss in several chunks (correctness_base); `plain_loss` computes the whole logits.

    The CPU smoke run's base is fp32 already, so its `fp32` run would be base_again's run a third time (the same
    overrides, seeded): it is not trained there, and its comparison reads base_again's losses (SMOKE_SAME_RUN)."""
    variants = {
        "base": [], "base_again": [],
        "zero0": ["deepspeed=zero0"], "zero2": ["deepspeed=zero2"], "zero3": ["deepspeed=zero3"],
        "fp32": ["deepspeed.precision=fp32"],
        "compiled": ["model.compile=blocks"],
        "plain_loss": ["model.loss_chunk_tokens=0"],
        "accum4": ["train.micro_batch_size=2", "train.grad_accum=4"],
    }
    return {name: extra for name, extra in variants.items() if not (cpu_smoke and name in SMOKE_SAME_RUN)}


SMOKE_SAME_RUN = {"fp32": "base_again"}
"""In the CPU smoke run (fp32 throughout), a correctness run -> the run it is identical to, whose losses stand for it."""


def worker_correctness(args, work: Path) -> dict:
    steps, seq = (6, 64) if args.cpu_smoke else (30, 256)
    model = TINY_MODEL if args.cpu_smoke else SMALL_GPU_MODEL
    # The CPU here may lack native bf16 (100x slower): the smoke run checks the paths in fp32.
    precision = "fp32" if args.cpu_smoke else "bf16"
    chunk = 128 if args.cpu_smoke else 512  # the fused loss in several chunks per micro batch of 8 x seq
    base = [*model, "deepspeed=zero1", f"deepspeed.precision={precision}", "model.compile=off", f"train.seq_len={seq}",
            f"model.loss_chunk_tokens={chunk}",
            "train.micro_batch_size=8", "train.global_batch_size=8", "train.grad_accum=1",
            f"train.tokens={steps * 8 * seq}", "optim.lr=1e-3", "train.eval_interval=0", "checkpoint.interval=0",
            "checkpoint.save_final=false", "checkpoint.resume=false", "stability.recovery.ring_interval=0"]
    corpus(work)
    variants = correctness_variants(args.cpu_smoke)
    procs, failed = {}, {}
    for name, extra in variants.items():
        procs[name] = start_training(run_overrides(work, name, device_of(args), *base, *extra), work / f"{name}.log")
        if args.cpu_smoke:  # two cores: one run at a time
            procs[name].wait()
    got, pending = {}, dict(procs)
    while pending:  # as each run ends, the comparisons it completes go into the partial result
        time.sleep(0.5)
        for name, proc in list(pending.items()):
            if proc.poll() is None:
                continue
            del pending[name]
            # The run's result, and in the CPU smoke run that of each run it stands for (SMOKE_SAME_RUN).
            names = [name, *(alias for alias, same in SMOKE_SAME_RUN.items() if args.cpu_smoke and same == name)]
            if proc.returncode != 0:  # a failed run fails its own comparisons, not the others
                failed.update(dict.fromkeys(names, last_error(work / f"{name}.log")))
            else:
                got.update(dict.fromkeys(names, losses(work / "runs" / name)))
            if "base" in got:
                write_partial(args, correctness_report(got, steps, failed))
    return correctness_report(got, steps, failed)


def last_error(log: Path) -> str:
    """The last line of a failed run's log that names an error, else its last line."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    named = [line for line in lines if "Error" in line or "error" in line]
    return (named or lines or ["(empty log)"])[-1][-300:]


def relative_gap(a: dict[int, float], b: dict[int, float]) -> tuple[float, float]:
    """(relative gap at the first step, largest relative gap over all steps) between two loss curves."""
    steps = sorted(b)
    if sorted(a) != steps:
        raise RuntimeError(f"the runs logged different steps: {sorted(a)[:5]}... vs {steps[:5]}...")
    gaps = [abs(a[s] - b[s]) / abs(b[s]) for s in steps]
    return gaps[0], max(gaps)


def correctness_report(got: dict[str, dict[int, float]], steps: int, failed: dict[str, str] | None = None) -> dict:
    failed = failed or {}
    rows, checks = [], []
    if "base" in failed:
        raise RuntimeError(f"the base run failed: {failed['base']}")
    base = got["base"]
    if len(base) != steps:
        raise RuntimeError(f"the base run logged {len(base)} steps, not {steps}")
    if "base_again" in failed:
        rows.append(["two seeded runs", f"run failed: {failed['base_again']}", "identical", False])
        checks.append(check("seeded_runs_identical", False, f"base_again failed: {failed['base_again']}"))
    elif "base_again" in got:  # (neither: not finished yet, a partial result)
        identical = got["base_again"] == base
        diff = max(abs(got["base_again"][s] - base[s]) for s in base)
        rows.append(["two seeded runs", "identical" if identical else f"differ by up to {diff:.3g}", "identical",
                     identical])
        checks.append(check("seeded_runs_identical", identical, f"largest difference {diff:.3g} over {steps} steps"))
    first_step_check(got, rows, checks)
    pairs = [("zero0", "base", ZERO_TOLERANCE, "ZeRO-0 vs ZeRO-1"),
             ("zero2", "base", ZERO_TOLERANCE, "ZeRO-2 vs ZeRO-1"), ("zero3", "base", ZERO_TOLERANCE, "ZeRO-3 vs ZeRO-1"),
             ("fp32", "base", FP32_TOLERANCE, "fp32 vs bf16 (ZeRO-1)"),
             ("compiled", "base", BF16_TOLERANCE, "compiled blocks vs eager"),
             ("plain_loss", "base", BF16_TOLERANCE, "plain loss (whole logits) vs the fused one"),
             ("accum4", "base", BF16_TOLERANCE, "4 x micro 2 (fp32 accumulation) vs 1 x micro 8")]
    for name, ref, tolerance, label in pairs:
        if name not in got and name not in failed:
            continue  # not finished yet (a partial result)
        if name in failed:
            rows.append([label, f"run failed: {failed[name]}", f"<={tolerance}", False])
            checks.append(check(name, False, f"run failed: {failed[name]}"))
            continue
        first, worst = relative_gap(got[name], got[ref])
        ok = worst <= tolerance
        rows.append([label, f"first step {first:.2e}, largest {worst:.2e} (relative)", f"<={tolerance}", ok])
        checks.append(check(name, ok, f"relative gap: first step {first:.3g}, largest over {steps} steps {worst:.3g}"))
    return {"figures": {"losses": got, "final": {k: v[max(v)] for k, v in got.items()}, "failed": failed},
            "rows": rows, "checks": checks}


def first_step_check(got: dict[str, dict[int, float]], rows: list, checks: list) -> None:
    """The first step's loss under ZeRO 0, 2 and 3 against ZeRO-1's (the runs that finished): before any update it
    depends only on the initial weights and the batch, so it must be the same to within FIRST_STEP_TOLERANCE."""
    ran = [name for name in ("zero0", "zero2", "zero3") if name in got]
    if not ran:
        return
    first = min(got["base"])
    gaps = {name: abs(got[name][first] - got["base"][first]) / abs(got["base"][first]) for name in ran}
    worst = max(gaps, key=gaps.get)
    ok = gaps[worst] <= FIRST_STEP_TOLERANCE
    value = "identical" if not any(gaps.values()) else f"largest gap {gaps[worst]:.2e} ({worst})"
    rows.append([f"first step's loss, ZeRO {'/'.join(n[-1] for n in ran)} vs ZeRO-1", value,
                 f"<={FIRST_STEP_TOLERANCE:g}", ok])
    checks.append(check("zero_first_step", ok, ", ".join(f"{name} {gap:.3g}" for name, gap in gaps.items())))


# -- e. kill -9 during an asynchronous write ---------------------------------------------------------------
def worker_checkpoint_kill(args, work: Path) -> dict:
    """As tests/pretrain/checkpoint/test_checkpoint_async_cpu.py, with one rank on the GPU: saves every 4
    steps written in the background, each held back 4 s; once step 8 is staged and step 4 published,
    kill -9; resume to step 10. Its losses must equal an uninterrupted run's to the last bit (the cpu_tiny run,
    ZeRO-3)."""
    common = ["experiment=cpu_tiny", "deepspeed=zero3", "train.tokens=1000000", "checkpoint.interval=4",
              "checkpoint.async_save=true", "model.compile=off"]
    device = device_of(args)
    corpus(work)
    whole = start_training(run_overrides(work, "whole", device, *common, "train.max_steps=10"), work / "whole.log")
    killed = start_training(run_overrides(work, "killed", device, *common, "checkpoint.inject_write_delay_s=4"),
                            work / "killed.log")
    checkpoints = work / "runs" / "killed" / "checkpoints"
    staged = wait_for_staged_write(killed, checkpoints, work / "killed.log")
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    wait_all({"whole": whole}, work)
    rows, checks = [], []
    published = (checkpoints / "latest").read_text().strip()
    intact = published == "step_0000004" and not (checkpoints / "step_0000008" / "ayumi.json").exists()
    checks.append(check("latest_intact", intact, f"after kill -9 (step 8 staged {staged:.1f} s in): latest = {published}"))
    resumed = start_training(run_overrides(work, "killed", device, *common, "train.max_steps=10"), work / "resumed.log")
    wait_all({"resumed": resumed}, work)
    resumed_from = "resumed from" in (work / "resumed.log").read_text() and "step_0000004" in (work / "resumed.log").read_text()
    got, expected = losses(work / "runs" / "killed"), losses(work / "runs" / "whole")
    equal = [got.get(s) for s in range(5, 11)] == [expected[s] for s in range(5, 11)]
    diff = max(abs(got.get(s, float("nan")) - expected[s]) for s in range(5, 11))
    checks.append(check("resumed_exactly", equal and resumed_from,
                        f"resumed from step 4: {resumed_from}; steps 5-10 equal the uninterrupted run's: {equal} "
                        f"(largest difference {diff:.3g})"))
    rows.append(["kill -9 mid-write: latest stays on the previous checkpoint", published, "step_0000004", intact])
    rows.append(["resume: losses of steps 5-10 vs uninterrupted", "equal" if equal else f"differ by {diff:.3g}", "equal",
                 equal and resumed_from])
    return {"figures": {"resumed": got, "whole": expected}, "rows": rows, "checks": checks}


def wait_for_staged_write(proc: subprocess.Popen, checkpoints: Path, log: Path, timeout: float = 300) -> float:
    """Seconds until step 8's folder exists while `latest` still names step 4 (its write is held back)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        latest = checkpoints / "latest"
        if (checkpoints / "step_0000008").is_dir() and latest.is_file() and latest.read_text().strip() == "step_0000004":
            return time.monotonic() - start
        if proc.poll() is not None:
            raise RuntimeError("the run ended before step 8 was staged: " + log.read_text(errors="replace")[-3000:])
        time.sleep(0.05)
    raise RuntimeError("step 8 was never staged after step 4 was published")


# -- f. stability --------------------------------------------------------------------------------------
SPIKE_STEP = 150
STABILITY = ["stability.detector.warmup_steps=40", "stability.detector.min_history=30",
             "stability.recovery.ring_interval=20", "stability.recovery.rollback_steps=20",
             "stability.recovery.skip_batches=10", "stability.recovery.lr_cooldown_steps=30",
             f"+stability.inject.lr_multiply={{{SPIKE_STEP}:50.0,{SPIKE_STEP + 1}:50.0,{SPIKE_STEP + 2}:50.0}}"]


def worker_stability(args, work: Path) -> dict:
    """The LR x50 for three steps at 150-152 (the cpu_tiny run, one rank): one spike, a rollback to a ring
    checkpoint >= 20 steps earlier, 10 batches skipped, and the last 20 steps' loss back near the clean run's."""
    common = ["experiment=cpu_tiny", "deepspeed=zero2", "train.tokens=131072", "train.max_steps=200",
              "checkpoint.interval=0", "checkpoint.save_final=false", "model.compile=off", "train.eval_interval=0"]
    device, root = device_of(args), markov_corpus(work)
    procs = {"spiked": start_training(run_overrides(work, "spiked", device, *common, *STABILITY, root=root),
                                      work / "spiked.log"),
             "clean": start_training(run_overrides(work, "clean", device, *common, *STABILITY[:-1], root=root),
                                     work / "clean.log")}
    wait_all(procs, work)
    run_events = events(work / "runs" / "spiked")
    kinds = [e["event"] for e in run_events]
    spikes = [e for e in run_events if e["event"] == "spike"]
    recovered = [e for e in run_events if e["event"] == "recovered"]
    skipped = [e for e in run_events if e["event"] == "batches_skipped"]
    false_alarms = [e for e in events(work / "runs" / "clean") if e["event"] in ("spike", "rollback")]
    got, clean = losses(work / "runs" / "spiked"), losses(work / "runs" / "clean")
    # The last 20 steps' mean: after the skip the two runs train on different batches, and one step's loss
    # varies by 10% from batch to batch.
    final, final_clean = (statistics.mean(run[s] for s in sorted(run)[-20:]) for run in (got, clean))
    final_ratio = final / final_clean
    rows, checks = [], []
    detected = len(spikes) == 1 and SPIKE_STEP <= spikes[0].get("spike_start", -1) <= SPIKE_STEP + 3
    to_step = recovered[0].get("to_step") if recovered else None
    rolled = to_step is not None and to_step <= SPIKE_STEP - 20
    checks.append(check("spike_detected", detected, f"spike events {[(e['step'], e.get('spike_start')) for e in spikes]}"))
    checks.append(check("rolled_back", rolled, f"recovered to step {to_step}"))
    checks.append(check("batches_skipped", bool(skipped), f"{len(skipped)} batches_skipped event(s)"))
    checks.append(check("no_false_alarm", not false_alarms, f"clean run: {len(false_alarms)} spike/rollback events"))
    checks.append(check("final_loss", final_ratio <= 1.05, f"mean loss of the last 20 steps {final:.4f} vs clean {final_clean:.4f}"))
    rows.append(["spike (LR x50 at 150-152) detected", f"at step {spikes[0]['step']}" if spikes else "no", "one", detected])
    rows.append(["rolled back to", f"step {to_step}", f"<={SPIKE_STEP - 20}", rolled])
    rows.append(["batches skipped", f"{len(skipped)} event(s)", ">=1", bool(skipped)])
    rows.append(["last 20 steps' mean loss vs a clean run", f"{final:.4f} / {final_clean:.4f} = {final_ratio:.3f}",
                 "<=1.05", final_ratio <= 1.05])
    return {"figures": {"events": kinds, "final_ratio": final_ratio}, "rows": rows, "checks": checks}


# -- i. FP8 loss --------------------------------------------------------------------------------------
FP8_LOSS_TOLERANCE = 0.01
"""The last FP8_LOSS_TAIL steps' mean loss of each FP8 recipe against bf16's, relative (issue 41)."""
FP8_LOSS_STEPS, FP8_LOSS_TAIL = 300, 50
FP8_LOSS_SMOKE_STEPS, FP8_LOSS_SMOKE_TAIL = 40, 10
STABILITY_EVENTS = ("skip_update", "spike", "rollback", "stop", "loss_scale_alarm")


def worker_fp8_loss(args, work: Path) -> dict:
    """The 125m preset (its layers; the Markov corpus's 512 ids) for 300 steps of 16 x 512 tokens, bf16 against FP8
    tensorwise and rowwise from the same seed and data, the three at once on the GPU: the last 50 steps' mean loss of
    each FP8 run within 1% of bf16's, and no stability event in any. On the CPU: the tiny model under torchao's
    emulation, 40 steps."""
    device, root = device_of(args), markov_corpus(work)
    steps, tail = (FP8_LOSS_SMOKE_STEPS, FP8_LOSS_SMOKE_TAIL) if args.cpu_smoke else (FP8_LOSS_STEPS, FP8_LOSS_TAIL)
    if args.cpu_smoke:
        shape = ["experiment=cpu_tiny", *TINY_MODEL, "deepspeed=zero1", f"train.tokens={steps * 8 * 64}"]
    else:
        shape = ["experiment=cpu_tiny", "model=125m", "model.max_seq_len=512", "train.seq_len=512",
                 "train.micro_batch_size=16", "train.global_batch_size=16", "deepspeed=zero1",
                 f"train.tokens={steps * 16 * 512}", "optim.lr=6e-4", "optim.min_lr=6e-5", "optim.warmup_steps=30"]
    common = [*shape, f"train.max_steps={steps}", "deepspeed.precision=bf16", "model.compile=off",
              "train.eval_interval=0", "checkpoint.interval=0", "checkpoint.save_final=false"]
    recipes = {"bf16": [], "tensorwise": ["model.fp8=tensorwise"], "rowwise": ["model.fp8=rowwise"]}
    if args.cpu_smoke:
        recipes = {k: v + (["model.fp8_emulate=true"] if v else []) for k, v in recipes.items()}
    procs = {name: start_training(run_overrides(work, name, device, *common, *extra, root=root), work / f"{name}.log")
             for name, extra in recipes.items()}
    wait_all(procs, work)
    runs = {name: losses(work / "runs" / name) for name in recipes}
    means = {name: statistics.mean(run[s] for s in sorted(run)[-tail:]) for name, run in runs.items()}
    alarms = {name: [e["event"] for e in events(work / "runs" / name) if e["event"] in STABILITY_EVENTS]
              for name in recipes}
    rows, checks = [], []
    for recipe in ("tensorwise", "rowwise"):
        ratio = means[recipe] / means["bf16"]
        ok = abs(ratio - 1) <= FP8_LOSS_TOLERANCE
        detail = f"last {tail} steps' mean loss {means[recipe]:.4f} vs bf16 {means['bf16']:.4f} = {ratio:.4f}"
        rows.append([f"FP8 {recipe}: mean loss of the last {tail} of {steps} steps / bf16's", detail,
                     f"{1 - FP8_LOSS_TOLERANCE:g}..{1 + FP8_LOSS_TOLERANCE:g}", ok])
        checks.append(check(f"fp8_loss_{recipe}", ok, detail))
    quiet = not any(alarms.values())
    rows.append(["stability events (skip, spike, rollback)", str(alarms), "none", quiet])
    checks.append(check("fp8_no_stability_event", quiet, str(alarms)))
    return {"figures": {"tail": means, "steps": steps, "alarms": alarms}, "rows": rows, "checks": checks}


# -- e. asynchronous vs synchronous save ---------------------------------------------------------------
def worker_checkpoint_save(args, work: Path) -> dict:
    out = work / "checkpoint_async.json"
    cmd = [sys.executable, str(REPO / "bench" / "checkpoint_async.py"), "--repeats", "1", "--json", str(out),
           "--work", str(work / "checkpoints")]
    cmd += ["--model", "debug", "--device", "cpu", "--precision", "fp32"] if args.cpu_smoke else \
        ["--model", "1b", "--device", "cuda", "--precision", "bf16"]
    subprocess.run(cmd, cwd=REPO, check=True)
    res = json.loads(out.read_text())
    ratio = res["ours_ms"] / res["base_ms"]
    ok = ratio <= ASYNC_TARGET
    rows = [["checkpoint", f"{res['gib']:.2f} GiB ({res['model']}, {res['precision']}, ZeRO-{res['zero_stage']})", "", None],
            ["synchronous save", f"{res['base_ms']:,.0f} ms ({res['durable_ms']:,.0f} ms fsynced)", "", None],
            ["asynchronous save: blocked", f"{res['ours_ms']:,.0f} ms = {ratio:.3f} of synchronous", f"<={ASYNC_TARGET}", ok],
            ["asynchronous save: background write", f"{res['write_ms']:,.0f} ms", "", None],
            ["synchronous save: with checksums / without", f"{res['base_ms']:,.0f} / {res['plain_ms']:,.0f} ms = "
             f"{res['checksum_ratio']:.3f}", "<=1.05", None]]
    return {"figures": res, "rows": rows, "checks": [check("async_blocked", ok, f"ratio {ratio:.3f}")]}


# -- g. the demo's training phase ----------------------------------------------------------------------
def worker_demo_train(args, work: Path) -> dict:
    """`ayumi train experiment=demo` on the demo's shards, as `ayumi demo` runs it (stage 5), timed."""
    if args.demo_data:
        data = Path(args.demo_data)
        overrides = [f"data.root={data / 'shards' / 'demo'}", f"data.tokenizer_dir={data / 'tokenizers' / 'demo_8k'}"]
    elif args.cpu_smoke:  # the demo's domains as byte tokens: the path, not the demo's figures
        overrides = [f"data.root={demo_like_corpus(work)}", "data.tokenizer_dir=null", "model.vocab_size=512",
                     "train.max_steps=12"]
    else:
        return {"rows": [["demo data", "not given (--demo-data)", "", False]],
                "checks": [check("demo_data", False, "no --demo-data: build it with `ayumi demo` and carry it")]}
    cmd = [sys.executable, "-m", "pretrain.tools.cli", "train", "experiment=demo", f"run_root={work / 'runs'}",
           "logging=none", *overrides]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO)
    seconds = time.perf_counter() - start
    run_dir = work / "runs" / "demo"
    got = losses(run_dir)
    kinds = [e["event"] for e in events(run_dir)]
    rows = [["demo training (wall, launcher to exit)", f"{seconds:.0f} s, {len(got)} steps logged", "", proc.returncode == 0],
            ["final train loss", f"{got[max(got)]:.3f}" if got else "-", "", None],
            ["spike recovered", str("recovered" in kinds), "True" if args.demo_data else "", None]]
    checks = [check("demo_exit", proc.returncode == 0, f"exit {proc.returncode} after {seconds:.0f} s")]
    if args.demo_data:
        checks.append(check("demo_spike_recovered", "recovered" in kinds, f"events {kinds}"))
    return {"figures": {"seconds": seconds, "steps": len(got), "events": kinds}, "rows": rows, "checks": checks}


def demo_like_corpus(work: Path) -> Path:
    """The demo's five domains (train and val) as byte tokens of the repository's text."""
    from data.manifest import MANIFEST_NAME
    from data.token_root import TokenRoot

    root = work / "demo_like"
    if (root / MANIFEST_NAME).is_file():
        return root
    files = sorted(p for p in REPO.glob("*/*.py") if p.is_file())
    with TokenRoot(root, vocab_size=512, eos_id=256, name="demo_like") as out:
        for index, domain in enumerate(("ja_raw", "ja_clean", "en", "math", "code")):
            docs = [list(p.read_bytes()) + [256] for p in files[index::5] if p.stat().st_size]
            for split, chosen in (("train", docs * 4), ("val", docs[:4])):
                with out.shard(domain, split) as writer:
                    for doc in chosen:
                        writer.add_document(doc)
    return root


# -- h. long context: document masking and RoPE scaling ------------------------------------------------
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def worker_long_context(args, work: Path) -> dict:
    """Document masking through the kernel ayumi picks (pretrain/model/documents.py: flash varlen on the GPU in bf16,
    SDPA with a dense mask in fp32 and on the CPU): each packed document's losses equal it alone, and each kernel's
    attention and gradients equal attention over each document alone, odd and 1-token lengths included; a step's
    time against causal attention with ~512-token documents (target <=1.00) and with long ones (<=1.03), timed on
    the GPU only; llama3 RoPE scaling's logits against transformers'; a short-to-long curriculum."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 comparisons below: no TF32 rounding in the matmuls
    device = device_of(args)
    checks, rows, figures = [], [], {}

    def progress() -> dict:  # after each check: a part stopped at its limit keeps the ones it finished
        summary = {"figures": figures, "rows": rows, "checks": checks}
        write_partial(args, summary)
        return summary

    gap, kernel = documents_alone_gap(device)
    figures.update(documents_alone_max_gap=gap, documents_alone_kernel=kernel)
    rows.append([f"packed documents vs each alone (fp32, restart positions; kernel {kernel})", f"max gap {gap:.2e}",
                 "<=1e-4", gap <= 1e-4])
    checks.append(check("documents_alone", gap <= 1e-4, f"largest per-token loss gap {gap:.2e} ({kernel})"))
    progress()
    checks.append(document_kernel_rows(device, rows, figures))
    progress()
    rope_gap = llama3_logits_gap(device, work)
    figures["llama3_logits_max_gap"] = rope_gap
    rows.append(["llama3 RoPE logits vs transformers (fp32)", f"max gap {rope_gap:.2e}", "<=1e-5", rope_gap <= 1e-5])
    checks.append(check("llama3_rope", rope_gap <= 1e-5, f"largest logit gap {rope_gap:.2e}"))
    progress()
    checks += document_speed_rows(device, args.cpu_smoke, rows, figures)
    figures["kernels"] = kernel_choices()
    rows.append(["kernels this process chose (document attention; fp32-output GEMM)",
                 kernels_text(figures["kernels"]), "", None])
    progress()
    switched, detail = short_to_long_run(args, work)
    rows.append(["short-to-long curriculum, document masking (compiled on the GPU)", detail, "lengths as staged",
                 switched])
    checks.append(check("short_to_long", switched, detail))
    return progress()


def document_kernel_rows(device: str, rows: list, figures: dict) -> dict:
    """document_kernel_gaps as table rows and figures, and its check: each dtype's gap within its tolerance and
    a tenth of what attention across documents gives."""
    ok, details = True, []
    for dtype, kernel, gap, leak, tolerance in document_kernel_gaps(device):
        passed = gap <= tolerance and gap <= leak / 10
        ok &= passed
        figures[f"document_kernel_{dtype}"] = {"kernel": kernel, "gap": gap, "across_documents": leak}
        rows.append([f"attention within documents vs each alone, {dtype} (kernel {kernel}; output, dq, dk, dv)",
                     f"gap {gap:.2e} (across documents: {leak:.2e})", f"<={tolerance:.0e}", passed])
        details.append(f"{dtype} {kernel} {gap:.2e}")
    return check("document_kernels", ok, ", ".join(details))


def document_speed_rows(device: str, cpu_smoke: bool, rows: list, figures: dict) -> list[dict]:
    """document_step_times as table rows and figures; on the GPU, a check per regime against its target (a CPU's
    figures mean nothing: no check there)."""
    targets = {"short": 1.00, "long": 1.03}
    labels = {"short": "~512-token documents", "long": "long documents (1-2 a sample)"}
    checks = []
    for regime, (masked_ms, causal_ms) in document_step_times(device, cpu_smoke).items():
        ratio, prefix = masked_ms / causal_ms, "" if regime == "short" else "long_"
        figures.update({f"{prefix}document_step_ms": masked_ms, f"{prefix}causal_step_ms": causal_ms,
                        f"{prefix}document_over_causal": ratio})
        ok = None if cpu_smoke else ratio <= targets[regime]
        rows.append([f"a step with document masking / causal, {labels[regime]}",
                     f"{masked_ms:.1f} / {causal_ms:.1f} ms = {ratio:.3f}", f"<={targets[regime]:.2f}", ok])
        if ok is not None:
            checks.append(check(f"document_{regime}_speed", ok, f"{ratio:.3f} of causal ({labels[regime]})"))
    return checks


def short_to_long_run(args, work: Path) -> tuple[bool, str]:
    """A two-stage curriculum trained as a user runs it, compiled blocks and document masking on: 256-token samples,
    then 1024-token ones from long documents with a larger RoPE base (64 then 256 on the CPU). Passes when every
    step's batches had its stage's length (the model recompiles once for the longer shape) and every loss is
    finite. The CPU smoke run trains it eager (the compiled path's CPU tests live in the suite; here it would add
    two compilations to every suite run). Returns (passed, what was seen)."""
    seq, steps = (64, 6) if args.cpu_smoke else (256, 20)
    model = TINY_MODEL if args.cpu_smoke else SMALL_GPU_MODEL
    tokens = steps * 8 * seq
    stages = (f"curriculum.stages=[{{name:short,tokens:{tokens},weights:{{code:0.5,docs:0.5}}}},"
              f"{{name:long,tokens:{tokens},seq_len:{4 * seq},rope_theta:40000,weights:{{code:0.5,docs:0.5}},"
              f"min_document_tokens:{{code:{seq}}}}}]")
    overrides = run_overrides(
        work, "short_to_long", device_of(args), *model, f"model.max_seq_len={4 * seq}",
        f"model.compile={'off' if args.cpu_smoke else 'blocks'}",
        "model.attention=document", "deepspeed=zero1", f"deepspeed.precision={'fp32' if args.cpu_smoke else 'bf16'}",
        "curriculum=tiny", stages, f"train.seq_len={seq}", "train.micro_batch_size=8", "train.global_batch_size=8",
        "train.grad_accum=1", f"train.tokens={2 * tokens}", "train.eval_interval=0", "checkpoint.interval=0",
        "checkpoint.save_final=false", "checkpoint.resume=false", "stability.recovery.ring_interval=0")
    log = work / "short_to_long.log"
    if start_training(overrides, log).wait() != 0:
        return False, f"the run failed: {last_error(log)}"
    from pretrain.metrics import METRICS_FILE
    from pretrain.tools.report.timeline import read_jsonl

    rows = [r for r in read_jsonl(work / "runs" / "short_to_long" / METRICS_FILE).rows if "train/loss" in r]
    lengths = [r["train/seq_len"] for r in rows]
    finite = all(math.isfinite(r["train/loss"]) for r in rows)
    wanted = [seq] * steps + [4 * seq] * steps
    return lengths == wanted and finite, (f"{len(rows)} steps, lengths {sorted(set(lengths))} "
                                          f"({'as staged' if lengths == wanted else 'NOT as staged'}), "
                                          f"losses {'finite' if finite else 'NOT finite'}")


def documents_alone_gap(device: str) -> tuple[float, str]:
    """Largest per-token loss difference between a packed sample and its documents run alone (fp32: a 90-token
    document is the shape compiled FlexAttention crashed on), and the kernel document masking ran."""
    import torch
    import torch.nn.functional as F

    from pretrain.model.config import ModelConfig
    from pretrain.model.documents import mask_kernel
    from pretrain.model.llama import Llama

    torch.manual_seed(0)
    model = Llama(ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=352, num_layers=2, num_heads=4,
                              num_kv_heads=2, max_seq_len=256, init_std=0.1, attention="document",
                              document_end_id=1, restart_positions=True)).to(device).eval()
    lengths = [37, 90, 12, 64, 53]  # 256 tokens, the last document cut off
    tokens = torch.randint(2, 512, (257,), generator=torch.Generator().manual_seed(1))
    for end in torch.tensor(lengths[:-1]).cumsum(0) - 1:
        tokens[end] = 1
    inputs, labels = tokens[None, :-1].to(device), tokens[None, 1:].to(device)

    def per_token(x, y):
        with torch.no_grad():
            logits = model(x).logits.float()
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")

    packed, start, gap = per_token(inputs, labels), 0, 0.0
    for length in lengths:
        alone = per_token(inputs[:, start:start + length], labels[:, start:start + length])
        gap = max(gap, (packed[start:start + length] - alone).abs().max().item())
        start += length
    return gap, mask_kernel(torch.device(device), torch.float32, 128 // 4)


def document_kernel_gaps(device: str) -> list[tuple[str, str, float, float, float]]:
    """Document masking's attention on `device` against fp32 attention over each document alone, in fp32 and bf16:
    2 rows of 257 tokens (documents of 37, 90, 1, 12, 64, 53 and of 128, 90, 39 tokens), 4 query heads on 2 K/V
    heads of 32. Per dtype: (dtype, the kernel mask_kernel picks, the largest gap of the output and of the q, k, v
    gradients relative to the reference's largest value, the same gap for causal attention across documents, the
    tolerance: 1e-4 in fp32, 3e-2 in bf16, whose rounding is 2^-8)."""
    import torch
    import torch.nn.functional as F

    from pretrain.model.documents import attention_mask, document_attention, mask_kernel

    lengths = ([37, 90, 1, 12, 64, 53], [128, 90, 39])
    ids = torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in lengths], device=device)
    generator = torch.Generator().manual_seed(3)
    base = [torch.randn(2, heads, 257, 32, generator=generator) for heads in (4, 2, 2, 4)]  # q, k, v, grad

    def alone(q, k, v):  # each document on its own: causal SDPA, K/V heads repeated
        rows = []
        for r, row in enumerate(lengths):
            starts = [sum(row[:i]) for i in range(len(row))]
            rows.append(torch.cat([F.scaled_dot_product_attention(
                q[r:r + 1, :, s:s + n], k[r:r + 1, :, s:s + n].repeat_interleave(2, 1),
                v[r:r + 1, :, s:s + n].repeat_interleave(2, 1), is_causal=True) for s, n in zip(starts, row)], 2))
        return torch.cat(rows)

    def across(q, k, v):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)

    def values(attend, dtype):  # output and q, k, v gradients, in fp32
        q, k, v = (x.to(device, dtype).requires_grad_() for x in base[:3])
        out = attend(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), base[3].to(device, dtype))
        return [x.float() for x in (out, *grads)]

    def gap(got, want):
        return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want))

    results = []
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        mask = attention_mask(ids, mask_kernel(torch.device(device)))
        # The reference takes the dtype's rounded inputs, in fp32: the gap is the kernel's own.
        want = values(lambda q, k, v: alone(q.float(), k.float(), v.float()), dtype)
        got = values(lambda q, k, v: document_attention(q, k, v, mask), dtype)
        leak = values(lambda q, k, v: across(q.float(), k.float(), v.float()), dtype)
        kernel = mask_kernel(torch.device(device), dtype, 32)
        results.append((str(dtype).removeprefix("torch."), kernel, gap(got, want), gap(leak, want), tolerance))
    return results


def llama3_logits_gap(device: str, work: Path) -> float:
    """Largest logit difference between ayumi's Llama and transformers' on a llama3-scaled folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pretrain.model.config import ModelConfig
    from pretrain.model.hf_import import model_fields, read_hf_config
    from pretrain.model.llama import Llama

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE), initializer_range=0.1))
    folder = work / "llama3"
    hf.save_pretrained(folder)
    ours = Llama(ModelConfig(**model_fields(read_hf_config(folder), folder)))
    ours.load_state_dict(hf.state_dict(), strict=False)
    hf, ours = hf.to(device).eval(), ours.to(device).eval()
    ids = torch.randint(0, 512, (2, 256), generator=torch.Generator().manual_seed(2)).to(device)
    with torch.no_grad():
        return (ours(ids).logits.float() - hf(ids).logits.float()).abs().max().item()


def document_step_times(device: str, cpu_smoke: bool) -> dict[str, tuple[float, float]]:
    """{regime: (document ms, causal ms)} per training step, same weights and batch, in bench/document_attention.py's
    two regimes (ABBA rounds of consecutive steps, medians): ~512-token documents and long ones (one or two a
    sample). bf16 1b-like layers at micro batch 2 x seq 4096 on the GPU (flash varlen vs SDPA's causal flash kernel),
    tiny fp32 on the CPU (seq 128, ~16-token documents)."""
    import torch

    from bench.document_attention import SHAPES, compare, models, packed_batch, regime_lengths

    if cpu_smoke:
        shape = dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_layers=2, num_heads=4, num_kv_heads=2)
        seq, batch, dtype, rounds, steps, short_mean = 128, 2, torch.float32, 2, 1, 16
    else:
        shape, seq, batch, dtype, rounds, steps, short_mean = SHAPES["cuda"], 4096, 2, torch.bfloat16, 4, 2, 512
    masked, causal = models(shape, seq, device, dtype)
    times = {}
    for regime in ("short", "long"):
        lengths = regime_lengths(regime, seq, short_mean)
        tokens = packed_batch(batch, seq, shape["vocab_size"], lengths=lengths).to(device)
        ours, baseline, _ = compare(masked, causal, tokens, rounds, steps, f"{regime} ")
        times[regime] = (statistics.median(ours), statistics.median(baseline))
    return times


WORKERS = {"env": worker_env, "correctness": worker_correctness, "checkpoint_kill": worker_checkpoint_kill,
           "stability": worker_stability, "checkpoint_save": worker_checkpoint_save, "demo_train": worker_demo_train,
           "long_context": worker_long_context, "peer": worker_peer, "peer_torchtitan": worker_peer_torchtitan,
           "fp8_loss": worker_fp8_loss,
           **{key: worker_speed for key in SPEED}}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
