"""Checkpoint mechanism: atomic, self-describing checkpoint folders and the `latest` pointer.

Layout under the checkpoint root::

    step_0000100/                 DeepSpeed's files (every rank writes its own shards)
        ayumi_state.pt            trainer state shared by all ranks (counters, data position, ...)
        ayumi_rank00000.pt        per-rank state (RNG of torch, numpy, python, CUDA)
        ayumi.json                written last by rank 0: marks the folder complete, describes it
    latest                        the newest complete tag, replaced atomically after ayumi.json
    universal/step_0000100.XXXX/  a conversion's private folder (mkdtemp, 0700), only while a checkpoint cut
                                  for another number of ranks is loaded
    step_0000040.corrupt/         a damaged checkpoint a run set aside (pretrain/checkpoint/trust.py)

`ayumi.json` records every file's size and checksum (pretrain/checkpoint/integrity.py): each rank hashes
what it writes as it writes it, and rank 0 merges the ranks' sums into the record before `latest` moves.
Every load verifies the folder against that record first (resumes, rollbacks, and so the universal
conversion too), all ranks sharing the hashing and agreeing on the verdict. Checksums find damage, not a
writer: every file is also checked to hold only tensors and plain data before any is read, and each is read
with `weights_only=True` (pretrain/checkpoint/safety.py, common/safe_load.py), so loading never runs code.

A crash mid-save leaves a folder without `ayumi.json` and `latest` still naming the previous
checkpoint; such folders are never loaded and are removed by the next save. With `async_writes`
a save returns once the tensors are staged in host memory and the files are written in the
background (pretrain/checkpoint/async_writer.py); `ayumi.json` and `latest` follow only once every
rank's files are fsynced, the next save first waits for the previous one (`wait`), and the
trainer drains before rollbacks and at the end. *When* to save
(interval, signals, end of run) is the trainer's policy, not this module's.
"""
from __future__ import annotations

import copy
import errno
import json
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from common.safe_load import UnsafeFile
from common.safe_load import load as load_plain
from curriculum.plan import directory_bytes, existing_parent, human_bytes
from pretrain.checkpoint import integrity, paths, safety
from pretrain.checkpoint.async_writer import (
    WRITTEN, WRITTEN_GLOB, BackgroundWriter, HostBuffers, StagingCollector, finish_staging, stage,
)
from pretrain.checkpoint.layout import (  # noqa: F401 - the folder names, re-exported for the checkpointer's users
    LATEST, META, QUARANTINE_SUFFIX, SHARED_STATE, TAG_PREFIX, complete_tags, is_complete, is_tag, latest_tag,
    rank_state_name, step_of, tag_for,
)
from pretrain.model.config import ModelConfig
from common.files import write_text_atomic

UNIVERSAL_DIR = "universal"  # under a checkpoint root: conversions' private folders, while they are being loaded


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or does not fit this run."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint's files do not match the checksums recorded at save, or the state it loads cannot be trained
    from (non-finite weights or Adam moments). Raised on every rank alike; the message is one line naming the
    checkpoint and the file or tensor."""

    def __init__(self, tag_dir: Path, problem: str):
        super().__init__(integrity.damaged_line(tag_dir, problem))
        self.tag_dir = Path(tag_dir)
        self.problem = problem


class CheckpointUnsafe(CheckpointError):
    """A checkpoint file holds objects other than tensors and plain data, so loading it could run code: refused
    before any of it is read, on every rank alike (never set aside as damaged: nothing is wrong with its bytes
    as far as anyone can tell, and an older checkpoint is no answer to a planted one). One line naming the file."""


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


def capture_rng() -> dict[str, Any]:
    """This process's RNG states as tensors and plain data (what a rank's RNG file holds: read weights-only)."""
    state = {"python": random.getstate(), "numpy": numpy_state_as_tensors(np.random.get_state()),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def numpy_state_as_tensors(state: tuple) -> dict[str, Any]:
    """NumPy's legacy RNG state (`np.random.get_state()`: its key is a uint32 array, which would pickle as NumPy
    objects) as a tensor and plain data. int64 holds every uint32 exactly."""
    generator, keys, position, has_gauss, cached_gaussian = state
    return {"generator": str(generator), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "position": int(position), "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    numpy = state["numpy"]
    np.random.set_state((numpy["generator"], numpy["keys"].numpy().astype(np.uint32), numpy["position"],
                         numpy["has_gauss"], numpy["cached_gaussian"]))
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
    `first_problem(text)` gives every rank the problem of the lowest rank that has one
    (pretrain.engine.distributed.first_problem): the ranks verify a checkpoint's files together and
    all take the same decision, naming the same file.
    """

    def __init__(self, root: Path, keep_last: int, rank: int, barrier, world_size: int = 1, zero_stage: int = 0,
                 any_rank=lambda flag: flag, expected_bytes: int = 0, async_writes: bool = False,
                 write_delay_s: float = 0.0, tensor_parallel: int = 1,
                 first_problem: Callable[[str | None], str | None] = lambda problem: problem):
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
        self.first_problem = first_problem
        self.protect: Callable[[int, list[int]], set[int]] = lambda step, steps: set()
        """Steps keep_last must not delete after a save at `step` (set by pretrain.checkpoint.ring.RunCheckpoints)."""
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
                            self.tensor_parallel, self.first_problem)

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
            advice = self._failed_save_advice(step, "see that rank's line, then start the job again")
            raise CheckpointWriteFailed(f"saving {tag_dir} failed on another rank (its log says why); {advice}")
        if self.rank == 0 and prune:
            self._prune(step)
        return tag_dir

    def save(self, engine, step: int, shared_state: dict[str, Any], meta: dict[str, Any]) -> Path:
        self.wait()  # one write in flight at most: the previous one is durable and published first
        # The record is published later under an async write; the caller's dict may change meanwhile (a curriculum
        # stage retunes the model's RoPE in run_meta), so the record is what held at this step.
        meta = copy.deepcopy(meta)
        tag = tag_for(step)
        tag_dir = self.root / tag
        self._refuse_links([tag_dir])  # every rank alike, before any writes: no save goes through a link
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tag_dir.exists():  # left by a crash mid-save, or a re-save of the same step
                shutil.rmtree(tag_dir)
        self._check_room(step)
        self._barrier()
        if self.async_writes:
            return self._save_async(engine, step, tag_dir, shared_state, meta)
        try:
            hashing = integrity.HashingEngine()  # DeepSpeed's files, hashed as they are written
            engine.save(self.root, tag, client_state={"ayumi_step": step}, collector=hashing)
            sums = hashing.sums
            sums[tag_dir / rank_state_name(self.rank)] = integrity.save_hashed(
                capture_rng(), tag_dir / rank_state_name(self.rank), atomic=True)
            if self.rank == 0:
                sums[tag_dir / SHARED_STATE] = integrity.save_hashed(shared_state, tag_dir / SHARED_STATE, atomic=True)
            integrity.write_sums(tag_dir / WRITTEN.format(self.rank), integrity.relative_sums(tag_dir, sums))
        except (OSError, RuntimeError) as err:
            raise self._write_failed(tag_dir, step, err) from err
        self._barrier()  # every rank's files and sums are on disk before the folder is declared complete
        if self.rank == 0:
            try:
                self._publish(tag_dir, step, meta)
            except OSError as err:
                raise self._write_failed(tag_dir, step, err) from err
            self._prune(step)
        self._barrier()
        return tag_dir

    def _publish(self, tag_dir: Path, step: int, meta: dict[str, Any]) -> None:
        """Rank 0, once every rank's files are written: ayumi.json with every file's checksum, then `latest`."""
        markers = sorted(tag_dir.glob(WRITTEN_GLOB))
        meta = {**meta, "step": step, "tag": tag_dir.name, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                integrity.RECORD_KEY: integrity.checksum_record(tag_dir, markers)}
        write_text_atomic(tag_dir / META, json.dumps(meta, indent=2, default=str) + "\n")
        write_text_atomic(self.root / LATEST, tag_dir.name + "\n")
        for marker in markers:
            marker.unlink(missing_ok=True)

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
            def publish() -> None:  # on rank 0's writer thread, once every rank's files and sums are durable
                self._publish(tag_dir, step, meta)
        self._writer.start(tag_dir, files, publish)
        self._pending = (tag_dir, step)
        return tag_dir

    def _full_disk_advice(self, step: int) -> str:
        return self._failed_save_advice(step, "free space there (old runs, other files) or point checkpoint.dir at "
                                              "a larger disk, then start the job again")

    def _failed_save_advice(self, step: int, fix: str = "start the job again") -> str:
        """What was kept of a failed save and how to go on: `fix` then resume from the last good checkpoint."""
        last = latest_tag(self.root)
        kept = f"{self.root / last} is the last good checkpoint" if last else "no checkpoint of this run exists yet"
        resume = f"it resumes from {last}" if last else "it starts again from step 0"
        return f"nothing of step {step} was kept and {kept}. Fix: {fix}: {resume}"

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
            paths.discard(self.root, tag_dir)
        if full:
            return CheckpointWriteFailed(
                f"the disk at {self.root} is full ({human_bytes(_free_bytes(self.root))} free) while saving step {step} "
                f"on rank {self.rank}; {self._full_disk_advice(step)}")
        # Not the disk (a peer lost in the save's collectives, a permission, an I/O error): no advice to free space.
        return CheckpointWriteFailed(f"saving {tag_dir} failed on rank {self.rank}: {err}; "
                                     f"{self._failed_save_advice(step)}")

    def _prune(self, step: int) -> None:
        """Drop old complete checkpoints beyond keep_last (but those `protect` names) and incomplete leftovers.
        Folders set aside as damaged (`.corrupt`) are no tags: never counted, never deleted."""
        tags = complete_tags(self.root)
        newest = tags[-1] if tags else None
        kept = self.protect(step, [step_of(tag) for tag in tags])
        for tag in tags[:-self.keep_last] if self.keep_last > 0 else []:
            if tag != newest and step_of(tag) not in kept:
                paths.discard(self.root, self.root / tag)  # a link is left as it is, never followed
        for path in self.root.iterdir():
            if path.is_dir() and is_tag(path.name) and not is_complete(path):
                if newest is None or step_of(path.name) < step_of(newest):
                    paths.discard(self.root, path)

    def load(self, engine, tag: str, root: Path | None = None,
             verdict: integrity.Verdict | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load engine state and return (shared state, meta); restores this rank's RNG last.

        meta["resharded_from"] is set when the checkpoint came from another number of ranks
        through the universal form; meta["verified"] says whether its files were checked against
        checksums (False: saved before they were recorded). Ranks the checkpoint had no RNG file for
        keep their seed. Raises CheckpointCorrupt on every rank, before anything is read, when a file
        does not match its checksum. `verdict`: the folder was just verified (not hashed again).
        """
        root = Path(root or self.root)
        tag_dir = root / tag
        if not is_complete(tag_dir):
            raise CheckpointError(f"{tag_dir} is not a complete ayumi checkpoint (no {META})")
        verdict = verdict or self.verify(tag_dir)
        if verdict.status == integrity.DAMAGED:
            raise CheckpointCorrupt(tag_dir, verdict.problem)
        meta = integrity.read_meta(tag_dir)
        meta["verified"] = verdict.status == integrity.VERIFIED
        try:
            cut_for = self._needs_universal(tag_dir, meta)
            if cut_for:
                self._load_universal(engine, tag_dir)
                meta["resharded_from"] = cut_for[0] * cut_for[1]  # what the files say, not the record
                meta["resharded_from_tensor_parallel"] = cut_for[1]
            else:
                engine.load(root, tag)  # DeepSpeed's files, weights-only (TrainEngine.load)
            shared = load_plain(tag_dir / SHARED_STATE)
            rank_file = tag_dir / rank_state_name(self.rank)
            if rank_file.exists():
                restore_rng(load_plain(rank_file))
        except UnsafeFile as err:  # a file changed since the folder was checked: the gate refused it as it was read
            raise CheckpointUnsafe(f"{err}; nothing of it was loaded") from None
        return shared, meta

    def verify(self, tag_dir: Path) -> integrity.Verdict:
        """The folder against its recorded checksums: each rank hashes its share of the files, and every rank
        gets the same verdict (the problem the lowest rank found, naming the file). A folder that is not damaged is
        then checked to hold only tensors and plain data (ranks sharing the files again): CheckpointUnsafe on every
        rank otherwise, before any rank reads a file."""
        verdict = integrity.verify(tag_dir, share=(self.rank, self.world_size))
        problem = self.first_problem(verdict.problem if verdict.status == integrity.DAMAGED else None)
        if problem:
            return integrity.Verdict(integrity.DAMAGED, verdict.files, problem)
        unsafe = self.first_problem(safety.folder_problem(tag_dir, share=(self.rank, self.world_size)))
        if unsafe:
            raise CheckpointUnsafe(unsafe)
        return verdict

    def set_aside(self, tag_dir: Path) -> Path:
        """Rename a damaged checkpoint folder to `<name>.corrupt` (rank 0, then a barrier) so it is never chosen,
        listed or pruned again, and kept for a person to look at. Returns the new path."""
        aside = tag_dir.with_name(tag_dir.name + QUARANTINE_SUFFIX)
        number = 1
        while aside.exists():  # the same step damaged twice (a re-save of it, damaged again)
            number += 1
            aside = tag_dir.with_name(f"{tag_dir.name}{QUARANTINE_SUFFIX}{number}")
        if self.rank == 0 and tag_dir.exists():
            tag_dir.rename(aside)
        self._barrier()
        return aside

    def check_paths(self) -> None:
        """Refuse, on every rank alike, a checkpoint root whose `checkpoints/`, `universal/` or rollback ring folder is
        a link (or resolves outside the root): every later write or delete there would land elsewhere. One line."""
        from pretrain.checkpoint.layout import RING_DIR

        self._refuse_links([self.root / UNIVERSAL_DIR, self.root / RING_DIR], agree=True)

    def _refuse_links(self, folders: list[Path], agree: bool = False) -> None:
        """CheckpointError with paths.links_problem's line when ayumi must not write into or delete one of `folders`
        (under this root). `agree`: the ranks agree first (a collective every rank calls)."""
        problem = paths.links_problem(self.root, folders)
        problem = self.first_problem(problem) if agree else problem
        if problem:
            raise CheckpointError(problem)

    def _needs_universal(self, tag_dir: Path, meta: dict[str, Any]) -> tuple[int, int] | None:
        """(data-parallel, tensor-parallel) sizes the checkpoint's optimizer states are cut for when DeepSpeed cannot
        load them directly on this run's ranks, else None. Decided from DeepSpeed's per-rank files in the folder
        (pretrain.engine.checkpoint_formats.optimizer_layout), never from ayumi.json alone: a record that does not
        describe its files is refused (check_record)."""
        saved_stage = meta.get("zero_stage", self.zero_stage)
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
        if saved_stage == 0:  # whole optimizer state on every rank: loads at any data-parallel size
            return None
        from pretrain.engine.checkpoint_formats import optimizer_layout  # DeepSpeed's file names

        cut_for = optimizer_layout(tag_dir)
        if cut_for is None:  # no shards to convert: DeepSpeed's own load says what is missing
            return None
        check_record(tag_dir, meta, cut_for)
        # ZeRO 1-3 cut the optimizer state by the data-parallel size and the tensor-parallel size.
        here = (self.world_size // self.tensor_parallel, self.tensor_parallel)
        return None if cut_for == here else cut_for

    def _load_universal(self, engine, tag_dir: Path) -> None:
        """Load `tag_dir` through DeepSpeed's universal form, converted by rank 0 into a private folder (mkdtemp,
        0700) under `<root>/universal/`, removed once loaded. Before any conversion every parameter name in the
        folder's DeepSpeed files must be one of the model's own (the converter makes paths of them): refused on every
        rank alike, one line naming the file and the name."""
        self._refuse_links([self.root / UNIVERSAL_DIR], agree=True)
        foreign = None
        if self.rank == 0:
            from pretrain.engine.checkpoint_formats import foreign_name  # the DeepSpeed room

            foreign = foreign_name(tag_dir, engine.own_names())
        problem = self.first_problem(foreign_line(*foreign) if foreign else None)
        if problem:
            raise CheckpointError(problem)
        private, failure = None, None
        if self.rank == 0:
            try:
                private = paths.private_folder(self.root, self.root / UNIVERSAL_DIR, tag_dir.name + ".")
                _check_room_for_universal(tag_dir, private)
                from pretrain.engine.checkpoint_formats import convert_to_universal  # the DeepSpeed room

                convert_to_universal(tag_dir, private / tag_dir.name, engine.own_names())
            except Exception as err:  # every rank must hear of it, or they would wait forever below
                failure = err
        private = self.first_problem(str(private) if private else None)  # its name, for the other ranks
        try:
            if self._any_rank(failure is not None):
                raise CheckpointError(f"cannot load {tag_dir} on {self.world_size} ranks: {failure or 'see rank 0'}")
            engine.load(Path(private), tag_dir.name, universal=True)
            self._barrier()
        finally:
            if self.rank == 0 and private:  # a one-off: this run saves regular checkpoints for its own size
                paths.remove_tree(self.root, Path(private))  # with the `latest_universal` file DeepSpeed adds
                _remove_if_empty(self.root / UNIVERSAL_DIR)


def foreign_line(path: Path, name: object) -> str:
    """The refusal of a checkpoint file naming a parameter the model does not have."""
    return (f"{path} names a parameter this model does not have ({name!r}): DeepSpeed's conversion for another "
            "number of ranks would make a path of it, so nothing was converted or loaded. Fix: load a checkpoint of "
            "this model from a source you trust")


def check_record(tag_dir: Path, meta: dict[str, Any], cut_for: tuple[int, int]) -> None:
    """Refuse a checkpoint whose ayumi.json says another number of ranks than its DeepSpeed files hold: ayumi never
    writes one, so it was edited or files of another save were mixed in."""
    world, tp = meta.get("world_size"), meta.get("tensor_parallel", 1)
    if world is None or (world, tp) == (cut_for[0] * cut_for[1], cut_for[1]):
        return
    raise CheckpointError(
        f"{tag_dir / META} records world_size {world} (tensor-parallel {tp}), but the folder holds DeepSpeed optimizer "
        f"states of {cut_for[0] * cut_for[1]} ranks (tensor-parallel {cut_for[1]}): the record does not describe its "
        "files, so nothing of it was loaded. Fix: do not load it; take the checkpoint again from a source you trust")


def _remove_if_empty(folder: Path) -> None:
    """rmdir `folder` when nothing else is in it (another conversion's leftovers stay for a person to look at)."""
    try:
        folder.rmdir()
    except OSError:
        pass


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
    """Consolidated fp32 weights, the model config, and tokenizer facts of a checkpoint, once its files are verified
    against their checksums (CheckpointCorrupt otherwise) and checked to hold only tensors and plain data
    (CheckpointUnsafe otherwise). extra["verified"] is False for a checkpoint saved before checksums were
    recorded."""
    from pretrain.engine.checkpoint_formats import consolidated_state_dict

    root, tag = resolve_checkpoint(path)
    verdict = integrity.verify(root / tag)
    if verdict.status == integrity.DAMAGED:
        raise CheckpointCorrupt(root / tag, verdict.problem)
    unsafe = safety.folder_problem(root / tag)
    if unsafe:
        raise CheckpointUnsafe(unsafe)
    meta = integrity.read_meta(root / tag)
    try:
        state = consolidated_state_dict(root, tag)  # weights-only, DeepSpeed's consolidation included
    except UnsafeFile as err:
        raise CheckpointUnsafe(f"{err}; nothing of it was loaded") from None
    extra = {key: meta.get(key) for key in ("tokenizer_dir", "bos_id", "eos_id", "pad_id")}
    extra["verified"] = verdict.status == integrity.VERIFIED
    return state, model_config_from_meta(meta), extra


def resharded_note(meta: dict[str, Any], world_size: int, tensor_parallel: int) -> str:
    """`; re-sharded from N ranks to M ...` for a resume message when the checkpoint came through the universal
    form (meta["resharded_from"]); empty otherwise."""
    if "resharded_from" not in meta:
        return ""

    def tp(size: int) -> str:
        return f" (tensor-parallel {size})" if size > 1 else ""
    saved, saved_tp = meta["resharded_from"], meta["resharded_from_tensor_parallel"]
    return (f"; re-sharded from {saved} ranks{tp(saved_tp)} to {world_size}{tp(tensor_parallel)} through DeepSpeed's "
            f"universal checkpoint (its folder holds optimizer states cut for {saved // saved_tp} data-parallel "
            f"rank(s){tp(saved_tp)}, this run has {world_size // tensor_parallel})")
