"""Shared test helpers: small real-text shards and environment for DeepSpeed runs on CPU."""
from __future__ import annotations

import os
from pathlib import Path

from data.token_root import TokenRoot

REPO = Path(__file__).resolve().parents[1]

# Real text (public domain: the opening of Natsume Soseki's "I Am a Cat" and Jane Austen's
# "Pride and Prejudice"), encoded as UTF-8 bytes: a byte-level vocabulary needs no tokenizer.
JA_TEXT = (
    "吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。何でも薄暗いじめじめした所で"
    "ニャーニャー泣いていた事だけは記憶している。吾輩はここで始めて人間というものを見た。"
)
EN_TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be "
    "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
    "surrounding families, that he is considered the rightful property of some one or other of their daughters."
)
EOS = 256
VOCAB = 512


def byte_tokens(text: str) -> list[int]:
    return list(text.encode("utf-8")) + [EOS]


def write_tiny_corpus(root: Path, repeats: int = 40, val_docs: int = 4, vocab_size: int = VOCAB) -> Path:
    """DATA_ROOT with ja/ and en/ domains (train + val) of byte tokens, repeated so loss can fall. `vocab_size`: the
    vocabulary its manifest records (a larger one stands for data made by a larger tokenizer)."""
    with TokenRoot(root, vocab_size=vocab_size, eos_id=EOS, name="tiny") as out:
        for name, text in (("ja", JA_TEXT), ("en", EN_TEXT)):
            for split, count in (("train", repeats), ("val", val_docs)):
                with out.shard(name, split) as writer:
                    for i in range(count):
                        writer.add_document(byte_tokens(text))
    return root


def cpu_env(**extra: str) -> dict[str, str]:
    """Environment for a DeepSpeed subprocess on CPU (no GPU, no W&B network)."""
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", WANDB_MODE="offline", WANDB_SILENT="true", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def read_jsonl(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def train_losses(run_dir: Path) -> dict[int, float]:
    """step -> train/loss from a run's metrics.jsonl."""
    return {rec["step"]: rec["train/loss"] for rec in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in rec}


def run_whole_and_resumed(corpus: Path, tmp_path: Path, common: list[str], stop_at: int, first_ranks: int = 2,
                          then_ranks: int = 2):
    """The same job twice: in one go on 2 ranks (tmp_path/full), and stopped after `stop_at` steps
    on `first_ranks` then resumed on `then_ranks` (tmp_path/split). 1 rank runs as a plain process.
    Returns (the whole run's losses, the resumed run's losses, the resuming process)."""
    def launch(run_root: Path, nproc: int, *extra: str):
        proc = run_training(tiny_overrides(corpus, run_root, *common, *extra), nproc=nproc, launcher="fork")
        assert proc.returncode == 0, proc.stdout[-6000:]
        return proc

    launch(tmp_path / "full", 2)
    launch(tmp_path / "split", first_ranks, f"train.max_steps={stop_at}")
    resumed = launch(tmp_path / "split", then_ranks)
    assert "resumed from" in resumed.stdout
    return train_losses(tmp_path / "full" / "cpu_tiny"), train_losses(tmp_path / "split" / "cpu_tiny"), resumed


PARALLEL_COMPARISON_STEPS = 30
PARALLEL_COMPARISON = ["deepspeed=zero1", "deepspeed.precision=fp32", f"train.max_steps={PARALLEL_COMPARISON_STEPS}",
                       "checkpoint.interval=0", "train.eval_interval=0"]
"""The job a parallel layout is compared on against one rank: fp32 (so differences are rounding only), ZeRO-1,
evaluation at the end."""


def train_side_by_side(root: Path, common: list[str], runs: list[tuple[str, int, list[str]]]) -> dict:
    """A tiny corpus under `root` and one cpu_tiny job per (name, ranks, extra overrides) on it, each in
    root/name (forked ranks). Returns {"corpus", "root", name: its run dir, name + "_log": its output}."""
    corpus = write_tiny_corpus(root / "corpus")
    out = {"corpus": corpus, "root": root}
    for name, nproc, extra in runs:
        proc = run_training(tiny_overrides(corpus, root / name, *common, *extra), nproc=nproc, launcher="fork")
        assert proc.returncode == 0, proc.stdout[-6000:]
        out[name] = root / name / "cpu_tiny"
        out[name + "_log"] = proc.stdout
    return out


def tiny_overrides(data_root: Path, run_root: Path, *extra: str) -> list[str]:
    """The cpu_tiny experiment on a test corpus, W&B off unless a test turns it on."""
    return ["experiment=cpu_tiny", f"data.root={data_root}", f"run_root={run_root}", "logging=none", *extra]


def run_training(overrides: list[str], nproc: int = 2, launcher: str = "torchrun", entry: str | None = None,
                 timeout: int = 300, env: dict | None = None, **popen):
    """Start a real multi-process training job and wait for it: through torchrun, the deepspeed launcher, plain
    python (one rank), or `fork`: each rank forked from the test worker's rank server (tests/rank_server.py), the
    same entry point and launcher environment without paying torch's import per process. `fork` is for jobs whose
    test is about training, not about the launcher; it falls back to torchrun (python for one rank) when `env`
    changes what is read at import time, or when extra Popen arguments are given.

    `entry` replaces `-m pretrain.train` with a script (e.g. the fp16 test harness).
    Returns the CompletedProcess with stdout and stderr merged.
    """
    import subprocess

    from pretrain.tools.launch import launcher_command

    if launcher == "fork":
        answer = _rank_server().run(nproc, overrides, entry, env or cpu_env(), timeout) if not popen else None
        if answer is not None:
            return answer
        launcher = "python" if nproc == 1 else "torchrun"

    cmd = launcher_command(launcher, nproc, overrides, master_port=free_port())
    if entry is not None:
        module_at = cmd.index("-m" if launcher != "deepspeed" else "--module")
        cmd[module_at:module_at + 2] = [entry]
    return subprocess.run(cmd, cwd=REPO, env=env or cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout, **popen)


def run_one_rank_script(script: str, timeout: int = 300) -> object:
    """Run `script` (Python source) as rank 0 of a 1-rank process group on CPU and return the JSON of its last
    `RESULT ` line; fails the test with the output's tail when it exits non-zero or prints none."""
    import json
    import subprocess
    import sys

    env = cpu_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RankServer:
    """The client of one tests/rank_server.py process (one per test worker, started on first use)."""

    def __init__(self):
        import subprocess
        import sys

        self.env = cpu_env()
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.rank_server"], cwd=REPO, env=self.env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self.proc.stdout.readline()
        if '"ready"' not in ready:
            raise RuntimeError(f"tests/rank_server.py did not start: {ready!r}")

    def serves(self, env: dict) -> bool:
        from tests.rank_server import FROZEN_ENV

        return self.proc.poll() is None and all(env.get(key) == self.env.get(key) for key in FROZEN_ENV)

    def run(self, nproc: int, argv: list[str], entry: str | None, env: dict, timeout: float):
        """The job's CompletedProcess (stdout: every rank's output, merged), or None when it cannot serve env."""
        import json
        import subprocess
        import tempfile

        if not self.serves(env):
            return None
        with tempfile.NamedTemporaryFile("r", suffix=".log", encoding="utf-8", errors="replace") as log:
            request = {"ranks": nproc, "argv": list(argv), "entry": str(entry) if entry else None, "env": dict(env),
                       "cwd": str(REPO), "log": log.name, "timeout": timeout, "port": free_port()}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            answer = json.loads(self.proc.stdout.readline())
            output = log.read()
        args = ["rank_server", str(nproc), *argv]
        if answer["timed_out"]:
            raise subprocess.TimeoutExpired(args, timeout, output=output)
        failed = [code for code in answer["codes"] if code != 0]
        return subprocess.CompletedProcess(args, failed[0] if failed else 0, stdout=output)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


_SERVER: list[RankServer] = []


def _rank_server() -> RankServer:
    """This process's rank server, started on first use and closed at exit."""
    import atexit

    if not _SERVER or _SERVER[0].proc.poll() is not None:
        _SERVER[:] = [RankServer()]
        atexit.register(_SERVER[0].close)
    return _SERVER[0]
