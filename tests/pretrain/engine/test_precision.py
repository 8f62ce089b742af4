"""deepspeed.precision=auto: the choice follows what torch runs on this CPU, is cached per ISA
environment, is agreed by all ranks, and a resumed run keeps its checkpoint's precision.

An AVX2-only CPU is simulated on any x86 host with `ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`
(torch's bf16 matmul then takes its ~50-100x slower reference path), so these tests hold on hosts
with and without native bf16.
"""
from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest
import torch

from pretrain.engine import precision
from pretrain.config import ConfigError, check_config, compose_config, to_object
from pretrain.engine.precision import PrecisionChoice, agreed, kept_from_checkpoint
from tests.helpers import REPO, cpu_env, read_jsonl, run_training, tiny_overrides, write_tiny_corpus

AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
x86_only = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the AVX2 simulation is x86-only")

RESOLVE = r"""
import json, torch
from pretrain.engine.precision import CACHE_FILE, resolve_precision
auto = resolve_precision("auto", torch.device("cpu"))
explicit = resolve_precision("bf16", torch.device("cpu"))
print(json.dumps({"auto": [auto.precision, auto.reason], "bf16": [explicit.precision, explicit.warning],
                  "capability": torch.backends.cpu.get_cpu_capability(), "cache": str(CACHE_FILE)}))
"""


def resolve_in_child(tmp_path, **env) -> dict:
    """resolve_precision in a fresh process (the ISA variables act at start-up), cache under tmp_path."""
    child_env = cpu_env(XDG_CACHE_HOME=str(tmp_path / "cache"), **env)
    for name in set(precision.ISA_ENV_VARS) - set(env):  # the host as it is, even when the suite runs simulated
        child_env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", RESOLVE], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=child_env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@x86_only
def test_auto_picks_fp32_on_a_cpu_without_native_bf16(tmp_path):
    answer = resolve_in_child(tmp_path, **AVX2_ONLY)
    assert answer["capability"] == "AVX2"
    assert answer["auto"][0] == "fp32"
    assert "no fast bf16" in answer["auto"][1] and "AVX2" in answer["auto"][1] and "oneDNN bf16 no" in answer["auto"][1]
    # An explicit bf16 still trains in bf16, with one warning that names the measured slowdown.
    explicit, warning = answer["bf16"]
    assert explicit == "bf16"
    assert warning and "slower than fp32" in warning and "deepspeed.precision=auto" in warning


@x86_only
def test_the_measurement_is_cached_per_isa_environment(tmp_path):
    """Runs on one machine decide alike, and a simulated AVX2 CPU is never served the host's answer."""
    first = resolve_in_child(tmp_path, **AVX2_ONLY)
    cache = json.loads(open(first["cache"]).read())
    assert len(cache) == 1 and next(iter(cache.values()))["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert next(iter(cache.values()))["slowdown"] > 5  # the reference bf16 path is tens of times slower
    again = resolve_in_child(tmp_path, **AVX2_ONLY)
    assert again["auto"] == first["auto"] and len(json.loads(open(first["cache"]).read())) == 1
    host = resolve_in_child(tmp_path)  # the host without the simulation: its own entry
    assert len(json.loads(open(host["cache"]).read())) == 2


@pytest.mark.parametrize("onednn_bf16, slowdown, expected", [
    (True, 0.4, "bf16"),   # AVX512-BF16 / AMX: bf16 matmuls ~2.5x as fast as fp32 (this host)
    (True, 1.6, "fp32"),   # oneDNN only emulates bf16 (AVX512 without BF16): slower than fp32
    (False, 0.9, "fp32"),  # torch has no bf16 path at all, whatever a measurement said
])
def test_auto_on_cpu_needs_onednn_bf16_and_a_measured_speed_up(monkeypatch, onednn_bf16, slowdown, expected):
    facts = precision.CpuBf16(onednn_bf16, "AVX512", slowdown)
    monkeypatch.setattr(precision, "cpu_bf16", lambda: facts)
    choice = precision.resolve_precision("auto", torch.device("cpu"))
    assert choice.precision == expected
    assert choice.describe().startswith(f"precision: {expected} (deepspeed.precision=auto: ")
    assert f"oneDNN bf16 {'yes' if onednn_bf16 else 'no'}" in choice.reason


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
    fresh = run_training(tiny_overrides(corpus, tmp_path / "a", "train.max_steps=3"), env=env)
    assert fresh.returncode == 0, fresh.stdout[-4000:]
    assert "precision: fp32 (deepspeed.precision=auto: this CPU has no fast bf16" in fresh.stdout
    ds_config = json.loads((tmp_path / "a" / "cpu_tiny" / "deepspeed_config.json").read_text())
    assert "bf16" not in ds_config and "fp16" not in ds_config

    saved = run_training(tiny_overrides(corpus, tmp_path / "b", "train.max_steps=2", "deepspeed.precision=bf16"))
    assert saved.returncode == 0, saved.stdout[-4000:]
    resumed = run_training(tiny_overrides(corpus, tmp_path / "b", "train.max_steps=3"), env=env)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert "precision: bf16 (deepspeed.precision=auto: kept from the checkpoint being resumed" in resumed.stdout
    assert "WARNING: resuming a bf16 run" in resumed.stdout
    steps = [rec["step"] for rec in read_jsonl(tmp_path / "b" / "cpu_tiny" / "metrics.jsonl") if "train/loss" in rec]
    assert steps == [1, 2, 3]
