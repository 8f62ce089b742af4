"""The engine: everything that talks to DeepSpeed, and the process groups it runs in.

This folder is the only part of ayumi that imports `deepspeed` (`pretrain/tools/doctor.py` aside, which
reports DeepSpeed's versions and ops); a test holds that rule (tests/test_layout.py). The trainer sees a
small facade instead (`TrainEngine`: a micro step, the grad norm, the loss scale, save and load), so it
reads as plain training logic and DeepSpeed's quirks are handled here once (docs/deepspeed-on-cpu.md).

- `train_engine.py`: `TrainEngine`, the facade over DeepSpeed's engine, and `build_model` (ZeRO-3 init);
- `distributed.py`: `DistInfo`, process groups (NCCL/gloo, tensor parallelism), small collectives;
- `ds_config.py`: DeepSpeed's JSON config rendered from ayumi's;
- `optimizer.py`: the AdamW DeepSpeed wraps (an update can be withheld), parameter groups;
- `grad_accum.py`: fp32 gradient accumulation where DeepSpeed does not do it;
- `precision.py`: `deepspeed.precision=auto` resolved for the hardware;
- `host_memory.py`: allocator settings for CPU training;
- `op_build.py`: DeepSpeed's JIT-built ops (CPU Adam), and the lock a killed build leaves;
- `checkpoint_formats.py`: DeepSpeed's universal conversion and fp32 consolidation of checkpoints (weights-only).

May import: `pretrain.config`, `pretrain.model`, `common`. Nothing here imports the trainer, the
checkpointer or the tools.
"""
import os

import torch

# DeepSpeed picks its accelerator when it is imported; on a machine without CUDA say "cpu" up front
# instead of letting it guess (and warn). Every module of this package runs this first.
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
