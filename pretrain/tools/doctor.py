"""`ayumi doctor`: is this machine ready to train? One table of facts, problems and fixes.

    ayumi doctor [--json] [--refresh-precision] [key=value ...]

Checks, in order: Python; torch, its CUDA build, NCCL and the GPUs (name, memory); DeepSpeed's
version, accelerator and op compatibility; CPU cores and RAM; the tokenizer/data libraries;
free disk on the data root and the run root (and, for a run, that its data root holds prepared data);
W&B mode and readiness. Given Hydra overrides (`experiment=NAME ...`) it also composes that run's
config and compares the disk its checkpoints need at their peak with the free disk, by the same rule
and with the same figures as `ayumi plan` (the rule is printed below), and checks its per-GPU memory.

The precision row is what `deepspeed.precision` resolves to here and why. On the CPU that is
decided by the CPU's bf16 capability, sanity-checked by a matmul measurement cached per machine
(~/.cache/ayumi/cpu_precision.json); the row shows the measurement's date. `--refresh-precision`
measures again and replaces the cached one: run it on an idle machine when a busy one vetoed bf16.

DeepSpeed facts come from a subprocess (the same questions `ds_report` asks): only
pretrain/engine/ imports deepspeed in the product, and nothing here may trigger an op build.
wandb is not imported either (only pretrain/metrics.py does); its presence and the API key are
checked from the package metadata and the environment.

Exit status (common/status.py) 0 unless something is broken: 1 for a FAIL line (each WARN/FAIL line
says what to do, and the fixes are repeated as next steps at the end), 2 when the overrides given do
not compose.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path

from common.status import BAD_INPUT, DONE, REFUSED
from curriculum.plan import DISK_RULE, checkpoint_disk, checkpoint_shape, disk_problem, disk_summary, existing_parent

OK, INFO, WARN, FAIL = "ok", "info", "warn", "FAIL"
GIB = 1024**3
LOW_DISK_GIB = 20  # below this a root is flagged even without a plan: one 1B bf16 checkpoint is ~15 GiB
DEEPSPEED_PROBE_TIMEOUT_S = 120
LIBRARIES = ("sentencepiece", "transformers", "datasets", "hydra-core", "safetensors", "wandb", "psutil")


@dataclass
class Check:
    """One line of the report."""

    section: str
    name: str
    status: str
    """ok | info | warn | FAIL."""
    detail: str
    fix: str = ""
    """What to do about a warn/FAIL (empty otherwise)."""


# ---- Python, torch, GPUs ----------------------------------------------------------------------


def check_python() -> list[Check]:
    version = platform.python_version()
    status, fix = OK, ""
    if sys.version_info < (3, 10):
        status, fix = FAIL, "ayumi needs Python >= 3.10: recreate the venv with a newer Python (./ayumi does it)"
    return [Check("system", "python", status, f"{version} ({sys.executable})", fix)]


def check_torch() -> list[Check]:
    try:
        import torch
    except Exception as err:  # missing or broken (e.g. a CUDA library mismatch): nothing else can run
        return [Check("torch", "torch", FAIL, f"cannot import torch: {err}",
                      "install torch into this venv (./ayumi bootstrap, or pip install torch)")]
    checks = [Check("torch", "torch", OK, torch.__version__)]
    cuda_build = torch.version.cuda
    checks.append(Check("torch", "CUDA build", INFO, cuda_build or "none (CPU-only build)"))
    if not torch.cuda.is_available():
        fix = ("" if not cuda_build else
               "torch was built with CUDA but sees no GPU: check `nvidia-smi`, the driver and CUDA_VISIBLE_DEVICES")
        checks.append(Check("torch", "GPUs", WARN if cuda_build else INFO,
                            "none: training runs on CPU (DS_ACCELERATOR=cpu, gloo), fine for the demo and tests", fix))
        return checks
    checks.append(Check("torch", "NCCL", OK, ".".join(map(str, _nccl_version(torch)))))
    for index in range(torch.cuda.device_count()):
        checks.append(_gpu_check(torch, index))
    return checks


def check_precision(requested: str, refresh: bool = False) -> Check:
    """What `deepspeed.precision` resolves to on this machine, and why (pretrain/engine/precision.py); `refresh`
    measures the CPU's bf16 matmul again first and replaces the cached measurement (CPU training only)."""
    import torch

    from pretrain.engine.precision import cpu_bf16, resolve_precision

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    choice = resolve_precision(requested, device, cpu_bf16(refresh=True) if refresh and device.type == "cpu" else None)
    if choice.warning:
        return Check("torch", "precision", WARN, f"{choice.precision} ({choice.reason})", choice.warning)
    return Check("torch", "precision", OK, f"{choice.precision} (deepspeed.precision={requested}: {choice.reason})")


def _nccl_version(torch) -> tuple:
    version = torch.cuda.nccl.version()
    return version if isinstance(version, tuple) else (version // 1000, version % 1000 // 100, version % 100)


def _gpu_check(torch, index: int) -> Check:
    props = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    detail = f"{props.name}, {total / GIB:.1f} GiB ({free / GIB:.1f} GiB free), compute {props.major}.{props.minor}"
    busy = free < 0.5 * total
    return Check("torch", f"GPU {index}", WARN if busy else OK, detail,
                 "more than half of its memory is in use by another process (nvidia-smi shows which)" if busy else "")


# ---- DeepSpeed (in a subprocess) --------------------------------------------------------------

# What ds_report asks, as JSON: version, accelerator, and for every op builder whether it can be
# built here (is_compatible, which checks headers/compilers but builds nothing) and whether the
# wheel shipped it prebuilt. Warnings DeepSpeed prints on import go to stderr, the answer to stdout.
_DEEPSPEED_PROBE = r"""
import contextlib, io, json, sys
with contextlib.redirect_stdout(sys.stderr):
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS
    accelerator = get_accelerator()
    ops = {}
    for name, builder in sorted(ALL_OPS.items()):
        try:
            compatible = bool(builder.is_compatible(False))
        except Exception:
            compatible = False
        prebuilt = bool(installed_ops.get(name, False)) and accelerator_name == accelerator._name
        ops[name] = {"compatible": compatible, "prebuilt": prebuilt}
print(json.dumps({"version": deepspeed.__version__, "accelerator": accelerator._name, "ops": ops}))
"""


def deepspeed_facts() -> dict:
    """{"version", "accelerator", "ops": {name: {compatible, prebuilt}}} or {"error": why}."""
    try:
        # -P: `-c` would put the working folder first on the import path, where a deepspeed/ or json.py would win.
        result = subprocess.run([sys.executable, "-P", "-c", _DEEPSPEED_PROBE], capture_output=True, text=True,
                                timeout=DEEPSPEED_PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"importing deepspeed took over {DEEPSPEED_PROBE_TIMEOUT_S} s"}
    if result.returncode != 0:
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        return {"error": lines[-1] if lines else f"exit status {result.returncode}"}
    return json.loads(result.stdout.strip().splitlines()[-1])


# Ops a training run may JIT-compile: the optimizer for ZeRO-Offload and the CPU shared-memory
# collective (ayumi turns the latter off on CPU and passes torch's AdamW otherwise).
_OPS_THAT_MATTER = {
    "cpu_adam": "deepspeed.offload_optimizer=true",
    "fused_adam": "DeepSpeed's own Adam on GPU (ayumi uses torch's fused AdamW)",
}


def check_deepspeed(facts: dict) -> list[Check]:
    if "error" in facts:
        return [Check("deepspeed", "deepspeed", FAIL, f"cannot import deepspeed: {facts['error']}",
                      "pip install deepspeed into this venv; `ds_report` shows the details")]
    checks = [Check("deepspeed", "deepspeed", OK, f"{facts['version']}, accelerator {facts['accelerator']}")]
    ops = facts.get("ops", {})
    prebuilt = sorted(name for name, op in ops.items() if op["prebuilt"])
    compatible = sorted(name for name, op in ops.items() if op["compatible"] and not op["prebuilt"])
    incompatible = sorted(name for name, op in ops.items() if not op["compatible"])
    checks.append(Check("deepspeed", "ops prebuilt", INFO, ", ".join(prebuilt) or "none (ops compile on first use)"))
    checks.append(Check("deepspeed", "ops buildable", INFO, ", ".join(compatible) or "none"))
    if incompatible:
        checks.append(Check("deepspeed", "ops unavailable", INFO, ", ".join(incompatible)))
    for name, used_by in _OPS_THAT_MATTER.items():
        op = ops.get(name)
        if op and not op["compatible"] and not op["prebuilt"]:
            checks.append(Check("deepspeed", name, WARN, f"cannot be built here; needed by {used_by}",
                                "`ds_report` lists the missing headers or compiler"))
    needs_compiler = any(not op["prebuilt"] for op in ops.values())
    if needs_compiler and not (shutil.which("ninja") or Path(sys.executable).with_name("ninja").exists()):
        checks.append(Check("deepspeed", "ninja", WARN, "not found: DeepSpeed's op builds (JIT) need it",
                            "pip install ninja (only needed for ops like cpu_adam with ZeRO-Offload)"))
    return checks


# ---- CPU, RAM, libraries ----------------------------------------------------------------------


def check_host() -> list[Check]:
    import psutil

    memory = psutil.virtual_memory()
    logical, physical = os.cpu_count() or 1, psutil.cpu_count(logical=False) or 0
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
    checks = [
        Check("system", "CPU", OK, f"{usable} usable cores ({logical} logical, {physical} physical)"),
        Check("system", "RAM", OK if memory.available >= 4 * GIB else WARN,
              f"{memory.total / GIB:.1f} GiB total, {memory.available / GIB:.1f} GiB available",
              "" if memory.available >= 4 * GIB else "under 4 GiB free: data preparation and the loader may swap"),
    ]
    return checks


def check_libraries() -> list[Check]:
    checks = []
    for name in LIBRARIES:
        try:
            checks.append(Check("libraries", name, OK, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            checks.append(Check("libraries", name, FAIL, "not installed", f"pip install {name} (or re-run ./ayumi)"))
    return checks


# ---- Disk and the plan's checkpoints ------------------------------------------------------------


def disk_free(path: Path) -> int:
    """Free bytes on the filesystem that holds `path` (or would: its nearest existing parent)."""
    return shutil.disk_usage(existing_parent(path)).free


def check_roots(data_root: Path, run_root: Path, data_read: bool = False) -> list[Check]:
    """Free disk and writability of both roots; with `data_read` (a run's data.root, which training reads)
    also whether it holds prepared data."""
    missing = missing_data(data_root) if data_read else None
    return [root_check("data root", data_root, "AYUMI_DATA_ROOT", missing), root_check("run root", run_root, "AYUMI_RUN_ROOT")]


def root_check(name: str, root: Path, variable: str, missing: tuple[str, str] | None = None) -> Check:
    """One root's row: FAIL when it cannot be written or a run's data is missing (`missing`: what, fix), WARN when
    its disk is nearly full."""
    free = disk_free(root)
    detail = f"{root.absolute()}: {free / GIB:.1f} GiB free"
    if not _writable(root):
        return Check("disk", name, FAIL, detail, f"{root} is not writable: set {variable} to a folder you can write")
    if missing:
        what, fix = missing
        return Check("disk", name, FAIL, f"{root.absolute()} {what} ({free / GIB:.1f} GiB free on its disk)", fix)
    if free < LOW_DISK_GIB * GIB:
        return Check("disk", name, WARN, detail, f"under {LOW_DISK_GIB} GiB free: point it at a larger disk")
    return Check("disk", name, OK, detail)


def missing_data(root: Path) -> tuple[str, str] | None:
    """(what is missing, the fix) when a run's data root holds no prepared data: training would refuse to start."""
    from data.manifest import MANIFEST_NAME

    if root.is_dir() and (root / MANIFEST_NAME).is_file():
        return None
    what = "does not exist" if not root.is_dir() else f"holds no {MANIFEST_NAME} (no data prepared there)"
    return what, (f"write the shards there with `ayumi data prepare data=NAME data.root={root} tokenizer_dir=DIR`, "
                  "or set data.root=DIR (or AYUMI_DATA_ROOT) to where they are")


def _writable(path: Path) -> bool:
    return os.access(existing_parent(path), os.W_OK)


def check_plan(overrides: list[str]) -> tuple[list[Check], object | None]:
    """Compose the run's config; compare its checkpoints' size with the free disk. (checks, config or None)"""
    from pretrain.config import ConfigError, checked_config, composed_from_args, total_steps
    from pretrain.model.flops import count_parameters

    try:
        # As `ayumi train` composes it (model.* from model.init_from included) and with the config's own rules.
        cfg = checked_config(composed_from_args(overrides)[0])
        parameters = count_parameters(cfg.model)
    except (ConfigError, ValueError) as err:
        message = " / ".join(line.strip() for line in str(err).splitlines() if line.strip())
        return [Check("plan", "config", FAIL, message[:400], "fix the overrides (`ayumi train --cfg job ...` "
                      "prints the resolved config)")], None
    # The figures and the verdict of `ayumi plan` (curriculum/plan.py checkpoint_disk, DISK_RULE).
    disk = checkpoint_disk(total_steps(cfg.train), checkpoint_shape(cfg, parameters),
                           free_bytes=disk_free(Path(cfg.checkpoint.dir)))
    problem = disk_problem(disk)
    detail = f"{cfg.name}: {parameters:,} parameters; {disk_summary(disk)}"
    checks = [Check("plan", "checkpoints", FAIL if problem else OK, detail, problem or ""), check_memory(cfg),
              check_fp8(cfg), check_run_files(cfg)]
    return checks, cfg


def check_run_files(cfg) -> Check:
    """The files `ayumi train` checks before any rank starts (pretrain/startup/checks.py): the data's vocabulary against
    model.vocab_size and eval.downstream's task files. model.fp8 is check_fp8's row."""
    from pretrain.startup.checks import task_file_problems, vocabulary_problems
    from pretrain.model.vocabulary import tokenizer_vocabulary, vocabulary_line

    problems = vocabulary_problems(cfg) + task_file_problems(cfg)
    if problems:
        return Check("plan", "run files", FAIL, " / ".join(problems)[:400], "the fix each line names")
    model = cfg.model  # the plan's line: what the vocabulary was checked against, or that no tokenizer is known yet
    detail = vocabulary_line(model.vocab_size, model.vocab_multiple,
                             tokenizer_vocabulary(cfg.data.root, cfg.data.tokenizer_dir))
    tasks = f"; {len(cfg.eval.downstream.tasks)} eval task file(s) read" if cfg.eval.downstream.tasks else ""
    return Check("plan", "run files", OK, detail + tasks)


def check_fp8(cfg) -> Check:
    """model.fp8 against the GPUs here and the layout: the refusals `ayumi train` would make (pretrain/startup/checks.py)."""
    from pretrain.startup.checks import fp8_problems

    model = cfg.model
    if model.fp8 == "off":
        return Check("plan", "fp8", INFO, "off (model.fp8=tensorwise or rowwise on a GPU of compute capability 8.9+)")
    problems = fp8_problems(cfg)
    if problems:
        return Check("plan", "fp8", FAIL, " / ".join(problems)[:400], "model.fp8=off, or the fix each line names")
    how = "torchao's emulation, for tests only" if model.fp8_emulate else "torchao float8"
    return Check("plan", "fp8", OK, f"{model.fp8} ({how}): the blocks' Linear layers; embedding and LM head unchanged")


def check_memory(cfg) -> Check:
    """The per-GPU memory estimate (pretrain/plan/memory.py) against the GPUs here or train.gpu_memory_gib."""
    from pretrain.plan.memory import estimate_memory, fit_advice, memory_shape
    from pretrain.plan.hardware import planned_hardware

    hardware = planned_hardware(cfg)
    memory = estimate_memory(memory_shape(cfg, hardware.data_parallel))  # the memory alone: no data to open
    detail = (f"{memory.required / GIB:.1f} GiB per GPU needed ({memory.model_states / GIB:.1f} model states, "
              f"{memory.term('activations') / GIB:.1f} activations) with {hardware.data_parallel} data-parallel ranks"
              + (f" of tensor-parallel {hardware.tensor_parallel}" if hardware.tensor_parallel > 1 else ""))
    if not hardware.gpu_bytes:
        return Check("plan", "memory", INFO, f"{detail}; not checked: {hardware.where}")
    if memory.required > hardware.gpu_bytes:
        return Check("plan", "memory", FAIL, f"{detail}, {hardware.where} has {hardware.gpu_bytes / GIB:.1f} GiB",
                     fit_advice(memory.shape, hardware.gpu_bytes, cfg.train.global_batch_size))
    return Check("plan", "memory", OK, f"{detail}, {hardware.where} has {hardware.gpu_bytes / GIB:.1f} GiB")


# ---- W&B ------------------------------------------------------------------------------------------


def check_wandb(configured_mode: str | None) -> list[Check]:
    """Mode (WANDB_MODE wins over the config, as in wandb itself) and whether online logging can work."""
    installed = importlib.util.find_spec("wandb") is not None
    env_mode = os.environ.get("WANDB_MODE")
    mode = env_mode or configured_mode or "offline"
    source = "WANDB_MODE" if env_mode else "config" if configured_mode else "ayumi's default"
    if not installed:
        return [Check("wandb", "W&B", WARN if mode != "disabled" else INFO, f"wandb not installed (mode {mode})",
                      "pip install wandb, or run with logging=none" if mode != "disabled" else "")]
    if mode in ("disabled", "offline", "dryrun"):
        detail = f"mode {mode} (from {source})"
        if mode != "disabled":
            detail += ": runs log under RUN_DIR/wandb; `wandb sync` uploads them later"
        return [Check("wandb", "W&B", OK, detail)]
    has_key = bool(os.environ.get("WANDB_API_KEY")) or _netrc_has_wandb()
    if has_key:
        return [Check("wandb", "W&B", OK, f"mode online (from {source}), API key found")]
    return [Check("wandb", "W&B", FAIL, f"mode online (from {source}) but no API key",
                  "`wandb login` or export WANDB_API_KEY=...; or WANDB_MODE=offline and `wandb sync` later")]


def _netrc_has_wandb() -> bool:
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text()
    except OSError:
        return False


# ---- Report ----------------------------------------------------------------------------------------


def default_roots() -> tuple[Path, Path]:
    return Path(os.environ.get("AYUMI_DATA_ROOT", ".cache")), Path(os.environ.get("AYUMI_RUN_ROOT", "runs"))


def run_checks(overrides: list[str], refresh_precision: bool = False) -> list[Check]:
    checks = check_python() + check_host() + check_torch()
    data_root, run_root = default_roots()
    configured_mode, precision, plan_checks, data_read = None, "auto", [], False
    if overrides:
        plan_checks, cfg = check_plan(overrides)
        if cfg is not None:
            data_root, run_root = Path(cfg.data.root), Path(cfg.run_root)
            configured_mode = cfg.logging.wandb.mode if cfg.logging.wandb.enabled else "disabled"
            precision = cfg.deepspeed.precision
            # A curriculum that declares its own (Megatron) domains writes data.root's manifest at start.
            data_read = not cfg.curriculum.domains
    if not any(check.name == "torch" and check.status == FAIL for check in checks):
        checks.append(check_precision(precision, refresh_precision))
    checks += check_deepspeed(deepspeed_facts()) + check_libraries()
    return checks + check_roots(data_root, run_root, data_read) + plan_checks + check_wandb(configured_mode)


def next_steps(checks: list[Check], overrides: list[str]) -> list[str]:
    steps = [f"{check.name}: {check.fix}" for check in checks if check.status in (FAIL, WARN) and check.fix]
    if not any(check.status == FAIL for check in checks):
        steps.append("ready: `ayumi demo` runs the whole pipeline on real text; `ayumi train experiment=NAME` trains")
        if not overrides:
            steps.append("`ayumi doctor experiment=NAME` also checks that run's checkpoint size against the free disk")
    return steps


def format_table(checks: list[Check], steps: list[str]) -> str:
    width = max(len(check.name) for check in checks)
    lines, section = ["ayumi doctor"], None
    for check in checks:
        if check.section != section:
            section = check.section
            lines.append(f"\n{section}")
        lines.append(f"  {check.status:<4}  {check.name:<{width}}  {check.detail}")
        if check.fix and check.status in (WARN, FAIL):
            lines.append(f"  {'':<4}  {'':<{width}}  -> {check.fix}")
    broken = sum(check.status == FAIL for check in checks)
    warned = sum(check.status == WARN for check in checks)
    lines.append(f"\n{broken} broken, {warned} warning(s)")
    lines += ["next steps:"] + [f"  - {step}" for step in steps]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from common.conf import asks_for_help
    from pretrain.config import training_config_help

    argv = sys.argv[1:] if argv is None else argv
    # The field list is read from the config's source: only worth it when help is asked.
    about = f"{__doc__}\n" + textwrap.fill(f"Checkpoint disk: {DISK_RULE}.", width=100, break_on_hyphens=False)
    parser = argparse.ArgumentParser(prog="ayumi doctor", description=about, usage="ayumi doctor [--json] [--refresh-precision] [key=value ...]",
                                     epilog=training_config_help(cfg_job=False) if asks_for_help(argv) else None,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    parser.add_argument("--refresh-precision", action="store_true",
                        help="measure this CPU's bf16 matmul against fp32 again and replace the cached measurement "
                             "(~/.cache/ayumi/cpu_precision.json) that deepspeed.precision=auto's CPU decision is "
                             "sanity-checked with; its date is in the precision row. Use it on an idle machine after a "
                             "busy one vetoed bf16")
    args, overrides = parser.parse_known_args(argv)
    unknown = [arg for arg in overrides if arg.startswith("-")]
    if unknown:
        parser.error(f"unknown option(s) {unknown}; overrides are key=value")
    checks = run_checks(overrides, args.refresh_precision)
    steps = next_steps(checks, overrides)
    broken = any(check.status == FAIL for check in checks)
    if args.json:
        print(json.dumps({"ok": not broken, "checks": [asdict(check) for check in checks], "next_steps": steps}, indent=2))
    else:
        print(format_table(checks, steps))
    return exit_status(checks)


def exit_status(checks: list[Check]) -> int:
    """BAD_INPUT when the overrides given do not compose (fix them and rerun: the run was not checked), else
    REFUSED when any check is broken (the machine is not ready), else DONE (common/status.py)."""
    if any(check.section == "plan" and check.name == "config" and check.status == FAIL for check in checks):
        return BAD_INPUT
    return REFUSED if any(check.status == FAIL for check in checks) else DONE


if __name__ == "__main__":
    sys.exit(main())
