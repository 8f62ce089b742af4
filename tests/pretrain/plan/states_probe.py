"""Run as a script (one rank, or each rank under torchrun): the model states a DeepSpeed engine keeps between
steps, in bytes per parameter, measured with glibc's accounting as memory_probe.py does, for test_memory.py.

Argv: ZeRO stage, precision, micro batches per step. Prints one JSON line per rank: the bytes in use after two
full steps (activations freed) beyond those before the model was built, and the plan's resident model states.
"""
import gc
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from pretrain.config import compose_config, to_object  # noqa: E402
from pretrain.engine.distributed import init_distributed  # noqa: E402
from pretrain.engine.host_memory import keep_freed_memory_for_reuse  # noqa: E402
from pretrain.engine.train_engine import TrainEngine, build_model  # noqa: E402
from pretrain.model.llama import Llama  # noqa: E402
from pretrain.plan.memory import estimate_memory, memory_shape  # noqa: E402
from tests.pretrain.plan.memory_probe import bytes_in_use  # noqa: E402


def main(stage: int, precision: str, accum: int) -> None:
    keep_freed_memory_for_reuse()
    torch.set_num_threads(1)
    ranks = int(os.environ.get("WORLD_SIZE", 1))
    cfg = to_object(compose_config([
        "model=debug", "model.hidden_size=512", "model.intermediate_size=1536", "model.num_layers=4",
        "model.num_heads=8", "model.num_kv_heads=8", "model.vocab_size=8192", "model.max_seq_len=64",
        "model.loss_chunk_tokens=0", f"deepspeed=zero{stage}", f"deepspeed.precision={precision}", "train.device=cpu",
        "train.seq_len=64", "train.micro_batch_size=1", f"train.global_batch_size={accum * ranks}",
        f"train.grad_accum={accum}", "logging=none"]))
    dist = init_distributed("cpu")
    warm_up_the_kernels(cfg)
    gc.collect()
    before = bytes_in_use()
    torch.manual_seed(0)
    engine = TrainEngine(build_model(lambda init_weights: Llama(cfg.model, init_weights=init_weights), cfg, dist), cfg, dist)
    ids = torch.randint(0, cfg.model.vocab_size, (1, 64))
    engine.train()
    for _ in range(2 * accum):  # two whole steps: every lazily made state exists
        engine.backward(engine.forward(ids, ids).loss)
        engine.micro_step()
    gc.collect()
    kept = bytes_in_use() - before
    estimate = estimate_memory(memory_shape(cfg, dist.world_size))
    resident = estimate.model_states + estimate.term("gradient accumulation")
    print(json.dumps({"rank": dist.rank, "kept": kept, "planned": resident}), flush=True)


def warm_up_the_kernels(cfg) -> None:
    """One forward and backward of a throwaway model of the same shape and dtype, freed before the baseline.

    oneDNN keeps a primitive cache and scratchpads for the matmul shapes it has seen, allocated once per process
    and sized by the CPU's instruction set (about 10 MB more with AVX-512/AMX than with AVX2 for this model):
    library workspace, not model states, and on a GPU the plan's reserve covers cuBLAS's. Made here, the engine's
    own matmuls find them and the difference measured below counts only what the engine keeps.
    """
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.deepspeed.precision, torch.float32)
    model = Llama(cfg.model).to(dtype).train()
    ids = torch.randint(0, cfg.model.vocab_size, (1, cfg.train.seq_len))
    model(ids, ids).loss.backward()
    del model, ids


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
