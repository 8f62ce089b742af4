"""keep_freed_memory_for_reuse: a CPU step's big tensors come from glibc's heap and stay there once
freed, so the next step reuses them instead of mmap-ing (and faulting in) fresh memory."""
from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from tests.helpers import REPO

# glibc's own accounting (mallinfo2): bytes in mmap-ed blocks while a 24 MB tensor (a step's
# logits) is alive, and free bytes kept in the heap after it is freed.
HEAP_ACCOUNTING = r"""
import ctypes, json, sys, torch
from pretrain.engine.host_memory import keep_freed_memory_for_reuse

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
tuned = keep_freed_memory_for_reuse() if sys.argv[1] == "tuned" else False
logits = torch.empty(6_000_000).fill_(1.0)
mmapped_while_alive = libc.mallinfo2().hblkhd
del logits
kept_after_free = libc.mallinfo2().fordblks
print(json.dumps({"tuned": tuned, "mmapped": mmapped_while_alive, "kept": kept_after_free}))
"""


def heap_accounting(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", HEAP_ACCOUNTING, mode], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_a_steps_big_tensors_are_served_from_the_heap_and_kept_for_reuse():
    plain, tuned = heap_accounting("plain"), heap_accounting("tuned")
    assert plain["mmapped"] >= 24_000_000  # glibc's default: a fresh mmap, unmapped again on free
    assert tuned["tuned"] is True
    assert tuned["mmapped"] < 24_000_000  # from the heap instead
    assert tuned["kept"] >= 24_000_000  # and still there for the next step once freed
