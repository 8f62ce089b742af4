"""Test harness (run by torchrun on 2 ranks): the gradient a bf16 step hands the optimizer, by accumulation dtype.

For each setup in argv[2] (a ZeRO stage, "_offload" for ZeRO-Offload: "0,1,2,3,1_offload"), builds the
cpu_tiny model in bf16 with grad accum 8 (micro batch 1, global batch 16 on 2 ranks) twice from the
same seed, with deepspeed.grad_accum_dtype=fp32 and =bf16, and runs one step's 8 micro-batches
through pretrain.engine.train_engine.TrainEngine. A hook registered before the engine's records each
micro-batch's own bf16 gradient t_k in the fp32 run (ayumi's hooks under ZeRO 0-1 and DeepSpeed's
under ZeRO 2-3 clear `param.grad` between micro-batches there). Both runs see the same t_k: same
weights, same batches. The reference is exact: the fp64 mean over the two ranks of S_r = sum_k t_k.

Writes OUT_DIR/rank<N>.json (OUT_DIR = argv[1]) with, per setup and dtype, of the full gradients g the
optimizer sees (TrainEngine.named_full_grads), A_r = sum_k |t_k| and u = 2^-8 (bf16's unit roundoff):
- rel_err: ||g - ref|| / ||ref|| (L2 over all parameters);
- over_bound: elements with |g - ref| > u (|S_0| + |S_1|) (1 + 2u) + 2^-20 (A_0 + A_1), the error of
  summing in fp32, rounding to bf16 once per rank and once in the bf16 all-reduce (ZeRO 0-1);
- over_term_bound: elements with |g - ref| > (u/2 (1 + 2u) + 2^-20) (A_0 + A_1), the error of rounding
  each micro-batch's reduced gradient to bf16 and summing those in fp32 (ZeRO 2-3).
"""
import json
import os
import sys

import torch
import torch.distributed as torch_dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))  # the repo

from pretrain.config import compose_config, to_object  # noqa: E402
from pretrain.engine.train_engine import TrainEngine  # noqa: E402
from pretrain.engine.distributed import exit_process, init_distributed
from pretrain.model.llama import Llama  # noqa: E402

GRAD_ACCUM = 8
BF16_UNIT = 2.0**-8
"""Unit roundoff of bf16 (8 significant bits): rounding moves a value by at most this, relatively."""


def one_step(setup: str, accum_dtype: str, dist_info, ids: torch.Tensor):
    """(sum of t_k, sum of |t_k|) per parameter as recorded, and the full gradients after the step's last backward.

    `setup`: the ZeRO stage, with "_offload" for ZeRO-Offload (optimizer states, and on stage 3 parameters).
    """
    stage, offload = int(setup[0]), setup.endswith("_offload")
    cfg = to_object(compose_config([
        "experiment=cpu_tiny", "model.vocab_size=512", f"deepspeed.zero_stage={stage}", "deepspeed.precision=bf16",
        f"deepspeed.grad_accum_dtype={accum_dtype}", "train.micro_batch_size=1", "train.global_batch_size=16",
        f"deepspeed.offload_optimizer={offload}", f"deepspeed.offload_param={offload and stage == 3}",
    ]))
    torch.manual_seed(cfg.train.seed)
    model = Llama(cfg.model)
    sums: dict[str, torch.Tensor] = {}
    abs_sums: dict[str, torch.Tensor] = {}

    def record(name):
        def hook(param):
            grad = param.grad.double()
            sums[name] = sums.get(name, 0) + grad
            abs_sums[name] = abs_sums.get(name, 0) + grad.abs()
        return hook

    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(record(name))
    engine = TrainEngine(model, cfg, dist_info)
    assert engine.grad_accum == GRAD_ACCUM, engine.grad_accum
    grads = None
    for micro in range(GRAD_ACCUM):
        batch = ids[dist_info.rank * GRAD_ACCUM + micro].unsqueeze(0)
        out = engine.forward(batch[:, :-1], batch[:, 1:])
        engine.backward(out.loss)
        if micro == GRAD_ACCUM - 1:
            grads = {name.removeprefix("module."): g.double().clone() for name, g in engine.named_full_grads()}
        engine.micro_step()
    return sums, abs_sums, grads


def over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    total = tensor.clone()
    torch_dist.all_reduce(total)
    return total


def main() -> None:
    out_dir, setups = sys.argv[1], sys.argv[2].split(",")
    dist_info = init_distributed("cpu")
    assert dist_info.world_size == 2
    ids = torch.randint(0, 512, (2 * GRAD_ACCUM, 65), generator=torch.Generator().manual_seed(7))
    result = {}
    for setup in setups:
        reference = bound = term_bound = None
        for accum_dtype in ("fp32", "bf16"):
            sums, abs_sums, grads = one_step(setup, accum_dtype, dist_info, ids)
            if reference is None:  # from the fp32 run, where each record is one micro-batch's gradient
                reference = {n: over_ranks(s) / 2 for n, s in sums.items()}
                bound = {n: BF16_UNIT * over_ranks(s.abs()) * (1 + 2 * BF16_UNIT) + 2.0**-20 * over_ranks(abs_sums[n])
                         for n, s in sums.items()}
                term_bound = {n: (BF16_UNIT / 2 * (1 + 2 * BF16_UNIT) + 2.0**-20) * over_ranks(a) for n, a in abs_sums.items()}
            diff = sum(float((grads[n] - reference[n]).pow(2).sum()) for n in reference) ** 0.5
            norm = sum(float(reference[n].pow(2).sum()) for n in reference) ** 0.5
            result[f"zero{setup}/{accum_dtype}"] = {
                "same_names": sorted(grads) == sorted(reference),
                "rel_err": diff / norm,
                "over_bound": sum(int(((grads[n] - reference[n]).abs() > bound[n]).sum()) for n in reference),
                "over_term_bound": sum(int(((grads[n] - reference[n]).abs() > term_bound[n]).sum()) for n in reference),
                "elements": sum(t.numel() for t in reference.values()),
            }
    with open(os.path.join(out_dir, f"rank{dist_info.rank}.json"), "w") as handle:
        json.dump(result, handle)
    exit_process(0)


if __name__ == "__main__":
    main()
