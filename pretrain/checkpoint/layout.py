"""The names inside a checkpoint root, without torch: what `ayumi checkpoint verify` and the checkpointer share.

    step_0000100/            a checkpoint folder (complete once its ayumi.json is there)
    step_0000040.corrupt/    a folder a run found damaged and set aside: never loaded or pruned again
    latest                   the newest complete tag
    recovery/                the rollback ring, laid out the same way

Only names matching `step_<digits>` are checkpoints, so a folder set aside under another name is never
chosen, listed or pruned as one.
"""
from __future__ import annotations

import re
from pathlib import Path

LATEST = "latest"
META = "ayumi.json"
SHARED_STATE = "ayumi_state.pt"
TAG_PREFIX = "step_"
QUARANTINE_SUFFIX = ".corrupt"
"""Appended to a damaged checkpoint folder's name when a run sets it aside (checkpoint.on_corrupt=fallback)."""
RING_DIR = "recovery"
"""The rollback ring's folder under the checkpoint root (pretrain/checkpoint/ring.py)."""

_TAG = re.compile(rf"^{TAG_PREFIX}(\d+)$")


def tag_for(step: int) -> str:
    return f"{TAG_PREFIX}{step:07d}"


def is_tag(name: str) -> bool:
    """Whether `name` is a checkpoint folder's name (`step_0000100`), not a set-aside or temporary one."""
    return _TAG.match(name) is not None


def step_of(tag: str) -> int:
    return int(tag[len(TAG_PREFIX):])


def rank_state_name(rank: int) -> str:
    return f"ayumi_rank{rank:05d}.pt"


def is_complete(tag_dir: Path) -> bool:
    return (tag_dir / META).is_file()


def complete_tags(root: Path) -> list[str]:
    """Complete checkpoint tags under root, oldest first."""
    if not root.is_dir():
        return []
    tags = [p.name for p in root.iterdir() if p.is_dir() and is_tag(p.name) and is_complete(p)]
    return sorted(tags, key=step_of)


def older_tags(root: Path, tag: str) -> list[str]:
    """The complete tags under root older than `tag`, newest first: where a damaged `tag`'s stand-in is looked for."""
    return [name for name in reversed(complete_tags(root)) if step_of(name) < step_of(tag)]


def quarantined(root: Path) -> list[Path]:
    """The folders a run set aside as damaged under root (`step_0000040.corrupt`, ...), oldest step first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(TAG_PREFIX) and QUARANTINE_SUFFIX in p.name]
    return sorted(found, key=lambda p: (step_of(p.name.split(".")[0]), p.name))


def latest_tag(root: Path) -> str | None:
    """The tag `latest` names, if that checkpoint is complete; else the newest complete one."""
    pointer = root / LATEST
    if pointer.is_file():
        tag = pointer.read_text().strip()
        if tag and is_tag(tag) and is_complete(root / tag):
            return tag
    tags = complete_tags(root)
    return tags[-1] if tags else None
