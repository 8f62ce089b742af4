"""Inductor's on-disk cache, one folder per CPU instruction-set setting.

Why: torch's inductor keeps compiled graphs across processes under TORCHINDUCTOR_CACHE_DIR (by default a
`torchinductor_<user>` folder in the temp folder), and their cache key does not cover the vector instruction
set the C++ kernels were generated for, which inductor picks from the CPU and ATEN_CPU_CAPABILITY (seen with
torch 2.13). A graph compiled under one setting is then served to a run under another, and its C++ source,
written for the first instruction set, is built with the second one's flags: AVX-512 kernels reused as AVX2
gave NaN in compiled blocks and the reverse a segfault; on an AVX2 CPU, AVX2 kernels reused without vector
instructions fail to build, and scalar kernels reused as AVX2 are silently kept.

What: before anything compiles, `use_isa_keyed_cache` points TORCHINDUCTOR_CACHE_DIR at a subfolder named by
that setting (inductor's pick, ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA or DNNL_MAX_CPU_ISA, the torch version),
so a kernel is only ever reused under the setting it was built for. The subfolder is of torch's default folder,
or of the TORCHINDUCTOR_CACHE_DIR the user set: a folder of one's own is as easily shared by two settings (a run
limited to AVX2 after a native one gave NaN there, as in the default folder before).
"""
from __future__ import annotations

import hashlib
import json
import os

import torch

CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
PREFIX = "ayumi-isa-"


def isa_folder_name() -> str:
    """`ayumi-isa-<inductor's vector ISA>-<hash of everything that decides it>`, e.g. ayumi-isa-avx2-1a2b3c4d5e."""
    from torch._inductor.cpu_vec_isa import invalid_vec_isa, pick_vec_isa

    isa = pick_vec_isa()
    name = "scalar" if isa is invalid_vec_isa else str(isa).replace(" ", "_")
    setting = {"torch": torch.__version__, "inductor_isa": str(isa),
               "aten_capability": torch.backends.cpu.get_cpu_capability(),
               **{variable: os.environ.get(variable, "") for variable in ISA_VARIABLES}}
    digest = hashlib.sha256(json.dumps(setting, sort_keys=True).encode()).hexdigest()[:10]
    return f"{PREFIX}{name}-{digest}"


def use_isa_keyed_cache() -> str:
    """Points TORCHINDUCTOR_CACHE_DIR at this process's ISA-keyed subfolder of the cache folder (the user's, else
    torch's default) and returns it: the folder inductor will use."""
    current = os.environ.get(CACHE_VARIABLE)  # read before isa_folder_name: picking the ISA sets it
    try:  # private torch modules: where a torch lacks them, inductor's own folder is used as before
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        default = os.path.abspath(default_cache_dir())
        name = isa_folder_name()
    except ImportError:
        return current or ""
    folder = os.path.join(cache_base(current, default), name)
    os.environ[CACHE_VARIABLE] = folder
    return folder


def cache_base(current: str | None, default: str) -> str:
    """The folder the keyed subfolders go in: the TORCHINDUCTOR_CACHE_DIR set (torch writes its own default back
    once it used it, and a parent passes its keyed subfolder on to its children: the folder above that one), else
    torch's default."""
    if not current:
        return default
    current = os.path.abspath(current)
    return os.path.dirname(current) if os.path.basename(current).startswith(PREFIX) else current
