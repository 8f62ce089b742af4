"""How many intra-op threads a CPU rank takes (pretrain.engine.distributed.cpu_threads), in the process that
joins the group: a user's OMP_NUM_THREADS is kept, torchrun's default 1 on several ranks is not."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pretrain.engine.distributed import cpu_threads
from tests.helpers import REPO, cpu_env, free_port

CORES = os.cpu_count() or 1


@pytest.mark.parametrize("environ, local_world, expected", [
    ({}, 1, CORES),
    ({}, 2, max(1, CORES // 2)),
    ({"OMP_NUM_THREADS": "1"}, 1, 1),  # one rank: torchrun sets nothing, so the 1 is the user's
    ({"OMP_NUM_THREADS": "1"}, 2, max(1, CORES // 2)),  # several ranks: torchrun's own default
    ({"OMP_NUM_THREADS": "3"}, 2, 3),
    ({"OMP_NUM_THREADS": "many"}, 1, CORES),
    ({"OMP_NUM_THREADS": "0"}, 1, CORES),
])
def test_threads_follow_the_cores_unless_the_user_said(environ, local_world, expected):
    assert cpu_threads(local_world, environ) == expected


def test_a_single_rank_run_keeps_omp_num_threads_1():
    """The process group is really joined (gloo, one rank) and torch's thread count read afterwards."""
    script = ("import torch; from pretrain.engine.distributed import init_distributed; "
              "init_distributed('cpu'); print('threads', torch.get_num_threads())")
    env = cpu_env(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                  WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "threads 1" in proc.stdout.splitlines()[-1]
