"""A fork server for the tests' training ranks: torch, DeepSpeed and ayumi imported once, each rank a fork.

A 2-rank job started through torchrun costs about 16 CPU-seconds on the test machines whatever its length: the
launcher and each rank import torch (3 s each), and the ranks DeepSpeed and ayumi (1.5 s more), then torch's
dynamo when the optimizer is built (2.5 s more). With most of the suite made of short 2-rank jobs, that start-up
was most of its time. This server imports it all once (per test
worker) and forks one process per rank, so a rank starts in milliseconds.

A rank here is the product's own entry point (`pretrain.train.main`, or a test harness script) in a process of
its own, with the environment a launcher gives it (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT; none for one rank, as `python -m pretrain.train`), talking gloo to the other ranks as under
torchrun. What it does not reproduce is the launcher itself: tests of launcher behaviour (signals through
torchrun or `deepspeed`, its exit statuses, a dead launcher) keep the real ones (tests/helpers.run_training).
Like torchrun, when one rank fails the others are stopped (SIGTERM, then SIGKILL after a grace period).

The server never computes anything itself (a fork after OpenMP has started its threads can hang the child), and
environment variables read at import time (FROZEN_ENV) are fixed when it starts: a job that needs other values
is run by a real launcher instead.

Protocol: one JSON request per line on stdin ({"ranks", "argv", "entry", "env", "cwd", "log", "timeout"}), one
JSON answer per line on stdout ({"codes": [...], "timed_out": bool}).
"""
from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
import traceback

FROZEN_ENV = ("DS_ACCELERATOR", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
              "PYTHONPATH", "LD_PRELOAD", "PYTHONHASHSEED", "CUDA_VISIBLE_DEVICES", "HOME",
              "TORCH_LOGS", "AYUMI_CONF_DIR", "XDG_CACHE_HOME")
"""Read when a module loads (by torch, OpenMP, Python, or ayumi: common/conf.py's CONF_DIR, the precision probe's
cache file): a job whose environment differs here cannot use the server."""

GRACE_S = 10.0
"""After one rank fails, how long the others get to stop on SIGTERM before SIGKILL (torchrun's way)."""


def preload() -> None:
    """Everything a training rank imports, imported once (nothing is computed)."""
    import deepspeed  # noqa: F401
    import deepspeed.runtime.engine  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (torch's optimizers import it when built: 2.5 s a rank)
    # DeepSpeed's ZeRO optimizer check imports its Muon module, which calls torch.compile at import and so imports
    # inductor: 0.9 s a rank of every ZeRO 1-3 job.
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    # What DeepSpeed's engine imports lazily in every rank: its AutoEP config check, and distutils (with setuptools
    # behind it) for its op builders' compiler probe. 0.1-0.5 s a rank.
    import deepspeed.module_inject.auto_ep_config  # noqa: F401
    import distutils.ccompiler  # noqa: F401
    import distutils.sysconfig  # noqa: F401

    import pretrain.train  # noqa: F401


def run_rank(rank: int, request: dict, port: int) -> None:
    """In the forked child: become rank `rank` of the request's job, run it, and leave with its status."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group: a timeout kills the rank and anything it started
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.chdir(request["cwd"])
        env = dict(request["env"])
        if request["ranks"] > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(request["ranks"]),
                       LOCAL_WORLD_SIZE=str(request["ranks"]), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
        os.environ.clear()
        os.environ.update(env)
        if request.get("entry"):
            sys.argv = [request["entry"], *request["argv"]]
            try:
                runpy.run_path(request["entry"], run_name="__main__")
                code = 0
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        else:
            import pretrain.train

            sys.argv = ["pretrain.train", *request["argv"]]
            code = pretrain.train.main(list(request["argv"]))
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # as an uncaught exception in a real process: the traceback, status 1
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(int(code or 0) & 0xFF)


def wait_for(pids: list[int], timeout: float) -> tuple[list[int], bool]:
    """Exit statuses (negative: killed by that signal) of every rank; stops the rest when one fails."""
    codes: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    timed_out = False
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid in pids:
            codes[pid] = os.waitstatus_to_exitcode(status)
            if codes[pid] != 0 and failed_at is None:
                failed_at = time.monotonic()
                _signal_all(pids, codes, signal.SIGTERM)
            continue
        now = time.monotonic()
        if failed_at is not None and now - failed_at > GRACE_S:
            _signal_all(pids, codes, signal.SIGKILL)
        if now > deadline and not timed_out:
            timed_out = True
            _signal_all(pids, codes, signal.SIGKILL)
        time.sleep(0.02)
    return [codes[pid] for pid in pids], timed_out


def _signal_all(pids: list[int], done: dict[int, int], sig: int) -> None:
    for pid in pids:
        if pid not in done:
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass


def serve() -> None:
    preload()
    answer = sys.stdout
    print(json.dumps({"ready": os.getpid()}), file=answer, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        port = request.get("port", 0)
        sys.stdout.flush()
        sys.stderr.flush()
        pids = []
        for rank in range(request["ranks"]):
            pid = os.fork()
            if pid == 0:
                run_rank(rank, request, port)
            try:
                os.setpgid(pid, pid)  # as the child does: whichever runs first, the group exists before a kill
            except (PermissionError, ProcessLookupError):
                pass
            pids.append(pid)
        codes, timed_out = wait_for(pids, request["timeout"])
        print(json.dumps({"codes": codes, "timed_out": timed_out}), file=answer, flush=True)


if __name__ == "__main__":
    serve()
