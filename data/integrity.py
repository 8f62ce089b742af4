"""Are a data root's shards still what `ayumi data prepare` recorded? Checked at training start and by `ayumi data verify`.

At training start every rank runs the same checks on the shards the run will read (so every rank
fails alike, with one message naming the file and the fix):
- each listed shard's `.idx` and `.bin` exist, and the `.bin` has the recorded byte size;
- ayumi's own `.idx` has the size the recorded document count gives; it is read, and its layout and counts
  checked, when first used (samples are read by token offsets, which need no index: a root of 10,000 shards
  per domain opens in two `stat`s per shard); a registered Megatron prefix's index is read and checked at start;
- the recorded largest id is below the tokenizer's vocabulary (a record edited down is caught);
- with `verify` `full` (or `auto` on up to AUTO_FULL_BYTES of shards), each `.bin`'s sha256.
Damage the checks above cannot see cheaply on big data (bytes overwritten in place) is caught
per sample by PackedSamples before the model sees an id, and in full by `ayumi data verify`.
Registered Megatron prefixes over FULL_CHECK_BYTES (data/megatron.py) have no recorded sha256: for
them an in-place overwrite that keeps every id in the vocabulary goes unseen (`ayumi data verify`
lists them).

Every message ends with its fix (`repair_hint`): ayumi's own shards are remade by `ayumi data
prepare`; a registered Megatron prefix lives outside the data root, so only its owner can restore it.
"""
from __future__ import annotations

import os
from pathlib import Path

from data.lineage import history_problem
from data.manifest import DOMAIN_RECORD_NAME, ManifestError, check_seal, read_json, shard_prefix
from data.shards import ShardFormatError, ShardReader, dtype_for_vocab, file_sha256

VERIFY_MODES = ("auto", "full", "sizes")
AUTO_FULL_BYTES = 1 << 30
"""`verify=auto` checksums every shard when the run reads at most this many bytes of shards."""


def repair_hint(record: dict, shard: dict) -> str:
    """How to repair a listed shard that is missing, changed or damaged (the `Fix:` of the messages here)."""
    if not shard.get("prefix"):
        return "re-run `ayumi data prepare` for this data root"
    return f"restore or re-preprocess {shard['prefix']}, then re-run {register_again(record)}"


def register_again(record: dict) -> str:
    """The command that rewrites a domain's record: `ayumi data prepare`, or for a domain declared in a
    curriculum file (data/register.py) the plan or training start with that curriculum."""
    if record.get("curriculum"):
        return f"`ayumi plan` or `ayumi train` with curriculum {record['curriculum']!r} (it registers the domain again)"
    return "`ayumi data prepare` for this data root"


def check_domain_record(root: Path, name: str, record: dict) -> None:
    """A prepared domain's `domain.json` must be there, unedited, and agree with the manifest's copy."""
    path = Path(root) / name / DOMAIN_RECORD_NAME
    on_disk = read_json(path)
    check_seal(on_disk, path)
    problem = history_problem(on_disk)
    if problem:
        raise ManifestError(f"{path}: {problem}: the record was damaged. Fix: re-run {register_again(record)}")
    if on_disk != record:
        raise ManifestError(f"{path} differs from the record of {name!r} in {Path(root) / 'manifest.json'}: the domain "
                            f"was re-prepared or changed without the rest of the root. Fix: re-run {register_again(record)}")


def open_listed_shards(root: Path, name: str, record: dict, split: str, checksum: bool) -> list[ShardReader]:
    """Readers of a split's shards in the record's order, each checked against its record entry.

    ayumi's own shards open from the record's counts (`ShardReader.recorded`: two `stat`s, the index read and
    checked on first use), so opening stays flat in the shard count; a registered Megatron prefix reads its
    index now (its record does not hold its layout)."""
    readers = []
    vocab = record["tokenizer"]["vocab_size"]
    dtype = dtype_for_vocab(vocab)
    folder = os.path.join(root, name, split, "")  # strings, not Paths: 10,000 shards cost 20,000 `stat`s, little more
    own_fix = repair_hint(record, {})
    counts_from = f"{name}/{DOMAIN_RECORD_NAME}"
    for shard in record["splits"][split]["shards"]:
        if shard.get("prefix"):
            fix = repair_hint(record, shard)
            reader = ShardReader(shard_prefix(root, name, split, shard), fix)  # missing files, wrong sizes, a bad index
            problem = _mismatch(reader, shard)
            if problem:
                raise ShardFormatError(f"{reader.idx_path}: {problem} than {counts_from} records; the shard "
                                       f"was replaced or damaged. Fix: {fix}")
        else:
            fix = own_fix
            reader = ShardReader.recorded(folder + shard["name"], fix, dtype, shard["docs"], shard["tokens"],
                                          counts_from)
        if shard.get("max_id", -1) >= vocab:
            raise ShardFormatError(
                f"{Path(root) / name / DOMAIN_RECORD_NAME}: shard {shard['name']} holds id {shard['max_id']}, but the "
                f"record says the tokenizer has {vocab} ids: the record was edited or damaged. Fix: re-run "
                f"{register_again(record)}")
        if checksum and shard.get("sha256"):
            check_checksum(reader, shard, fix)
        readers.append(reader)
    return readers


def _mismatch(reader: ShardReader, shard: dict) -> str:
    if reader.num_tokens != shard["tokens"]:
        return f"the index describes {reader.num_tokens:,} tokens, other"
    if reader.num_docs != shard["docs"]:
        return f"the index describes {reader.num_docs:,} documents, other"
    return ""


def check_checksum(reader: ShardReader, shard: dict, fix: str) -> None:
    actual = file_sha256(reader.bin_file)
    if actual != shard["sha256"]:
        raise ShardFormatError(f"{reader.bin_path}: sha256 {actual[:12]}… is not the recorded {shard['sha256'][:12]}…: "
                               f"the token bytes changed after the shard was written. Fix: {fix} "
                               "(a damaged disk? check it first)")


def wants_checksum(mode: str, records: list[tuple[dict, str]]) -> bool:
    """Whether `verify` mode asks for checksums on these (record, split) pairs."""
    if mode not in VERIFY_MODES:
        raise ValueError(f"data.verify={mode!r}: choose one of {', '.join(VERIFY_MODES)}")
    if mode != "auto":
        return mode == "full"
    return sum(record["splits"][split]["bytes"] for record, split in records) <= AUTO_FULL_BYTES


def verify_root(root: str | Path, manifest: dict) -> list[str]:
    """`ayumi data verify`: every listed shard, in full (sizes, counts, sha256, every id below the vocabulary).

    Returns one line per problem (empty when the root is intact); a shard whose record has no
    sha256 (large Megatron data) gets the id check only.
    """
    root = Path(root)
    problems = []
    for name, record in manifest["domains"].items():
        try:
            check_domain_record(root, name, record)
        except ManifestError as err:
            problems.append(str(err))
        vocab = record["tokenizer"]["vocab_size"]
        for split, info in record["splits"].items():
            for shard in info["shards"]:
                problems.extend(_verify_shard(root, name, record, split, shard, vocab))
    return problems


def _verify_shard(root: Path, name: str, record: dict, split: str, shard: dict, vocab: int) -> list[str]:
    one = {**record, "splits": {split: {**record["splits"][split], "shards": [shard]}}}
    try:
        reader, = open_listed_shards(root, name, one, split, checksum=True)
        reader.document_indices  # the index read and checked in full (opening checked its size only)
    except ShardFormatError as err:
        return [str(err)]
    low, high = reader.min_id(), reader.max_id()
    if low < 0 or high >= vocab:
        return [f"{reader.bin_path}: holds id {high if high >= vocab else low}, outside the vocabulary [0, {vocab}); "
                f"the token bytes are damaged. Fix: {repair_hint(record, shard)}"]
    return []


def unchecksummed_prefixes(manifest: dict) -> list[str]:
    """Registered Megatron prefixes without a recorded sha256 (over FULL_CHECK_BYTES when registered), in order."""
    return [shard["prefix"] for record in manifest["domains"].values() for info in record["splits"].values()
            for shard in info["shards"] if shard.get("prefix") and not shard.get("sha256")]
