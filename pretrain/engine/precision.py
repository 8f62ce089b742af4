"""Which floating-point format a run trains in: `deepspeed.precision=auto` resolved for the hardware.

- **GPU**: bf16 where the GPU computes it natively (Ampere and newer), else fp16 with DeepSpeed's
  dynamic loss scaler (V100/T4-class GPUs).
- **CPU**: bf16 only where torch has a fast bf16 matmul on this CPU, else fp32. A CPU without
  native bf16 (AVX2-only machines such as AMD Zen 2/3, most laptops) runs a bf16 matmul ~50-100x
  slower than fp32, which turns a minutes-long run into an hour.

The CPU answer follows what torch itself will run, not `/proc/cpuinfo`: oneDNN's bf16 support
(`torch.ops.mkldnn._is_mkldnn_bf16_supported()`, which honours `ONEDNN_MAX_CPU_ISA`), confirmed by
a one-off micro-benchmark (one bf16 and one fp32 matmul, a few ms) so that a CPU where oneDNN only
emulates bf16 slower than fp32 also trains in fp32. The measurement is cached per CPU, torch
version and ISA environment (`~/.cache/ayumi/cpu_precision.json`), so runs on one machine decide
alike. Ranks agree on one answer before DeepSpeed starts (pretrain/train.py), and a resumed run
keeps the precision its checkpoint was trained in.

Simulate an AVX2-only CPU on an AMX/AVX512 host: `ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pretrain.config import PRECISIONS

ISA_ENV_VARS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
"""Environment variables that change which CPU kernels torch runs (part of the cache key)."""

BF16_WORTH_IT = 1.0
"""On CPU, bf16 is chosen only when a bf16 matmul takes at most this many times the fp32 one."""

CACHE_FILE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ayumi" / "cpu_precision.json"


@dataclass(frozen=True)
class CpuBf16:
    """What this CPU does with bf16 matmuls, as torch runs them."""

    onednn_bf16: bool
    """oneDNN reports a bf16 ISA (AVX512-BF16, AMX, AVX512-core emulation, AVX2-VNNI-2, Arm BF16)."""
    capability: str
    """torch.backends.cpu.get_cpu_capability(): the vector ISA of torch's own kernels (AVX2, AVX512, ...)."""
    slowdown: float
    """Measured bf16 matmul time / fp32 matmul time (below 1: bf16 is faster)."""

    @property
    def native(self) -> bool:
        """bf16 is worth training in on this CPU."""
        return self.onednn_bf16 and self.slowdown <= BF16_WORTH_IT

    def describe(self) -> str:
        speed = (f"{1 / self.slowdown:.1f}x as fast as fp32" if self.slowdown <= 1
                 else f"{self.slowdown:.0f}x slower than fp32" if self.slowdown >= 10
                 else f"{self.slowdown:.1f}x slower than fp32")
        return f"CPU capability {self.capability}, oneDNN bf16 {'yes' if self.onednn_bf16 else 'no'}, bf16 matmul measured {speed}"


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision a run trains in and why."""

    precision: str
    """bf16 | fp16 | fp32: what DeepSpeed is configured with."""
    requested: str
    """deepspeed.precision as configured (auto | bf16 | fp16 | fp32)."""
    reason: str
    """One line: why this precision (printed at start and by `ayumi doctor`)."""
    warning: str | None = None
    """Set when an explicit choice will be slow on this hardware (printed once)."""

    def describe(self) -> str:
        return f"precision: {self.precision} (deepspeed.precision={self.requested}: {self.reason})"


def onednn_bf16_supported() -> bool:
    """Whether torch's oneDNN has a bf16 path on this CPU (honours ONEDNN_MAX_CPU_ISA)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # an older or unusual torch build: assume the slow path
        return False


def _best_matmul_seconds(dtype: torch.dtype, budget_s: float) -> float:
    """Fastest of a few (128 x 512) @ (512 x 512) matmuls in `dtype` within about `budget_s`."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(128, 512, generator=gen).to(dtype)
    b = torch.randn(512, 512, generator=gen).to(dtype)
    a @ b  # warm-up: oneDNN builds its kernel on first use
    best, spent = float("inf"), 0.0
    for _ in range(20):
        start = time.perf_counter()
        a @ b
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
        if spent > budget_s:
            break
    return best


def measure_bf16_slowdown() -> float:
    """bf16 / fp32 time of the same matmul on this CPU (about 10 ms where bf16 is fast, ~0.2 s where not)."""
    fp32 = _best_matmul_seconds(torch.float32, budget_s=0.01)
    bf16 = _best_matmul_seconds(torch.bfloat16, budget_s=0.01)
    return bf16 / max(fp32, 1e-9)


def _cpu_key() -> str:
    """This CPU model and flags, torch's version and the ISA environment: what the measurement depends on."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features")):
                cpu += line
    except OSError:
        pass
    env = ",".join(f"{name}={os.environ.get(name, '')}" for name in ISA_ENV_VARS)
    return hashlib.sha256(f"{cpu}|{torch.__version__}|{env}".encode()).hexdigest()[:16]


def _read_cache() -> dict:
    try:
        entries = json.loads(CACHE_FILE.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def _store_slowdown(entries: dict, key: str, slowdown: float) -> None:
    """Best effort: a read-only home only costs a re-measurement next time."""
    from common.files import write_text_atomic

    entries[key] = {"slowdown": slowdown, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "torch": torch.__version__, **{name: os.environ.get(name, "") for name in ISA_ENV_VARS}}
    try:
        CACHE_FILE.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(CACHE_FILE, json.dumps(entries, indent=2) + "\n")
    except OSError:
        pass


@functools.cache
def cpu_bf16() -> CpuBf16:
    """This CPU's bf16 facts: measured once per machine and ISA environment, then read from the cache."""
    key, entries = _cpu_key(), _read_cache()
    try:
        slowdown = float(entries[key]["slowdown"])
    except (KeyError, TypeError, ValueError):
        slowdown = measure_bf16_slowdown()
        _store_slowdown(entries, key, slowdown)
    return CpuBf16(onednn_bf16_supported(), torch.backends.cpu.get_cpu_capability(), slowdown)


def _gpu_has_bf16() -> bool:
    # Emulated bf16 (pre-Ampere) is slow and brings no memory win over fp16: only native counts.
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch < 2.3 has no argument and reports native support only
        return torch.cuda.is_bf16_supported()


def _gpu_name() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"{torch.cuda.get_device_name()} (compute capability {major}.{minor})"


def resolve_precision(requested: str, device: torch.device) -> PrecisionChoice:
    """The precision to train in on `device` for `deepspeed.precision=requested`."""
    if requested not in PRECISIONS:
        raise ValueError(f"deepspeed.precision must be one of {', '.join(PRECISIONS)}, got {requested!r}")
    if device.type == "cuda":
        return _resolve_on_gpu(requested)
    return _resolve_on_cpu(requested)


def _resolve_on_gpu(requested: str) -> PrecisionChoice:
    native = _gpu_has_bf16()
    if requested == "auto":
        if native:
            return PrecisionChoice("bf16", requested, f"{_gpu_name()} computes bf16 natively")
        return PrecisionChoice("fp16", requested, f"{_gpu_name()} has no native bf16: fp16 with dynamic loss scaling")
    warning = None
    if requested == "bf16" and not native:
        warning = (f"deepspeed.precision=bf16 on {_gpu_name()}, which has no native bf16: it is emulated and slow; "
                   "use deepspeed.precision=auto (fp16 with loss scaling here) or fp32")
    return PrecisionChoice(requested, requested, "as configured", warning)


def _resolve_on_cpu(requested: str) -> PrecisionChoice:
    if requested == "auto":
        facts = cpu_bf16()
        if facts.native:
            return PrecisionChoice("bf16", requested, f"this CPU computes bf16 natively: {facts.describe()}")
        return PrecisionChoice("fp32", requested, f"this CPU has no fast bf16: {facts.describe()}")
    warning = None
    if requested == "bf16":
        facts = cpu_bf16()
        if not facts.native:
            warning = (f"deepspeed.precision=bf16 on a CPU without native bf16 ({facts.describe()}): training will be "
                       f"about {max(1.0, facts.slowdown):.0f}x slower in its matmuls; use deepspeed.precision=auto "
                       "(fp32 here) unless bf16 itself is what you are testing")
    return PrecisionChoice(requested, requested, "as configured", warning)


CAPABILITY_ORDER = {"fp32": 0, "fp16": 1, "bf16": 2}
"""Order for agreeing across ranks: the least capable rank's choice wins."""


def agreed(choice: PrecisionChoice, lowest: int) -> PrecisionChoice:
    """`choice` after all ranks' choices were combined into the lowest CAPABILITY_ORDER value `lowest`."""
    precision = next(name for name, value in CAPABILITY_ORDER.items() if value == lowest)
    if precision == choice.precision:
        return choice
    return PrecisionChoice(precision, choice.requested, f"another rank's hardware chose {precision} ({choice.reason} here)")


def kept_from_checkpoint(choice: PrecisionChoice, saved: str | None) -> PrecisionChoice:
    """A resumed `auto` run keeps the precision it was trained in (exact resume; DeepSpeed's optimizer
    state is laid out per precision). An explicit setting is the user's to change."""
    if choice.requested != "auto" or not saved or saved == choice.precision or saved not in CAPABILITY_ORDER:
        return choice
    warning = None
    if saved == "bf16" and choice.precision == "fp32":
        warning = (f"resuming a bf16 run on hardware that would pick fp32 ({choice.reason}); it stays bf16 and will "
                   "be slow here. Set deepspeed.precision explicitly only if you accept a different precision.")
    return PrecisionChoice(saved, choice.requested, f"kept from the checkpoint being resumed (auto would pick "
                                                    f"{choice.precision} here)", warning)
