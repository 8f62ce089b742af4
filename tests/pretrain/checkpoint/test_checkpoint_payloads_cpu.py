"""Loading a checkpoint never runs code: a real payload planted in each kind of checkpoint file, its checksum
recomputed so that it matches (as whoever planted it would), then loaded through every command that reads checkpoints.

The payload is a pickle whose `__reduce__` makes a marker folder when unpickled (os.mkdir). One short 2-rank ZeRO-1
run (module fixture) gives the checkpoint; each case plants into a copy. Every command must refuse with exit status
2 and one line naming the file, and the marker must never appear:

- `ayumi checkpoint verify`, `ayumi export hf` and `ayumi eval` (in this process: a payload that ran would make its
  marker here), for model states, an optimizer shard, the shared trainer state and a rank's RNG file;
- `ayumi train` resuming (an optimizer shard and an RNG file that only rank 1 reads: the ranks agree and all stop)
  and with `checkpoint.load_from` (model states, the shared state), through the real launcher;
- DeepSpeed's own readers behind ayumi's (its fp32 consolidation, its universal conversion), which pass
  `weights_only=False` themselves: run by ayumi weights-only, they refuse the payload too;
- an older ayumi's RNG files (NumPy arrays): refused with the fix, converted by `ayumi checkpoint convert --trust`
  (after which the run resumes), while a payload in such a file is refused by the conversion, --trust or not;
- files built to show the static check another pickle than torch reads (a legacy stream before a zip, the real
  record as DATA.PKL), or to BUILD onto DeepSpeed's shared enum member: refused by verify and by a resume, the enum
  unchanged (issue 49).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from common.safe_load import DEEPSPEED_GLOBALS, load
from pretrain.checkpoint import integrity
from pretrain.checkpoint.layout import META
from pretrain.tools.cli import main
from tests.helpers import REPO, cpu_env, run_training, tiny_overrides
from tests.pretrain.checkpoint.test_safe_load import OnTheEnum, legacy_before_zip, pickle_in_capitals
from tests.pretrain.tools.test_train_exit_status import ayumi, ranks_said

pytestmark = pytest.mark.slow

BASE = ["deepspeed=zero1", "deepspeed.precision=fp32", "train.eval_interval=0", "train.max_steps=4",
        "checkpoint.interval=2", "checkpoint.keep_last=2"]
TAG = "step_0000004"
KINDS = {  # file kind -> the file of the checkpoint it is planted in
    "model states": "mp_rank_00_model_states.pt",
    "optimizer states": "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    "shared state": "ayumi_state.pt",
    "rng file": "ayumi_rank00001.pt",
}
REFUSAL = "holds objects other than tensors and plain data (posix.mkdir): loading it could run code"


class Payload:
    """Unpickled, it makes the folder `marker` (what a real attack would do with a shell command instead)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


@pytest.fixture(scope="module")
def base_root(corpus, tmp_path_factory) -> Path:
    """A run root whose run has checkpoints at steps 2 and 4 (ZeRO-1, 2 ranks), trained once for the module."""
    root = tmp_path_factory.mktemp("base")
    proc = run_training(tiny_overrides(corpus, root, *BASE), launcher="fork")
    assert proc.returncode == 0, proc.stdout[-6000:]
    return root


def rerecord(tag_dir: Path, name: str) -> None:
    """Recompute a file's checksum in ayumi.json, as someone who can write the folder can."""
    meta = json.loads((tag_dir / META).read_text())
    meta[integrity.RECORD_KEY]["files"][name] = integrity.hash_file(tag_dir / name).to_json()
    (tag_dir / META).write_text(json.dumps(meta))


def plant(tag_dir: Path, name: str, marker: Path) -> Path:
    """Add the payload to a checkpoint file (beside what it held) and recompute its checksum; the file's path."""
    path = tag_dir / name
    state = load(path, DEEPSPEED_GLOBALS)
    state["planted"] = Payload(marker)
    torch.save(state, path)
    rerecord(tag_dir, name)
    assert integrity.verify(tag_dir).status == integrity.VERIFIED  # the checksums are no defence
    return path


@pytest.fixture
def planted(base_root, tmp_path):
    """plant(kind) -> (run root copy, planted file, marker) for a payload in that kind of file of the newest
    checkpoint."""
    def make(kind: str):
        root = Path(shutil.copytree(base_root, tmp_path / "runs"))
        marker = tmp_path / "marker"
        path = plant(root / "cpu_tiny" / "checkpoints" / TAG, KINDS[kind], marker)
        return root, path, marker
    return make


def one_line(stderr: str, prefix: str) -> str:
    [line] = [line for line in stderr.splitlines() if line.startswith(prefix)]
    return line


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_verify_export_and_eval_refuse_every_kind_of_file_without_running_it(planted, kind, tmp_path, capsys):
    root, path, marker = planted(kind)
    run = root / "cpu_tiny"
    assert main(["checkpoint", "verify", str(run)]) == 2
    captured = capsys.readouterr()
    assert f"checkpoints/{TAG}  " in captured.out and "unsafe: " in captured.out
    assert one_line(captured.err, "ayumi checkpoint verify: ").startswith(f"ayumi checkpoint verify: {path} {REFUSAL}")
    assert main(["export", "hf", str(run), str(tmp_path / "hf")]) == 2
    assert one_line(capsys.readouterr().err, "ayumi export hf: ").startswith(f"ayumi export hf: {path} {REFUSAL}")
    assert not (tmp_path / "hf").exists()
    tasks = tmp_path / "tasks.jsonl"  # never read: the checkpoint is refused first
    tasks.write_text(json.dumps({"context": "a", "choices": ["b", "c"], "gold": 0}) + "\n")
    assert main(["eval", str(run / "checkpoints" / TAG), f"tasks={tasks}", "--out", str(tmp_path / "out.json")]) == 2
    assert one_line(capsys.readouterr().err, "ayumi eval: ").startswith(f"ayumi eval: {path} {REFUSAL}")
    # A curve stops too (not a hole marked "damaged"), and writes nothing.
    assert main(["eval", str(run), "--all", f"tasks={tasks}", "--out", str(tmp_path / "curve.json")]) == 2
    assert one_line(capsys.readouterr().err, "ayumi eval: ").startswith(f"ayumi eval: {path} {REFUSAL}")
    assert not (tmp_path / "out.json").exists() and not (tmp_path / "curve.json").exists()
    assert not marker.exists()


@pytest.mark.parametrize("kind, how", [("optimizer states", "resume"), ("rng file", "resume"),
                                       ("model states", "load_from"), ("shared state", "load_from")])
def test_ayumi_train_refuses_a_planted_file_on_every_rank_before_reading_it(planted, corpus, tmp_path, kind, how):
    root, path, marker = planted(kind)
    ckpts = root / "cpu_tiny" / "checkpoints"
    if how == "resume":
        overrides = tiny_overrides(corpus, root, *BASE, "train.max_steps=6")
    else:  # another run starts from the planted checkpoint
        overrides = tiny_overrides(corpus, tmp_path / "other", *BASE, f"checkpoint.load_from={ckpts / TAG}")
    proc = ayumi("train", *overrides)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    [line] = ranks_said(proc.stderr)
    assert line.startswith(f"{path} {REFUSAL}; nothing of the checkpoint was loaded. Fix: do not load it"), line
    assert proc.stderr.rstrip("\n").splitlines()[-1] == f"ayumi train: {line}"
    assert not marker.exists()
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == ["step_0000002", TAG]  # none set aside


def own_names(tag_dir: Path) -> set[str]:
    """The parameter names of the model the folder's ayumi.json records."""
    from pretrain.checkpoint.layout import META
    from pretrain.tools.verify import model_names

    return model_names(json.loads((tag_dir / META).read_text()))


def test_deepspeeds_own_readers_go_through_ayumis_gate(base_root, tmp_path):
    """Were a file to reach DeepSpeed's readers unchecked (they call torch.load with weights_only=False), its fp32
    consolidation and its universal conversion refuse the payload all the same, naming the file, as they read it."""
    from pretrain.engine.checkpoint_formats import ConversionRefused, _fp32_weights, convert_to_universal
    from common.safe_load import UnsafeFile

    tag_dir = Path(shutil.copytree(base_root / "cpu_tiny" / "checkpoints" / TAG, tmp_path / TAG))
    marker = tmp_path / "marker"
    name = KINDS["optimizer states"]
    plant(tag_dir, name, marker)
    with pytest.raises(UnsafeFile, match=f"^{tag_dir / name} holds objects other than tensors and plain data "
                                         r"\(posix.mkdir\)"):
        _fp32_weights(tag_dir)
    with pytest.raises(ConversionRefused, match=f"^{tag_dir / name} holds objects other than tensors and plain data "
                                                r"\(posix.mkdir\)"):
        convert_to_universal(tag_dir, tmp_path / "universal", own_names(tag_dir))
    assert not marker.exists() and not (tmp_path / "universal").exists()


def test_the_converter_checks_each_files_names_as_it_reads_it(base_root, tmp_path):
    """A file put in place after the resume's own check of the names (here: no check at all) is refused by the
    converter's process as it reads the file, before DeepSpeed makes a path of the name: nothing appears outside."""
    from pretrain.engine.checkpoint_formats import ConversionRefused, convert_to_universal

    tag_dir = Path(shutil.copytree(base_root / "cpu_tiny" / "checkpoints" / TAG, tmp_path / TAG))
    sentinel = tmp_path / "sentinel"
    sentinel.mkdir()
    name = KINDS["optimizer states"]
    state = load(tag_dir / name, DEEPSPEED_GLOBALS)
    mappings = state["optimizer_state_dict"]["param_slice_mappings"][0]
    mappings[str(sentinel / "abs")] = next(iter(mappings.values()))
    torch.save(state, tag_dir / name)
    with pytest.raises(ConversionRefused, match=f"^{tag_dir / name} names a parameter this model does not have "
                                                f"\\('{sentinel / 'abs'}'\\): DeepSpeed's conversion stopped"):
        convert_to_universal(tag_dir, tmp_path / "universal", own_names(tag_dir))
    assert not any(sentinel.iterdir()) and not (tmp_path / "universal").exists()
    assert not (tmp_path / "universal.partial").exists()


def as_older_ayumi(tag_dir: Path, extra=None) -> None:
    """Rewrite a checkpoint's RNG files as an older ayumi saved them (NumPy's state as an array) and record them."""
    for path in sorted(tag_dir.glob("ayumi_rank*.pt")):
        state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if extra is not None:
            state["planted"] = extra
        torch.save(state, path)
        rerecord(tag_dir, path.name)


def test_an_older_ayumis_checkpoints_are_refused_then_converted_once_with_trust_and_resume(base_root, corpus, tmp_path,
                                                                                            capsys):
    root = Path(shutil.copytree(base_root, tmp_path / "runs"))
    run = root / "cpu_tiny"
    for tag in ("step_0000002", TAG):
        as_older_ayumi(run / "checkpoints" / tag)
    assert main(["checkpoint", "verify", str(run)]) == 2
    lines = capsys.readouterr().err.splitlines()  # one per checkpoint
    assert len(lines) == 2 and all(line.startswith("ayumi checkpoint verify: ") for line in lines)
    line = lines[-1]
    assert f"{run / 'checkpoints' / TAG / 'ayumi_rank00000.pt'} holds objects other than tensors and plain data " \
           "(numpy._core.multiarray._reconstruct, numpy.dtype, numpy.ndarray)" in line
    assert line.endswith(f"`ayumi checkpoint convert {run / 'checkpoints'} --trust` rewrites the RNG files of the "
                         "checkpoints there once")
    assert main(["checkpoint", "convert", str(run)]) == 2  # without --trust: a list, nothing changed
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 4 and "nothing was changed" in err
    assert main(["checkpoint", "verify", str(run)]) == 2
    capsys.readouterr()
    assert main(["checkpoint", "convert", str(run), "--trust"]) == 0
    assert capsys.readouterr().out.startswith("converted 4 RNG file(s) in 2 checkpoint(s)")
    assert main(["checkpoint", "verify", str(run)]) == 0  # new checksums recorded, only tensors and plain data
    proc = run_training(tiny_overrides(corpus, root, *BASE, "train.max_steps=6"), launcher="fork")
    assert proc.returncode == 0 and f"resumed from {run / 'checkpoints' / TAG} at step 4" in proc.stdout, \
        proc.stdout[-4000:]


def test_the_conversion_never_reads_a_payload_even_when_trusted(base_root, tmp_path, capsys):
    tag_dir = Path(shutil.copytree(base_root / "cpu_tiny" / "checkpoints" / TAG, tmp_path / TAG))
    marker = tmp_path / "marker"
    as_older_ayumi(tag_dir, extra=Payload(marker))
    before = {path.name: path.read_bytes() for path in tag_dir.iterdir()}
    assert main(["checkpoint", "convert", str(tag_dir), "--trust"]) == 2
    line = one_line(capsys.readouterr().err, "ayumi checkpoint convert: ")
    assert line.startswith(f"ayumi checkpoint convert: {tag_dir / 'ayumi_rank00000.pt'} holds objects other than "
                           "tensors and plain data (numpy._core.multiarray._reconstruct, numpy.dtype, numpy.ndarray, "
                           "posix.mkdir)") and line.endswith("no conversion reads it, and nothing was converted")
    assert {path.name: path.read_bytes() for path in tag_dir.iterdir()} == before and not marker.exists()
    # A converted file planted afterwards is refused like any other.
    shutil.rmtree(tag_dir)
    shutil.copytree(base_root / "cpu_tiny" / "checkpoints" / TAG, tag_dir)
    as_older_ayumi(tag_dir)
    assert main(["checkpoint", "convert", str(tag_dir), "--trust"]) == 0
    path = plant(tag_dir, "ayumi_rank00000.pt", marker)
    assert main(["checkpoint", "verify", str(tag_dir)]) == 2
    assert one_line(capsys.readouterr().err, "ayumi checkpoint verify: ").startswith(
        f"ayumi checkpoint verify: {path} {REFUSAL}")
    assert not marker.exists()


def counter_beside(tag_dir: Path, name: str) -> dict:
    """The file's state with a Counter added: a type torch's own weights-only defaults admit, ayumi's list does not."""
    import collections

    state = load(tag_dir / name, DEEPSPEED_GLOBALS)
    state["planted"] = collections.Counter("ab")
    return state


def plant_legacy_before_zip(tag_dir: Path, name: str) -> None:
    legacy_before_zip(tag_dir / name, counter_beside(tag_dir, name))


def plant_pickle_in_capitals(tag_dir: Path, name: str) -> None:
    pickle_in_capitals(tag_dir / name, counter_beside(tag_dir, name))


def plant_build_on_the_enum(tag_dir: Path, name: str) -> None:
    state = load(tag_dir / name, DEEPSPEED_GLOBALS)
    state["optimizer_state_dict"]["zero_stage"] = OnTheEnum()
    torch.save(state, tag_dir / name)


BYPASSES = {  # issue 49, findings 3a, 3b and 4: how the file is built -> what its line says of it
    "legacy stream before a zip": (plant_legacy_before_zip,
                                   "is not a torch file ayumi can check (not a zip archive (torch would unpickle it as "
                                   "a legacy stream)): torch would read a pickle that was never checked"),
    "DATA.PKL beside data.pkl": (plant_pickle_in_capitals, "holds objects other than tensors and plain data "
                                                           "(collections.Counter): loading it could run code"),
    "BUILD onto ZeroStageEnum": (plant_build_on_the_enum,
                                 "uses allowed objects otherwise than checkpoint files do (pickle BUILD on "
                                 "deepspeed.runtime.zero.config.ZeroStageEnum): loading it could change objects the "
                                 "whole process shares"),
}


@pytest.mark.parametrize("bypass", sorted(BYPASSES))
def test_a_file_built_to_show_the_static_check_another_pickle_or_to_build_on_a_shared_enum_is_refused(
        base_root, corpus, tmp_path, capsys, bypass):
    """What the static check reads is what torch reads (torch's own zip reader), and a BUILD onto DeepSpeed's enum
    member is refused: `ayumi checkpoint verify` says unsafe, a resume stops with status 2 and one line naming the
    file and the reason, and a load of the file (in a child process) leaves the enum member as it was."""
    build, description = BYPASSES[bypass]
    root = Path(shutil.copytree(base_root, tmp_path / "runs"))
    run = root / "cpu_tiny"
    tag_dir = run / "checkpoints" / TAG
    name = KINDS["optimizer states"]
    build(tag_dir, name)
    rerecord(tag_dir, name)
    assert integrity.verify(tag_dir).status == integrity.VERIFIED  # the checksums are no defence
    path = tag_dir / name
    said = f"{path} {description}"
    assert main(["checkpoint", "verify", str(run)]) == 2
    captured = capsys.readouterr()
    assert f"checkpoints/{TAG}  " in captured.out and "unsafe: " in captured.out, captured.out
    assert one_line(captured.err, "ayumi checkpoint verify: ").startswith(f"ayumi checkpoint verify: {said}")
    proc = ayumi("train", *tiny_overrides(corpus, root, *BASE, "train.max_steps=6"))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    [line] = ranks_said(proc.stderr)
    assert line.startswith(f"{said}; nothing of the checkpoint was loaded. Fix: do not load it"), line
    assert proc.stderr.rstrip("\n").splitlines()[-1] == f"ayumi train: {line}"
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")) == [
        "step_0000002", TAG]
    if bypass == "BUILD onto ZeroStageEnum":  # what a load of the file does to the process
        child = ("from common.safe_load import DEEPSPEED_GLOBALS, UnsafeFile, load\n"
                 "from deepspeed.runtime.zero.config import ZeroStageEnum\n"
                 f"try:\n    load({str(path)!r}, DEEPSPEED_GLOBALS)\nexcept UnsafeFile:\n    print('REFUSED')\n"
                 "print('MEMBER', ZeroStageEnum.optimizer_states.value, ZeroStageEnum.optimizer_states.name)\n")
        proc = subprocess.run([sys.executable, "-c", child], cwd=REPO, env=cpu_env(), capture_output=True, text=True,
                              timeout=120)
        assert proc.stdout.splitlines() == ["REFUSED", "MEMBER 1 optimizer_states"], proc.stdout + proc.stderr
