"""Test harness (run by torchrun on 2 ranks): ZeRO-3 partitioned construction vs a whole model.

Builds the cpu_tiny model through pretrain.engine.train_engine.build_model with deepspeed.zero3_init on, and
writes OUT_DIR/rank<N>.json per rank (OUT_DIR = argv[1]): whether every parameter was partitioned at construction (no rank
held it whole), whether each one, gathered, equals the same-seed model built whole (cast to the
training dtype), whether the weight-decay groups came out the same, and whether the global CPU random generator
is where it was before the build (each parameter draws from a generator of its own, seeded from cfg.train.seed
and its name). It leaves through exit_process, as pretrain.train does: a plain end of the script could abort in
Python's shutdown.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from pretrain.config import compose_config, to_object  # noqa: E402
from pretrain.engine.train_engine import build_model  # noqa: E402
from pretrain.engine.distributed import exit_process, init_distributed  # noqa: E402
from pretrain.model.llama import Llama, no_weight_decay  # noqa: E402
from pretrain.engine.optimizer import param_groups  # noqa: E402

import deepspeed  # noqa: E402  (test code may import it: the check is about DeepSpeed's partitioning)

cfg = to_object(compose_config(["experiment=cpu_tiny", "model.vocab_size=512", "deepspeed.zero_stage=3",
                                   "deepspeed.zero3_init=true", "deepspeed.precision=bf16"]))
dist = init_distributed("cpu")
torch.manual_seed(cfg.train.seed + 1000 * dist.rank)  # each rank's own stream, as pretrain.train sets it later
generator_before = torch.get_rng_state()
model = build_model(lambda init_weights: Llama(cfg.model, init_weights=init_weights), cfg, dist)
same_generator = torch.equal(generator_before, torch.get_rng_state())
whole = Llama(cfg.model, seed=cfg.train.seed).to(torch.bfloat16)

expected = dict(whole.named_parameters())
partitioned = all(p.numel() == 0 and 0 < p.ds_tensor.numel() < p.ds_numel for p in model.parameters())
same = True
for name, param in model.named_parameters():
    with deepspeed.zero.GatheredParameters([param]):
        same &= param.dtype == torch.bfloat16 and torch.equal(param.data, expected[name].data)
names = [[no_weight_decay(n, p) for n, p in model.named_parameters()], [no_weight_decay(n, p) for n, p in whole.named_parameters()]]
groups = [len(g["params"]) for g in param_groups(model.named_parameters(), 0.1)]
result = dict(rank=dist.rank, partitioned=partitioned, same_init=same, same_decay_split=names[0] == names[1],
              groups=groups, same_generator=same_generator)
with open(os.path.join(sys.argv[1], f"rank{dist.rank}.json"), "w") as handle:
    json.dump(result, handle)
exit_process(0)
