"""Megatron domains declared outside conf/data (a curriculum file's `domains:`), registered into a data root.

A team whose corpora are already Megatron `.bin/.idx` prefixes can name them in one curriculum file
and train. Each such domain is checked and recorded by the code `ayumi data prepare` runs for a
`megatron:` domain of conf/data (`register_megatron_domain`, data/megatron.py: the same id, EOD and
index checks, the same record), then added to the root's manifest beside the domains already there,
so training, the plan, the mixer, `ayumi data inspect` and `ayumi data verify` read it like any other.

What a call writes, and when it writes nothing:
- each declared domain's folder (`<root>/<name>/domain.json`: the record naming the prefixes, and
  which curriculum declared it), unless a record with the same fingerprint (config, tokenizer, each
  file's size and mtime) is already there: then the prefixes are not read again;
- `manifest.json`: the domains it listed plus the declared ones, written atomically, and only when
  something changed. So the call is cheap and safe to repeat at every plan and training start.
Unlike `ayumi data prepare`, it leaves the old manifest in place while it checks: a refused prefix
leaves the root as it was. A reader that comes between a re-registered domain's new folder and the
new manifest is refused by data/integrity.py (the two records differ), never given mixed data.

Refused, one line each: declared data checked against another tokenizer than the root's (a root has
one tokenizer); a declared name that the root already uses for a domain from `ayumi data prepare`
(rename it in the curriculum); a root that is not finished (folders without a manifest).

`ayumi data prepare` rewrites the manifest with its own config's domains: a curriculum's domains
drop out of it (their folders stay; it warns about them) and the next plan or training start with
that curriculum adds them back without reading the prefixes again.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from data.config import DomainConfig
from data.manifest import (
    MANIFEST_NAME, build_manifest, load_manifest, read_domain_record, tokenizer_identity, write_json_atomic,
)
from data.megatron import MegatronDataError, domain_fingerprint
from data.prepare import PARTIAL_DIR, PIPELINE_VERSION, check_overlap, finished_record, register_megatron_domain
from data.shards import TokenizerMismatchError
from tokenizer.declared import load_declared_tokenizer


WHERE = "curriculum.domains"
"""The config key messages name (the domains come from a curriculum, already checked by curriculum.config)."""
TOKENIZER_KEY = "data.tokenizer_dir"


def register_declared_domains(root: str | os.PathLike, domains: dict[str, DomainConfig], tokenizer_dir: str,
                              curriculum: str) -> dict:
    """Register `domains` (Megatron data only, checked by curriculum.config.declared_domains) into `root`, checked
    against `tokenizer_dir`; returns the manifest. `curriculum` names the file that declared them (kept in each
    record, so fixes name the command that registers them again)."""
    root = Path(root)
    tokenizer = load_declared_tokenizer(tokenizer_dir)
    existing = _existing_manifest(root, domains)
    if existing is not None:
        _check_same_tokenizer(existing, tokenizer, root, tokenizer_dir, WHERE, TOKENIZER_KEY)
    listed = dict(existing["domains"]) if existing else {}
    records = {name: _registered(root, name, domain, tokenizer, listed.get(name), curriculum, WHERE)
               for name, domain in domains.items()}
    if existing is not None and all(listed.get(name) == record for name, record in records.items()):
        return existing  # every declared domain is listed as recorded: nothing to write
    root.mkdir(parents=True, exist_ok=True)
    # Megatron data has no content keys, so adding it changes neither side of the train/val overlap
    # check: a root's recorded result stands (re-reading every keys.bin of a big root would cost minutes).
    overlap = existing["overlap_check"] if existing else check_overlap(root, records)
    manifest = build_manifest(existing["name"] if existing else root.name, tokenizer_identity(tokenizer),
                              {**listed, **records}, overlap)
    write_json_atomic(root / MANIFEST_NAME, manifest)
    with contextlib.suppress(OSError):
        (root / PARTIAL_DIR).rmdir()  # emptied by each publish; only a crashed one leaves something in it
    return manifest


def _existing_manifest(root: Path, domains: dict[str, DomainConfig]) -> dict | None:
    """The root's manifest; None for a root that does not exist yet or holds only the declared domains' folders."""
    if (root / MANIFEST_NAME).is_file():
        return load_manifest(root)
    if root.is_dir() and any(not path.name.startswith(".") and path.name not in domains for path in root.iterdir()):
        load_manifest(root)  # raises: not a finished data root (an interrupted `ayumi data prepare`?)
    return None


def _check_same_tokenizer(manifest: dict, tokenizer, root: Path, tokenizer_dir: str, where: str,
                          tokenizer_key: str) -> None:
    recorded = manifest["tokenizer"]
    if recorded["sha256"] != tokenizer.sha256:
        raise TokenizerMismatchError(
            f"{where}: data root {root} holds data made with tokenizer {recorded.get('model_path')} (sha256 "
            f"{str(recorded['sha256'])[:12]}…), but {tokenizer_key}={tokenizer_dir} (sha256 {tokenizer.sha256[:12]}…) "
            "declares the curriculum's Megatron data; a data root has one tokenizer. Fix: set "
            f"{tokenizer_key} to the tokenizer both were made with, or give the curriculum's data its own data.root")


def _registered(root: Path, name: str, domain: DomainConfig, tokenizer, listed: dict | None, curriculum: str,
                where: str) -> dict:
    """The domain's record: the one on disk when its fingerprint still matches, else checked and published now."""
    fingerprint = domain_fingerprint(name, domain, tokenizer.sha256, PIPELINE_VERSION, where)
    record = finished_record(root / name, fingerprint)
    if record is not None:
        return record
    for other in (listed, read_domain_record(root / name)):
        if other is not None and not other.get("curriculum"):
            made = "Megatron prefixes of conf/data" if other.get("source") == "megatron" else "corpus files"
            raise MegatronDataError(
                f"{where}.{name}: data root {root} already has a domain {name!r} made by `ayumi data prepare` (from "
                f"{made}); a curriculum adds domains, it does not replace them. Fix: give the curriculum's domain "
                "another name (in its stages' weights too), or drop it from the curriculum to train on the prepared one")
    return register_megatron_domain(root, name, domain, tokenizer, fingerprint, where, curriculum)
