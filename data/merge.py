"""`ayumi data merge ROOT`: a domain's many small shards rewritten as fewer large ones, the stream unchanged.

A root made by many tasks, or registered from Megatron's `preprocess_data.py` run per file, can hold
thousands of shards per domain. Training opens them in two `stat`s each (data/shards.py), but every tool
that scans them (`ayumi data verify`, checksums at start) pays per file, and so does the file system.
Merging copies each split's token bytes, shard after shard in the record's order, through the writer
`ayumi data prepare` cuts shards with (data/prepare.py's ShardSequence, `shard_max_mb` each). The
documents, their order, their content keys and therefore every training batch stay the same; only the
shard boundaries move. Each old shard's bytes are checked against its recorded sha256 as they are read.

Nothing is published until every domain asked for is written in full under `ROOT/.partial/merge/`.
Then the new shards are renamed into the domain folders under names no old shard has (`merged_NNNNN`;
below), each `domain.json` is replaced, then `manifest.json`, and
the old shards are removed. A kill before that leaves the old root as it was (only `.partial/`, which
nothing reads and the next run removes). A kill in the few renames of publication leaves records that
disagree: training refuses with one line, and `ayumi data merge ROOT` again completes the merge.

Each merge appends to the domain record's `merged` history the shard records it replaced (data/lineage.py), and
names the new shards with a stem no shard of the split's history has used (`merged_`, then `merged2_`, ...): a
name means one shard for good. A run on the root therefore resumes across a merge (its checkpoints identify the
data by the shards it was first written in), and its `data.exclude` documents, named by old shards, follow their
documents into the merged ones.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np

from data.integrity import check_domain_record
from data.lineage import history_columns, shard_names
from data.manifest import (
    DOMAIN_RECORD_NAME, KEY_BYTES, KEYS_NAME, MANIFEST_NAME, ManifestError, build_manifest, load_manifest,
    read_sealed, seal, shards_intact, write_json_atomic,
)
from data.prepare import PARTIAL_DIR, ShardSequence
from data.shards import ShardFormatError, ShardReader, dtype_for_vocab, file_sha256

log = logging.getLogger("ayumi.data")

MERGE_DIR = "merge"
"""Under ROOT/.partial: the domains being merged, never read, removed on the next run."""
SHARD_FILE = re.compile(r"^(?:part|merged\d*)_\d{5,}\.(?:bin|idx)$")
"""The shard files of ayumi's own splits: `part_` as prepared, `merged_`, `merged2_`, ... as merged."""
PROGRESS_SECONDS = 30.0
"""How often a long merge logs how far it is (shards, MB copied, MB/s)."""
CHUNK_TOKENS = 1 << 25
"""Tokens copied per step (64 MiB of uint16 ids; a longer document is one step): bounded memory."""


class MergeError(ValueError):
    """The merge cannot start (a domain not in the root, a Megatron domain, a bad size); one line says why."""


def merge_root(root: str | os.PathLike, names: list[str] | None = None, shard_max_mb: float = 256.0) -> dict:
    """Merge the shards of `names` (all of the root's own domains when none) into shards of `shard_max_mb`;
    returns {domain: {split: (shards before, shards after)}} for what was rewritten."""
    root = Path(root)
    if not shard_max_mb > 0:
        raise MergeError(f"--shard-max-mb {shard_max_mb} must be > 0")
    manifest = load_manifest(root)
    finished = adopt_interrupted(root, manifest)
    if finished:
        log.info("completed the merge of %s that was interrupted while publishing", ", ".join(finished))
        manifest = load_manifest(root)
    chosen = choose_domains(root, manifest, names)
    cap = max(1, int(shard_max_mb * 2**20))
    work = root / PARTIAL_DIR / MERGE_DIR
    remove_work(root, work)  # what a killed merge left: never read, and it would count against the free space
    plan = {}
    for name in chosen:
        record = manifest["domains"][name]
        check_domain_record(root, name, record)
        plan[name] = {split: info for split, info in record["splits"].items() if wants_merge(info, cap)}
        if not plan[name]:
            log.info("%s: already in shards of at most %s MiB, left as it is", name, f"{shard_max_mb:g}")
    check_free_space(root, [info for splits in plan.values() for info in splits.values()])
    new_records, done = {}, {}
    try:
        for name, splits in plan.items():
            record = manifest["domains"][name]
            remove_unlisted(root / name, record)
            if not splits:
                continue
            new_records[name] = merge_domain(root, name, record, splits, work / name, cap, shard_max_mb)
            done[name] = {split: (len(info["shards"]), len(new_records[name]["splits"][split]["shards"]))
                          for split, info in splits.items()}
        publish(root, manifest, new_records, work)
    finally:
        remove_work(root, work)
    return done


def remove_work(root: Path, work: Path) -> None:
    """Remove the merge's working folder, and `.partial` when that leaves it empty (a `prepare` may have its own
    work there)."""
    shutil.rmtree(work, ignore_errors=True)
    partial = root / PARTIAL_DIR
    if partial.is_dir() and not any(partial.iterdir()):
        partial.rmdir()


def check_free_space(root: Path, splits: list[dict]) -> None:
    """Refuse before writing when the file system cannot hold a second copy of the splits to merge (the old shards
    are removed only once the merged ones are published)."""
    needed = sum(info["bytes"] + KEY_BYTES * info["docs"] for info in splits)
    free = shutil.disk_usage(root).free
    if needed > free:
        raise MergeError(f"merging needs {needed / 2**30:.2f} GiB free under {root} (a copy of the shards it merges, "
                         f"until the old ones are removed), {free / 2**30:.2f} GiB are. Fix: free space there, or "
                         "merge fewer domains at a time (--domain)")


def choose_domains(root: Path, manifest: dict, names: list[str] | None) -> list[str]:
    """The domains to merge: those named (each must be the root's own), or every domain ayumi wrote."""
    known = list(manifest["domains"])
    unknown = [name for name in names or [] if name not in manifest["domains"]]
    if unknown:
        raise MergeError(f"domain(s) {', '.join(unknown)} are not in {root / MANIFEST_NAME} "
                         f"(it has: {', '.join(known)})")
    registered = [name for name in names or [] if is_registered(manifest["domains"][name])]
    if registered:
        raise MergeError(f"domain(s) {', '.join(registered)} of {root} are registered Megatron data: their shards "
                         "stay at their prefixes, outside the root. Fix: merge the prefixes with Megatron's "
                         "tools/merge_datasets.py, then declare the merged prefix in the domain's `megatron:`")
    if names:
        return list(dict.fromkeys(names))
    return [name for name in known if not is_registered(manifest["domains"][name])]


def is_registered(record: dict) -> bool:
    """Whether every split of a domain lives at Megatron prefixes (no shard of it is ayumi's to rewrite)."""
    shards = [shard for info in record["splits"].values() for shard in info["shards"]]
    return bool(shards) and all(shard.get("prefix") for shard in shards)


def wants_merge(info: dict, cap: int) -> bool:
    """A split of ayumi's own shards that fewer shards of `cap` bytes could hold."""
    if any(shard.get("prefix") for shard in info["shards"]):
        return False  # a validation split taken from Megatron prefixes (`megatron_val`): not ours to rewrite
    return len(info["shards"]) > max(1, math.ceil(info["bytes"] / cap))


def merge_domain(root: Path, name: str, record: dict, splits: dict[str, dict], out: Path, cap: int,
                 shard_max_mb: float) -> dict:
    """Write the merged splits of one domain under `out`; returns its new record (sealed), names still to publish."""
    vocab = record["tokenizer"]["vocab_size"]
    new_splits = dict(record["splits"])
    for split, info in splits.items():
        stem = unused_stem(record, split)
        sequence = ShardSequence(out / split, cap, vocab)
        try:
            copy_split(root / name / split, name, info, sequence, vocab)
            merged = sequence.close()
        except BaseException:
            sequence.abort()
            raise
        if (merged["docs"], merged["tokens"]) != (info["docs"], info["tokens"]):
            raise ShardFormatError(f"{root / name / split}: merged {merged['docs']} documents and {merged['tokens']} "
                                   f"tokens, the record says {info['docs']} and {info['tokens']}; nothing was changed. "
                                   f"Fix: `ayumi data verify {root}`")
        old_keys = root / name / split / KEYS_NAME  # a root written from token ids (data/token_root.py) has none
        if old_keys.is_file() and file_sha256(out / split / KEYS_NAME) != file_sha256(old_keys):
            raise ShardFormatError(f"{root / name / split / KEYS_NAME}: its keys differ from those merged; nothing was "
                                   f"changed. Fix: `ayumi data verify {root}`")
        for shard in merged["shards"]:
            shard["name"] = stem + shard["name"].removeprefix("part_")
        new_splits[split] = merged
        log.info("%s/%s: %d shards merged into %d", name, split, len(info["shards"]), len(merged["shards"]))
    body = {key: value for key, value in record.items() if key != "record_sha256"}
    merges = body.get("merged", []) + [{"shard_max_mb": shard_max_mb, "shards_before": {
        split: len(info["shards"]) for split, info in splits.items()}, "shards": {
        split: history_columns(info["shards"]) for split, info in splits.items()}}]
    return seal({**body, "splits": new_splits, "merged": merges})


def unused_stem(record: dict, split: str) -> str:
    """`merged_`, else `merged2_`, `merged3_`, ...: the first stem no shard of the split, present or replaced, has
    (a merge recorded before the history kept shard lists names no shard: data/lineage.py ignores it)."""
    used = {name.rsplit("_", 1)[0] + "_" for name in shard_names(record, split)}
    return next(stem for stem in (f"merged{number if number > 1 else ''}_" for number in range(1, len(used) + 2))
                if stem not in used)


def copy_split(folder: Path, name: str, info: dict, sequence: ShardSequence, vocab: int) -> None:
    """Every document of a split's shards, in order, with its key, into `sequence`; each shard's bytes are
    checked against its recorded sha256 as they are read. Logs its progress every PROGRESS_SECONDS."""
    dtype = dtype_for_vocab(vocab)
    started = last = time.monotonic()
    copied = 0
    fix = f"`ayumi data verify {folder.parent.parent}` lists what is damaged; re-run `ayumi data prepare`"
    keys_path = folder / KEYS_NAME
    with open(keys_path if keys_path.is_file() else os.devnull, "rb") as keys_file:  # no keys: zeros, not published
        for number, shard in enumerate(info["shards"]):
            if time.monotonic() - last >= PROGRESS_SECONDS:
                last = time.monotonic()
                log.info("%s/%s: %s of %s shards, %.1f MB copied, %.1f MB/s", name, folder.name, f"{number:,}",
                         f"{len(info['shards']):,}", copied / 1e6, copied / 1e6 / max(last - started, 1e-9))
            reader = ShardReader.recorded(os.path.join(folder, shard["name"]), fix, dtype, shard["docs"],
                                          shard["tokens"], f"{name}/{DOMAIN_RECORD_NAME}")
            offsets, digest = reader.doc_offsets, hashlib.sha256()
            start = 0
            while start < reader.num_docs:
                stop = max(start + 1, int(np.searchsorted(offsets, offsets[start] + CHUNK_TOKENS, side="right")) - 1)
                stop = min(stop, reader.num_docs)
                tokens = reader.slice(int(offsets[start]), int(offsets[stop]))
                digest.update(tokens.tobytes())
                keys = keys_file.read((stop - start) * KEY_BYTES) if keys_path.is_file() else bytes(
                    (stop - start) * KEY_BYTES)
                if len(keys) != (stop - start) * KEY_BYTES:
                    raise ShardFormatError(f"{folder / KEYS_NAME}: ends before the documents of {shard['name']}; the "
                                           f"file is truncated. Fix: {fix}")
                sequence.add_docs(np.frombuffer(keys, dtype=np.uint8).reshape(-1, KEY_BYTES),
                                  np.diff(offsets[start:stop + 1]), tokens)
                start = stop
            copied += shard["bytes"]
            if shard.get("sha256") and digest.hexdigest() != shard["sha256"]:
                raise ShardFormatError(f"{reader.bin_path}: sha256 {digest.hexdigest()[:12]}… is not the recorded "
                                       f"{shard['sha256'][:12]}…; nothing was changed. Fix: {fix}")


def publish(root: Path, manifest: dict, records: dict[str, dict], work: Path) -> None:
    """Rename the merged shards into place, replace each domain.json, then manifest.json; remove the old shards."""
    if not records:
        return
    for name, record in records.items():
        for split, info in record["splits"].items():
            if (work / name / split).is_dir():
                for shard in info["shards"]:
                    for suffix in (".bin", ".idx"):
                        built = "part_" + shard["name"].split("_", 1)[1]
                        os.replace(work / name / split / (built + suffix),
                                   root / name / split / (shard["name"] + suffix))
    for name, record in records.items():
        write_json_atomic(root / name / DOMAIN_RECORD_NAME, record)
    domains = {name: records.get(name, old) for name, old in manifest["domains"].items()}
    write_json_atomic(root / MANIFEST_NAME, build_manifest(manifest["name"], manifest["tokenizer"], domains,
                                                           manifest["overlap_check"]))
    for name in records:
        remove_unlisted(root / name, records[name])


def remove_unlisted(domain_dir: Path, record: dict) -> None:
    """Remove shard files of a domain's splits that its record does not list (left by an interrupted merge, or
    the old shards of a finished one); other files are left alone."""
    for split, info in record["splits"].items():
        folder = domain_dir / split
        if not folder.is_dir() or any(shard.get("prefix") for shard in info["shards"]):
            continue
        listed = {shard["name"] + suffix for shard in info["shards"] for suffix in (".bin", ".idx")}
        for entry in os.scandir(folder):
            if SHARD_FILE.match(entry.name) and entry.name not in listed:
                os.unlink(entry.path)


def adopt_interrupted(root: Path, manifest: dict) -> list[str]:
    """Complete a merge killed while publishing: a domain whose domain.json is a merge of the manifest's record
    (the same record but for its splits and merge history, its shards all there) goes into the manifest."""
    adopted = {}
    for name, record in manifest["domains"].items():
        on_disk = read_sealed(root / name / DOMAIN_RECORD_NAME)
        if on_disk is None or on_disk == record or len(on_disk.get("merged", [])) != len(record.get("merged", [])) + 1:
            continue
        same = {key: value for key, value in on_disk.items() if key not in ("splits", "merged", "record_sha256")} == \
            {key: value for key, value in record.items() if key not in ("splits", "merged", "record_sha256")}
        counts = all((on_disk["splits"].get(split, {}).get("docs"), on_disk["splits"].get(split, {}).get("tokens"))
                     == (info["docs"], info["tokens"]) for split, info in record["splits"].items())
        if same and counts and shards_intact(root / name, on_disk):
            adopted[name] = on_disk
    if adopted:
        domains = {name: adopted.get(name, old) for name, old in manifest["domains"].items()}
        write_json_atomic(root / MANIFEST_NAME, build_manifest(manifest["name"], manifest["tokenizer"], domains,
                                                               manifest["overlap_check"]))
        for name, record in adopted.items():
            remove_unlisted(root / name, record)
    return list(adopted)


__all__ = ["MergeError", "ManifestError", "merge_root"]
