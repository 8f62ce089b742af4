"""The training domains of a data root, opened from what its manifest lists (never by globbing folders).

A domain is either prepared by ayumi (shards under `<root>/<domain>/`) or registered Megatron data
(prefixes anywhere, data/megatron.py); both open the same way, into `PackedSamples` (or
`BlendedSamples` for weighted prefixes), after data/integrity.py's checks. A shard the manifest
lists but the disk lacks stops the run; a stray file in a domain folder is never read.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from data.integrity import check_domain_record, open_listed_shards, wants_checksum
from data.lineage import Lineage, original_fields
from data.manifest import ManifestError, load_manifest
from data.packed import BlendedSamples, EodAppended, LongDocuments, PackedSamples
from data.shards import ShardFormatError


def select_domains(manifest: dict, root: Path, names: list[str] | None) -> list[str]:
    """The names to train on (all of the manifest's, sorted, when none are given); unknown names are refused."""
    known = list(manifest["domains"])
    if not names:
        return sorted(known)  # by name, as the folders were read before manifests listed them: same stream
    unknown = [name for name in names if name not in manifest["domains"]]
    if unknown:
        raise ShardFormatError(f"domain(s) {', '.join(unknown)} are not in {Path(root) / 'manifest.json'} (it has: "
                               f"{', '.join(known)}). Fix: check data.domains / the curriculum's domains, or data.root")
    return list(names)


def open_domain(root: Path, name: str, record: dict, split: str, seq_len: int, vocab_size: int | None,
                checksum: bool, min_document_tokens: int = 0) -> PackedSamples | BlendedSamples:
    """One domain's split as samples, every shard checked against its record; with `min_document_tokens`,
    from its documents of at least that many tokens only (data.packed.LongDocuments)."""
    readers = open_listed_shards(root, name, record, split, checksum)
    shards = record["splits"][split]["shards"]
    readers = [EodAppended(reader, shard["eod_id"]) if shard.get("append_eod") else reader
               for reader, shard in zip(readers, shards)]
    if min_document_tokens:
        readers = [LongDocuments(reader, min_document_tokens) for reader in readers]
    weights = [shard.get("weight") for shard in shards]
    if any(weight is not None for weight in weights):
        samples = BlendedSamples([PackedSamples([reader], seq_len, name, vocab_size) for reader in readers],
                                 weights, name)
    else:
        samples = PackedSamples(readers, seq_len, name, vocab_size)
    samples.fingerprint = _fingerprint(record, split)  # a merge moves boundaries, not data
    if isinstance(samples, PackedSamples):
        samples.lineage = Lineage(record, split) or None
    return samples


def open_streams(root: str | Path, shapes: dict[str, tuple[str, int, int]], vocab_size: int | None = None,
                 verify: str = "sizes") -> dict[str, PackedSamples | BlendedSamples]:
    """Training splits opened at other sample shapes, for a curriculum's streams: name -> (domain, seq_len,
    shortest document in tokens, 0 = any). The manifest is read once; sizes only by default (a run opened
    its domains with its own `data.verify` already)."""
    root = Path(root)
    manifest = load_manifest(root)
    out = {}
    for name, (domain, seq_len, min_document_tokens) in shapes.items():
        record = manifest["domains"][domain]
        out[name] = open_domain(root, domain, record, "train", seq_len, vocab_size,
                                wants_checksum(verify, [(record, "train")]), min_document_tokens)
    return out


def _fingerprint(record: dict, split: str) -> str:
    """What identifies the data: each shard's name, size and checksum (or size alone when none is recorded), of the
    shards a split was first written in (data/lineage.py: `ayumi data merge` keeps them in the record)."""
    keys = original_fields(record, split, ("name", "prefix", "bytes", "sha256"))
    return hashlib.sha256(json.dumps(keys).encode("utf-8")).hexdigest()[:16]


def open_run_data(root: str | Path, names: list[str] | None, seq_len: int, vocab_size: int | None = None,
                  verify: str = "auto", validation: bool = True,
                  ) -> tuple[dict, dict[str, PackedSamples | BlendedSamples], dict[str, PackedSamples | BlendedSamples]]:
    """(manifest, train domains, validation domains) of a run, checked as data/integrity.py describes."""
    root = Path(root)
    manifest = load_manifest(root)
    chosen = select_domains(manifest, root, names)
    records = {name: manifest["domains"][name] for name in chosen}
    val_names = validation_domains(records, validation)
    checksum = wants_checksum(verify, [(records[n], "train") for n in chosen] + [(records[n], "val") for n in val_names])
    for name, record in records.items():
        check_domain_record(root, name, record)
        if "train" not in record["splits"]:
            raise ShardFormatError(f"domain {name!r} of {root} has no training split")
    train = {name: open_domain(root, name, records[name], "train", seq_len, vocab_size, checksum) for name in chosen}
    val = {}
    for name in val_names:
        samples = open_domain(root, name, records[name], "val", seq_len, vocab_size, checksum)
        if len(samples):
            val[name] = samples
    return manifest, train, val


def validation_domains(records: dict[str, dict], validation: bool = True) -> list[str]:
    """The domains (of `records`, the manifest's) a run computes a validation loss on: those with a val split,
    none when data.validation is off."""
    return [name for name, record in records.items() if validation and "val" in record["splits"]]


def validation_notice(root: str | Path, names: list[str] | None, validation: bool = True) -> str | None:
    """One line when a run on `root` (its domains `names`; empty: all) has no validation loss, or has it for some
    domains only; None when every domain has one, or when the root cannot be read (other checks say why).

    For `ayumi plan` and `ayumi train` to say before the run what would otherwise only show as a missing curve:
    a small corpus prepared with a fraction (data=ja_en: val_fraction=0.001) holds out no document at all."""
    try:
        manifest = load_manifest(root)
        records = {name: manifest["domains"][name] for name in select_domains(manifest, Path(root), names)}
    except (ManifestError, ShardFormatError, OSError, ValueError, KeyError):
        return None
    if not validation:
        return "no validation loss: data.validation=false"
    with_val = validation_domains(records)
    without = [name for name in records if name not in with_val]
    if not without:
        return None
    fix = ("to get one, prepare the data again with data.domains.NAME.val_count=N (N documents held out per domain; "
           "a val_fraction holds out none of a small corpus)")
    if not with_val:
        return f"no validation loss: no domain of {root} has a validation split ({', '.join(without)}); {fix}"
    return (f"validation loss on {', '.join(with_val)} only: {', '.join(without)} of {root} has no validation split; "
            f"{fix}")
