"""Which floating-point format a run trains in: `deepspeed.precision=auto` resolved for the hardware.

- **GPU**: bf16 where the GPU computes it natively (Ampere and newer), else fp16 with DeepSpeed's
  dynamic loss scaler (V100/T4-class GPUs).
- **CPU**: bf16 where the CPU has bf16 instructions that torch uses, else fp32. A CPU without
  native bf16 (AVX2-only machines such as AMD Zen 2/3, most laptops) runs a bf16 matmul tens to
  hundreds of times slower than fp32, which turns a minutes-long run into an hour.

The CPU answer is decided by the capability, as torch will run it: AVX512-BF16 or AMX on x86 (Arm:
oneDNN's BF16 path), oneDNN's bf16 support (`torch.ops.mkldnn._is_mkldnn_bf16_supported()`), and
neither lowered by the ISA variables (`ONEDNN_MAX_CPU_ISA` below AVX512_CORE_BF16, or
`ATEN_CPU_CAPABILITY` below avx512). A measurement is only a sanity check: bf16 and fp32 matmuls
timed in interleaved pairs on one thread, and bf16 vetoed only when the median of the pairs' ratios
says it is grossly slower (over BF16_VETO_SLOWDOWN), so a busy machine, which slows both halves of a
pair alike, cannot turn a bf16 CPU into an fp32 one. The measurement is cached per CPU, torch version
and ISA environment (`~/.cache/ayumi/cpu_precision.json`, with its date, printed with every decision),
so runs on one machine decide alike; `ayumi doctor --refresh-precision` measures again. Ranks agree on
one answer before DeepSpeed starts (pretrain/train.py), and a resumed run keeps the precision its
checkpoint was trained in.

Simulate an AVX2-only CPU on an AMX/AVX512 host: `ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pretrain.config import PRECISIONS

ISA_ENV_VARS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
"""Environment variables that change which CPU kernels torch runs (part of the cache key)."""

ONEDNN_BELOW_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")
"""ONEDNN_MAX_CPU_ISA values that stop oneDNN short of native bf16 (AVX512_CORE_BF16, AMX and ALL do not);
AVX512_CORE still reports bf16 support, but only as a slow emulation."""

BF16_VETO_SLOWDOWN = 4.0
"""On a CPU with native bf16, the measured bf16/fp32 matmul time (median of the pairs) above which bf16 is
vetoed anyway: only a grossly slow bf16 path, never noise, overrides the capability."""

MEASURE_PAIRS = 7
"""Interleaved (bf16, fp32) matmul pairs in one measurement; their ratios' median is the slowdown."""

MEASUREMENT_METHOD = "interleaved-median/1"
"""Written into each cache entry; an entry measured another way (an older ayumi's single bf16-then-fp32
timing, which a busy machine could skew) is not trusted and is measured again."""

REFRESH_HINT = "`ayumi doctor --refresh-precision` measures again"

CACHE_FILE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ayumi" / "cpu_precision.json"


@dataclass(frozen=True)
class Bf16Capability:
    """Whether torch runs bf16 natively on this CPU, as the ISA variables let it (no measurement)."""

    native: bool
    """bf16 instructions present, used by torch's oneDNN and not lowered by ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY."""
    why: str
    """What decided it, for the printed reason (e.g. "AVX512-BF16, oneDNN bf16, CPU capability AVX512")."""


@dataclass(frozen=True)
class Bf16Measurement:
    """bf16 / fp32 matmul time ratios of interleaved pairs, and when they were measured."""

    ratios: tuple[float, ...]
    """One ratio per (bf16, fp32) pair, in measuring order (below 1: bf16 was faster)."""
    measured_at: str
    """Local time of the measurement, ISO 8601 to the second (printed with every decision taken from it)."""

    @property
    def slowdown(self) -> float:
        """The median ratio: a pair slowed by a burst of load elsewhere does not move it."""
        return statistics.median(self.ratios)

    def describe(self) -> str:
        slowdown = self.slowdown
        speed = (f"{1 / slowdown:.1f}x as fast as fp32" if slowdown <= 1
                 else f"{slowdown:.0f}x slower than fp32" if slowdown >= 10 else f"{slowdown:.1f}x slower than fp32")
        return f"bf16 matmul {speed} (median of {len(self.ratios)} interleaved pairs, measured {self.measured_at})"


@dataclass(frozen=True)
class CpuBf16:
    """This CPU's bf16 facts: what it can do and what a measurement saw."""

    capability: Bf16Capability
    measurement: Bf16Measurement

    @property
    def vetoed(self) -> bool:
        """Native bf16, but the measurement found it grossly slower than fp32 (a broken or emulated path)."""
        return self.capability.native and self.measurement.slowdown > BF16_VETO_SLOWDOWN

    @property
    def native(self) -> bool:
        """bf16 is worth training in on this CPU: the capability decides, the measurement can only veto."""
        return self.capability.native and not self.vetoed

    def describe(self) -> str:
        return f"{self.capability.why}; {self.measurement.describe()}"


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
    """Set when the choice deserves a second look: an explicit one that will be slow here, or a bf16 CPU vetoed by its
    measurement (printed once)."""

    def describe(self) -> str:
        return f"precision: {self.precision} (deepspeed.precision={self.requested}: {self.reason})"


def onednn_bf16_supported() -> bool:
    """Whether torch's oneDNN has a bf16 path on this CPU (honours ONEDNN_MAX_CPU_ISA, down to AVX512_CORE emulation)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # an older or unusual torch build: assume the slow path
        return False


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def bf16_instructions() -> str | None:
    """The bf16 instructions this CPU has, whatever the ISA variables say ("AMX", "AVX512-BF16", "Arm BF16"), or None."""
    if _x86():
        for name, probe in (("AMX", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported")):
            if getattr(torch.cpu, probe, lambda: False)():
                return name
        return None
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "Arm BF16" if onednn_bf16_supported() else None  # oneDNN's Arm check is the hardware's
    return None


def isa_lowered(aten_capability: str) -> str | None:
    """The ISA variable that keeps torch below native bf16 on an x86 CPU that has it, e.g. "ONEDNN_MAX_CPU_ISA=AVX2"."""
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        value = os.environ.get(name, "")
        if value.upper() in ONEDNN_BELOW_BF16:
            return f"{name}={value}"
    aten_env = os.environ.get("ATEN_CPU_CAPABILITY", "")
    if aten_env and "AVX512" not in aten_capability.upper():  # torch's own kernels (norms, softmax, Adam) held to AVX2
        return f"ATEN_CPU_CAPABILITY={aten_env}"
    return None


def bf16_capability() -> Bf16Capability:
    """Native bf16 as torch will run it here: instructions present, not lowered, oneDNN's bf16 path on."""
    aten = torch.backends.cpu.get_cpu_capability()
    instructions = bf16_instructions()
    if instructions is None:
        missing = "AVX512-BF16 or AMX" if _x86() else "BF16"
        return Bf16Capability(False, f"no {missing} instructions, CPU capability {aten}")
    lowered = isa_lowered(aten) if _x86() else None
    if lowered:
        return Bf16Capability(False, f"{instructions} present but {lowered} keeps torch below it, CPU capability {aten}")
    if not onednn_bf16_supported():
        return Bf16Capability(False, f"{instructions} present but torch's oneDNN has no bf16 path, CPU capability {aten}")
    return Bf16Capability(True, f"{instructions}, oneDNN bf16, CPU capability {aten}")


def _matmul_seconds(a: torch.Tensor, b: torch.Tensor) -> float:
    start = time.perf_counter()
    a @ b
    return time.perf_counter() - start


def measure_bf16_ratios(pairs: int = MEASURE_PAIRS) -> tuple[float, ...]:
    """bf16 / fp32 time of a (128 x 256) @ (256 x 256) matmul, `pairs` times: each bf16 run followed at once by its
    fp32 run, so load elsewhere on the machine falls on both halves of a pair alike. On one thread, as the ranks
    run on the CPU (OMP_NUM_THREADS=1), so `ayumi doctor` measures what training will see. About 10 ms where
    bf16 is native, ~0.3 s where it is not."""
    gen = torch.Generator().manual_seed(0)
    a32, b32 = torch.randn(128, 256, generator=gen), torch.randn(256, 256, generator=gen)
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a16 @ b16, a32 @ b32  # warm-up: oneDNN builds its kernels on first use
        return tuple(_matmul_seconds(a16, b16) / max(_matmul_seconds(a32, b32), 1e-9) for _ in range(pairs))
    finally:
        torch.set_num_threads(threads)


def cache_key() -> str:
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


def _cached_measurement(entry) -> Bf16Measurement | None:
    """The entry's measurement if it was taken the current way; None (measure again) for anything else."""
    try:
        if entry["method"] != MEASUREMENT_METHOD:
            return None
        ratios = tuple(float(r) for r in entry["ratios"])
        measured = Bf16Measurement(ratios, str(entry["measured_at"]))
        return measured if ratios and all(r > 0 for r in ratios) else None
    except (KeyError, TypeError, ValueError):
        return None


def _store(entries: dict, key: str, facts: CpuBf16) -> None:
    """Best effort: a read-only home only costs a re-measurement next time."""
    from common.files import write_text_atomic

    measured = facts.measurement
    entries[key] = {"method": MEASUREMENT_METHOD, "ratios": [round(r, 4) for r in measured.ratios],
                    "slowdown": round(measured.slowdown, 4), "measured_at": measured.measured_at,
                    # For a person reading the file; the decision is re-derived from the capability on every read.
                    "native_bf16": facts.capability.native, "auto": "bf16" if facts.native else "fp32",
                    "torch": torch.__version__, **{name: os.environ.get(name, "") for name in ISA_ENV_VARS}}
    try:
        write_text_atomic(CACHE_FILE, json.dumps(entries, indent=2) + "\n")
    except OSError:
        pass


_FACTS: dict[str, CpuBf16] = {}
"""This process's answer per cache key: every caller in a process (ranks, the doctor's rows) sees one measurement."""


def cpu_bf16(refresh: bool = False) -> CpuBf16:
    """This CPU's bf16 facts: the capability, asked every time (cheap), and the measurement, taken once per machine
    and ISA environment and then read from the cache; `refresh` measures again and replaces the cached one."""
    key = cache_key()
    if key in _FACTS and not refresh:
        return _FACTS[key]
    with _cache_lock():  # the ranks of a job start together: one measures, the others read its answer
        entries = _read_cache()
        measured = None if refresh else _cached_measurement(entries.get(key))
        fresh = measured is None
        if fresh:
            measured = Bf16Measurement(measure_bf16_ratios(), time.strftime("%Y-%m-%dT%H:%M:%S"))
        facts = CpuBf16(bf16_capability(), measured)
        if fresh:
            _store(entries, key, facts)
    _FACTS[key] = facts
    return facts


@contextlib.contextmanager
def _cache_lock():
    """An exclusive lock beside the cache file while it is read, measured for and written; none where the cache
    folder cannot be written (each process then measures for itself)."""
    try:
        CACHE_FILE.parent.mkdir(parents=True, exist_ok=True)
        handle = open(CACHE_FILE.with_suffix(".lock"), "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _gpu_has_bf16() -> bool:
    # Emulated bf16 (pre-Ampere) is slow and brings no memory win over fp16: only native counts.
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch < 2.3 has no argument and reports native support only
        return torch.cuda.is_bf16_supported()


def _gpu_name() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"{torch.cuda.get_device_name()} (compute capability {major}.{minor})"


def resolve_precision(requested: str, device: torch.device, cpu: CpuBf16 | None = None) -> PrecisionChoice:
    """The precision to train in on `device` for `deepspeed.precision=requested` (`cpu`: this CPU's facts, when the
    caller has them already, as `ayumi doctor --refresh-precision` does; else cpu_bf16())."""
    if requested not in PRECISIONS:
        raise ValueError(f"deepspeed.precision must be one of {', '.join(PRECISIONS)}, got {requested!r}")
    if device.type == "cuda":
        return _resolve_on_gpu(requested)
    return cpu_choice(requested, cpu or (cpu_bf16() if requested in ("auto", "bf16") else None))


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


def cpu_choice(requested: str, facts: CpuBf16 | None) -> PrecisionChoice:
    """The CPU's decision for `requested` from its facts (needed for auto and bf16): the capability decides auto,
    the measurement can only veto a native bf16 that it finds grossly slower."""
    if requested == "auto":
        if facts.native:
            return PrecisionChoice("bf16", requested, f"this CPU computes bf16 natively: {facts.describe()}")
        if facts.vetoed:
            return PrecisionChoice(
                "fp32", requested, f"this CPU has native bf16 but its measurement vetoed it: {facts.describe()}, over "
                                   f"the {BF16_VETO_SLOWDOWN:.0f}x sanity limit",
                f"bf16 on this CPU was vetoed by the measurement of {facts.measurement.measured_at} (bf16 "
                f"{facts.measurement.slowdown:.0f}x slower than fp32); if the machine was busy then, {REFRESH_HINT} on an "
                "idle one; deepspeed.precision=bf16 trains in bf16 regardless")
        return PrecisionChoice("fp32", requested, f"this CPU has no native bf16: {facts.describe()}")
    warning = None
    if requested == "bf16" and not facts.native:
        warning = (f"deepspeed.precision=bf16 on a CPU where auto picks fp32 ({facts.describe()}): training will be "
                   f"about {max(1.0, facts.measurement.slowdown):.0f}x slower in its matmuls; use "
                   "deepspeed.precision=auto (fp32 here) unless bf16 itself is what you are testing")
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
