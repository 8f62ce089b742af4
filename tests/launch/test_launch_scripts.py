"""launch/*.sh and slurm.sbatch: the commands they print with --dry-run, their errors, and (slow)
real runs of slurm.sbatch through stand-ins for srun/scontrol/scancel on this machine's CPU."""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, cpu_env, free_port, read_jsonl, tiny_overrides, write_tiny_corpus

LAUNCH = REPO / "launch"


def run_script(script: str, *args: str, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "AYUMI_", "OMP_", "MASTER_"))}
    base.update(env or {})
    return subprocess.run(["bash", str(LAUNCH / script), *args], cwd=kwargs.pop("cwd", REPO), env=base,
                          capture_output=True, text=True, timeout=60, **kwargs)


def printed_command(proc: subprocess.CompletedProcess) -> list[str]:
    """The words of the "+ COMMAND" line (shell-quoted as a user would copy it)."""
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("+ ")]
    assert len(lines) == 1, proc.stdout
    return shlex.split(lines[0][2:])


def test_scripts_parse():
    for script in ("env.sh", "local.sh", "multinode.sh", "slurm.sbatch"):
        subprocess.run(["bash", "-n", str(LAUNCH / script)], check=True)


# ---- local.sh ---------------------------------------------------------------------------------


def test_local_cpu_uses_torchrun_with_two_processes():
    proc = run_script("local.sh", "--dry-run", "experiment=cpu_tiny", "name=my run", env={"AYUMI_GPUS": "0"})
    cmd = printed_command(proc)
    assert Path(cmd[0]).name == "torchrun"
    assert cmd[1:] == ["--nproc_per_node", "2", "--standalone", "-m", "pretrain.train", "experiment=cpu_tiny", "name=my run"]
    assert "DS_ACCELERATOR=cpu" in proc.stdout and "OMP_NUM_THREADS=" in proc.stdout


def test_local_gpus_use_the_deepspeed_launcher_without_local_rank():
    cmd = printed_command(run_script("local.sh", "--dry-run", "experiment=llama_1b_example", env={"AYUMI_GPUS": "8"}))
    assert Path(cmd[0]).name == "deepspeed"
    assert cmd[1:] == ["--num_gpus", "8", "--no_local_rank", "--module", "pretrain.train", "experiment=llama_1b_example"]


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_local_matches_ayumi_train(launcher):
    """launch/local.sh and `ayumi train` (pretrain/tools/launch.py) start the same command."""
    from pretrain.tools.launch import launcher_command

    shell = printed_command(run_script("local.sh", "--dry-run", "--launcher", launcher, "--nproc", "3",
                                       "--master-port", "29511", "train.tokens=1000", env={"AYUMI_GPUS": "0"}))
    python = launcher_command(launcher, 3, ["train.tokens=1000"], master_port=29511)
    assert Path(shell[0]).name == Path(python[0]).name and shell[1:] == python[1:]


def test_local_run_name_pin_and_errors():
    cmd = printed_command(run_script("local.sh", "--dry-run", env={"AYUMI_GPUS": "0", "AYUMI_RUN_NAME": "pinned"}))
    assert cmd[-1] == "name=pinned"
    cmd = printed_command(run_script("local.sh", "--dry-run", "name=mine", env={"AYUMI_GPUS": "0", "AYUMI_RUN_NAME": "pinned"}))
    assert cmd[-1] == "name=mine" and "name=pinned" not in cmd
    bad = run_script("local.sh", "--dry-run", "--launcher", "mpirun")
    assert bad.returncode == 2 and "--launcher must be deepspeed or torchrun, got 'mpirun'" in bad.stderr


def test_env_defaults_yield_to_the_environment():
    script = f"source {LAUNCH / 'env.sh'}; echo $NCCL_DEBUG $NCCL_IB_TIMEOUT $TORCH_NCCL_ASYNC_ERROR_HANDLING $PYTHONPATH"
    out = subprocess.run(["bash", "-c", script], env={"PATH": os.environ["PATH"], "NCCL_DEBUG": "INFO"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["INFO", "22", "1", str(REPO)]


# ---- multinode.sh ------------------------------------------------------------------------------


def test_multinode_command_and_forwarded_environment(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nnode-a slots=4\n\nnode-b slots=4\n")
    env = {"AYUMI_RUN_ROOT": str(tmp_path / "runs"), "WANDB_API_KEY": "secret", "WANDB_MODE": "offline"}
    proc = run_script("multinode.sh", "--dry-run", "--hostfile", str(hostfile), "--master-port", "29601",
                      "experiment=llama_1b_example", env=env)
    cmd = printed_command(proc)
    assert Path(cmd[0]).name == "deepspeed"
    assert cmd[1:9] == ["--hostfile", str(hostfile), "--master_addr", "node-a", "--master_port", "29601", "--launcher", "pdsh"]
    assert cmd[-3:] == ["--module", "pretrain.train", "experiment=llama_1b_example"] and "--no_local_rank" in cmd
    forwarded = [line[4:] for line in proc.stdout.splitlines() if line.startswith("#   ")]
    assert f"AYUMI_RUN_ROOT={tmp_path / 'runs'}" in forwarded and "WANDB_MODE=offline" in forwarded
    assert any(line.startswith("OMP_NUM_THREADS=") for line in forwarded)
    assert not any("WANDB_API_KEY" in line or "secret" in line for line in forwarded)
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing


def test_multinode_needs_a_hostfile(tmp_path):
    proc = run_script("multinode.sh", "--dry-run", "x=1")
    assert proc.returncode == 2 and "no hostfile" in proc.stderr and "hostfile.example" in proc.stderr
    proc = run_script("multinode.sh", "--dry-run", "--hostfile", str(tmp_path / "missing"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr


# ---- slurm.sbatch --------------------------------------------------------------------------------

FAKE_ALLOCATION = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_NUM_NODES": "2"}


def node_command(cmd: list[str]) -> list[str]:
    """The words of the `bash -c '...'` each node runs, after `exec`."""
    assert cmd[0] == "srun" and cmd[-3:-1] == ["bash", "-c"], cmd
    words = shlex.split(cmd[-1])
    return words[words.index("exec") + 1:]


def test_slurm_torchrun_variant(tmp_path):
    env = {**FAKE_ALLOCATION, "SLURM_GPUS_PER_NODE": "h100:4", "SLURM_CPUS_PER_TASK": "32", "AYUMI_RUN_ROOT": str(tmp_path)}
    proc = run_script("slurm.sbatch", "--dry-run", "experiment=llama_1b_example", env=env)
    cmd = printed_command(proc)
    assert cmd[1:6] == ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=0", "--cpus-per-task=32"]
    node = node_command(cmd)
    assert Path(node[0]).name == "torchrun"
    assert node[1:] == ["--nnodes", "2", "--nproc_per_node", "4", "--master_addr", "gpu07", "--master_port",
                        str(20000 + 4242 % 20000), "--node_rank", "$SLURM_NODEID", "-m", "pretrain.train",
                        "experiment=llama_1b_example"]
    assert "scancel --signal=TERM 4242" in proc.stdout
    assert f"run root {tmp_path}" in proc.stdout


def test_slurm_deepspeed_variant_hostfile_from_the_allocation(tmp_path):
    env = {**FAKE_ALLOCATION, "SLURM_GPUS_ON_NODE": "8", "AYUMI_RUN_ROOT": str(tmp_path), "AYUMI_REQUEUE": "1",
           "AYUMI_RUN_NAME": "llama1b"}
    proc = run_script("slurm.sbatch", "--dry-run", "--launcher", "deepspeed", env=env)
    node = node_command(printed_command(proc))
    hostfile = str(tmp_path / ".launch" / "hostfile.4242")
    assert Path(node[0]).name == "deepspeed"
    assert node[1:] == ["--hostfile", hostfile, "--no_ssh", "--master_addr", "gpu07", "--master_port", "24242",
                        "--no_local_rank", "--node_rank", "$SLURM_NODEID", "--module", "pretrain.train", "name=llama1b"]
    assert "#   gpu07 slots=8\n#   gpu08 slots=8" in proc.stdout
    assert "then scontrol requeue 4242" in proc.stdout
    assert not Path(hostfile).exists()


def test_slurm_header_asks_for_the_warning_signal():
    header = [line for line in (LAUNCH / "slurm.sbatch").read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --signal=B:TERM@120" in header and "#SBATCH --requeue" in header
    assert "#SBATCH --ntasks-per-node=1" in header


def test_slurm_outside_an_allocation_says_how_to_dry_run():
    proc = run_script("slurm.sbatch", "--dry-run")
    assert proc.returncode == 2 and "not inside a SLURM allocation" in proc.stderr and "SLURM_JOB_NODELIST=" in proc.stderr


def test_nodelist_expansion_without_scontrol():
    script = f"source {LAUNCH / 'env.sh'}; ayumi_hostnames 'gpu[008-010,12],login,r[1-2]n[1-2]'"
    env = {"PATH": "/usr/bin:/bin", "AYUMI_PYTHON": os.sys.executable}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["gpu008", "gpu009", "gpu010", "gpu12", "login", "r1n1", "r1n2", "r2n1", "r2n2"]


# ---- slow: slurm.sbatch for real, two "nodes" on this machine --------------------------------

# srun stand-in: runs the `bash -c CMD` once per node in its own session (as slurmstepd runs each
# task in its own cgroup), with SLURM_NODEID set; records the task pids for the scancel stand-in.
FAKE_SRUN = """#!/bin/bash
nodes=1
for arg in "$@"; do [[ "$arg" == --nodes=* ]] && nodes="${arg#--nodes=}"; done
command="${@: -1}"
pids=()
for ((i = 0; i < nodes; i++)); do
    SLURM_NODEID=$i setsid bash -c "$command" > "$FAKE_SLURM_DIR/node$i.log" 2>&1 &
    pids+=($!)
done
printf '%s\\n' "${pids[@]}" > "$FAKE_SLURM_DIR/tasks"
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""
# scancel --signal=TERM JOB: signal every process of every task (slurmstepd signals the step's cgroup).
FAKE_SCANCEL = """#!/bin/bash
echo "scancel $*" >> "$FAKE_SLURM_DIR/calls"
while read -r pid; do kill -TERM -- "-$pid" 2>/dev/null; done < "$FAKE_SLURM_DIR/tasks"
"""
FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$FAKE_SLURM_DIR/calls"
[[ "$1 $2" == "show hostnames" ]] && tr , '\\n' <<< "$3"
exit 0
"""


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scancel", FAKE_SCANCEL), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    corpus = write_tiny_corpus(tmp_path / "corpus")
    env = cpu_env(PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_SLURM_DIR=str(tmp_path), SLURM_JOB_ID="77",
                  SLURM_JOB_NODELIST="localhost,127.0.0.1", SLURM_GPUS_ON_NODE="0", AYUMI_NPROC_PER_NODE="1",
                  MASTER_PORT=str(free_port()), AYUMI_RUN_ROOT=str(tmp_path / "runs"))
    env.pop("OMP_NUM_THREADS", None)
    return tmp_path, corpus, env


def node_logs(tmp_path: Path) -> str:
    return "\n".join(path.read_text() for path in sorted(tmp_path.glob("node*.log")))


@pytest.mark.slow
def test_slurm_deepspeed_variant_trains_across_two_nodes(fake_slurm):
    tmp_path, corpus, env = fake_slurm
    overrides = tiny_overrides(corpus, tmp_path / "ignored", "train.max_steps=3", "checkpoint.interval=0")
    overrides = [o for o in overrides if not o.startswith("run_root=")]  # the script pins AYUMI_RUN_ROOT
    proc = subprocess.run(["bash", str(LAUNCH / "slurm.sbatch"), "--launcher", "deepspeed", *overrides], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr + node_logs(tmp_path)
    run_dir = tmp_path / "runs" / "cpu_tiny"
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert steps == [1, 2, 3]
    assert (tmp_path / "runs" / ".launch" / "hostfile.77").read_text() == "localhost slots=1\n127.0.0.1 slots=1\n"
    for node in (0, 1):  # each node's launcher joined one 2-process world
        assert "dist_world_size=2" in (tmp_path / f"node{node}.log").read_text()


@pytest.mark.slow
def test_slurm_sigterm_is_forwarded_saved_and_requeued(fake_slurm):
    tmp_path, corpus, env = fake_slurm
    overrides = [o for o in tiny_overrides(corpus, tmp_path, "train.tokens=1000000", "checkpoint.interval=0")
                 if not o.startswith("run_root=")]
    env["AYUMI_REQUEUE"] = "1"
    batch = subprocess.Popen(["bash", str(LAUNCH / "slurm.sbatch"), *overrides], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics_file = tmp_path / "runs" / "cpu_tiny" / "metrics.jsonl"
    deadline = time.time() + 150
    while time.time() < deadline and batch.poll() is None:
        if metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    else:
        batch.kill()
        pytest.fail("training ended or never reached step 3: " + batch.communicate()[0] + node_logs(tmp_path)[-4000:])
    batch.send_signal(signal.SIGTERM)  # what --signal=B:TERM@120 does: the batch shell only
    out, _ = batch.communicate(timeout=150)

    assert batch.returncode == 0, out + node_logs(tmp_path)[-4000:]
    calls = (tmp_path / "calls").read_text().splitlines()
    assert "scancel --signal=TERM 77" in calls and "scontrol requeue 77" in calls
    stops = [e for e in read_jsonl(tmp_path / "runs" / "cpu_tiny" / "events.jsonl") if e["event"] == "signal_stop"]
    assert len(stops) == 1
    latest = (tmp_path / "runs" / "cpu_tiny" / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{stops[0]['step']:07d}"
