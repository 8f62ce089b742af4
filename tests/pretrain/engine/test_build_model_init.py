"""build_model: one seed gives the same initial weights at every ZeRO stage, whatever device holds the parameters.

A GPU's parameters draw from the GPU's own random generator, the whole model built on the CPU from the CPU's:
an H200 run once started ZeRO-3 from other weights than ZeRO-1 (3.85e-3 apart at the first step). A CPU-only
machine has no second generator, so here the parameters are made to live on a stand-in device: every random
fill applied to a parameter draws from a generator of its own, as on a GPU. DeepSpeed's partitioned
construction and gathering are stood in for (their real counterparts are checked on 2 ranks by
tests/pretrain/zero3_init_check.py); what is checked is where build_model takes its random numbers from.
"""
from __future__ import annotations

from contextlib import contextmanager

import deepspeed
import pytest
import torch
from torch.overrides import TorchFunctionMode

from pretrain.config import compose_config, to_object
from pretrain.engine.distributed import DistInfo
from pretrain.engine.train_engine import build_model
from pretrain.model.llama import Llama

SEED = 1234
MAIN = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))


class _DeviceGenerator(TorchFunctionMode):
    """Random fills applied to a parameter draw from this device's own generator (not the CPU's), as on a GPU."""

    FILLS = frozenset([torch.Tensor.uniform_, torch.Tensor.normal_, torch.nn.init.uniform_, torch.nn.init.normal_,
                       torch.nn.init.kaiming_uniform_, torch.nn.init.kaiming_normal_])

    def __init__(self):
        super().__init__()
        self.generator = torch.Generator().manual_seed(99)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # nn.init's functions pass it by name
        if func in self.FILLS and isinstance(target, torch.nn.Parameter):
            kwargs = {**kwargs, "generator": self.generator}
        return func(*args, **kwargs)


@pytest.fixture
def parameters_on_a_device(monkeypatch):
    """deepspeed.zero.Init and GatheredParameters stood in for: the parameters are made and initialized on the
    stand-in device (not partitioned: one process)."""
    device = _DeviceGenerator()

    @contextmanager
    def on_device(*args, **kwargs):
        with device:
            yield

    monkeypatch.setattr(deepspeed.zero, "Init", on_device)
    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", on_device)
    return device


def config(*overrides: str):
    return to_object(compose_config(["experiment=cpu_tiny", "model.vocab_size=512", *overrides]))  # no data to follow


def factory(cfg):
    return lambda init_weights: Llama(cfg.model, init_weights=init_weights)


def whole_cpu_model(cfg) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The reference: the whole model built on the CPU from SEED, and the CPU generator's state after it."""
    torch.manual_seed(SEED)
    model = Llama(cfg.model)
    return dict(model.named_parameters()), torch.get_rng_state()


def test_the_stand_in_device_draws_other_numbers(parameters_on_a_device):
    """The premise: on the stand-in device the modules' own initializers (nn.Linear's, nn.Embedding's) take no
    CPU random numbers, and the model's init gives other weights than on the CPU."""
    cfg = config()
    expected, _ = whole_cpu_model(cfg)
    torch.manual_seed(SEED)
    before = torch.get_rng_state()
    Llama(cfg.model, init_weights=False)
    assert not torch.equal(torch.get_rng_state(), before)  # on the CPU the construction draws
    torch.manual_seed(SEED)
    with parameters_on_a_device:
        Llama(cfg.model, init_weights=False)
    assert torch.equal(torch.get_rng_state(), before)  # on the device it draws elsewhere
    with parameters_on_a_device:
        model = Llama(cfg.model)
    assert not torch.equal(model.model.embed_tokens.weight, expected["model.embed_tokens.weight"])


def test_zero3_partitioned_build_takes_every_draw_from_the_cpu(parameters_on_a_device):
    """ZeRO-3 with zero3_init: the parameters live on the device, yet the weights are the whole CPU model's."""
    cfg = config("deepspeed.zero_stage=3", "deepspeed.zero3_init=true", "deepspeed.precision=bf16")
    expected, state_after = whole_cpu_model(cfg)
    torch.manual_seed(SEED)
    model = build_model(factory(cfg), cfg, MAIN)
    got = dict(model.named_parameters())
    assert got.keys() == expected.keys()
    different = [name for name in got if not torch.equal(got[name], expected[name])]
    assert different == []
    # The construction's draws were replayed on the CPU too: the generator ends where the whole model's does.
    assert torch.equal(torch.get_rng_state(), state_after)


def test_zero1_builds_on_the_cpu_whatever_the_default_device():
    """ZeRO 0-2 build the whole model and DeepSpeed moves it: built on the CPU even under another default device."""
    cfg = config("deepspeed.zero_stage=1")
    expected, _ = whole_cpu_model(cfg)
    torch.manual_seed(SEED)
    with torch.device("meta"):  # a device with no values at all: a build there would keep none
        model = build_model(factory(cfg), cfg, MAIN)
    for name, param in model.named_parameters():
        assert param.device.type == "cpu", name
        assert torch.equal(param, expected[name]), name
