"""`ayumi train`: run pretrain.train on this machine with the right launcher.

- GPUs visible: `deepspeed --num_gpus N --module pretrain.train ...` (one process per GPU).
- CPU only: `torchrun --standalone --nproc_per_node 2 -m pretrain.train ...` with
  DS_ACCELERATOR=cpu and gloo. torchrun starts faster than the deepspeed launcher on CPU and
  gives bitwise-equal losses (shared/DEEPSPEED_CPU.md); `--launcher deepspeed` picks the latter.

Multi-node and SLURM launches are the scripts under launch/.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # torch missing or broken CUDA: treat as CPU
        return 0


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
    return env


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="ayumi train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=0, help="processes (default: every GPU, or 2 on CPU)")
    parser.add_argument("--launcher", choices=["auto", "deepspeed", "torchrun", "python"], default="auto")
    parser.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: launcher's)")
    parser.add_argument("--dry-run", action="store_true", help="print the command and exit")
    return parser.parse_known_args(argv)


def main(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    if "--cfg" in overrides:  # print the resolved config without starting processes
        from pretrain.train import main as train_main

        return train_main(overrides)
    gpus = gpu_count()
    nproc = args.nproc or (gpus if gpus else 2)
    launcher = args.launcher if args.launcher != "auto" else ("deepspeed" if gpus else "torchrun")
    if nproc == 1 and args.launcher == "auto":
        launcher = "python"
    cmd = launcher_command(launcher, nproc, overrides, args.master_port)
    env = launch_env(gpus)
    print("+ " + " ".join(shlex.quote(part) for part in cmd), flush=True)
    if args.dry_run:
        return 0
    return subprocess.call(cmd, env=env)
