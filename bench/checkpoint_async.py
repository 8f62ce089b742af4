"""Training-blocked time of an asynchronous checkpoint save vs a synchronous one, and what checksums cost.

One rank in-process (CPU, or the GPU with --device cuda), a Llama of the given shape under
ayumi's TrainEngine (DeepSpeed, ZeRO --zero-stage, fp32 master weights + AdamW moments), one
training step so the optimizer state exists, then in each round:

* plain: a synchronous save without checksums, as ayumi saved before it recorded them (DeepSpeed's
  own checkpoint engine writes every file with torch.save, then the RNG and shared state, ayumi.json
  and `latest`): the write itself;
* sync: `Checkpointer.save` with async_writes=False: every file hashed (xxh3_128) from the bytes as
  they are written, the sums merged into ayumi.json (no fsync; the same save with its files fsynced
  afterwards is printed for reference);
* async: `Checkpointer.save` with async_writes=True: the time until it returns is what training
  waits for (staging the tensors in host memory); the background write (files + hashing + fsync +
  publication) is then waited for outside the timing, as the next save would after many steps;
* async without hashing (the writer's hashing file swapped for a plain one): the same blocked time,
  to show the checksums add none to it (the two async saves alternate which goes first as well).

Medians over --repeats rounds. Each round saves to a fresh step, so every side writes the same
bytes; plain and sync alternate which goes first, and their ratio is the median of each round's
pair (the process CPU time of each is printed too: other jobs on the machine move it far less
than wall time). The first async save allocates its host buffers (reused afterwards): it is
reported on its own and left out of the median, as it happens once per run.

Ends with:
  RESULT checkpoint_async ours=<async blocked>ms baseline=<sync>ms ratio=<r> target=<=0.10 ...
  RESULT checkpoint_checksums ours=<sync>ms baseline=<plain>ms ratio=<r> target=<=1.05 ...
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
CHECKSUM_TARGET = "<=1.05"
"""A synchronous save with checksums against the same save without them (the write itself)."""


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
    from pretrain.checkpoint import integrity
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
    plain, base, durable, ours, writes, unhashed, hashing = [], [], [], [], [], [], []
    cpu = {"plain": [], "sync": []}
    step = 0
    first_async = None

    def async_save(step: int) -> tuple[float, float]:
        """(blocked, background write) of one asynchronous save, its folder removed afterwards."""
        start = time.perf_counter()
        asyn.save(engine, step, shared, {})
        blocked = time.perf_counter() - start
        start = time.perf_counter()
        asyn.wait()
        written = time.perf_counter() - start
        shutil.rmtree(work / "async" / f"step_{step:07d}")
        return blocked, written

    def sync_save(step: int) -> int:
        """One synchronous save with checksums, timed (and with its files fsynced, for reference), then the hashing
        alone of its files, timed; the folder removed. Returns its size."""
        start, started_cpu = time.perf_counter(), time.process_time()
        sync.save(engine, step, shared, {})
        base.append(time.perf_counter() - start)
        cpu["sync"].append(time.process_time() - started_cpu)
        folder = work / "sync" / f"step_{step:07d}"
        for path in sorted(folder.iterdir()):  # what the async side guarantees too
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        durable.append(time.perf_counter() - start)
        start = time.perf_counter()
        for path in sorted(folder.iterdir()):  # the hashing alone, from the page cache
            integrity.hash_file(path)
        hashing.append(time.perf_counter() - start)
        size = directory_bytes(folder)
        # One checkpoint on disk at a time (a 1b one is ~16 GiB): removed once timed, outside the timing.
        shutil.rmtree(folder)
        return size

    def unhashed_save(step: int) -> None:
        start, started_cpu = time.perf_counter(), time.process_time()
        plain_save(engine, work / "plain", step, shared)
        plain.append(time.perf_counter() - start)
        cpu["plain"].append(time.process_time() - started_cpu)
        shutil.rmtree(work / "plain" / f"step_{step:07d}")

    for round_ in range(args.repeats + 1):
        step += 1
        if round_ % 2:  # alternate which goes first: the page cache and other jobs treat both alike
            unhashed_save(step)
            size = sync_save(step)
        else:
            size = sync_save(step)
            unhashed_save(step)
        # The two async saves alternate too: the first after the synchronous ones meets their dirty pages' writeback.
        if round_ % 2:
            with unhashed_writes(integrity):
                unhashed.append(async_save(step)[0])
            step += 1
            blocked, written = async_save(step)
        else:
            blocked, written = async_save(step)
            step += 1
            with unhashed_writes(integrity):
                unhashed.append(async_save(step)[0])
        writes.append(written)
        if round_ == 0:
            first_async = blocked  # allocates the host buffers
        else:
            ours.append(blocked)
        print(f"round {round_}: sync save {1e3 * base[-1]:.0f} ms ({1e3 * durable[-1]:.0f} ms with its files fsynced; "
              f"{1e3 * plain[-1]:.0f} ms without checksums), async blocked {1e3 * blocked:.0f} ms (+ background write "
              f"{1e3 * writes[-1]:.0f} ms after it; blocked {1e3 * unhashed[-1]:.0f} ms without hashing)")
    ours_ms, base_ms = 1e3 * statistics.median(ours), 1e3 * statistics.median(base[1:])
    plain_ms, unhashed_ms = 1e3 * statistics.median(plain[1:]), 1e3 * statistics.median(unhashed[1:])
    hash_ms = 1e3 * statistics.median(hashing[1:])
    paired = [b / p for b, p in zip(base[1:], plain[1:])]
    cpu_sync, cpu_plain = (statistics.median(cpu[side][1:]) for side in ("sync", "plain"))
    ratio = ours_ms / base_ms
    print(f"checkpoint {size / 2**30:.2f} GiB; first async save (buffers allocated) {1e3 * first_async:.0f} ms; "
          f"medians over {len(ours)} rounds")
    durable_ms = 1e3 * statistics.median(durable[1:])
    print(f"for reference, not the RESULT: vs a synchronous save fsynced as the async one is "
          f"({durable_ms:.0f} ms) the ratio is {ours_ms / durable_ms:.3f}")
    print(f"checksums: the synchronous save takes {base_ms:.0f} ms with them, {plain_ms:.0f} ms without "
          f"(+{100 * (base_ms / plain_ms - 1):.1f}%); hashing every file alone from the page cache takes {hash_ms:.0f} ms "
          f"({size / 2**20 / max(hash_ms, 1e-9) * 1e3:.0f} MiB/s, {100 * hash_ms / plain_ms:.1f}% of the write); the async "
          f"save blocks {ours_ms:.0f} ms with them, {unhashed_ms:.0f} ms without (hashing runs in the writer thread)")
    print(f"checksums in process CPU time: the synchronous save uses {cpu_sync:.2f} s with them, {cpu_plain:.2f} s "
          f"without (+{100 * (cpu_sync / cpu_plain - 1):.1f}%)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": args.model, "precision": args.precision, "zero_stage": args.zero_stage, "device": str(dinfo.device),
            "gib": size / 2**30, "ours_ms": ours_ms, "base_ms": base_ms, "durable_ms": durable_ms,
            "write_ms": 1e3 * statistics.median(writes[1:]), "first_async_ms": 1e3 * first_async,
            "plain_ms": plain_ms, "hash_ms": hash_ms, "unhashed_ms": unhashed_ms, "checksum_ratio": statistics.median(paired),
            "cpu_sync_s": cpu_sync, "cpu_plain_s": cpu_plain, "rounds": len(ours)}))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    finalize_distributed()
    # Spread: each round's blocked time over the same round's synchronous save (round 0 allocates: left out).
    print(result_line("checkpoint_async", ours_ms, base_ms, TARGET, unit="ms", ratio=ratio,
                      spread=[o / b for o, b in zip(ours, base[1:])]))
    # The ratio: the median of each round's pair (both sides of a round share the machine's moment).
    print(result_line("checkpoint_checksums", base_ms, plain_ms, CHECKSUM_TARGET, unit="ms",
                      ratio=statistics.median(paired), spread=paired))
    return 0


def plain_save(engine, root: Path, step: int, shared: dict) -> None:
    """A synchronous save without checksums, as ayumi saved before it recorded them: DeepSpeed's own checkpoint
    engine writes its files (torch.save to a path), then the RNG and shared state, ayumi.json and `latest`."""
    import torch

    from common.files import write_text_atomic
    from pretrain.checkpoint.checkpointer import LATEST, META, SHARED_STATE, capture_rng, rank_state_name, tag_for

    tag = tag_for(step)
    root.mkdir(parents=True, exist_ok=True)
    engine.save(root, tag, client_state={"ayumi_step": step})
    for obj, name in ((capture_rng(), rank_state_name(0)), (shared, SHARED_STATE)):
        aside = root / tag / f".{name}.tmp"
        torch.save(obj, aside)
        os.replace(aside, root / tag / name)
    write_text_atomic(root / tag / META, json.dumps({"step": step, "tag": tag}) + "\n")
    write_text_atomic(root / LATEST, tag + "\n")


class _PlainFile:
    """A file object that only writes (the hashing file's stand-in for the async side without hashing)."""

    def __init__(self, raw) -> None:
        self.raw, self.size = raw, 0

    def write(self, data) -> int:
        self.size += memoryview(data).nbytes
        return self.raw.write(data)

    def flush(self) -> None:
        self.raw.flush()

    def sum(self):
        from pretrain.checkpoint.integrity import FileSum

        return FileSum(self.size, "")


class unhashed_writes:
    """Within it, checkpoint files are written without hashing (the record then holds empty sums: bench only)."""

    def __init__(self, integrity) -> None:
        self.integrity = integrity

    def __enter__(self) -> None:
        self.kept, self.integrity.HashingFile = self.integrity.HashingFile, _PlainFile

    def __exit__(self, *exc) -> None:
        self.integrity.HashingFile = self.kept


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
