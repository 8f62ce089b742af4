"""common/safe_load.py and the files ayumi writes: a payload is refused by the static check and by torch's unpickler
whatever form it takes (another pickle protocol, the legacy format), a rank's RNG file round-trips as tensors and
plain data, and a load nested in another keeps the outer one's allow-list (torch's is one set per process).
Real payloads with a marker folder; the real run's files are in test_checkpoint_payloads_cpu.py."""
from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from common.safe_load import (
    DEEPSPEED_GLOBALS, UnsafeFile, check, forced_weights_only, load, pickle_problems, unsafe_globals,
)
from pretrain.checkpoint.checkpointer import capture_rng, restore_rng
from pretrain.checkpoint.integrity import save_hashed


class Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


@pytest.mark.parametrize("form", ["protocol 2", "protocol 4", "legacy format"])
def test_a_payload_is_refused_in_every_form_and_never_runs(tmp_path, form):
    path, marker = tmp_path / "x.pt", tmp_path / "marker"
    state = {"weights": torch.ones(3), "planted": Payload(marker)}
    if form == "legacy format":
        torch.save(state, path, _use_new_zipfile_serialization=False)
    else:
        torch.save(state, path, pickle_protocol=int(form.split()[1]))
    found = unsafe_globals(path)
    if form == "protocol 2":  # torch.save's own: the global is named
        assert found == ["posix.mkdir"]
    else:  # protocol 4 names it by STACK_GLOBAL (an opcode torch refuses too); the legacy format is no zip at all
        assert found
    said = "is not a torch file ayumi can check" if form == "legacy format" else \
        "holds objects other than tensors and plain data"
    with pytest.raises(UnsafeFile, match=f"^{path} {said}"):
        load(path)
    assert not marker.exists()


def test_torchs_unpickler_refuses_what_the_static_check_might_miss(tmp_path):
    """The second gate alone: torch's own load, not the gated torch.load, asked for what DeepSpeed's readers pass."""
    path, marker = tmp_path / "x.pt", tmp_path / "marker"
    torch.save({"planted": Payload(marker)}, path)
    with forced_weights_only(DEEPSPEED_GLOBALS), pytest.raises(Exception, match="posix.mkdir"):
        torch.serialization.load(path, weights_only=False)
    assert not marker.exists()
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ  # switched back on the way out


def test_a_third_party_torch_load_passes_ayumis_gate_not_torchs_defaults(tmp_path):
    """What DeepSpeed's readers call (torch.load, weights_only=False) is ayumi's check then load: a Counter, which
    torch's own defaults admit, is refused naming the file; torch.load is torch's again on the way out."""
    import collections

    path = tmp_path / "optim.pt"
    torch.save({"weights": torch.ones(2), "planted": collections.Counter(a=1)}, path)
    ungated = torch.load
    with forced_weights_only(DEEPSPEED_GLOBALS):
        with pytest.raises(UnsafeFile, match=f"^{path} holds objects other than tensors and plain data "
                                             r"\(collections.Counter\)"):
            torch.load(str(path), map_location="cpu", weights_only=False)
        with open(path, "rb") as handle, pytest.raises(UnsafeFile, match="collections.Counter"):
            torch.load(handle, weights_only=False)  # an open file: checked and loaded from that same object
    assert torch.load is ungated
    assert type(torch.load(path, weights_only=True)["planted"]) is collections.Counter  # torch's defaults alone


def test_a_file_put_in_place_after_the_check_is_never_loaded(tmp_path):
    """One open file for the check and the load: a writer swapping a plain file and one holding a Counter (admitted
    by torch's defaults, refused by ayumi's list) under the same name, as fast as it can, never gets the Counter
    into the process. Each load gives the plain file or refuses the other."""
    import collections
    import threading

    path = tmp_path / "model.pt"
    plain, planted = tmp_path / "plain.pt", tmp_path / "planted.pt"
    torch.save({"weights": torch.ones(2)}, plain)
    torch.save({"weights": torch.ones(2), "planted": collections.Counter(a=1)}, planted)
    stop = threading.Event()

    def swap():
        sources = [plain.read_bytes(), planted.read_bytes()]
        turn = 0
        while not stop.is_set():
            spare = tmp_path / f"spare{turn % 2}.pt"
            spare.write_bytes(sources[turn % 2])
            os.replace(spare, path)
            turn += 1

    path.write_bytes(plain.read_bytes())
    writer = threading.Thread(target=swap)
    writer.start()
    loaded = refused = 0
    try:
        for _ in range(300):
            try:
                assert set(load(path)) == {"weights"}
                loaded += 1
            except UnsafeFile as err:
                assert "collections.Counter" in str(err)
                refused += 1
    finally:
        stop.set()
        writer.join()
    assert loaded and refused  # the swaps really interleaved with the loads


def test_plain_data_passes_and_the_opcodes_are_checked_not_run():
    assert pickle_problems(b"\x80\x02}q\x00X\x01\x00\x00\x00aq\x01K\x01s.", frozenset()) == []  # {"a": 1}
    assert pickle_problems(b"\x80\x02cos\nsystem\nq\x00.", frozenset()) == ["os.system"]
    assert sorted(pickle_problems(b"(S'ls'\nios\nsystem\n.", frozenset())) == ["pickle opcode INST", "pickle opcode STRING"]


def test_a_ranks_rng_file_is_tensors_and_plain_data_and_restores_every_generator(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # NumPy keeps a cached gaussian: part of its state
    save_hashed(capture_rng(), tmp_path / "rng.pt")
    check(tmp_path / "rng.pt")  # nothing beyond tensors and plain data
    expected = (random.random(), np.random.standard_normal(), np.random.randint(1 << 30), torch.rand(2).tolist())
    restore_rng(load(tmp_path / "rng.pt"))
    assert (random.random(), np.random.standard_normal(), np.random.randint(1 << 30), torch.rand(2).tolist()) == expected


def test_a_nested_load_keeps_the_outer_allow_list(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    torch.save({"loss_scaler": LossScaler(4.0)}, tmp_path / "optim.pt")
    with forced_weights_only(DEEPSPEED_GLOBALS):
        assert load(tmp_path / "optim.pt", DEEPSPEED_GLOBALS)["loss_scaler"].cur_scale == 4.0
        # DeepSpeed's own read right after ours (its universal loader): LossScaler must still be allowed.
        assert torch.load(tmp_path / "optim.pt", weights_only=False)["loss_scaler"].cur_scale == 4.0
    with pytest.raises(UnsafeFile, match="LossScaler"):
        load(tmp_path / "optim.pt")  # not allowed where it was not asked for


# Issue 49, findings 3 and 4: files built as an attacker would, so that Python's zipfile and torch's reader see two
# different pickles, or so that a pickle BUILDs onto DeepSpeed's shared enum member.

def torch_records(path) -> dict[str, bytes]:
    """Every record of a torch zip file (names without the archive folder), read by torch's own reader."""
    if not hasattr(path, "read"):
        path = str(path)
    else:
        path.seek(0)
    reader = torch._C.PyTorchFileReader(path)
    return {name: reader.get_record(name) for name in reader.get_all_records()}


def legacy_before_zip(path, planted) -> None:
    """(a) `planted` as a legacy (non-zip) torch stream, the benign zip that was at `path` after it: zipfile finds the
    zip (it accepts data before one), torch.load unpickles the legacy stream."""
    import io

    stream = io.BytesIO()
    torch.save(planted, stream, _use_new_zipfile_serialization=False)
    path.write_bytes(stream.getvalue() + path.read_bytes())


def pickle_in_capitals(path, planted) -> None:
    """(b) `planted` as the record `archive/DATA.PKL`, the benign pickle that was at `path` beside it as
    `archive/zzz/data.pkl`: zipfile finds only the benign one under its exact name, torch's reader matches names
    whatever their case and reads the planted one."""
    import io
    import zipfile

    benign = torch_records(path)["data.pkl"]
    stream = io.BytesIO()
    torch.save(planted, stream)
    records = torch_records(stream)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/DATA.PKL", records.pop("data.pkl"))
        for name, data in records.items():
            archive.writestr(f"archive/{name}", data)
        archive.writestr("archive/zzz/data.pkl", benign)


class OnTheEnum:
    """Pickled, a BUILD onto DeepSpeed's member ZeroStageEnum.optimizer_states: its value and name rewritten."""

    def __reduce__(self):
        from deepspeed.runtime.zero.config import ZeroStageEnum

        return ZeroStageEnum, (1,), {"_value_": 99, "_name_": "planted"}


def optimizer_like_state() -> dict:
    """What a ZeRO optimizer state file holds beyond tensors: DeepSpeed's loss scaler, stage and partition places."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    dynamic = DynamicLossScaler(init_scale=2.0 ** 16, scale_window=1000, min_scale=1, delayed_shift=2,
                                consecutive_hysteresis=False, raise_error_at_min_scale=True, dtype=torch.float16)
    return {"optimizer_state_dict": {"zero_stage": ZeroStageEnum.optimizer_states, "loss_scaler": LossScaler(4.0),
                                     "dynamic": dynamic, "param_slice_mappings": [{"w": fragment_address(3, 0)}]},
            "w": torch.ones(3)}


@pytest.mark.parametrize("build", [legacy_before_zip, pickle_in_capitals])
def test_the_static_check_reads_the_pickle_torch_reads(tmp_path, build):
    """Findings 3a and 3b: a Counter (which torch's own defaults admit, ayumi's list does not) in the pickle torch
    would read, a benign one where Python's zipfile looks: refused by the static check and by load."""
    import collections

    path = tmp_path / "x.pt"
    torch.save({"w": torch.ones(3)}, path)
    build(path, {"w": torch.ones(3), "planted": collections.Counter("ab")})
    assert "planted" in torch.load(path, weights_only=True)  # torch itself reads the planted pickle
    found = unsafe_globals(path)
    assert found and all("Counter" in item or "zip archive" in item for item in found), found
    said = "is not a torch file ayumi can check" if build is legacy_before_zip else \
        "holds objects other than tensors and plain data"
    with pytest.raises(UnsafeFile, match=f"^{path} {said}"):
        load(path)


def test_a_second_pickle_record_differing_in_case_is_refused(tmp_path):
    import io
    import zipfile

    path = tmp_path / "x.pt"
    torch.save({"w": torch.ones(3)}, path)
    records = torch_records(path)
    stream = io.BytesIO()
    with zipfile.ZipFile(stream, "w") as archive:
        for name, data in records.items():
            archive.writestr(f"archive/{name}", data)
        archive.writestr("archive/Data.pkl", records["data.pkl"])
    path.write_bytes(stream.getvalue())
    assert unsafe_globals(path) == ["not one data.pkl record but 2 (Data.pkl, data.pkl)"]


def test_a_build_onto_deepspeeds_enum_is_refused_by_both_gates_and_the_member_is_unchanged(tmp_path):
    """Finding 4: the static check refuses the BUILD; torch's unpickler alone (as DeepSpeed's readers run it) refuses
    it too, because what it allows is a function giving the member, not the enum class. Checked in a child process,
    so that a BUILD that went through would show there and nowhere else."""
    import subprocess
    import sys

    from tests.helpers import REPO, cpu_env

    path = tmp_path / "optim.pt"
    state = optimizer_like_state()
    state["optimizer_state_dict"]["zero_stage"] = OnTheEnum()
    torch.save(state, path)
    assert unsafe_globals(path, DEEPSPEED_GLOBALS) == ["pickle BUILD on deepspeed.runtime.zero.config.ZeroStageEnum"]
    child = f"""
import torch
from common.safe_load import DEEPSPEED_GLOBALS, UnsafeFile, forced_weights_only, load
from deepspeed.runtime.zero.config import ZeroStageEnum
try:
    load({str(path)!r}, DEEPSPEED_GLOBALS)
except UnsafeFile as err:
    print("REFUSED", err)
try:
    with forced_weights_only(DEEPSPEED_GLOBALS):
        torch.serialization.load({str(path)!r}, weights_only=False)  # torch's gate alone
except Exception as err:
    print("TORCH REFUSED", type(err).__name__)
member = ZeroStageEnum.optimizer_states
print("MEMBER", member.value, member.name, ZeroStageEnum(1) is member)
"""
    proc = subprocess.run([sys.executable, "-c", child], cwd=REPO, env=cpu_env(), capture_output=True, text=True,
                          timeout=120)
    lines = proc.stdout.splitlines()
    assert lines[0] == (f"REFUSED {path} uses allowed objects otherwise than checkpoint files do (pickle BUILD on "
                        "deepspeed.runtime.zero.config.ZeroStageEnum): loading it could change objects the whole "
                        "process shares"), proc.stdout + proc.stderr
    assert lines[1:] == ["TORCH REFUSED UnpicklingError", "MEMBER 1 optimizer_states True"], proc.stdout + proc.stderr


def test_deepspeeds_objects_load_as_deepspeeds_own_rebuilt_from_plain_values(tmp_path):
    """Through the stand-ins: the loss scalers and partition places come back as DeepSpeed's classes (so they save
    as such again), the stage as the very member."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    torch.save(optimizer_like_state(), tmp_path / "optim.pt")
    assert unsafe_globals(tmp_path / "optim.pt", DEEPSPEED_GLOBALS) == []
    loaded = load(tmp_path / "optim.pt", DEEPSPEED_GLOBALS)["optimizer_state_dict"]
    assert loaded["zero_stage"] is ZeroStageEnum.optimizer_states
    assert type(loaded["loss_scaler"]) is LossScaler and loaded["loss_scaler"].cur_scale == 4.0
    assert type(loaded["dynamic"]) is DynamicLossScaler and loaded["dynamic"].dtype is torch.float16
    assert type(loaded["param_slice_mappings"][0]["w"]) is fragment_address
    assert loaded["param_slice_mappings"][0]["w"] == fragment_address(3, 0)
    torch.save(loaded, tmp_path / "again.pt")  # saved again by DeepSpeed's next checkpoint: the same globals
    assert unsafe_globals(tmp_path / "again.pt", DEEPSPEED_GLOBALS) == []


def test_a_deepspeed_object_takes_only_plain_values_under_names_its_class_does_not_define(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    scaler = LossScaler(1.0)
    scaler.update_scale = 3  # pickled in its state: an attribute that would shadow the method
    torch.save({"loss_scaler": scaler}, tmp_path / "optim.pt")
    assert unsafe_globals(tmp_path / "optim.pt", DEEPSPEED_GLOBALS) == []  # statically plain data
    with forced_weights_only(DEEPSPEED_GLOBALS), pytest.raises(UnsafeFile, match="LossScaler given the attribute "
                                                                                 "'update_scale'"):
        torch.load(tmp_path / "optim.pt", weights_only=False)  # DeepSpeed's call: the gate, then torch refuses
