"""`ayumi export hf` writes its folder and files with the user's umask (issue 48, papercut: they were 0700/0600).

The folder is built under a temporary name by tempfile.mkdtemp (always 0700) and safetensors writes its file 0600:
on a shared cluster a teammate could not read an export. Now the umask decides: 022 gives 0755 and 0644, and 077
keeps the export private. Through `ayumi export hf`'s own entry in this process (the checkpoint reader answers with
a small model; the real one, through a subprocess, is in tests/pretrain/checkpoint/test_damaged_newest_cpu.py).
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

import pretrain.checkpoint.checkpointer as checkpointer
from pretrain.tools import export
from tests.pretrain.model.test_export import TINY, trained_like

pytest.importorskip("transformers")


def modes(folder: Path) -> dict[str, int]:
    """Permission bits of the folder ('.') and of each file in it."""
    return {".": stat.S_IMODE(folder.stat().st_mode),
            **{p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}}


@pytest.fixture
def umask():
    """Set the process umask for one test, then put the former one back."""
    former = os.umask(0o022)
    yield os.umask
    os.umask(former)


@pytest.mark.parametrize("mask, folder_mode, file_mode", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640),
                                                          (0o077, 0o700, 0o600)])
def test_export_folder_and_files_follow_the_umask(tmp_path, monkeypatch, umask, mask, folder_mode, file_mode):
    model = trained_like(TINY)
    monkeypatch.setattr(checkpointer, "load_for_export", lambda path: (model.state_dict(), TINY, {"eos_id": 2}))
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    umask(mask)
    out = tmp_path / "hf"
    assert export.main(["hf", str(tmp_path / "ckpt"), str(out), "--tokenizer-dir", str(tok)]) == 0
    found = modes(out)
    assert set(found) == {".", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json"}
    assert found == {".": folder_mode, **{name: file_mode for name in found if name != "."}}
