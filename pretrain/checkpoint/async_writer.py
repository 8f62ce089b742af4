"""Asynchronous checkpoint writes: stage a checkpoint's tensors in host memory, write them in a thread.

The training step pays only for the copy (device -> host on a GPU, a memcpy on a CPU); the files
are serialised, written and fsynced by one background thread per rank and checkpoint root.

How a save goes (pretrain.checkpoint.checkpointer.Checkpointer drives it; all ranks):

1. ``StagingCollector`` stands in for DeepSpeed's checkpoint engine during ``save_checkpoint``:
   DeepSpeed hands it every file's state dict (model, ZeRO partitions, client state) and it keeps
   a *copy* of each tensor instead of writing (training goes on mutating the originals in place).
   DeepSpeed's own collectives in ``save_checkpoint`` (barriers, tag validation) run here, on
   the training thread, as in a synchronous save.
2. ``BackgroundWriter.start`` writes the staged files, hashing each from the bytes it writes
   (pretrain/checkpoint/integrity.py: the checksums cost the training nothing), fsyncs each and the
   folder, then leaves a ``.written_rankNNNNN`` marker holding the files' sums (fsynced, renamed into
   place whole). The thread does no collective: gloo and NCCL do not allow one concurrent with the
   training's on the same group.
3. Rank 0's thread publishes (``ayumi.json`` with every rank's sums, then ``latest``, via the caller's ``publish``) once
   every rank's marker is there, or once the ranks agreed at the next save or a drain that all
   writes are done (``peers_done``: for checkpoint folders that are not one shared file system).
   A crash or kill -9 before that leaves the previous ``latest`` and its folder as they were.

A rank whose write fails leaves ``.failed_rankNNNNN`` (with the error), so rank 0 stops waiting;
the error reaches every rank at the next agreement (Checkpointer.wait).

DeepSpeed's own asynchronous writers in 0.19.8 were not used: ``FastCheckpointEngine`` needs the
``async_io`` op (libaio, a CUDA-era build), and ``DecoupledCheckpointEngine`` passes the *live*
tensors to a writer process through a multiprocessing queue (shared memory, no copy), so a step
taken while it writes changes what it writes.
"""
from __future__ import annotations

import copy
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from common.files import fsync_dir
from pretrain.checkpoint.integrity import relative_sums, save_hashed, write_sums

WRITTEN = ".written_rank{:05d}"
"""A rank's marker: its files are durable; it holds their sums (integrity.write_sums)."""
WRITTEN_GLOB = ".written_rank*"
FAILED = ".failed_rank{:05d}"


class HostBuffers:
    """Host-memory copies kept from one save to the next (allocating, and on a GPU pinning, gigabytes
    at every save would cost more than the copy). The i-th tensor staged reuses the i-th buffer when
    shape and dtype match. Only touched while no write is in flight (a save waits for the previous)."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.cursor = 0

    def rewind(self) -> None:
        self.cursor = 0

    def take(self, like: torch.Tensor) -> torch.Tensor:
        i, self.cursor = self.cursor, self.cursor + 1
        if i < len(self.buffers) and self.buffers[i].shape == like.shape and self.buffers[i].dtype == like.dtype:
            return self.buffers[i]
        buffer = torch.empty(like.shape, dtype=like.dtype, pin_memory=torch.cuda.is_available())
        if i < len(self.buffers):
            self.buffers[i] = buffer
        else:
            self.buffers.append(buffer)
        return buffer


def stage(obj: Any, buffers: HostBuffers | None = None) -> Any:
    """A copy of obj whose tensors live in host memory and share nothing with training.

    Containers are rebuilt, tensors copied (into `buffers` when given; from a GPU without blocking,
    see finish_staging), other leaves deep-copied where they can be (config objects that cannot
    are kept as they are: nothing changes them during training)."""
    if torch.is_tensor(obj):
        if buffers is None:
            if obj.device.type == "cpu":
                return obj.detach().clone()
            host = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=torch.cuda.is_available())
        else:
            host = buffers.take(obj)
        return host.copy_(obj.detach(), non_blocking=obj.device.type != "cpu")
    if isinstance(obj, OrderedDict):
        return OrderedDict((k, stage(v, buffers)) for k, v in obj.items())
    if isinstance(obj, dict):
        return {k: stage(v, buffers) for k, v in obj.items()}
    if isinstance(obj, list):
        return [stage(v, buffers) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(stage(v, buffers) for v in obj)
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if obj is None or isinstance(obj, (int, float, str, bool, bytes, torch.Size, torch.dtype, torch.device)):
        return obj
    try:
        return copy.deepcopy(obj)
    except Exception:  # noqa: BLE001 - e.g. objects holding locks; DeepSpeed's are read-only after init
        return obj


def finish_staging() -> None:
    """Wait for the non-blocking device -> host copies stage() queued."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StagingCollector:
    """Duck-typed stand-in for a DeepSpeed checkpoint engine that stages files instead of writing them.

    Only the methods DeepSpeed's ``save_checkpoint`` calls; loading goes through the real engine."""

    def __init__(self, inner=None, buffers: HostBuffers | None = None) -> None:
        self.buffers = buffers
        if buffers is not None:
            buffers.rewind()
        self.inner = inner
        """The engine's real checkpoint engine (set by pretrain.engine.train_engine.TrainEngine.save)."""
        self.files: list[tuple[Path, Any]] = []

    def create(self, info) -> None:
        pass

    def makedirs(self, path, exist_ok=False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path: str) -> None:
        self.files.append((Path(path), stage(state_dict, self.buffers)))

    def load(self, path: str, map_location=None):
        return self.inner.load(path, map_location=map_location)

    def commit(self, info) -> bool:
        return True

    def is_data_parallel_writer(self, dp_rank) -> bool:
        return self.inner.is_data_parallel_writer(dp_rank)

    def is_decoupled(self) -> bool:
        return False

    def preserves_storage_sharing(self) -> bool:
        return False  # stage() copies every tensor: DeepSpeed need not clone them first

    def set_commit_info(self, info) -> None:
        pass

    def get_commit_info(self):
        return None

    def cleanup(self) -> None:
        pass


class BackgroundWriter:
    """One rank's background writes of one checkpoint root, one checkpoint at a time."""

    def __init__(self, rank: int, world_size: int, delay_s: float = 0.0) -> None:
        self.rank = rank
        self.world_size = world_size
        self.delay_s = delay_s
        """Fault drill (checkpoint.inject_write_delay_s): sleep before writing, so a test can kill mid-write."""
        self._thread: threading.Thread | None = None
        self._written = threading.Event()
        self._peers_done = threading.Event()
        self._cancel = threading.Event()
        self.error: BaseException | None = None
        """This rank's write error (for rank 0 also: another rank's failure marker, or publishing)."""

    def start(self, tag_dir: Path, files: list[tuple[Path, Any]], publish: Callable[[], None] | None) -> None:
        """Write files (already staged) in the background; rank 0 passes `publish` (ayumi.json, latest)."""
        assert self._thread is None, "the previous write was not waited for"
        self.error = None
        for event in (self._written, self._peers_done, self._cancel):
            event.clear()
        self._thread = threading.Thread(target=self._run, args=(Path(tag_dir), files, publish),
                                        name=f"ayumi-checkpoint-writer-{tag_dir.name}", daemon=True)
        self._thread.start()

    def _run(self, tag_dir: Path, files: list[tuple[Path, Any]], publish) -> None:
        try:
            folders = {tag_dir} | {path.parent for path, _ in files}
            if self.delay_s > 0:
                time.sleep(self.delay_s)
            sums = {}
            for path, obj in files:
                path.parent.mkdir(parents=True, exist_ok=True)
                sums[path] = save_hashed(obj, path, durable=True)
            files.clear()  # let the staged copies go as soon as they are on disk
            for folder in folders:
                fsync_dir(folder)
            write_sums(tag_dir / WRITTEN.format(self.rank), relative_sums(tag_dir, sums))
        except BaseException as err:  # noqa: BLE001 - reported at the next agreement
            self.error = err
            try:
                (tag_dir / FAILED.format(self.rank)).write_text(f"{type(err).__name__}: {err}\n")
            except OSError:
                pass
        finally:
            self._written.set()
        if publish is None or self.error is not None:
            return
        try:
            if self._wait_for_peers(tag_dir):
                publish()
                for rank in range(self.world_size):
                    (tag_dir / WRITTEN.format(rank)).unlink(missing_ok=True)
        except BaseException as err:  # noqa: BLE001
            self.error = err

    def _wait_for_peers(self, tag_dir: Path) -> bool:
        """True once every rank wrote its part; False if one failed or the writer was cancelled."""
        while not self._cancel.is_set():
            if self._peers_done.is_set():
                return True
            if any(tag_dir.glob(".failed_rank*")):
                self.error = RuntimeError("another rank could not write its part: "
                                          + "; ".join(p.read_text().strip() for p in tag_dir.glob(".failed_rank*")))
                return False
            if sum(1 for _ in tag_dir.glob(WRITTEN_GLOB)) >= self.world_size:
                return True
            self._peers_done.wait(0.05)
        return False

    def wait_written(self) -> BaseException | None:
        """Block until this rank's files are durable (or failed); its error, if any."""
        if self._thread is not None:
            self._written.wait()
        return self.error

    def finish(self, peers_done: bool) -> BaseException | None:
        """After the ranks agreed: let rank 0 publish (peers_done) or give up, and join the thread."""
        if self._thread is None:
            return None
        (self._peers_done if peers_done else self._cancel).set()
        self._thread.join()
        self._thread = None
        return self.error
