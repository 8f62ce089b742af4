"""`ayumi train`: run pretrain.train on this machine with the right launcher.

- GPUs visible: `deepspeed --num_gpus N --module pretrain.train ...` (one process per GPU).
- CPU only: `torchrun --standalone --nproc_per_node 2 -m pretrain.train ...` with
  DS_ACCELERATOR=cpu and gloo. torchrun starts faster than the deepspeed launcher on CPU and
  gives bitwise-equal losses (docs/deepspeed-on-cpu.md); `--launcher deepspeed` picks the latter.

The whole config is composed and checked here first (types, ranges, names, each stage's length and
RoPE, the data's vocabulary against model.vocab_size, eval.downstream's task files: the checks `ayumi
plan` and `--cfg job` make too, pretrain/startup/checks.py; then the batch over the ranks about to start,
the data as the ranks will open it, the plan: stage budgets, repetition, checkpoint disk, GPU memory,
and `model.init_from`'s tensors from their safetensors headers), without importing torch or
DeepSpeed: a mistake exits with status 2 and one line per problem before any process starts, and
`--dry-run` prints the command only for a valid config (it skips the files the config names: the
data, the tokenizer, the task files, the plan and init_from's tensors: they may live on the cluster). Multi-node and SLURM launches are
the scripts under launch/.

What the ranks refuse once running (a shard damaged after this check, a disk that fills) they say
in one line and leave for this process (pretrain/job/exit_status.py): `ayumi train` returns their
status (2, 3), not the launcher's 1, and repeats their line last, below the launcher's report.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pretrain.plan.hardware import gpu_count


def preflight_plan(cfg, nproc: int, gpus: int) -> None:
    """The ranks' data checks and the plan's (budgets, repetition, checkpoint disk, GPU memory) before any rank starts.

    The ranks run the same checks (pretrain.train.build_data); here they cost no process start and
    a refusal is printed once, not once per rank under the launcher's own error report. The data is
    opened as the ranks open it (the curriculum's own domains registered first; sizes and records,
    no checksums), so a missing or damaged shard raises its own error, one line naming the file and
    the fix; the plan's problems raise PlanRefused listing them. Imports torch only where GPUs are
    visible (their memory).
    """
    from curriculum.declared import register_curriculum_domains
    from curriculum.plan import raise_if_refused
    from data.domains import open_run_data
    from pretrain.model.flops import count_parameters
    from pretrain.plan.hardware import Hardware, planned_hardware
    from pretrain.plan.run_plan import run_plan

    register_curriculum_domains(cfg)
    _, train, _ = open_run_data(cfg.data.root, cfg.data.domains or None, cfg.train.seq_len, verify="sizes",
                                validation=cfg.data.validation)
    # On the CPU the ranks train in host memory: no GPU figure to check against.
    hardware = planned_hardware(cfg, ranks=nproc) if gpus else \
        Hardware.cpu(nproc, cfg.parallel.tensor, cfg.parallel.sequence)
    raise_if_refused(run_plan(cfg, count_parameters(cfg.model), hardware, domains=train).plan)


def preflight_init_from(cfg) -> None:
    """model.init_from's tensors against the model's shape, as each rank checks them before reading one
    (pretrain.train.hf_initial_weights), from the safetensors headers: no torch, no tensor read.

    Skipped when the ranks will resume from a checkpoint (they then never read the folder): `load_from`, or
    `resume` with a complete checkpoint in the run's checkpoint dir (a step folder with its ayumi.json, not one
    set aside as damaged: pretrain.checkpoint.layout, which imports no torch).
    """
    from pretrain.checkpoint.layout import complete_tags
    from pretrain.model.hf_import import check_init_from

    ckpt = cfg.checkpoint
    resumes = bool(ckpt.load_from) or (ckpt.resume and bool(complete_tags(Path(ckpt.dir))))
    if not resumes:
        check_init_from(cfg.model)


def launcher_command(launcher: str, nproc: int, overrides: list[str], master_port: int | None = None) -> list[str]:
    """The exact command line that starts `nproc` training processes."""
    if launcher == "deepspeed":
        cmd = [_tool("deepspeed"), "--num_gpus", str(nproc), "--no_local_rank"]
        if master_port:
            cmd += ["--master_port", str(master_port)]
        return cmd + ["--module", "pretrain.train", *overrides]
    if launcher == "torchrun":
        cmd = [_tool("torchrun"), "--nproc_per_node", str(nproc)]
        cmd += ["--standalone"] if not master_port else ["--master_addr", "127.0.0.1", "--master_port", str(master_port)]
        return cmd + ["-m", "pretrain.train", *overrides]
    if launcher == "python":
        return [sys.executable, "-m", "pretrain.train", *overrides]
    raise ValueError(f"unknown launcher {launcher!r}: deepspeed, torchrun or python")


def _tool(name: str) -> str:
    """The launcher script next to this interpreter (the venv's), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    return beside if os.path.exists(beside) else (shutil.which(name) or name)


def launch_env(gpus: int) -> dict[str, str]:
    env = dict(os.environ)
    if gpus == 0:
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("OMP_NUM_THREADS", "1")
    # A SIGTERM that reaches torchrun itself is passed on to the ranks, which then need time to save:
    # torchrun's own default before SIGKILL is 30 s.
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_GRACE_S))
    # The ranks run `python -m pretrain.train` in the user's folder, which Python would put first on the import path:
    # a folder there named tokenizer/, data/ or pretrain/ (a tokenizer output, say) would hide ayumi's own package.
    # Set, not defaulted: an empty PYTHONSAFEPATH (a shell's `export PYTHONSAFEPATH=`) means off to Python.
    env["PYTHONSAFEPATH"] = "1"
    return env


SHUTDOWN_GRACE_S = 600
"""Seconds a launcher lets the ranks finish their step and save after a SIGTERM before killing them."""
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""Signals `ayumi train` passes to every rank (SIGUSR1: a SLURM `--signal=USR1@T` choice)."""


def rank_processes(launcher_pid: int) -> list:
    """The training processes under the launcher: `pretrain.train` in their command line and a RANK in
    their environment (the launchers themselves name the module too, but have no rank)."""
    import psutil

    try:
        children = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.Error:
        return []
    ranks = []
    for child in children:
        try:
            if "pretrain.train" in " ".join(child.cmdline()) and "RANK" in child.environ():
                ranks.append(child)
        except psutil.Error:
            pass
    return ranks


def run_launcher(cmd: list[str], env: dict[str, str]) -> int:
    """Run the launcher and return its exit status, delivering SIGTERM/SIGINT/SIGUSR1 to every rank.

    The launcher starts in a session of its own, so a terminal's Ctrl-C or a scheduler's signal to this
    process reaches the ranks only through here: each rank gets the signal directly (the launchers
    would otherwise die of it, or kill the ranks 30 s later), finishes its step, saves and exits 0, and
    the launcher then exits 0 too. Before any rank exists the launcher itself gets it. If this process
    is killed outright, the ranks notice their launcher is gone (pretrain/job/launcher_watch.py).
    """
    import psutil

    proc = subprocess.Popen(cmd, env=env, start_new_session=True)

    def forward(signum, frame) -> None:
        targets = rank_processes(proc.pid) or [psutil.Process(proc.pid)]
        print(f"{PROG}: {signal.Signals(signum).name} passed to {len(targets)} training process(es): "
              "they finish the step, save and exit", file=sys.stderr, flush=True)
        for target in targets:
            try:
                target.send_signal(SIGUSR1_AS.get(signum, signum))
            except psutil.Error:
                pass

    previous = {signum: signal.signal(signum, forward) for signum in FORWARDED_SIGNALS}
    try:
        return proc.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


SIGUSR1_AS = {signal.SIGUSR1: signal.SIGTERM}
"""The ranks save on SIGTERM; SLURM's `--signal=USR1@T` (early warning) means the same here."""


PROG = "ayumi train"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(launcher options, everything else: Hydra overrides and --cfg job for pretrain.train)."""
    from common.conf import asks_for_help
    from pretrain.config import training_config_help

    # The field list is read from the config's source: only worth it when help is asked.
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, epilog=training_config_help() if asks_for_help(argv) else None,
        usage=f"{PROG} [--nproc N] [--launcher L] [--master-port P] [--dry-run] [key=value ...] [--cfg job]",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=0, help="processes (default: every GPU, or 2 on CPU)")
    parser.add_argument("--launcher", choices=["auto", "deepspeed", "torchrun", "python"], default="auto")
    parser.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: launcher's)")
    parser.add_argument("--dry-run", action="store_true", help="print the command and exit")
    return parser.parse_known_args(argv)


def main(argv: list[str]) -> int:
    from curriculum.config import CurriculumError
    from curriculum.plan import DATA_ERRORS, PlanRefused
    from pretrain.job.run_lock import check_unlocked
    from pretrain.model.hf_import import HFImportError
    from pretrain.config import (
        CHECKED_BY_LAUNCHER_ENV, EXIT_CONFIG_ERROR, ConfigError, data_parallel_grad_accum, data_parallel_size,
        default_run_notice, print_config_error,
    )
    from data.domains import validation_notice
    from data.exclude import ExcludeError
    from pretrain.excluded import plan_lines
    from pretrain.startup.checks import settled_before_launch

    args, overrides = parse_args(argv)
    try:
        # Types, ranges, names, stages, what a resume changes (pretrain/startup/resume.py), and (unless a dry run: they
        # may live on the cluster) the data's vocabulary and the task files (pretrain/startup/checks.py); no torch or
        # DeepSpeed import
        settled = settled_before_launch(overrides, check_files=not args.dry_run)
        if settled.printed:  # --cfg job: printed, nothing started
            return 0
        cfg, overrides = settled.cfg, settled.overrides  # the ranks get the run's replayed overrides too
        for line in settled.resume.lines() if settled.resume else []:
            print(f"{PROG}: {line}", flush=True)
        if settled.resume and settled.resume.complete:
            return 0
        gpus = gpu_count()
        nproc = args.nproc or (gpus if gpus else 2)
        # The ranks about to start must form whole tensor-parallel groups, and the global batch divide over the groups.
        data_parallel_grad_accum(cfg.train, data_parallel_size(cfg.parallel, nproc))
        if not args.dry_run:  # a dry run shows the command; its data may live elsewhere
            preflight_plan(cfg, nproc, gpus)
            plan_lines(cfg)  # a data.exclude file the ranks could not honour, said before any starts
            preflight_init_from(cfg)
            in_use = check_unlocked(cfg.run_dir)  # the ranks lock it; say it here once, before any starts
            if in_use:
                raise ConfigError(in_use)
    except (ConfigError, PlanRefused, CurriculumError, HFImportError, ExcludeError, *DATA_ERRORS) as err:
        # The ranks' INPUT_ERRORS, said once before any of them starts.
        print_config_error(PROG, err)
        return EXIT_CONFIG_ERROR
    notice = default_run_notice(PROG, overrides, cfg)
    if notice:
        print(notice, file=sys.stderr, flush=True)
    no_validation = None if args.dry_run else validation_notice(cfg.data.root, cfg.data.domains, cfg.data.validation)
    if no_validation:
        print(f"{PROG}: {no_validation}", flush=True)
    launcher = args.launcher if args.launcher != "auto" else ("deepspeed" if gpus else "torchrun")
    if nproc == 1 and args.launcher == "auto":
        launcher = "python"
    cmd = launcher_command(launcher, nproc, overrides, args.master_port)
    env = launch_env(gpus)
    env[CHECKED_BY_LAUNCHER_ENV] = "1"  # the ranks need not say again what runs
    print("+ " + " ".join(shlex.quote(part) for part in cmd), flush=True)
    if args.dry_run:
        return 0
    return run_job(cmd, env, cfg.run_dir)


def run_job(cmd: list[str], env: dict[str, str], run_dir: str) -> int:
    """Run the launcher; the job's status is the ranks' own when they left one (pretrain/job/exit_status.py),
    EXIT_HANG when the watchdog ended it, else the launcher's."""
    from pretrain.job.exit_status import STATUS_DIR_ENV

    started = time.time()
    with tempfile.TemporaryDirectory(prefix="ayumi-exit-") as exits:
        status = run_launcher(cmd, {**env, STATUS_DIR_ENV: exits})
        chosen = ranks_status(exits, status)
    return chosen if chosen is not None else hang_status(run_dir, started, status)


def ranks_status(folder: str, status: int) -> int | None:
    """The status the ranks left in `folder` when the launcher failed (torchrun reports their 2 or 3 as 1), their
    message repeated last so the launcher's report above does not bury it; None when they left none (a crash) or the
    first to leave was the hang watchdog (hang_status says that, naming its report)."""
    from pretrain.job.exit_status import agreed_exit, read_exits
    from pretrain.job.hang_watchdog import EXIT_HANG

    agreed = agreed_exit(read_exits(folder)) if status != 0 else None
    if agreed is None:
        return None
    chosen, messages = agreed
    if chosen == EXIT_HANG:  # the watchdog's, recorded before any other rank left: hang_status says it, with its report
        return None
    if chosen == status:  # a plain process (--nproc 1): its own line is already the last one
        return chosen
    for message in messages:
        for line in message.splitlines():
            print(f"{PROG}: {line}", file=sys.stderr, flush=True)
    if not messages:
        print(f"{PROG}: the training processes exited with status {chosen} (the launcher reported {status})",
              file=sys.stderr, flush=True)
    return chosen


def hang_status(run_dir: str, started: float, status: int) -> int:
    """The launcher's status, or EXIT_HANG when this job's ranks ended a hang (torchrun reports any failure as 1),
    so schedulers can requeue on the watchdog's own status."""
    from pretrain.job.hang_watchdog import EXIT_HANG, HANG_DIR, REPORT

    report = os.path.join(run_dir, HANG_DIR, REPORT)
    if status != 0 and os.path.exists(report) and os.path.getmtime(report) >= started:
        print(f"{PROG}: the job hung and was ended by the watchdog (exit status {EXIT_HANG}); report: {report}",
              file=sys.stderr, flush=True)
        return EXIT_HANG
    return status
