"""Training-blocked time of an asynchronous checkpoint save vs a synchronous one.

One rank in-process (CPU, or the GPU with --device cuda), a Llama of the given shape under
ayumi's TrainEngine (DeepSpeed, ZeRO --zero-stage, fp32 master weights + AdamW moments), one
training step so the optimizer state exists, then alternately:

* baseline: `Checkpointer.save` with async_writes=False (DeepSpeed writes every file, as today, no
  fsync; the same save with its files fsynced afterwards is printed for reference);
* ours: `Checkpointer.save` with async_writes=True: the time until it returns is what training
  waits for (staging the tensors in host memory); the background write (files + fsync +
  publication) is then waited for outside the timing, as the next save would after many steps.

Medians over --repeats rounds. Each round saves to a fresh step, so both sides write the same
bytes. The first async save allocates its host buffers (reused afterwards): it is reported on
its own and left out of the median, as it happens once per run.

Ends with: RESULT checkpoint_async ours=<ms>ms baseline=<ms>ms ratio=<r> target=<=0.10 ok=<true|false>
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.result_form import machine_line, result_line  # noqa: E402  (first: it reads the load at the start)

TARGET = "<=0.10"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="125m", help="model preset (conf/model/NAME.yaml); default 125m")
    p.add_argument("--zero-stage", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                   help="deepspeed.precision (bf16 on a GPU: bf16 weights beside the fp32 master copy)")
    p.add_argument("--json", default=None, help="also write the figures here as JSON")
    p.add_argument("--work", default=None, help="checkpoint folder (default: a temporary one, removed)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    print(machine_line(), flush=True)
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if args.device == "cpu" else "cuda")
    import torch  # one rank in this process: init_distributed sets the rank variables and a free port

    from curriculum.plan import directory_bytes
    from pretrain.checkpoint.checkpointer import Checkpointer
    from pretrain.config import compose_config, to_object
    from pretrain.engine.train_engine import TrainEngine, build_model
    from pretrain.engine.distributed import any_rank, barrier, finalize_distributed, init_distributed
    from pretrain.model.flops import count_parameters
    from pretrain.model.llama import Llama

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="ckpt_async_", dir=REPO / ".cache"
                                                                    if (REPO / ".cache").is_dir() else None))
    cfg = to_object(compose_config([
        f"model={args.model}", f"deepspeed=zero{args.zero_stage}", f"deepspeed.precision={args.precision}",
        f"train.device={args.device}", "train.seq_len=128", "train.micro_batch_size=1", "train.global_batch_size=1",
        f"run_root={work}", "logging=none"]))
    dinfo = init_distributed(cfg.train.device)
    torch.manual_seed(0)
    engine = TrainEngine(build_model(lambda init_weights: Llama(cfg.model, init_weights=init_weights), cfg, dinfo), cfg, dinfo)
    ids = torch.randint(0, cfg.model.vocab_size, (1, 128), device=dinfo.device)
    engine.train()
    engine.backward(engine.forward(ids, ids).loss)
    engine.micro_step()
    params = count_parameters(cfg.model)
    print(f"model {args.model}: {params / 1e6:.0f}M parameters, ZeRO-{args.zero_stage} fp32 + AdamW, "
          f"device {dinfo.device}, checkpoints under {work}")

    def checkpointer(name: str, async_writes: bool) -> Checkpointer:
        return Checkpointer(work / name, keep_last=1, rank=0, barrier=barrier, world_size=1,
                            zero_stage=args.zero_stage, any_rank=any_rank, async_writes=async_writes)

    sync, asyn = checkpointer("sync", False), checkpointer("async", True)
    shared = {"bench": True}
    base, durable, ours, writes = [], [], [], []
    step = 0
    first_async = None
    for round_ in range(args.repeats + 1):
        step += 1
        start = time.perf_counter()
        sync.save(engine, step, shared, {})
        base.append(time.perf_counter() - start)
        folder = work / "sync" / f"step_{step:07d}"
        for path in sorted(folder.iterdir()):  # what the async side guarantees too
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        durable.append(time.perf_counter() - start)
        size = directory_bytes(folder)
        # One checkpoint on disk at a time (a 1b one is ~16 GiB): removed once timed, outside the timing.
        shutil.rmtree(folder)
        start = time.perf_counter()
        asyn.save(engine, step, shared, {})
        blocked = time.perf_counter() - start
        start = time.perf_counter()
        asyn.wait()
        writes.append(time.perf_counter() - start)
        shutil.rmtree(work / "async" / f"step_{step:07d}")
        if round_ == 0:
            first_async = blocked  # allocates the host buffers
        else:
            ours.append(blocked)
        print(f"round {round_}: sync save {1e3 * base[-1]:.0f} ms ({1e3 * durable[-1]:.0f} ms with its files fsynced), async blocked {1e3 * blocked:.0f} ms "
              f"(+ background write {1e3 * writes[-1]:.0f} ms after it)")
    ours_ms, base_ms = 1e3 * statistics.median(ours), 1e3 * statistics.median(base[1:])
    ratio = ours_ms / base_ms
    print(f"checkpoint {size / 2**30:.2f} GiB; first async save (buffers allocated) {1e3 * first_async:.0f} ms; "
          f"medians over {len(ours)} rounds")
    durable_ms = 1e3 * statistics.median(durable[1:])
    print(f"for reference, not the RESULT: vs a synchronous save fsynced as the async one is "
          f"({durable_ms:.0f} ms) the ratio is {ours_ms / durable_ms:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": args.model, "precision": args.precision, "zero_stage": args.zero_stage, "device": str(dinfo.device),
            "gib": size / 2**30, "ours_ms": ours_ms, "base_ms": base_ms, "durable_ms": durable_ms,
            "write_ms": 1e3 * statistics.median(writes[1:]), "first_async_ms": 1e3 * first_async,
            "rounds": len(ours)}))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    finalize_distributed()
    # Spread: each round's blocked time over the same round's synchronous save (round 0 allocates: left out).
    print(result_line("checkpoint_async", ours_ms, base_ms, TARGET, unit="ms", ratio=ratio,
                      spread=[o / b for o, b in zip(ours, base[1:])]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
