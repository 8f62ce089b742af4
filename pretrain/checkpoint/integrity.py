"""Checksums of a checkpoint's files: recorded when it is saved, verified before anything uses it.

A checkpoint's own record, `ayumi.json`, lists every file of the folder with its size and xxh3_128 hash:

    "checksums": {"algorithm": "xxh3_128",
                  "files": {"mp_rank_00_model_states.pt": {"bytes": 1924231, "xxh3_128": "9f0c..."}, ...}}

How a save records them (pretrain/checkpoint/checkpointer.py drives it, synchronous and background saves alike):

1. each rank hashes the files it writes *from the bytes it writes* (`HashingFile` under `torch.save`: no second
   read of the file). DeepSpeed's own files go through `HashingEngine`, which stands in for DeepSpeed's checkpoint
   engine during a synchronous save; the background writer hashes in its thread, off the training's path;
2. the rank leaves its sums in its `.written_rankNNNNN` marker in the folder (`write_sums`, atomically);
3. rank 0 merges every rank's sums, hashes from disk any file no rank reported (DeepSpeed's copied helper
   scripts), and writes them into ayumi.json before `latest` moves (`checksum_record`).

The files carry no zip CRC32 of their own (`torch.save`'s, off for these saves): torch.load never checks it, it
costs about a third of a save's time on a CPU, and the record covers every byte of every file and is checked before
every load. Hashing in its place makes a save faster than it was without checksums (bench/checkpoint_async.py).

Verification (`verify`) compares sizes first (a stat per file, so a truncated file is named before anything is
read), then streams each file through the same hash. Ranks can split the files between them (`share`).
A checkpoint saved before checksums were recorded is UNVERIFIABLE: it still loads, with a notice.

Imports no torch (only `save_hashed` does, to serialise): `ayumi checkpoint verify` hashes without it.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import xxhash

from pretrain.checkpoint.layout import META, older_tags

ALGORITHM = "xxh3_128"
"""The hash of every checkpoint file: ~10 GB/s on one core, far above any disk, and it releases the GIL."""
RECORD_KEY = "checksums"
"""ayumi.json's key for the record."""
CHUNK_BYTES = 8 << 20
"""Read size when hashing a file from disk."""

VERIFIED, DAMAGED, UNVERIFIABLE = "verified", "damaged", "unverifiable"
"""Verdicts: every recorded file matches; a file is missing, of another size or other bytes (or ayumi.json cannot
be read); the checkpoint records no checksums (saved before they were recorded)."""


@dataclass(frozen=True)
class FileSum:
    """One file's size and hash."""

    size: int
    digest: str

    def to_json(self) -> dict[str, Any]:
        return {"bytes": self.size, ALGORITHM: self.digest}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> "FileSum":
        return cls(int(record["bytes"]), str(record[ALGORITHM]))


class HashingFile:
    """A write-only file object for `torch.save` that hashes every byte on its way to `raw` (sequential writes:
    torch's zip writer never seeks), so the sum is the file's without reading it back."""

    def __init__(self, raw) -> None:
        self.raw = raw
        self._hash = xxhash.xxh3_128()
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data)
        written = self.raw.write(view)
        self._hash.update(view)
        self.size += view.nbytes
        return written

    def flush(self) -> None:
        self.raw.flush()

    def sum(self) -> FileSum:
        return FileSum(self.size, self._hash.hexdigest())


def hash_file(path: Path) -> FileSum:
    """Size and hash of a file on disk, streamed in CHUNK_BYTES reads."""
    digest, size = xxhash.xxh3_128(), 0
    buffer = memoryview(bytearray(CHUNK_BYTES))
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            digest.update(buffer[:count])
            size += count
    return FileSum(size, digest.hexdigest())


_crc_lock = threading.Lock()
_crc_off = 0  # saves under way without torch's CRC32 (the training thread's and the background writer's)


@contextlib.contextmanager
def _without_torch_crc32():
    """torch.save computes no zip CRC32 inside: torch.load never checks it, and the checksum recorded for the whole
    file replaces it. torch's switch is process-wide: it is off while any of these saves runs, and back as it was
    after the last (another thread's torch.save meanwhile merely writes no CRC32, which torch.load does not mind)."""
    global _crc_off
    import torch

    with _crc_lock:
        if _crc_off == 0:
            _without_torch_crc32.kept = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _crc_off += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_off -= 1
            if _crc_off == 0:
                torch.serialization.set_crc32_options(_without_torch_crc32.kept)


def save_hashed(obj: Any, path: Path, *, durable: bool = False, atomic: bool = False, zipfile: bool = True) -> FileSum:
    """`torch.save(obj, path)` (without torch's zip CRC32), returning the written file's size and hash. `durable`:
    fsync it; `atomic`: write under a temporary name beside it and rename (readers see no half file). `zipfile`:
    torch's format (DeepSpeed's `checkpoint_serialization`)."""
    import torch

    path = Path(path)
    target = path.with_name(f".{path.name}.tmp{os.getpid()}") if atomic else path
    try:
        with open(target, "wb") as handle, _without_torch_crc32():
            hashing = HashingFile(handle)
            torch.save(obj, hashing, _use_new_zipfile_serialization=zipfile)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
    except BaseException:
        if atomic:  # a half file under the final name is the caller's to remove (it removes the whole folder)
            target.unlink(missing_ok=True)
        raise
    if atomic:
        os.replace(target, path)
    return hashing.sum()


class HashingEngine:
    """Stands in for DeepSpeed's checkpoint engine during a synchronous save: each file DeepSpeed hands it is
    written as its own engine would (`torch.save`, same format) and hashed on the way (`sums`, by path). Every
    other call goes to the real engine, `inner` (set by pretrain.engine.train_engine.TrainEngine.save)."""

    def __init__(self) -> None:
        self.inner = None
        self.sums: dict[Path, FileSum] = {}

    def save(self, state_dict, path: str) -> None:
        zipfile = bool(getattr(self.inner, "zipfile_serialization", True))
        self.sums[Path(path)] = save_hashed(state_dict, Path(path), zipfile=zipfile)

    def __getattr__(self, name: str):
        if name == "inner":  # not set yet (copying, pickling): never recurse
            raise AttributeError(name)
        return getattr(self.inner, name)


def relative_sums(tag_dir: Path, sums: dict[Path, FileSum]) -> dict[str, FileSum]:
    """Sums keyed by the file's path inside the checkpoint folder (as ayumi.json records them)."""
    return {Path(os.path.relpath(path, tag_dir)).as_posix(): value for path, value in sums.items()}


def write_sums(marker: Path, sums: dict[str, FileSum]) -> None:
    """A rank's sums into its marker file, durably and atomically: rank 0 reads the marker as soon as it exists,
    so it must never see half of one."""
    aside = marker.with_name(f".tmp{marker.name}")  # not matched by the markers' own pattern
    with open(aside, "w") as handle:
        json.dump({name: value.to_json() for name, value in sums.items()}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(aside, marker)


def read_sums(marker: Path) -> dict[str, FileSum]:
    """The sums a rank left in its marker ({} for an empty marker or one that cannot be read)."""
    try:
        records = json.loads(marker.read_text() or "{}")
        return {name: FileSum.from_json(record) for name, record in records.items()}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def checkpoint_files(tag_dir: Path) -> list[str]:
    """Every file of a checkpoint folder but its record (ayumi.json) and hidden ones (markers, temporary files)."""
    names = []
    for path in tag_dir.rglob("*"):
        relative = path.relative_to(tag_dir)
        if path.is_file() and relative.as_posix() != META and not any(part.startswith(".") for part in relative.parts):
            names.append(relative.as_posix())
    return sorted(names)


def checksum_record(tag_dir: Path, markers: Iterable[Path]) -> dict[str, Any]:
    """ayumi.json's record: every rank's sums (from `markers`) and, hashed here, any file of the folder that no
    rank reported (files DeepSpeed copies rather than saves)."""
    sums: dict[str, FileSum] = {}
    for marker in markers:
        sums.update(read_sums(marker))
    for name in checkpoint_files(tag_dir):
        if name not in sums:
            sums[name] = hash_file(tag_dir / name)
    return {"algorithm": ALGORITHM, "files": {name: sums[name].to_json() for name in sorted(sums)}}


@dataclass(frozen=True)
class Verdict:
    """What verifying one checkpoint folder found."""

    status: str
    """VERIFIED, DAMAGED or UNVERIFIABLE."""
    files: int = 0
    """Files the record lists (0 when there is no record)."""
    problem: str = ""
    """DAMAGED: the first damaged file and what is wrong with it (one line)."""


def recorded_sums(meta: dict[str, Any]) -> dict[str, FileSum] | None:
    """The files and sums an ayumi.json records; None when it records none (saved before checksums were)."""
    record = meta.get(RECORD_KEY)
    if not isinstance(record, dict) or record.get("algorithm") != ALGORITHM:
        return None
    return {name: FileSum.from_json(value) for name, value in record.get("files", {}).items()}


def read_meta(tag_dir: Path) -> dict[str, Any]:
    """A checkpoint's ayumi.json; ValueError (with the reason) when it cannot be read or parsed."""
    try:
        meta = json.loads((tag_dir / META).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{META} cannot be read ({err})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{META} holds no record")
    return meta


def verify(tag_dir: Path, share: tuple[int, int] = (0, 1)) -> Verdict:
    """Check a checkpoint folder against its record. Every file's size is checked; the hashing is split:
    `share=(index, count)` hashes every count-th file from index (ranks verifying together)."""
    try:
        sums = recorded_sums(read_meta(tag_dir))
    except (ValueError, KeyError, TypeError) as err:
        return Verdict(DAMAGED, 0, str(err))
    if sums is None:
        return Verdict(UNVERIFIABLE)
    names = sorted(sums)
    for name in names:
        path = tag_dir / name
        if not path.is_file():
            return Verdict(DAMAGED, len(names), f"{name} is missing ({sums[name].size} bytes at save)")
        size = path.stat().st_size
        if size != sums[name].size:
            return Verdict(DAMAGED, len(names), f"{name} has {size} bytes, {sums[name].size} were recorded at save")
    index, count = share
    for name in names[index::max(1, count)]:
        if hash_file(tag_dir / name).digest != sums[name].digest:
            return Verdict(DAMAGED, len(names), f"{name} does not match the {ALGORITHM} checksum recorded at save")
    return Verdict(VERIFIED, len(names))


def damaged_line(tag_dir: Path, problem: str) -> str:
    """The one line naming a damaged checkpoint and its file."""
    return f"checkpoint {tag_dir} is damaged: {problem}"


def newest_intact_before(root: Path, tag: str) -> tuple[str, Verdict] | None:
    """The newest complete checkpoint under `root` older than `tag` that is not damaged (verified, or saved before
    checksums were recorded), with its verdict; None when every older one is damaged or there is none. Older ones
    are hashed newest first until one passes: what a user refused `tag` should take instead."""
    for older in older_tags(root, tag):
        verdict = verify(root / older)
        if verdict.status != DAMAGED:
            return older, verdict
    return None
