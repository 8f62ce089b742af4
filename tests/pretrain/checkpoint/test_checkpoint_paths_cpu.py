"""A run folder from elsewhere writes and deletes nothing outside the run (issue 49, findings 1 and 2).

Built as someone who can write a run folder would: a parameter name that is a path (`../../x`, an absolute one)
planted in a checkpoint's DeepSpeed files, every checksum recomputed; ayumi.json's `world_size` edited so that a
resume would convert; `checkpoints/universal` a link to a folder elsewhere. Each is resumed through `ayumi train` on
2 ranks (the 1-rank checkpoints need DeepSpeed's universal conversion, which makes paths of those names): exit
status 2, one line naming the file or link, and nothing outside the run created, changed or removed (a sentinel
folder beside it). Without DeepSpeed: a save never goes through a link (tag folder, checkpoint root).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from common.safe_load import DEEPSPEED_GLOBALS, load
from pretrain.checkpoint import integrity
from pretrain.checkpoint.checkpointer import CheckpointError, Checkpointer, tag_for
from pretrain.checkpoint.layout import META
from tests.helpers import run_training, tiny_overrides
from tests.pretrain.checkpoint.test_checkpoint_files import FakeEngine
from tests.pretrain.checkpoint.test_checkpoint_payloads_cpu import rerecord
from tests.pretrain.tools.test_train_exit_status import ayumi, ranks_said

BASE = ["deepspeed=zero1", "deepspeed.precision=fp32", "train.eval_interval=0", "train.max_steps=2",
        "checkpoint.interval=2"]
TAG = "step_0000002"
MODEL = "mp_rank_00_model_states.pt"
SHARD = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def trained(corpus, root: Path, nproc: int) -> Path:
    """A run root whose cpu_tiny run saved step 2 on `nproc` ranks (ZeRO-1)."""
    proc = run_training(tiny_overrides(corpus, root, *BASE), nproc=nproc, launcher="fork")
    assert proc.returncode == 0, proc.stdout[-6000:]
    return root


@pytest.fixture(scope="module")
def one_rank(corpus, tmp_path_factory) -> Path:
    return trained(corpus, tmp_path_factory.mktemp("one_rank"), 1)


@pytest.fixture(scope="module")
def two_ranks(corpus, tmp_path_factory) -> Path:
    return trained(corpus, tmp_path_factory.mktemp("two_ranks"), 2)


def outside(tmp_path: Path, run: Path) -> dict[str, bytes | None]:
    """Every path under tmp_path but the run's own folder, with its bytes (None for a folder)."""
    return {str(path): (path.read_bytes() if path.is_file() else None) for path in sorted(tmp_path.rglob("*"))
            if not path.is_relative_to(run)}


def plant_name(tag_dir: Path, where: str, name: str) -> Path:
    """Add a parameter called `name` to the model states' weights or to an optimizer shard's slice mappings (a copy of
    a real entry), and recompute the file's checksum as its writer can; the file's path."""
    path = tag_dir / (MODEL if where == "module" else SHARD)
    state = load(path, DEEPSPEED_GLOBALS)
    if where == "module":
        state["module"][name] = torch.full_like(state["module"]["model.norm.weight"], 7.0)
    else:
        mappings = state["optimizer_state_dict"]["param_slice_mappings"][0]
        mappings[name] = next(iter(mappings.values()))
    torch.save(state, path)
    rerecord(tag_dir, path.name)
    assert integrity.verify(tag_dir).status == integrity.VERIFIED  # the checksums are no defence
    return path


def planted_copy(trained_root: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    """(a copy of a module's run root to plant into, its run dir, an empty sentinel folder outside the run that
    nothing may write into)."""
    root = Path(shutil.copytree(trained_root, tmp_path / "runs"))
    sentinel = tmp_path / "sentinel"
    sentinel.mkdir()
    return root, root / "cpu_tiny", sentinel


def verify_calls_it_unsafe(run: Path, starts: str) -> None:
    """`ayumi checkpoint verify` on the run: the planted folder is `unsafe` (never "verified"), exit 2, and its line
    on stderr is the one a resume refuses it with."""
    proc = ayumi("checkpoint", "verify", run)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [row] = [line for line in proc.stdout.splitlines() if line.startswith(f"checkpoints/{TAG}")]
    assert "unsafe" in row and "verified" not in row, row
    [said] = [line for line in proc.stderr.splitlines() if line.startswith("ayumi checkpoint verify: ")]
    assert said.removeprefix("ayumi checkpoint verify: ").startswith(starts), said


def resume_on_two(corpus, root: Path):
    proc = ayumi("train", *tiny_overrides(corpus, root, *BASE, "train.max_steps=4"))
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-4000:]
    [line] = ranks_said(proc.stderr)
    assert proc.stderr.rstrip("\n").splitlines()[-1] == f"ayumi train: {line}"
    return line


@pytest.mark.slow
@pytest.mark.parametrize("where, name", [("module", "ABSOLUTE"), ("param_slice_mappings", "../../../../../../x")])
def test_a_parameter_name_that_is_a_path_is_refused_before_any_conversion(one_rank, corpus, tmp_path, where, name):
    """A 1-rank checkpoint resumed on 2 ranks goes through DeepSpeed's converter, which joins each name to its output
    folder: the name is refused first, naming the file, and nothing appears outside the run."""
    root, run, sentinel = planted_copy(one_rank, tmp_path)
    name = str(sentinel / "abs") if name == "ABSOLUTE" else name
    path = plant_name(run / "checkpoints" / TAG, where, name)
    verify_calls_it_unsafe(run, f"{path} names a parameter this model does not have ({name!r}): ")
    before = outside(tmp_path, run)
    line = resume_on_two(corpus, root)
    assert line.startswith(f"{path} names a parameter this model does not have ({name!r}): "
                           "DeepSpeed's conversion"), line
    assert outside(tmp_path, run) == before and not any(sentinel.iterdir())
    assert not (run / "checkpoints" / "universal").exists()


@pytest.mark.slow
def test_an_edited_world_size_forces_no_conversion(two_ranks, corpus, tmp_path):
    """ayumi.json's world_size once decided the conversion: edited to 1 on a 2-rank checkpoint (with an absolute name
    planted), it is now checked against DeepSpeed's files, which hold 2 ranks' optimizer shards: refused, nothing
    converted, nothing written elsewhere."""
    root, run, sentinel = planted_copy(two_ranks, tmp_path)
    tag_dir = run / "checkpoints" / TAG
    plant_name(tag_dir, "module", str(sentinel / "abs"))
    meta = json.loads((tag_dir / META).read_text())
    meta["world_size"] = 1
    (tag_dir / META).write_text(json.dumps(meta))
    verify_calls_it_unsafe(run, f"{tag_dir / META} records world_size 1 (tensor-parallel 1), but the folder holds ")
    before = outside(tmp_path, run)
    line = resume_on_two(corpus, root)
    assert line.startswith(f"{tag_dir / META} records world_size 1 (tensor-parallel 1), but the folder holds "
                           "DeepSpeed optimizer states of 2 ranks"), line
    assert outside(tmp_path, run) == before and not any(sentinel.iterdir())


@pytest.mark.slow
def test_a_linked_universal_folder_is_refused_and_what_it_points_at_untouched(one_rank, corpus, tmp_path):
    """`checkpoints/universal` a link to a folder elsewhere: the conversion would have removed `<link>/step_0000002`
    and written there. Refused before anything is read; the folder and its files stay as they were."""
    root = Path(shutil.copytree(one_rank, tmp_path / "runs"))
    run = root / "cpu_tiny"
    sentinel = tmp_path / "sentinel"
    (sentinel / TAG).mkdir(parents=True)
    (sentinel / TAG / "keep.txt").write_text("someone else's\n")
    (sentinel / "keep.txt").write_text("someone else's\n")
    link = run / "checkpoints" / "universal"
    link.symlink_to(sentinel, target_is_directory=True)
    verify_calls_it_unsafe(run, f"{link} is a symbolic link (to {sentinel}): ")
    before = outside(tmp_path, run)
    line = resume_on_two(corpus, root)
    assert line.startswith(f"{link} is a symbolic link (to {sentinel}): ayumi writes under a checkpoint root only "
                           "through real folders"), line
    assert outside(tmp_path, run) == before and link.is_symlink()


def test_every_name_in_param_shapes_must_be_the_models_own(tmp_path):
    """param_shapes (the converter's list of what to merge) is checked like the weights and the slice mappings."""
    from pretrain.engine.checkpoint_formats import foreign_name

    tag_dir = tmp_path / TAG
    tag_dir.mkdir()
    torch.save({"module": {"w": torch.zeros(2)}, "param_shapes": [{"w": torch.Size([2]), "/etc/x": torch.Size([2])}]},
               tag_dir / MODEL)
    assert foreign_name(tag_dir, {"w"}) == (tag_dir / MODEL, "/etc/x")
    assert foreign_name(tag_dir, {"w", "/etc/x"}) is None


@pytest.mark.parametrize("linked", ["tag folder", "checkpoint root"])
def test_a_save_never_goes_through_a_link(tmp_path, linked):
    """A tag folder (or the root) planted as a link elsewhere: the save is refused, nothing written or removed there."""
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "keep").mkdir(parents=True)
    root = tmp_path / "checkpoints"
    if linked == "tag folder":
        root.mkdir()
        link = root / tag_for(10)
    else:
        link = root
    link.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(CheckpointError, match=f"^{link} is a symbolic link"):
        Checkpointer(root, keep_last=2, rank=0, barrier=lambda: None).save(FakeEngine(), 10, {}, {})
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep"] and link.is_symlink()


def test_pruning_leaves_a_linked_tag_folder_and_what_it_points_at(tmp_path):
    """The clean-ups delete only real folders inside the checkpoint root: an old checkpoint that is a link to a folder
    elsewhere is past keep_last, yet neither it nor the folder it points at is deleted. (A guard: shutil.rmtree
    already refused a link at the top; pretrain/checkpoint/paths.py's discard now says so for every clean-up.)"""
    root, elsewhere = tmp_path / "checkpoints", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / META).write_text("{}")
    (elsewhere / "keep").write_text("someone else's\n")
    root.mkdir()
    (root / "step_0000001").symlink_to(elsewhere, target_is_directory=True)
    for step in (2, 3):
        (root / f"step_000000{step}").mkdir()
        (root / f"step_000000{step}" / META).write_text("{}")
    Checkpointer(root, keep_last=1, rank=0, barrier=lambda: None)._prune(3)
    assert sorted(p.name for p in root.iterdir()) == ["step_0000001", "step_0000003"]
    assert sorted(p.name for p in elsewhere.iterdir()) == sorted(["keep", META])


@pytest.mark.slow
def test_a_linked_checkpoints_folder_is_refused_before_anything_is_loaded(one_rank, corpus, tmp_path):
    """`checkpoints/` itself a link to a folder elsewhere (every save, prune and conversion would land there): the
    ranks refuse it at start, one line naming the link and the fix, and the folder it points at stays as it was."""
    root = Path(shutil.copytree(one_rank, tmp_path / "runs"))
    run = root / "cpu_tiny"
    elsewhere = tmp_path / "elsewhere"
    shutil.move(run / "checkpoints", elsewhere)
    (run / "checkpoints").symlink_to(elsewhere, target_is_directory=True)
    before = outside(tmp_path, run)
    line = resume_on_two(corpus, root)
    assert line.startswith(f"{run / 'checkpoints'} is a symbolic link (to {elsewhere}): "), line
    assert "Fix: replace the link with a real folder (or point checkpoint.dir at the folder you meant)" in line
    assert outside(tmp_path, run) == before
