"""Checkpoint mechanism: atomic, self-describing checkpoint folders and the `latest` pointer.

Layout under the checkpoint root::

    step_0000100/                 DeepSpeed's files (every rank writes its own shards)
        ayumi_state.pt            trainer state shared by all ranks (counters, data position, ...)
        ayumi_rank00000.pt        per-rank state (RNG of torch, numpy, python, CUDA)
        ayumi.json                written last by rank 0: marks the folder complete, describes it
    latest                        the newest complete tag, replaced atomically after ayumi.json
    universal/step_0000100/       only while a checkpoint of another data-parallel size is loaded

A crash mid-save leaves a folder without `ayumi.json` and `latest` still naming the previous
checkpoint; such folders are never loaded and are removed by the next save. With `async_writes`
a save returns once the tensors are staged in host memory and the files are written in the
background (pretrain/checkpoint/async_writer.py); `ayumi.json` and `latest` follow only once every
rank's files are fsynced, the next save first waits for the previous one (`wait`), and the
trainer drains before rollbacks and at the end. *When* to save
(interval, signals, end of run) is the trainer's policy, not this module's.
"""
from __future__ import annotations

import errno
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from curriculum.plan import directory_bytes, existing_parent, human_bytes
from pretrain.checkpoint.async_writer import BackgroundWriter, HostBuffers, StagingCollector, finish_staging, stage
from pretrain.model.config import ModelConfig
from common.files import write_text_atomic

LATEST = "latest"
META = "ayumi.json"
SHARED_STATE = "ayumi_state.pt"
TAG_PREFIX = "step_"
UNIVERSAL_DIR = "universal"  # under a checkpoint root: converted copies, while they are being loaded


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or does not fit this run."""


class CheckpointDiskFull(CheckpointError):
    """No room for the next checkpoint, found before any rank wrote (every rank raises it alike)."""


class CheckpointWriteFailed(CheckpointError):
    """Writing failed on this rank mid-save (e.g. the disk filled): its partial files are gone, the last
    complete checkpoint and `latest` are intact. Other ranks may be waiting in DeepSpeed's barrier, so
    the rank must leave at once rather than meet them in a collective (pretrain.train.run)."""


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(existing_parent(path)).free


def _looks_like_a_full_disk(err: BaseException, root: Path, needed: int) -> bool:
    """ENOSPC, or torch's C++ writer's way of saying it ("iostream error", "unexpected pos") with little room left."""
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return True
    text = str(err)
    return ("iostream error" in text or "unexpected pos" in text or "No space left" in text) and \
        _free_bytes(root) < max(needed, 1 << 20)


def tag_for(step: int) -> str:
    return f"{TAG_PREFIX}{step:07d}"


def step_of(tag: str) -> int:
    return int(tag[len(TAG_PREFIX):])


def rank_state_name(rank: int) -> str:
    return f"ayumi_rank{rank:05d}.pt"


def atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def is_complete(tag_dir: Path) -> bool:
    return (tag_dir / META).is_file()


def complete_tags(root: Path) -> list[str]:
    """Complete checkpoint tags under root, oldest first."""
    if not root.is_dir():
        return []
    tags = [p.name for p in root.iterdir() if p.is_dir() and p.name.startswith(TAG_PREFIX) and is_complete(p)]
    return sorted(tags, key=step_of)


def latest_tag(root: Path) -> str | None:
    """The tag `latest` names, if that checkpoint is complete; else the newest complete one."""
    pointer = root / LATEST
    if pointer.is_file():
        tag = pointer.read_text().strip()
        if tag and is_complete(root / tag):
            return tag
    tags = complete_tags(root)
    return tags[-1] if tags else None


def capture_rng() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Checkpointer:
    """Saves and loads ayumi checkpoints for one run (all ranks call every method).

    `world_size`, `zero_stage` and `tensor_parallel` describe this run: a ZeRO 1-3 checkpoint saved by
    another number of ranks or another tensor-parallel size is loaded through DeepSpeed's universal form
    (converted by rank 0 under `<root>/universal/`, removed after loading; DeepSpeed 0.19 merges and
    re-cuts AutoTP shards there). `any_rank(flag)` is True on every rank when the
    flag is on any one (pretrain.engine.distributed.any_rank); it carries a failed conversion to all ranks.
    """

    def __init__(self, root: Path, keep_last: int, rank: int, barrier, world_size: int = 1, zero_stage: int = 0,
                 any_rank=lambda flag: flag, expected_bytes: int = 0, async_writes: bool = False,
                 write_delay_s: float = 0.0, tensor_parallel: int = 1):
        self.expected_bytes = expected_bytes
        """About what one checkpoint of this run takes on disk (curriculum.plan.checkpoint_size); 0 = unknown."""
        self.root = Path(root)
        self.keep_last = keep_last
        self.rank = rank
        self._barrier = barrier
        self.world_size = world_size
        self.zero_stage = zero_stage
        self.tensor_parallel = tensor_parallel
        self._any_rank = any_rank
        self.async_writes = async_writes
        """Stage in host memory and write in the background (checkpoint.async_save)."""
        self._write_delay_s = write_delay_s
        self._writer = BackgroundWriter(rank, world_size, write_delay_s) if async_writes else None
        self._buffers = HostBuffers()  # the staged copies, reused from save to save
        self._pending: tuple[Path, int] | None = None  # (tag dir, step) being written in the background

    def sibling(self, root: Path, keep_last: int) -> "Checkpointer":
        """A checkpointer for another folder of the same run (the rollback ring): same ranks, stage, writes."""
        return Checkpointer(root, keep_last, self.rank, self._barrier, self.world_size, self.zero_stage,
                            self._any_rank, self.expected_bytes, self.async_writes, self._write_delay_s,
                            self.tensor_parallel)

    @property
    def pending_step(self) -> int | None:
        """The step whose checkpoint is being written in the background, if any."""
        return self._pending[1] if self._pending else None

    def wait(self, prune: bool = True) -> Path | None:
        """Wait until the background write (if any) is durable on every rank and published.

        All ranks call it at the same point (one collective agrees on the outcome); a failure on
        any rank raises CheckpointWriteFailed on every rank, `latest` still naming the last good
        checkpoint. Returns the published folder."""
        if self._pending is None:
            return None
        tag_dir, step = self._pending
        self._pending = None
        err = self._writer.wait_written()
        failed = self._any_rank(err is not None)
        err = self._writer.finish(peers_done=not failed) or err
        if failed or self._any_rank(err is not None):
            if err is not None:
                raise self._write_failed(tag_dir, step, err) from err
            if self.rank == 0:
                shutil.rmtree(tag_dir, ignore_errors=True)
            raise CheckpointWriteFailed(f"saving {tag_dir} failed on another rank (its log says why); "
                                        f"{self._full_disk_advice(step)}")
        if self.rank == 0 and prune:
            self._prune()
        return tag_dir

    def save(self, engine, step: int, shared_state: dict[str, Any], meta: dict[str, Any]) -> Path:
        self.wait()  # one write in flight at most: the previous one is durable and published first
        tag = tag_for(step)
        tag_dir = self.root / tag
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tag_dir.exists():  # left by a crash mid-save, or a re-save of the same step
                shutil.rmtree(tag_dir)
        self._check_room(step)
        self._barrier()
        if self.async_writes:
            return self._save_async(engine, step, tag_dir, shared_state, meta)
        try:
            engine.save(self.root, tag, client_state={"ayumi_step": step})
            atomic_torch_save(capture_rng(), tag_dir / rank_state_name(self.rank))
            if self.rank == 0:
                atomic_torch_save(shared_state, tag_dir / SHARED_STATE)
        except (OSError, RuntimeError) as err:
            raise self._write_failed(tag_dir, step, err) from err
        self._barrier()  # every rank's files are on disk before the folder is declared complete
        if self.rank == 0:
            meta = {**meta, "step": step, "tag": tag, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
            try:
                write_text_atomic(tag_dir / META, json.dumps(meta, indent=2, default=str) + "\n")
                write_text_atomic(self.root / LATEST, tag + "\n")
            except OSError as err:
                raise self._write_failed(tag_dir, step, err) from err
            self._prune()
        self._barrier()
        return tag_dir

    def _save_async(self, engine, step: int, tag_dir: Path, shared_state: dict[str, Any],
                    meta: dict[str, Any]) -> Path:
        try:
            collector = StagingCollector(buffers=self._buffers)
            engine.save(self.root, tag_dir.name, client_state={"ayumi_step": step}, collector=collector)
            files = collector.files + [(tag_dir / rank_state_name(self.rank), capture_rng())]
            if self.rank == 0:
                files.append((tag_dir / SHARED_STATE, stage(shared_state)))
            finish_staging()
        except (OSError, RuntimeError) as err:
            raise self._write_failed(tag_dir, step, err) from err
        publish = None
        if self.rank == 0:
            meta = {**meta, "step": step, "tag": tag_dir.name, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S")}

            def publish() -> None:  # on rank 0's writer thread, once every rank's files are durable
                write_text_atomic(tag_dir / META, json.dumps(meta, indent=2, default=str) + "\n")
                write_text_atomic(self.root / LATEST, tag_dir.name + "\n")
        self._writer.start(tag_dir, files, publish)
        self._pending = (tag_dir, step)
        return tag_dir

    def _full_disk_advice(self, step: int) -> str:
        last = latest_tag(self.root)
        kept = f"{self.root / last} is the last good checkpoint" if last else "no checkpoint of this run exists yet"
        resume = f"it resumes from {last}" if last else "it starts again from step 0"
        return (f"nothing of step {step} was kept and {kept}. Fix: free space there (old runs, other files) or point "
                f"checkpoint.dir at a larger disk, then start the job again: {resume}")

    def _check_room(self, step: int) -> None:
        """Refuse on every rank alike, before anything is written, when the disk cannot hold the checkpoint."""
        if self.expected_bytes <= 0:  # unknown size (the same on every rank): nothing to check, no all-reduce
            return
        free = _free_bytes(self.root)
        if self._any_rank(free < self.expected_bytes):
            raise CheckpointDiskFull(
                f"the disk at {self.root} is full: {human_bytes(free)} free, a checkpoint of this run needs about "
                f"{human_bytes(self.expected_bytes)}; {self._full_disk_advice(step)}")

    def _write_failed(self, tag_dir: Path, step: int, err: BaseException) -> CheckpointWriteFailed:
        """Remove what this rank left of the failed save and say what happened."""
        full = _looks_like_a_full_disk(err, self.root, self.expected_bytes // max(1, self.world_size))  # before freeing
        for leftover in tag_dir.glob(".*.tmp*"):
            leftover.unlink(missing_ok=True)
        if self.rank == 0:
            shutil.rmtree(tag_dir, ignore_errors=True)
        if full:
            return CheckpointWriteFailed(
                f"the disk at {self.root} is full ({human_bytes(_free_bytes(self.root))} free) while saving step {step} "
                f"on rank {self.rank}; {self._full_disk_advice(step)}")
        return CheckpointWriteFailed(f"saving {tag_dir} failed on rank {self.rank}: {err}; {self._full_disk_advice(step)}")

    def _prune(self) -> None:
        """Drop old complete checkpoints beyond keep_last and any incomplete leftovers."""
        tags = complete_tags(self.root)
        newest = tags[-1] if tags else None
        for tag in tags[:-self.keep_last] if self.keep_last > 0 else []:
            if tag != newest:
                shutil.rmtree(self.root / tag, ignore_errors=True)
        for path in self.root.iterdir():
            if path.is_dir() and path.name.startswith(TAG_PREFIX) and not is_complete(path):
                if newest is None or step_of(path.name) < step_of(newest):
                    shutil.rmtree(path, ignore_errors=True)

    def load(self, engine, tag: str, root: Path | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load engine state and return (shared state, meta); restores this rank's RNG last.

        meta["resharded_from"] is set when the checkpoint came from another number of ranks
        through the universal form. Ranks the checkpoint had no RNG file for keep their seed.
        """
        root = Path(root or self.root)
        tag_dir = root / tag
        if not is_complete(tag_dir):
            raise CheckpointError(f"{tag_dir} is not a complete ayumi checkpoint (no {META})")
        meta = json.loads((tag_dir / META).read_text())
        if self._needs_universal(tag_dir, meta):
            self._load_universal(engine, tag_dir)
            meta["resharded_from"] = meta["world_size"]
            meta["resharded_from_tensor_parallel"] = meta.get("tensor_parallel", 1)
        else:
            engine.load(root, tag)
        shared = torch.load(tag_dir / SHARED_STATE, map_location="cpu", weights_only=False)
        rank_file = tag_dir / rank_state_name(self.rank)
        if rank_file.exists():
            restore_rng(torch.load(rank_file, map_location="cpu", weights_only=False))
        return shared, meta

    def _needs_universal(self, tag_dir: Path, meta: dict[str, Any]) -> bool:
        """Whether DeepSpeed cannot load this checkpoint directly on this run's ranks."""
        saved_stage, saved_world = meta.get("zero_stage", self.zero_stage), meta.get("world_size", self.world_size)
        saved_tp = meta.get("tensor_parallel", 1)  # checkpoints from before tensor parallelism: 1
        if saved_stage != self.zero_stage:
            raise CheckpointError(
                f"{tag_dir} was saved with ZeRO stage {saved_stage}, this run uses stage {self.zero_stage}. "
                f"Fix: resume with deepspeed=zero{saved_stage} (the data-parallel size may differ)."
            )
        if saved_stage == 0 and saved_tp != self.tensor_parallel:
            raise CheckpointError(
                f"{tag_dir} was saved with parallel.tensor={saved_tp}, this run uses {self.tensor_parallel}: a ZeRO-0 "
                "checkpoint holds one file per tensor-parallel rank and DeepSpeed converts only ZeRO 1-3 checkpoints "
                f"between sizes. Fix: resume with parallel.tensor={saved_tp} (the data-parallel size may differ).")
        # Stage 0 keeps whole optimizer state on every rank of a tensor-parallel position and loads at any
        # data-parallel size; ZeRO 1-3 cut it by the data-parallel size and the tensor-parallel size.
        return saved_stage >= 1 and (saved_world != self.world_size or saved_tp != self.tensor_parallel)

    def _load_universal(self, engine, tag_dir: Path) -> None:
        universal = self.root / UNIVERSAL_DIR / tag_dir.name
        failure = None
        if self.rank == 0:
            # Never reused: one left by a crash may come from another run's folder of the same name.
            shutil.rmtree(universal, ignore_errors=True)
            try:
                _check_room_for_universal(tag_dir, universal)
                from pretrain.engine.checkpoint_formats import convert_to_universal  # the DeepSpeed room

                convert_to_universal(tag_dir, universal)
            except Exception as err:  # every rank must hear of it, or they would wait forever below
                failure = err
        if self._any_rank(failure is not None):
            raise CheckpointError(f"cannot load {tag_dir} on {self.world_size} ranks: {failure or 'see rank 0'}")
        engine.load(universal.parent, universal.name, universal=True)
        self._barrier()
        if self.rank == 0:  # a one-off: this run saves regular checkpoints for its own size
            shutil.rmtree(universal.parent, ignore_errors=True)  # with the `latest_universal` file DeepSpeed adds


def _check_room_for_universal(tag_dir: Path, universal: Path) -> None:
    """Refuse to start a conversion the disk cannot hold: the converter writes every parameter's
    fp32 weights and Adam moments twice over (extracted shards, then the merged copy), about
    twice the checkpoint folder at its peak."""
    needed = 2 * directory_bytes(tag_dir)
    where = existing_parent(universal)
    free = shutil.disk_usage(where).free
    if free < needed:
        raise CheckpointError(
            f"converting {tag_dir} for another number of ranks needs ~{human_bytes(needed)} free under {where}, "
            f"only {human_bytes(free)} is. Fix: free disk space there, or resume on the number of ranks that "
            f"saved it (ayumi.json: world_size)."
        )


def start_checkpoint(load_from: str, resume: bool, own_root: Path) -> tuple[Path, str] | None:
    """(root, tag) of the checkpoint a run starts from: `checkpoint.load_from` when set, else the run's own
    `latest` when `checkpoint.resume`; None for a fresh start."""
    if load_from:
        return resolve_checkpoint(load_from)
    if resume and (tag := latest_tag(Path(own_root))) is not None:
        return Path(own_root), tag
    return None


def resolve_checkpoint(path: str | Path) -> tuple[Path, str]:
    """(root, tag) from a tag folder, a checkpoint root (uses latest) or a run dir."""
    path = Path(path)
    if is_complete(path):
        return path.parent, path.name
    for root in (path, path / "checkpoints"):
        if root.is_dir():
            tag = latest_tag(root)
            if tag:
                return root, tag
    raise CheckpointError(
        f"no complete ayumi checkpoint at {path}: give a run dir, its checkpoints/ folder, or a step_XXXXXXX folder"
    )


def model_config_from_meta(meta: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**meta["model"])


def load_for_export(path: str | Path) -> tuple[dict[str, torch.Tensor], ModelConfig, dict[str, Any]]:
    """Consolidated fp32 weights, the model config, and tokenizer facts of a checkpoint."""
    from pretrain.engine.checkpoint_formats import consolidated_state_dict

    root, tag = resolve_checkpoint(path)
    meta = json.loads((root / tag / META).read_text())
    state = consolidated_state_dict(root, tag)
    extra = {key: meta.get(key) for key in ("tokenizer_dir", "bos_id", "eos_id", "pad_id")}
    return state, model_config_from_meta(meta), extra


def resharded_note(meta: dict[str, Any], world_size: int, tensor_parallel: int) -> str:
    """`; re-sharded from N ranks to M ...` for a resume message when the checkpoint came through the universal
    form (meta["resharded_from"]); empty otherwise."""
    if "resharded_from" not in meta:
        return ""

    def tp(size: int) -> str:
        return f" (tensor-parallel {size})" if size > 1 else ""
    return (f"; re-sharded from {meta['resharded_from']} ranks{tp(meta['resharded_from_tensor_parallel'])} to "
            f"{world_size}{tp(tensor_parallel)} through DeepSpeed's universal checkpoint")
