"""TrainEngine on DeepSpeed's gradient accumulation: real DeepSpeed engines on CPU."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, cpu_env, free_port

pytestmark = pytest.mark.slow


BOUNDARY_CHECK = r"""
import json, sys, torch
sys.path.insert(0, {repo!r})
from pretrain.config import compose_config, to_object
from pretrain.engine import TrainEngine, finalize_distributed, init_distributed
from pretrain.model.llama import Llama

dist = init_distributed("cpu")
seen = {{}}
for stage in (1, 2, 3):
    cfg = to_object(compose_config(["experiment=cpu_tiny", f"deepspeed.zero_stage={{stage}}", "deepspeed.precision=bf16",
                                    "train.micro_batch_size=1", "train.global_batch_size=4"]))
    engine = TrainEngine(Llama(cfg.model), cfg, dist)
    flags = []
    for param in engine.module.parameters():
        param.register_post_accumulate_grad_hook(lambda p: flags.append(engine.optimizer.is_gradient_accumulation_boundary()))
    ids = torch.randint(0, 512, (1, 65), generator=torch.Generator().manual_seed(0))
    seen[stage] = []
    for micro in range(2 * engine.grad_accum):
        flags.clear()
        out = engine.forward(ids[:, :-1], ids[:, 1:])
        engine.backward(out.loss)
        seen[stage].append([engine.engine.is_gradient_accumulation_boundary(), sorted(set(flags))])
        engine.micro_step()
print("RESULT " + json.dumps(seen))
finalize_distributed()
"""


def test_zero_optimizers_know_the_step_boundary_during_backward():
    """DeepSpeed mirrors the accumulation boundary into its ZeRO optimizer from a hook on the forward's
    output tensors, which it does not find inside LlamaOutput; TrainEngine.backward sets it. Every
    gradient hook of a micro-batch must see that micro-batch's answer (1 rank, grad accum 4, 2 steps)."""
    env = cpu_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, "-c", BOUNDARY_CHECK.format(repo=str(REPO))], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-4000:]
    expected = [[micro % 4 == 3, [micro % 4 == 3]] for micro in range(8)]
    assert json.loads(lines[-1][len("RESULT "):]) == {str(stage): expected for stage in (1, 2, 3)}
