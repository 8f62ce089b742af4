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
    with pytest.raises(UnsafeFile, match=f"^{path} holds objects other than tensors and plain data"):
        load(path)
    assert not marker.exists()


def test_torchs_unpickler_refuses_what_the_static_check_might_miss(tmp_path):
    """The second gate alone (the static check passed over by calling torch the way DeepSpeed's readers are run)."""
    path, marker = tmp_path / "x.pt", tmp_path / "marker"
    torch.save({"planted": Payload(marker)}, path)
    with forced_weights_only(DEEPSPEED_GLOBALS), pytest.raises(Exception, match="posix.mkdir"):
        torch.load(path, weights_only=False)  # what DeepSpeed's readers pass
    assert not marker.exists()
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ  # switched back on the way out


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
