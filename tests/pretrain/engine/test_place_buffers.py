"""place_buffers: the RoPE tables follow the model to the training device under ZeRO-3, parameters stay put.

The first GPU run found ZeRO-3 leaving the RoPE tables on the CPU (DeepSpeed places parameters, never the
module). On a CPU-only machine every tensor is on one device, so the move is checked towards the meta device.
"""
from __future__ import annotations

import torch

from pretrain.engine.train_engine import place_buffers
from pretrain.model.config import ModelConfig
from pretrain.model.llama import Llama


def test_buffers_move_to_the_device_and_parameters_do_not():
    model = Llama(ModelConfig())
    place_buffers(model, torch.device("meta"))
    rope = model.model.rotary_emb
    assert rope.cos.device.type == "meta" and rope.sin.device.type == "meta"
    assert rope.cos.dtype == torch.float32  # rebuilt as fp32 tables, not cast
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_buffers_already_on_the_device_are_left_alone():
    model = Llama(ModelConfig())
    cos = model.model.rotary_emb.cos
    place_buffers(model, torch.device("cpu"))
    assert model.model.rotary_emb.cos is cos
