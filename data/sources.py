"""A thin adapter from a `DomainConfig` to the shared streaming readers in `common.corpus`.

The readers themselves (jsonl/.gz/.zst, text, parquet, `datasets` folders; skip counting; strict
mode) live in `common/corpus.py`, shared with the tokenizer builder. This module adds what
data preparation needs on top: the domain's file list with a fingerprint (sizes and mtimes, for
resume) and errors that name the domain's config key.
"""
from __future__ import annotations

import os
from pathlib import Path

from data.config import DomainConfig
from common.corpus import CorpusError, Document, ReadStats, expand_inputs

__all__ = ["CorpusError", "Document", "ReadStats", "domain_files", "file_fingerprints"]


def domain_files(name: str, domain: DomainConfig) -> list[Path]:
    """The domain's input files (sorted, de-duplicated); a pattern matching nothing raises CorpusError naming the key."""
    try:
        return expand_inputs(list(domain.inputs))
    except CorpusError as err:
        raise CorpusError(f"data.domains.{name}.inputs: {err}") from None


def file_fingerprints(paths: list[Path]) -> list[dict]:
    """[{path, size, mtime_ns}] per input; a `datasets` folder counts all the files below it.

    A file that cannot be stat-ed gets size -1: reading it later counts it as unreadable.
    """
    return [_fingerprint(path) for path in paths]


def _fingerprint(path: Path) -> dict:
    try:
        if path.is_dir():
            size, mtime = 0, 0
            for dirpath, _, filenames in os.walk(path):
                for filename in filenames:
                    stat = os.stat(os.path.join(dirpath, filename))
                    size += stat.st_size
                    mtime = max(mtime, stat.st_mtime_ns)
        else:
            stat = path.stat()
            size, mtime = stat.st_size, stat.st_mtime_ns
    except OSError:
        size, mtime = -1, 0
    return {"path": str(path.resolve()), "size": size, "mtime_ns": mtime}

