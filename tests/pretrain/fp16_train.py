"""TEST-ONLY entry: pretrain.train with DeepSpeed's CPU accelerator allowed to run fp16.

DeepSpeed's CPU accelerator refuses fp16 ("Type fp16 is not supported on your device"), yet CPU
fp16 matmuls work. Declaring fp16 supported lets the real fp16 optimizer and dynamic loss scaler
run on CPU, which is how the tests exercise that path on machines without a GPU
(docs/deepspeed-on-cpu.md). The product never does this.
"""
from deepspeed.accelerator import get_accelerator

get_accelerator().is_fp16_supported = lambda: True

from pretrain.train import exit_now, main  # noqa: E402

if __name__ == "__main__":
    exit_now(main())
