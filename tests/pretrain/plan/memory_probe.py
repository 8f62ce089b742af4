"""Run as a script: measure what a training forward keeps for backward on the CPU, for test_memory.py.

glibc's own accounting (mallinfo2: heap bytes in use + mmap-ed bytes) before and after one forward of
an already-warm model in train mode; the difference is exactly the activations autograd keeps (the
gradients exist already from the warm-up steps). Prints one JSON line per case.
"""
import ctypes
import gc
import json
import sys

import torch

from pretrain.engine.host_memory import keep_freed_memory_for_reuse
from pretrain.model.config import ModelConfig
from pretrain.model.llama import Llama


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2


def bytes_in_use() -> int:
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def kept_by_forward(case: dict) -> int:
    torch.manual_seed(0)
    model = Llama(ModelConfig(**case["model"]))
    model.to({"fp32": torch.float32, "bf16": torch.bfloat16}[case["precision"]]).train()
    model.set_activation_checkpointing(case["policy"])
    model.compile_for(case.get("compile", "off"), "cpu")
    ids = torch.randint(0, model.cfg.vocab_size, (case["micro_batch"], case["seq_len"]))
    if case.get("compile", "off") == "off":
        # Gradients allocated by a step on a short slice (they do not depend on the length), then the forward's
        # kernels set up at the measured shape without a graph: a sixth of two full steps' work, which matters
        # where bf16 is emulated (about 100x slower). Compiled blocks would compile for the short shape, then
        # again for the measured one, differently: they warm up at the measured shape.
        short = ids[:1, : max(8, case["seq_len"] // 8)]
        model(short, short).loss.backward()
        with torch.no_grad():
            model(ids, ids)
    else:
        for _ in range(2):  # gradients allocated, graphs compiled, lazy kernels initialised
            model(ids, ids).loss.backward()
    gc.collect()
    before = bytes_in_use()
    out = model(ids, ids)
    gc.collect()
    kept = bytes_in_use() - before
    del out
    return kept


if __name__ == "__main__":
    keep_freed_memory_for_reuse()
    torch.set_num_threads(1)
    for case in json.loads(sys.argv[1]):
        print(json.dumps({"kept": kept_by_forward(case)}), flush=True)
