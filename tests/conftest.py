"""Test-wide environment: CPU DeepSpeed, offline W&B and Hugging Face, no network at run time."""
import os

import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
