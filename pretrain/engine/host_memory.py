"""Host memory allocator settings for training on the CPU.

A CPU training step allocates and frees the same large tensors every step (logits, their
gradients, activations: tens of MB each). glibc serves blocks above its mmap threshold with a
fresh `mmap` and returns them with `munmap`, so every step page-faults those megabytes in again
(~5,000 faults per step for the demo model) and the kernel zeroes each page: measured on the demo
shape, 0.18 s/step became 0.14 s (fp32) and 0.12 s (bf16) once freed memory is kept for reuse.

`keep_freed_memory_for_reuse()` tells glibc (mallopt, effective for every later allocation) to
serve blocks up to 32 MiB from its heap and to keep up to 2 GiB of freed heap instead of trimming
it, with 256 MiB of headroom per heap growth: the same blocks are then reused step after step. A
CPU run's memory is bounded by its peak use anyway; only the return of memory to the OS between
steps is given up. Elsewhere (musl, macOS, Windows) it does nothing. The equivalent environment
variables (`MALLOC_MMAP_THRESHOLD_` etc.) would have to be set before the process starts, which a
user's own `deepspeed`/`torchrun` command line would not do.
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 * 2**20
"""glibc's largest allowed mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)."""
TRIM_THRESHOLD = 2**31 - 1
"""The largest value mallopt's int takes (~2 GiB)."""
TOP_PAD = 256 * 2**20


def keep_freed_memory_for_reuse() -> bool:
    """Configure glibc malloc as described above; False where there is no glibc `mallopt`."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = [mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD), mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            mallopt(M_TOP_PAD, TOP_PAD)]
    return all(result == 1 for result in done)
