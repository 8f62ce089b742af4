"""deepspeed.precision=auto: on the CPU the capability decides and a measurement can only veto bf16 when it is
grossly slower in most of its interleaved pairs; the measurement is cached per ISA environment with its date, which
every printed decision carries; all ranks agree, and a resumed run keeps its checkpoint's precision.

An AVX2-only CPU is simulated on any x86 host with `ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`
(torch's bf16 matmul then takes its reference path, tens of times slower), so these tests hold on hosts
with and without native bf16: what the host itself should pick is read from /proc/cpuinfo, not from torch.
"""
from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pretrain.engine import precision
from pretrain.config import ConfigError, check_config, compose_config, to_object
from pretrain.engine.precision import (
    Bf16Capability, Bf16Measurement, CpuBf16, PrecisionChoice, agreed, cpu_choice, isa_lowered, kept_from_checkpoint,
)
from tests.helpers import REPO, cpu_env, read_jsonl, run_training, tiny_overrides, write_tiny_corpus

AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
x86_only = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the AVX2 simulation is x86-only")

RESOLVE = r"""
import json, torch
from pretrain.engine.precision import CACHE_FILE, cache_key, resolve_precision
auto = resolve_precision("auto", torch.device("cpu"))
explicit = resolve_precision("bf16", torch.device("cpu"))
print(json.dumps({"auto": [auto.precision, auto.reason, auto.describe()], "bf16": [explicit.precision, explicit.warning],
                  "capability": torch.backends.cpu.get_cpu_capability(), "cache": str(CACHE_FILE), "key": cache_key()}))
"""
KEY = "from pretrain.engine.precision import cache_key; print(cache_key())"

NATIVE = Bf16Capability(True, "AVX512-BF16, oneDNN bf16, CPU capability AVX512")
NOT_NATIVE = Bf16Capability(False, "no AVX512-BF16 or AMX instructions, CPU capability AVX2")
WHEN = "2025-01-02T03:04:05"


def child_env(tmp_path, **env) -> dict:
    """A child's environment: the cache under tmp_path, the host as it is unless `env` simulates another CPU
    (even when the suite itself runs simulated)."""
    child = cpu_env(XDG_CACHE_HOME=str(tmp_path / "cache"), **env)
    for name in set(precision.ISA_ENV_VARS) - set(env):
        child.pop(name, None)
    return child


def resolve_in_child(tmp_path, **env) -> dict:
    """resolve_precision in a fresh process (the ISA variables act at start-up), cache under tmp_path."""
    done = subprocess.run([sys.executable, "-c", RESOLVE], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=child_env(tmp_path, **env))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def host_has_bf16() -> bool:
    """What the CPU itself says, independently of torch: AVX512-BF16 or AMX-BF16 among its flags."""
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))


def write_cache_entry(tmp_path, entry: dict, **env) -> Path:
    """`entry` as the cache's answer for this CPU in the ISA environment `env` (the key computed by a child in it)."""
    key = subprocess.run([sys.executable, "-c", KEY], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=child_env(tmp_path, **env)).stdout.strip()
    path = tmp_path / "cache" / "ayumi" / "cpu_precision.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({key: entry}))
    return path


def facts(capability: Bf16Capability, *ratios: float) -> CpuBf16:
    return CpuBf16(capability, Bf16Measurement(tuple(ratios), WHEN))


@pytest.mark.parametrize("ratios", [
    (0.4, 18.0, 0.45, 0.5, 21.0, 0.4, 0.42),  # bursts of load on some pairs (the reported 18x was one such)
    (1.5, 2.8, 3.9, 1.2, 3.5, 2.2, 1.8),      # bf16 slower than fp32 throughout, but not grossly
    (5.0, 0.5, 6.0, 0.5, 0.6, 0.5, 9.0),      # grossly slower in 3 pairs of 7: not consistent
])
def test_a_native_bf16_cpu_trains_in_bf16_whatever_the_noise(ratios):
    choice = cpu_choice("auto", facts(NATIVE, *ratios))
    assert choice.precision == "bf16" and choice.warning is None
    assert choice.describe().startswith("precision: bf16 (deepspeed.precision=auto: this CPU computes bf16 natively: "
                                        "AVX512-BF16, oneDNN bf16, CPU capability AVX512; bf16 matmul ")
    assert f"(median of 7 interleaved pairs, measured {WHEN}))" in choice.describe()


@pytest.mark.parametrize("ratios", [(17.0, 19.0, 18.0, 22.0, 16.0, 18.0, 20.0), (5.0, 0.5, 6.0, 0.5, 7.0, 0.5, 8.0)])
def test_only_a_gross_slowdown_in_most_pairs_vetoes_bf16(ratios):
    """A veto is printed with its date and how to measure again: it is the one decision a busy machine could
    still get wrong, and it must not stand unnoticed."""
    choice = cpu_choice("auto", facts(NATIVE, *ratios))
    assert choice.precision == "fp32"
    assert "has native bf16 but its measurement vetoed it" in choice.reason and "over the 4x sanity limit" in choice.reason
    assert f"measured {WHEN}" in choice.reason
    assert f"measurement of {WHEN}" in choice.warning and "ayumi doctor --refresh-precision" in choice.warning


def test_without_native_bf16_a_fast_measurement_does_not_pick_bf16():
    choice = cpu_choice("auto", facts(NOT_NATIVE, 0.4, 0.4, 0.5, 0.4, 0.4, 0.4, 0.4))
    assert choice.precision == "fp32" and choice.warning is None
    assert choice.reason.startswith("this CPU has no native bf16: no AVX512-BF16 or AMX instructions")
    explicit = cpu_choice("bf16", facts(NOT_NATIVE, 50.0, 60.0, 55.0))
    assert explicit.precision == "bf16" and "about 55x slower" in explicit.warning


@pytest.mark.parametrize("env, capability, lowered", [
    ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, "AVX512", "ONEDNN_MAX_CPU_ISA=AVX2"),
    ({"ONEDNN_MAX_CPU_ISA": "avx512_core"}, "AVX512", "ONEDNN_MAX_CPU_ISA=avx512_core"),  # bf16 only emulated
    ({"DNNL_MAX_CPU_ISA": "AVX2_VNNI"}, "AVX512", "DNNL_MAX_CPU_ISA=AVX2_VNNI"),
    ({"ATEN_CPU_CAPABILITY": "avx2"}, "AVX2", "ATEN_CPU_CAPABILITY=avx2"),
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, "AVX512", None),
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX", "ATEN_CPU_CAPABILITY": "avx512"}, "AVX512", None),
    ({}, "AVX2", None),  # torch's own choice of kernels, not a variable set to lower it
])
def test_the_isa_variables_lower_native_bf16(monkeypatch, env, capability, lowered):
    for name in precision.ISA_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert isa_lowered(capability) == lowered


@x86_only
def test_the_host_decides_by_its_bf16_instructions_and_the_simulation_by_the_isa_variables(tmp_path):
    """Both ways in fresh processes: the host as it is (bf16 where /proc/cpuinfo lists AVX512-BF16 or AMX-BF16),
    and the same host held to AVX2 (always fp32, naming the variable where the host had bf16)."""
    host = resolve_in_child(tmp_path / "host")
    if host_has_bf16():
        assert host["auto"][0] == "bf16" and "computes bf16 natively" in host["auto"][1], host
    else:
        assert host["auto"][0] == "fp32", host
        assert host["auto"][1].startswith("this CPU has no native bf16: no AVX512-BF16 or AMX instructions"), host
    simulated = resolve_in_child(tmp_path / "avx2", **AVX2_ONLY)
    assert simulated["capability"] == "AVX2" and simulated["auto"][0] == "fp32", simulated
    assert simulated["auto"][1].startswith("this CPU has no native bf16: ")
    assert ("present but ONEDNN_MAX_CPU_ISA=AVX2 keeps torch below it" if host_has_bf16()
            else "no AVX512-BF16 or AMX instructions") in simulated["auto"][1]
    # An explicit bf16 still trains in bf16, with one warning that names the measured slowdown.
    explicit, warning = simulated["bf16"]
    assert explicit == "bf16"
    assert warning and "slower than fp32" in warning and "deepspeed.precision=auto" in warning


@x86_only
def test_the_measurement_is_cached_per_isa_environment_with_its_date(tmp_path):
    """Runs on one machine decide alike, and a simulated AVX2 CPU is never served the host's answer."""
    first = resolve_in_child(tmp_path, **AVX2_ONLY)
    cache = json.loads(open(first["cache"]).read())
    assert list(cache) == [first["key"]]
    entry = cache[first["key"]]
    assert entry["ONEDNN_MAX_CPU_ISA"] == "AVX2" and entry["method"] == precision.MEASUREMENT_METHOD
    assert len(entry["ratios"]) == precision.MEASURE_PAIRS and entry["auto"] == "fp32"
    assert f"measured {entry['measured_at']})" in first["auto"][2]  # the printed line carries the cached date
    again = resolve_in_child(tmp_path, **AVX2_ONLY)
    assert again["auto"] == first["auto"] and json.loads(open(first["cache"]).read()) == cache  # read, not re-measured
    host = resolve_in_child(tmp_path)  # the host without the simulation: its own entry
    assert len(json.loads(open(host["cache"]).read())) == 2


@x86_only
def test_an_entry_measured_the_old_way_is_measured_again(tmp_path):
    """A cache written by an older ayumi (one bf16-then-fp32 timing, e.g. 18x on a busy machine) decides nothing."""
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    path = write_cache_entry(tmp_path, {"slowdown": 18.0, "measured_at": WHEN, "torch": torch.__version__,
                                        "ONEDNN_MAX_CPU_ISA": "", "DNNL_MAX_CPU_ISA": "", "ATEN_CPU_CAPABILITY": ""})
    answer = resolve_in_child(tmp_path)
    entry = json.loads(path.read_text())[answer["key"]]
    assert entry["method"] == precision.MEASUREMENT_METHOD and entry["measured_at"] >= started
    assert WHEN not in answer["auto"][2] and f"measured {entry['measured_at']})" in answer["auto"][2]
    assert answer["auto"][0] == ("bf16" if host_has_bf16() else "fp32")


def test_gpus_without_bf16_get_fp16_with_loss_scaling(monkeypatch):
    monkeypatch.setattr(precision, "_gpu_name", lambda: "Tesla V100 (compute capability 7.0)")
    monkeypatch.setattr(precision, "_gpu_has_bf16", lambda: False)
    old = precision.resolve_precision("auto", torch.device("cuda", 0))
    assert old.precision == "fp16" and "V100" in old.reason and "loss scaling" in old.reason
    assert precision.resolve_precision("bf16", torch.device("cuda", 0)).warning
    monkeypatch.setattr(precision, "_gpu_has_bf16", lambda: True)
    assert precision.resolve_precision("auto", torch.device("cuda", 0)).precision == "bf16"


def test_ranks_agree_on_the_least_capable_choice():
    here = PrecisionChoice("bf16", "auto", "this CPU computes bf16 natively")
    assert agreed(here, 2) is here
    lowered = agreed(here, 0)
    assert lowered.precision == "fp32" and "another rank" in lowered.reason


def test_a_resumed_auto_run_keeps_its_checkpoints_precision():
    fp32_here = PrecisionChoice("fp32", "auto", "this CPU has no fast bf16")
    kept = kept_from_checkpoint(fp32_here, "bf16")
    assert kept.precision == "bf16" and "kept from the checkpoint" in kept.reason and kept.warning
    assert kept_from_checkpoint(fp32_here, None) is fp32_here  # a fresh run
    explicit = PrecisionChoice("fp32", "fp32", "as configured")
    assert kept_from_checkpoint(explicit, "bf16") is explicit  # the user's explicit choice wins


def test_precision_values_are_checked():
    assert to_object(compose_config([])).deepspeed.precision == "auto"
    cfg = to_object(compose_config(["deepspeed.precision=fp8"]))
    with pytest.raises(ConfigError, match="deepspeed.precision must be auto, bf16, fp16 or fp32, got 'fp8'"):
        check_config(cfg)


@x86_only
@pytest.mark.slow
def test_a_run_on_an_avx2_cpu_trains_in_fp32_and_a_bf16_checkpoint_resumes_in_bf16(tmp_path):
    """Through the real launcher: auto on a (simulated) AVX2 CPU configures DeepSpeed in fp32; a run
    saved in bf16 resumes in bf16 there (exact resume), with the slowdown warning."""
    corpus = write_tiny_corpus(tmp_path / "corpus")
    env = cpu_env(XDG_CACHE_HOME=str(tmp_path / "cache"), **AVX2_ONLY)
    fresh = run_training(tiny_overrides(corpus, tmp_path / "a", "train.max_steps=3"), env=env, launcher="fork")
    assert fresh.returncode == 0, fresh.stdout[-4000:]
    cache = json.loads((tmp_path / "cache" / "ayumi" / "cpu_precision.json").read_text())
    assert len(cache) == 1  # both ranks read or wrote the one measurement of this ISA environment
    start_line = next(line for line in fresh.stdout.splitlines() if line.startswith("precision: "))
    assert start_line.startswith("precision: fp32 (deepspeed.precision=auto: this CPU has no native bf16: ")
    assert start_line.endswith(f"measured {next(iter(cache.values()))['measured_at']}))"), start_line
    ds_config = json.loads((tmp_path / "a" / "cpu_tiny" / "deepspeed_config.json").read_text())
    assert "bf16" not in ds_config and "fp16" not in ds_config

    saved = run_training(tiny_overrides(corpus, tmp_path / "b", "train.max_steps=2", "deepspeed.precision=bf16"),
                         env=cpu_env(XDG_CACHE_HOME=str(tmp_path / "host_cache")), launcher="fork")
    assert saved.returncode == 0, saved.stdout[-4000:]
    # auto named on the resume: a run's own override left out is replayed (pretrain/startup/resume.py), and here the
    # checkpoint's bf16 is to be kept by auto's own rule, as for a run started with auto on a bf16 host.
    resumed = run_training(tiny_overrides(corpus, tmp_path / "b", "train.max_steps=3", "deepspeed.precision=auto"),
                           env=env, launcher="fork")
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert "precision: bf16 (deepspeed.precision=auto: kept from the checkpoint being resumed" in resumed.stdout
    assert "WARNING: resuming a bf16 run" in resumed.stdout
    steps = [rec["step"] for rec in read_jsonl(tmp_path / "b" / "cpu_tiny" / "metrics.jsonl") if "train/loss" in rec]
    assert steps == [1, 2, 3]
