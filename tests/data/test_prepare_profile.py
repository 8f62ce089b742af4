"""AYUMI_PREPARE_PROFILE: a run says where its time went (data/prepare_profile.py), and writes the same bytes."""
from __future__ import annotations

import json
from pathlib import Path

from data.prepare import prepare
from data.prepare_profile import PROFILE_ENV
from tests.data.helpers import domain, make_config, write_jsonl
from common.corpus import read_jsonl_blocks


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_profile_counts_every_item_in_the_workers_and_changes_no_byte(tmp_path, tokenizer_dir, en_texts, monkeypatch):
    text = write_jsonl(tmp_path / "en.jsonl", en_texts)
    plain, profiled = tmp_path / "plain", tmp_path / "profiled"
    cfg = {"domains": {"en": domain([text], val_fraction=0.1)}, "workers": 2, "chunk_mb": 0.01}
    prepare(make_config(plain, tokenizer_dir, **cfg))
    assert not (tmp_path / "profile.json").exists()
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "profile.json"))
    prepare(make_config(profiled, tokenizer_dir, **cfg))
    assert tree_bytes(profiled) == tree_bytes(plain)

    profile = json.loads((tmp_path / "profile.json").read_text())
    chunks = len(list(read_jsonl_blocks(text, int(0.01 * 2**20))))  # each block fills an item
    workers = profile["workers"]
    assert 1 <= len(workers) <= 2 and sum(worker["items"] for worker in workers) == chunks > 2
    assert set(profile["phases"]) == {"start", "stream", "finishing_domains", "closing_pool", "overlap_and_manifest"}
    assert set(profile["stream"]) == {"reading", "waiting_on_workers", "finishing_domains", "routing_and_writing"}
    assert sum(profile["stream"].values()) <= profile["phases"]["stream"] + 1e-6 <= profile["wall"]
    for worker in workers:
        assert 0 < worker["busy"] and 0 <= worker["idle_between_items"]
        assert 0 < worker["first_item_at"] < worker["done_at"] <= profile["wall"]
