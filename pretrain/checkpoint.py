"""Checkpoint mechanism: atomic, self-describing checkpoint folders and the `latest` pointer.

Layout under the checkpoint root::

    step_0000100/                 DeepSpeed's files (every rank writes its own shards)
        ayumi_state.pt            trainer state shared by all ranks (counters, data position, ...)
        ayumi_rank00000.pt        per-rank state (RNG of torch, numpy, python, CUDA)
        ayumi.json                written last by rank 0: marks the folder complete, describes it
    latest                        the newest complete tag, replaced atomically after ayumi.json
    universal/step_0000100/       only while a checkpoint of another data-parallel size is loaded

A crash mid-save leaves a folder without `ayumi.json` and `latest` still naming the previous
checkpoint; such folders are never loaded and are removed by the next save. *When* to save
(interval, signals, end of run) is the trainer's policy, not this module's.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pretrain.model.config import ModelConfig
from common.files import write_text_atomic

LATEST = "latest"
META = "ayumi.json"
SHARED_STATE = "ayumi_state.pt"
TAG_PREFIX = "step_"
UNIVERSAL_DIR = "universal"  # under a checkpoint root: converted copies, while they are being loaded


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or does not fit this run."""


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

    `world_size` and `zero_stage` describe this run: a ZeRO 1-3 checkpoint saved by another
    number of ranks is loaded through DeepSpeed's universal form (converted by rank 0 under
    `<root>/universal/`, removed after loading). `any_rank(flag)` is True on every rank when the
    flag is on any one (pretrain.engine.any_rank); it carries a failed conversion to all ranks.
    """

    def __init__(self, root: Path, keep_last: int, rank: int, barrier, world_size: int = 1, zero_stage: int = 0,
                 any_rank=lambda flag: flag):
        self.root = Path(root)
        self.keep_last = keep_last
        self.rank = rank
        self._barrier = barrier
        self.world_size = world_size
        self.zero_stage = zero_stage
        self._any_rank = any_rank

    def save(self, engine, step: int, shared_state: dict[str, Any], meta: dict[str, Any]) -> Path:
        tag = tag_for(step)
        tag_dir = self.root / tag
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tag_dir.exists():  # left by a crash mid-save, or a re-save of the same step
                shutil.rmtree(tag_dir)
        self._barrier()
        engine.save(self.root, tag, client_state={"ayumi_step": step})
        atomic_torch_save(capture_rng(), tag_dir / rank_state_name(self.rank))
        if self.rank == 0:
            atomic_torch_save(shared_state, tag_dir / SHARED_STATE)
        self._barrier()  # every rank's files are on disk before the folder is declared complete
        if self.rank == 0:
            meta = {**meta, "step": step, "tag": tag, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
            write_text_atomic(tag_dir / META, json.dumps(meta, indent=2, default=str) + "\n")
            write_text_atomic(self.root / LATEST, tag + "\n")
            self._prune()
        self._barrier()
        return tag_dir

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
        if saved_stage != self.zero_stage:
            raise CheckpointError(
                f"{tag_dir} was saved with ZeRO stage {saved_stage}, this run uses stage {self.zero_stage}. "
                f"Fix: resume with deepspeed=zero{saved_stage} (the data-parallel size may differ)."
            )
        # Stage 0 keeps whole optimizer state on every rank and loads at any size.
        return saved_stage >= 1 and saved_world != self.world_size

    def _load_universal(self, engine, tag_dir: Path) -> None:
        universal = self.root / UNIVERSAL_DIR / tag_dir.name
        failure = None
        if self.rank == 0:
            # Never reused: one left by a crash may come from another run's folder of the same name.
            shutil.rmtree(universal, ignore_errors=True)
            try:
                _check_room_for_universal(tag_dir, universal)
                from pretrain.engine import convert_to_universal  # the DeepSpeed room

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
    from curriculum.plan import directory_bytes, existing_parent

    needed = 2 * directory_bytes(tag_dir)
    where = existing_parent(universal)
    free = shutil.disk_usage(where).free
    if free < needed:
        raise CheckpointError(
            f"converting {tag_dir} for another number of ranks needs ~{needed / 2**30:.1f} GiB free under {where}, "
            f"only {free / 2**30:.1f} GiB is. Fix: free disk space there, or resume on the number of ranks that "
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
    """Consolidated fp32 weights, the model config, and tokenizer facts of a checkpoint."""
    from pretrain.engine import consolidated_state_dict

    root, tag = resolve_checkpoint(path)
    meta = json.loads((root / tag / META).read_text())
    state = consolidated_state_dict(root, tag)
    extra = {key: meta.get(key) for key in ("tokenizer_dir", "bos_id", "eos_id", "pad_id")}
    return state, model_config_from_meta(meta), extra
