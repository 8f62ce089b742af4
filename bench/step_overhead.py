"""Benchmark: ayumi's training step vs a bare DeepSpeed loop, same model, batch and config.

CPU (default): 2 ranks under torchrun, gloo, DS_ACCELERATOR=cpu. Inside every rank the worker builds

  ours     = ayumi's full trainer, exactly as `pretrain.train` builds it (`build_trainer`, a composed
             config): shard loader with its prefetch thread, LR schedule, per-domain loss accounting
             and the one all-reduce per step, metrics ON (metrics.jsonl + W&B offline + a console
             line, redirected to a file); a step is `Trainer.train_step()` + `logger.log()`, as in
             `Trainer.run` (evaluation and checkpointing off);
  baseline = a bare DeepSpeed loop: the same `Llama` (same seed), the same DeepSpeed JSON
             (`pretrain.engine.train_engine.render_ds_config`), a torch AdamW over the same parameter groups,
             `deepspeed.initialize`, and `loss = engine(x, y).loss; engine.backward(loss);
             engine.step()` over the same micro-batches, pre-generated in memory. Nothing else.

Both engines live in the same processes and are timed interleaved: after warm-up steps of each,
blocks of K ayumi steps and K bare steps alternate (ABBA order), so machine noise hits both alike.
The figures are the median step times (rank 0, which also does the logging); the ratio is the median
over rounds of (ayumi's median / bare's median) of each round's two adjacent blocks, which is far
steadier on a shared machine than the ratio of the overall medians (also printed, with the means).

GPU (`--gpu`): one process per GPU, presets 125m and 1b in bf16 at seq 2048 (one launch per preset):
tokens/s and MFU (`pretrain.model.flops.flops_per_token`, peak from `pretrain.model.flops.peak_flops`) of both sides.
There a sample is a block of K steps timed with one synchronize at its end, divided by K (per-step
synchronising would hide the host-device syncs ayumi's step may add).

    python bench/step_overhead.py [--zero-stage 1] [--precision auto|bf16|fp32] [--rounds 30] [--block 2]
    python bench/step_overhead.py --metrics off      # diagnosis: `logging=none`, console off (metrics.jsonl stays)
    python bench/step_overhead.py --profile [cpu]    # + cProfile of rank 0's ayumi and bare steps
    python bench/step_overhead.py --gpu [--presets 125m,1b]

Ends with: RESULT step_overhead ours=<ms>ms baseline=<ms>ms ratio=<r> target=<=1.05 ok=<true|false>
(GPU: RESULT step_overhead_gpu_<preset> ... tok/s, and RESULT step_overhead_gpu_1b_mfu with target=>=40%,
a target with a unit applies to `ours` itself).

Note: this script imports `deepspeed` directly. The rule "only pretrain/engine/ imports deepspeed" (docs/design.md)
rule is for the product packages; the baseline here is, by definition, DeepSpeed without ayumi.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.result_form import machine_line, result_line  # noqa: E402  (first: it reads the load at the start)

TARGET_RATIO = 1.05
TARGET_MFU_1B = 0.40
EOS = 256


# ----------------------------------------------------------------------------------------------
# Launcher side (no torch import needed)
# ----------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="CPU ranks (default 2)")
    p.add_argument("--zero-stage", type=int, default=1, choices=[0, 1, 2, 3])
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"],
                   help="auto (default): bf16 where this CPU computes it natively, else fp32 (pretrain/engine/precision.py)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=512, help="model vocabulary (the data is byte tokens, < 257)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--warmup", type=int, default=4, help="untimed steps of each side before measuring")
    p.add_argument("--block", type=int, default=2, help="K: steps per timed block")
    p.add_argument("--rounds", type=int, default=30, help="rounds; each times one block of each side")
    p.add_argument("--metrics", default="on", choices=["on", "off"],
                   help="on: console + metrics.jsonl + W&B offline (the target); off: diagnosis only")
    p.add_argument("--prefetch", type=int, default=None, help="override data.prefetch_batches (diagnosis)")
    p.add_argument("--profile", nargs="?", const="wall", choices=["wall", "cpu"], default=None,
                   help="cProfile rank 0's timed steps with a wall (default) or process-CPU clock")
    p.add_argument("--gpu", action="store_true", help="GPU mode: presets in bf16 at seq 2048, tokens/s and MFU")
    p.add_argument("--presets", default="125m,1b", help="GPU mode: model presets (conf/model/)")
    p.add_argument("--gpu-micro-batch", default="125m=8,1b=4", help="GPU mode: micro batch per preset")
    p.add_argument("--work", default=None, help="keep corpus, run dirs and logs here (default: a temp dir)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--preset", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def write_corpus(root: Path, vocab: int, min_tokens: int, seed: int = 0) -> Path:
    """Two domains of byte-level tokens of real text: ayumi's own Python source and its docs/config.

    Content does not matter for timing, but two domains exercise the per-domain loss accounting.
    For a vocabulary above 257 (the GPU presets) the bytes are spread over the vocabulary.
    """
    import numpy as np

    from data.token_root import TokenRoot

    sources = {
        "code": sorted(p for pkg in ("pretrain", "data", "tokenizer", "curriculum") for p in (REPO / pkg).rglob("*.py")),
        "docs": sorted([*REPO.glob("conf/**/*.yaml"), *REPO.glob("*.md"), *REPO.glob("bench/*.py")]),
    }
    rng = np.random.default_rng(seed)
    spread = vocab > 1024
    with TokenRoot(root, vocab_size=vocab if spread else 257, eos_id=EOS, name="repo") as out:
        for domain, paths in sources.items():
            docs = [np.frombuffer(p.read_bytes(), dtype=np.uint8).astype(np.int64) for p in paths if p.is_file()]
            docs = [np.append(d, EOS) for d in docs if d.size]
            if not docs:
                docs = [np.arange(256, dtype=np.int64)]
            with out.shard(domain, "train") as writer:
                total = 0
                while total < min_tokens:
                    for doc in docs:
                        if spread:  # same structure, ids over the whole vocabulary
                            doc = (doc * 131 + rng.integers(0, vocab // 257, size=doc.size) * 257) % vocab
                        writer.add_document(doc)
                        total += doc.size
    return root


def launch(nproc: int, args_for_worker: list[str], log: Path, timeout: int, gpu: bool) -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun) if torchrun.exists() else "torchrun", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(port), str(Path(__file__).resolve()),
           "--worker", *args_for_worker]
    env = dict(os.environ)
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    if not gpu:
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    with open(log, "w") as handle:
        try:
            return subprocess.run(cmd, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return 124


def fail(log: Path, rc: int, name: str) -> int:
    tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
    print(f"worker failed (rc {rc}); last lines of {log}:\n{tail}", file=sys.stderr)
    print(result_line(name, float("nan"), float("nan"), f"<={TARGET_RATIO}", ratio=float("nan"), ok=False))
    return 1


def main_cpu(args: argparse.Namespace, work: Path, passthrough: list[str]) -> int:
    data = work / "corpus"
    if not data.exists():
        per_step = args.micro_batch * args.grad_accum * args.nproc * (args.seq + 1)
        write_corpus(data, args.vocab, min_tokens=max(200_000, 4 * per_step))
    out = work / "result.json"
    log = work / "worker.log"
    out.unlink(missing_ok=True)
    print(f"[step_overhead] {args.nproc} CPU ranks (torchrun, gloo); worker log {log}", flush=True)
    rc = launch(args.nproc, [*passthrough, "--work", str(work), "--out", str(out)], log, args.timeout, gpu=False)
    if rc != 0 or not out.exists():
        return fail(log, rc, "step_overhead")
    res = json.loads(out.read_text())
    print_cpu_report(res)
    # The ratio is the median of the per-round paired ratios: those rounds are its spread.
    print(result_line("step_overhead", res["ours_ms"], res["bare_ms"], f"<={TARGET_RATIO}", unit="ms",
                      ratio=res["ratio"], spread=res["paired_ratios"]))
    return 0


def print_cpu_report(res: dict) -> None:
    s = res["shape"]
    print(f"shape: Llama hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads, vocab {s['vocab']} "
          f"({s['params'] / 1e6:.2f}M params); seq {s['seq']}, micro batch {s['micro_batch']}, grad accum "
          f"{s['grad_accum']}, {s['world']} ranks -> {s['tokens_per_step']} tokens/step; ZeRO {s['zero_stage']} "
          f"{s['precision']}; metrics {s['metrics']}")
    print(f"timing: {s['warmup']} warm-up steps each, then {s['rounds']} rounds x {s['block']} steps each, "
          f"interleaved ABBA; rank 0 step times")
    for side, key in (("ayumi", "ours"), ("bare ", "bare")):
        t = res[f"{key}_times_ms"]
        print(f"  {side}: median {statistics.median(t):7.1f} ms  mean {statistics.fmean(t):7.1f}  min {min(t):7.1f}  "
              f"max {max(t):7.1f}  "
              f"(n={len(t)}; other ranks' medians {', '.join(f'{m:.1f}' for m in res[f'{key}_rank_medians_ms'][1:])})")
    print(f"  ratio (median of the {len(res['paired_ratios'])} per-round paired ratios) {res['ratio']:.3f}, "
          f"range {min(res['paired_ratios']):.3f}..{max(res['paired_ratios']):.3f}; ratio of medians "
          f"{res['ratio_of_medians']:.3f}; ratio of means {res['ours_mean_ms'] / res['bare_mean_ms']:.3f} "
          f"(means include periodic work, e.g. telemetry every stability.telemetry.group_norm_interval steps)")
    print(f"  process CPU time per step (rank 0, all threads; less disturbed by other load): ayumi "
          f"{res['ours_cpu_ms']:.1f} ms, bare {res['bare_cpu_ms']:.1f} ms, ratio {res['ours_cpu_ms'] / res['bare_cpu_ms']:.3f}; "
          f"child processes (W&B service) {res['helpers_cpu_ms_per_ours_step']:.1f} ms CPU per ayumi step")
    if res.get("profile"):
        print(res["profile"])


def main_gpu(args: argparse.Namespace, work: Path, passthrough: list[str]) -> int:
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        print("[step_overhead] --gpu: no CUDA device visible; skipping the GPU benchmark")
        return 0
    ngpu = torch.cuda.device_count()
    micro = dict(item.split("=") for item in args.gpu_micro_batch.split(",") if item)
    data = work / "corpus_gpu"
    if not data.exists():
        write_corpus(data, 50176, min_tokens=2_000_000)
    lines, status = [], 0
    for preset in [p for p in args.presets.split(",") if p]:
        out = work / f"result_gpu_{preset}.json"
        log = work / f"worker_gpu_{preset}.log"
        out.unlink(missing_ok=True)
        mb = int(micro.get(preset, 4))
        extra = [*passthrough, "--preset", preset, "--micro-batch", str(mb), "--grad-accum", "1", "--seq", "2048",
                 "--precision", "bf16", "--work", str(work), "--out", str(out)]
        print(f"[step_overhead] GPU {preset}: {ngpu} process(es), micro batch {mb}, seq 2048, bf16; log {log}",
              flush=True)
        rc = launch(ngpu, extra, log, args.timeout, gpu=True)
        if rc != 0 or not out.exists():
            fail(log, rc, f"step_overhead_gpu_{preset}")
            status = 1
            continue
        res = json.loads(out.read_text())
        print_cpu_report(res)
        print(f"  {preset}: ayumi {res['ours_tok_s']:.0f} tok/s, MFU {100 * (res['ours_mfu'] or 0):.1f}% | "
              f"bare {res['bare_tok_s']:.0f} tok/s, MFU {100 * (res['bare_mfu'] or 0):.1f}% ({res['gpu_name']})")
        lines += gpu_result_lines(preset, res)
    for line in lines:
        print(line)
    return status


def gpu_result_lines(preset: str, res: dict) -> list[str]:
    """tokens/s of both sides (and the 1b preset's MFU), each with its spread over the timed blocks."""
    # tokens/s is inverse to the step time: a round's tokens/s ratio is 1 / its paired time ratio.
    lines = [result_line(f"step_overhead_gpu_{preset}", res["ours_tok_s"], res["bare_tok_s"],
                         f">={1 / TARGET_RATIO:.3f}", unit="tok/s", spread=[1 / p for p in res["paired_ratios"]])]
    if preset == "1b" and res["ours_mfu"] is not None:
        mfu = 100 * res["ours_mfu"]
        # MFU scales with 1 / step time: each of ayumi's blocks gives one.
        lines.append(result_line("step_overhead_gpu_1b_mfu", mfu, 100 * res["bare_mfu"], f">={100 * TARGET_MFU_1B:.0f}%",
                                 unit="%", spread=[mfu * res["ours_ms"] / t for t in res["ours_times_ms"]]))
    return lines


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    print(machine_line(), flush=True)
    passthrough = [a for a in argv if a not in ("--gpu",)]
    # --work/--out/--presets are the launcher's own; the worker gets them explicitly.
    cleaned, skip = [], False
    for a in passthrough:
        if skip:
            skip = False
            continue
        if a in ("--work", "--out", "--presets", "--gpu-micro-batch", "--timeout"):
            skip = True
            continue
        if a.split("=")[0] in ("--work", "--out", "--presets", "--gpu-micro-batch", "--timeout"):
            continue
        cleaned.append(a)
    keep = args.work is not None
    work = Path(args.work).resolve() if keep else Path(tempfile.mkdtemp(prefix="ayumi_step_overhead_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return main_gpu(args, work, cleaned) if args.gpu else main_cpu(args, work, cleaned)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# Worker side: one process per rank, under torchrun
# ----------------------------------------------------------------------------------------------


def compose_bench_config(args: argparse.Namespace, run_root: Path, data_root: Path):
    """The run's config through Hydra, as `python -m pretrain.train <overrides>` composes it."""
    from omegaconf import OmegaConf

    from pretrain.config import compose_config, to_object

    gpu = args.preset is not None
    overrides = [
        f"name=bench_{args.preset or 'cpu'}", f"run_root={run_root}", f"data.root={data_root}",
        f"deepspeed=zero{args.zero_stage}", f"deepspeed.precision={args.precision}",
        f"train.seq_len={args.seq}", f"train.micro_batch_size={args.micro_batch}", f"train.grad_accum={args.grad_accum}",
        f"train.global_batch_size={args.micro_batch * args.grad_accum * int(os.environ['WORLD_SIZE'])}",
        "train.tokens=1000000000",  # sets the LR schedule's length only: the bench runs a fixed number of steps
        # ... so the plan's repetition of the small bench corpus over those 1B tokens never happens: no limit.
        "curriculum.default_max_repetition=inf",
        "train.eval_interval=0", "data.validation=false",  # evaluation off (in both)
        "checkpoint.interval=0", "checkpoint.save_final=false", "checkpoint.resume=false",  # checkpointing off
        "checkpoint.save_on_signal=false", "optim.warmup_steps=10",
        "stability.recovery.ring_interval=0",  # the recovery ring is checkpointing too: off
        # Stability detection and its telemetry stay at their defaults: they are part of ayumi's step.
        "logging=wandb_offline" if args.metrics == "on" else "logging=none",
    ]
    if gpu:
        overrides += [f"model={args.preset}"]
    else:
        overrides += [f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}",
                      f"model.num_heads={args.heads}", f"model.num_kv_heads={args.heads}",
                      f"model.intermediate_size={_swiglu_width(args.hidden)}",
                      f"model.vocab_size={args.vocab}", f"model.max_seq_len={args.seq}", "train.device=cpu"]
    if args.metrics == "off":
        overrides += ["logging.console=false"]
    if args.prefetch is not None:
        overrides += [f"data.prefetch_batches={args.prefetch}"]
    composed = compose_config(overrides)
    cfg = to_object(composed)
    resolved = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    return cfg, resolved


def _swiglu_width(hidden: int) -> int:
    """Llama's 8/3 * hidden rounded up to a multiple of 16."""
    return (8 * hidden // 3 + 15) // 16 * 16


def worker(args: argparse.Namespace) -> int:
    import cProfile
    import io
    import pstats

    import torch

    # Baseline only: see the module docstring for why a bench may import deepspeed.
    import deepspeed
    import torch.distributed as dist

    from pretrain.config import check_config
    from pretrain.engine.distributed import exit_process, init_distributed
    from pretrain.engine.train_engine import render_ds_config
    from pretrain.loader import BatchLoader
    from pretrain.model.flops import count_parameters, flops_per_token
    from pretrain.model.llama import Llama
    from pretrain.engine.optimizer import param_groups
    from pretrain.train import build_data, build_trainer, job_hardware
    from pretrain.model.flops import peak_flops

    work = Path(args.work)
    gpu = args.preset is not None
    data_root = work / ("corpus_gpu" if gpu else "corpus")
    run_root = work / "runs"
    cfg, resolved = compose_bench_config(args, run_root, data_root)
    check_config(cfg)
    dinfo = init_distributed(cfg.train.device)
    rank, world = dinfo.rank, dinfo.world_size
    if rank == 0 and Path(cfg.run_dir).exists():
        shutil.rmtree(cfg.run_dir)  # a fresh run: no resume, no truncated jsonl from an earlier bench
    dist.barrier()

    # -- ours: ayumi's trainer, built as pretrain.train.run builds it ---------------------------
    trainer, logger = build_trainer(cfg, dinfo, resolved)
    console_file = None
    if rank == 0 and hasattr(logger, "stream"):
        console_file = open(Path(cfg.run_dir) / "console.log", "w", buffering=1)
        logger.stream = console_file  # console ON, into a file instead of the terminal
    trainer.announce()
    logger.set_progress(trainer.total_steps, trainer.state.step)
    trainer.engine.train()

    trainer.checkpoints.refresh()

    def ayumi_step() -> None:
        # Exactly one turn of Trainer.run's loop. Evaluation and checkpoints (interval, final,
        # recovery ring) are off, so those branches cost a comparison each; a stability rollback
        # or stop would end the comparison, so the bench refuses to go on.
        outcome = trainer.step_once()
        if outcome.rolled_back or outcome.stability_stop or outcome.signal_stop:
            raise RuntimeError(f"the run loop rolled back or stopped at step {trainer.state.step} during the benchmark: {outcome}")

    # -- baseline: a bare DeepSpeed loop --------------------------------------------------------
    torch.manual_seed(cfg.train.seed)  # the same init as ayumi's model
    model = Llama(cfg.model)
    groups = [{k: v for k, v in g.items() if k != "name"} for g in param_groups(model.named_parameters(),
                                                                                 cfg.optim.weight_decay)]
    optimizer = torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                  eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay,
                                  fused=dinfo.device.type == "cuda")
    # Both sides sum micro-batch gradients alike: where ayumi sums bf16 gradients in fp32 itself (ZeRO 0-1,
    # pretrain/engine/grad_accum.py) the bare loop gets the same hooks, so the ratio measures ayumi's machinery,
    # not that numerics choice (`deepspeed.grad_accum_dtype`; its own cost is memory-bound, ~4% of this
    # tiny CPU step, negligible on a GPU).
    from pretrain.engine.grad_accum import Fp32GradAccumulator

    same_sums = Fp32GradAccumulator(model.named_parameters()) if trainer.engine.accumulator is not None else None
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=render_ds_config(cfg, world))
    if same_sums is not None:
        same_sums.allocate()
    engine.train()
    total_bare_steps = args.warmup + args.rounds * args.block
    # The same micro-batches ayumi's loader yields, built once, held in memory (no loader in the loop).
    source, _ = build_data(cfg, {}, job_hardware(dinfo))
    pregen = BatchLoader(source, cfg.train.micro_batch_size, trainer.engine.grad_accum, rank, world, dinfo.device,
                         prefetch=0)
    bare_steps = [[(b.input_ids, b.labels) for b in pregen.next_step()] for _ in range(total_bare_steps)]
    pregen.close()
    bare_index = 0

    def bare_step() -> None:
        nonlocal bare_index
        for x, y in bare_steps[bare_index]:
            loss = engine(x, y).loss
            # As TrainEngine.backward uses DeepSpeed: its public boundary call (DeepSpeed's own hook cannot see
            # inside LlamaOutput and would tell ZeRO one micro-batch late), then the same sums.
            boundary = engine.is_gradient_accumulation_boundary()
            if hasattr(engine.optimizer, "set_gradient_accumulation_boundary"):
                engine.optimizer.set_gradient_accumulation_boundary(boundary)
            if same_sums is None:
                engine.backward(loss)
            else:
                same_sums.begin_backward(boundary)
                engine.backward(loss)
                same_sums.end_backward()
            engine.step()
        bare_index += 1

    cuda = dinfo.device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    profilers = None
    if args.profile and rank == 0:
        clock = time.process_time if args.profile == "cpu" else time.perf_counter
        profilers = {"ours": cProfile.Profile(clock), "bare": cProfile.Profile(clock)}

    cpu_times: dict[str, list[float]] = {"ours": [], "bare": []}

    def run_block(fn, n: int, per_step: bool, prof=None, side: str | None = None) -> list[float]:
        """Wall seconds per step (CPU: each step; GPU: the block's time / n). Also records the
        process CPU seconds per step (all threads: the loader's prefetch thread included), which
        other users' load on the machine disturbs less than wall time."""
        times = []
        sync()
        block_start, block_cpu = time.perf_counter(), time.process_time()
        for _ in range(n):
            start, cpu = time.perf_counter(), time.process_time()
            if prof is not None:
                prof.enable()
            fn()
            if prof is not None:
                prof.disable()
            if per_step:
                times.append(time.perf_counter() - start)
                if side:
                    cpu_times[side].append(time.process_time() - cpu)
        sync()
        if not per_step:
            times = [(time.perf_counter() - block_start) / n] * n
            if side:
                cpu_times[side] += [(time.process_time() - block_cpu) / n] * n
        return times

    def children_cpu() -> float:
        """CPU seconds of this process's descendants (the W&B service on rank 0)."""
        try:
            import psutil

            total = 0.0
            for child in psutil.Process().children(recursive=True):
                try:
                    t = child.cpu_times()
                    total += t.user + t.system
                except psutil.Error:
                    pass
            return total
        except ImportError:
            return float("nan")

    per_step = not cuda  # CPU: every step timed; GPU: block time / K (see docstring)
    run_block(ayumi_step, args.warmup, per_step)
    run_block(bare_step, args.warmup, per_step)
    dist.barrier()
    helpers_cpu_start = children_cpu()
    ours, bare, paired = [], [], []
    for r in range(args.rounds):
        order = ("ours", "bare") if r % 4 in (0, 3) else ("bare", "ours")  # ABBA BAAB ...
        got = {}
        for side in order:
            fn = ayumi_step if side == "ours" else bare_step
            got[side] = run_block(fn, args.block, per_step, profilers[side] if profilers else None, side)
        ours += got["ours"]
        bare += got["bare"]
        paired.append(statistics.median(got["ours"]) / statistics.median(got["bare"]))

    helpers_cpu = children_cpu() - helpers_cpu_start
    # Every rank's medians (rank 0 logs, so it is the one that matters; the others show the spread).
    medians = torch.tensor([statistics.median(ours), statistics.median(bare)], dtype=torch.float64)
    gathered = [torch.zeros_like(medians) for _ in range(world)]
    dist.all_gather(gathered, medians)

    if rank == 0:
        s = cfg.train
        tokens_per_step = s.global_batch_size * s.seq_len
        med_ours, med_bare = statistics.median(ours), statistics.median(bare)
        result = {
            "shape": {"hidden": cfg.model.hidden_size, "layers": cfg.model.num_layers, "heads": cfg.model.num_heads,
                      "vocab": cfg.model.vocab_size, "params": count_parameters(cfg.model), "seq": s.seq_len,
                      "micro_batch": s.micro_batch_size, "grad_accum": trainer.engine.grad_accum, "world": world,
                      "tokens_per_step": tokens_per_step, "zero_stage": cfg.deepspeed.zero_stage,
                      "precision": cfg.deepspeed.precision, "metrics": args.metrics, "warmup": args.warmup,
                      "rounds": args.rounds, "block": args.block, "preset": args.preset},
            "ours_times_ms": [1000 * t for t in ours], "bare_times_ms": [1000 * t for t in bare],
            "ours_ms": 1000 * med_ours, "bare_ms": 1000 * med_bare, "ratio_of_medians": med_ours / med_bare,
            # The headline ratio: each round compares adjacent blocks, which share the machine's
            # load of that second; the median over rounds. (On a busy box step times are bimodal,
            # contended or not, and the ratio of the two medians swings with the mix.)
            "ratio": statistics.median(paired),
            "ours_mean_ms": 1000 * statistics.fmean(ours), "bare_mean_ms": 1000 * statistics.fmean(bare),
            "paired_ratios": paired, "paired_ratio_median": statistics.median(paired),
            "ours_cpu_ms": 1000 * statistics.median(cpu_times["ours"]),
            "bare_cpu_ms": 1000 * statistics.median(cpu_times["bare"]),
            "helpers_cpu_ms_per_ours_step": 1000 * helpers_cpu / max(1, len(ours)),
            "ours_rank_medians_ms": [1000 * float(g[0]) for g in gathered],
            "bare_rank_medians_ms": [1000 * float(g[1]) for g in gathered],
        }
        fpt = flops_per_token(cfg.model, s.seq_len)
        peak = peak_flops(dinfo.device)
        for key, med in (("ours", med_ours), ("bare", med_bare)):
            tok_s = tokens_per_step / med
            result[f"{key}_tok_s"] = tok_s
            result[f"{key}_mfu"] = tok_s * fpt / (peak * world) if peak else None
        result["gpu_name"] = torch.cuda.get_device_name(dinfo.device) if cuda else None
        if profilers:
            text = io.StringIO()
            for side, prof in profilers.items():
                text.write(f"--- cProfile ({args.profile} clock), rank 0, {side} timed steps (top 25 by internal time) ---\n")
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            profile_path = work / "profile.txt"
            profile_path.write_text(text.getvalue())
            for side, prof in profilers.items():
                prof.dump_stats(str(work / f"profile_{side}.pstats"))
            result["profile"] = f"cProfile written to {profile_path} (and profile_ours/bare.pstats)"
        Path(args.out).write_text(json.dumps(result))

    trainer.loader.close()
    logger.close()
    if console_file is not None:
        console_file.close()
    exit_process(0)  # not a plain return: gloo can abort in Python's shutdown (distributed.exit_process)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
