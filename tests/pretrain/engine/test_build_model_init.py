"""build_model: one seed gives the same initial weights at every ZeRO stage, whatever device holds the parameters.

A GPU's parameters draw from the GPU's own random generator, the whole model built on the CPU from the CPU's:
an H200 run once started ZeRO-3 from other weights than ZeRO-1 (3.85e-3 apart at the first step). Each parameter
now draws from a generator of its own, seeded from (seed, its name), made on the device the parameter lives on.
A CPU-only machine has no second generator, so here the parameters are made to live on a stand-in device: every
random fill applied to a parameter without a generator of its own draws from the device's generator, as on a GPU
(a draw that fell back on the default generator would give other weights there). DeepSpeed's partitioned
construction and gathering are stood in for (their real counterparts are checked on 2 ranks by
tests/pretrain/zero3_init_check.py); what is checked is where build_model takes its random numbers from, that
the values depend on nothing but (seed, name, shape), and that a run that loads a checkpoint draws nothing.
"""
from __future__ import annotations

import dataclasses
import random
from contextlib import contextmanager

import deepspeed
import pytest
import torch
from torch.overrides import TorchFunctionMode

from pretrain.config import compose_config, to_object
from pretrain.engine.distributed import DistInfo
from pretrain.engine.train_engine import build_model
from pretrain.model.llama import Llama, SkipInitializers, draw_each, parameter_seed

SEED = 1234
MAIN = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))


class _DeviceGenerator(TorchFunctionMode):
    """Random fills applied to a parameter draw from this device's own generator (not the CPU's), as on a GPU,
    unless the fill names a generator of its own (which, made for the parameter's device, is what it uses)."""

    FILLS = frozenset([torch.Tensor.uniform_, torch.Tensor.normal_, torch.nn.init.uniform_, torch.nn.init.normal_,
                       torch.nn.init.kaiming_uniform_, torch.nn.init.kaiming_normal_])

    def __init__(self):
        super().__init__()
        self.generator = torch.Generator().manual_seed(99)
        self.fills = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # nn.init's functions pass it by name
        if func in self.FILLS and isinstance(target, torch.nn.Parameter) and kwargs.get("generator") is None:
            self.fills += 1
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


@pytest.fixture
def init_calls(monkeypatch):
    """Every Llama.init_parameter call, by parameter name (on any thread)."""
    calls: list[str] = []
    real = Llama.init_parameter

    def counted(self, name, p, seed):
        calls.append(name)
        return real(self, name, p, seed)

    monkeypatch.setattr(Llama, "init_parameter", counted)
    return calls


def config(*overrides: str):
    return to_object(compose_config(["experiment=cpu_tiny", "model.vocab_size=512", *overrides]))  # no data to follow


def factory(cfg):
    return lambda init_weights: Llama(cfg.model, init_weights=init_weights)


def whole_cpu_model(cfg) -> dict[str, torch.Tensor]:
    """The reference: the whole model built on the CPU from SEED."""
    return dict(Llama(cfg.model, seed=SEED).named_parameters())


def test_the_stand_in_device_draws_other_numbers(parameters_on_a_device):
    """The premise: on the stand-in device a fill that names no generator takes no CPU random numbers and gives
    other values than on the CPU, so an init that drew from the default generator would differ there."""
    on_cpu, on_device = torch.nn.Parameter(torch.empty(8, 8)), torch.nn.Parameter(torch.empty(8, 8))
    torch.manual_seed(SEED)
    with torch.no_grad():
        on_cpu.normal_()
    torch.manual_seed(SEED)
    before = torch.get_rng_state()
    with parameters_on_a_device, torch.no_grad():
        on_device.normal_()
    assert torch.equal(torch.get_rng_state(), before)  # on the device it drew elsewhere
    assert not torch.equal(on_cpu, on_device)


def test_construction_draws_nothing(parameters_on_a_device):
    """Llama is built without nn.Linear's and nn.Embedding's own initializers: with init_weights=False no random
    number is taken from any generator (the CPU's or the device's)."""
    cfg = config()
    torch.manual_seed(SEED)
    before = torch.get_rng_state()
    with parameters_on_a_device:
        Llama(cfg.model, init_weights=False)
    Llama(cfg.model, init_weights=False)
    assert parameters_on_a_device.fills == 0
    assert torch.equal(torch.get_rng_state(), before)
    with SkipInitializers():  # what it leaves: an initializer returns its tensor untouched
        tensor = torch.zeros(3, 3)
        assert torch.nn.init.kaiming_uniform_(tensor) is tensor and tensor.normal_() is tensor
    assert torch.count_nonzero(tensor) == 0


def test_zero3_partitioned_build_draws_the_same_weights_as_every_other_stage(parameters_on_a_device):
    """ZeRO-3 with zero3_init: the parameters live on the device, yet the weights are the whole CPU model's and
    ZeRO 0-2's, bit for bit (bf16 parameters: drawn in fp32 and rounded, as the whole model cast to bf16 is)."""
    cfg = config("deepspeed.zero_stage=3", "deepspeed.zero3_init=true", "deepspeed.precision=bf16")
    expected = whole_cpu_model(cfg)
    before = torch.get_rng_state()
    model = build_model(factory(cfg), cfg, MAIN)
    got = dict(model.named_parameters())
    assert got.keys() == expected.keys()
    different = [name for name in got if not torch.equal(got[name], expected[name])]
    assert different == []
    assert torch.equal(torch.get_rng_state(), before)  # nothing taken from the CPU's generator
    for stage in (0, 1, 2):
        other = dict(build_model(factory(cfg), dataclasses.replace(
            cfg, deepspeed=dataclasses.replace(cfg.deepspeed, zero_stage=stage)), MAIN).named_parameters())
        assert [name for name in got if not torch.equal(got[name], other[name])] == [], stage
    # In bf16 (zero.Init makes the parameters in the training dtype) the values are the fp32 ones rounded.
    for name, param in Llama(cfg.model, init_weights=False).to(torch.bfloat16).named_parameters():
        Llama.init_parameter(model, name, param, SEED)
        assert torch.equal(param, expected[name].to(torch.bfloat16)), name


def test_zero1_builds_on_the_cpu_whatever_the_default_device():
    """ZeRO 0-2 build the whole model and DeepSpeed moves it: on the training device (the CPU here) even under
    another default device, with the seed from the config (cfg.train.seed), not the CPU generator's state."""
    cfg = config("deepspeed.zero_stage=1")
    assert cfg.train.seed == SEED
    expected = whole_cpu_model(cfg)
    torch.manual_seed(SEED + 1)  # the global generator's state is no input
    with torch.device("meta"):  # a device with no values at all: a build there would keep none
        model = build_model(factory(cfg), cfg, MAIN)
    for name, param in model.named_parameters():
        assert param.device.type == "cpu", name
        assert torch.equal(param, expected[name]), name


def test_each_parameter_depends_on_the_seed_and_its_name_only(monkeypatch):
    """The values of a parameter come from (seed, its name, its shape) alone: drawn in any order, by one thread or
    several, in a model with more layers around it, they are the same; another seed or name gives others."""
    cfg = config().model
    reference = dict(Llama(cfg, seed=SEED).named_parameters())
    shuffled = Llama(cfg, init_weights=False)
    named = list(shuffled.named_parameters())
    random.Random(0).shuffle(named)
    torch.manual_seed(0)  # what the global generator holds changes nothing either
    for name, param in named:  # one thread, an arbitrary order, random draws in between
        torch.randn(17)
        shuffled.init_parameter(name, param, SEED)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # draw_each's pool, even on a one-core machine
    threaded = Llama(cfg, seed=SEED)
    for name, param in reference.items():
        assert torch.equal(dict(shuffled.named_parameters())[name], param), name
        assert torch.equal(dict(threaded.named_parameters())[name], param), name
    deeper = dict(Llama(dataclasses.replace(cfg, num_layers=cfg.num_layers + 1), seed=SEED).named_parameters())
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"):
        assert torch.equal(deeper[name], reference[name]), name  # not a residual output: the same std
    other_seed = dict(Llama(cfg, seed=SEED + 1).named_parameters())
    assert not torch.equal(other_seed["model.layers.0.self_attn.q_proj.weight"],
                           reference["model.layers.0.self_attn.q_proj.weight"])
    assert not torch.equal(reference["model.layers.0.self_attn.q_proj.weight"],
                           reference["model.layers.1.self_attn.q_proj.weight"])
    # The seed of a name is a stable hash (Python's hash of a string changes per process): pinned here.
    assert parameter_seed(1234, "lm_head.weight") == parameter_seed(1234, "lm_head.weight")
    assert parameter_seed(1234, "lm_head.weight") != parameter_seed(1235, "lm_head.weight")
    assert parameter_seed(1234, "lm_head.weight") == 10660710373494992068


def test_draw_each_runs_every_draw_and_raises_what_one_raises(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # the pool, even with one intra-op thread (xdist)
    seen = []

    def draw(name, tensor):
        if name == "bad":
            raise ValueError("bad draw")
        seen.append(name)

    tensors = [(str(i), torch.empty(i + 1)) for i in range(5)]
    draw_each(tensors, draw, on_cpu=True)
    draw_each(tensors, draw, on_cpu=False)
    assert sorted(seen) == sorted([name for name, _ in tensors] * 2)
    with pytest.raises(ValueError, match="bad draw"):
        draw_each(tensors + [("bad", torch.empty(1))], draw, on_cpu=True)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_model_a_checkpoint_will_fill_draws_nothing(stage, parameters_on_a_device, init_calls):
    """from_checkpoint (a resume, checkpoint.load_from): no init draw and no read of model.init_from, at every stage;
    the parameters are zeros, never uninitialized memory (whatever reads them before the load)."""
    cfg = config(f"deepspeed.zero_stage={stage}", "deepspeed.precision=fp32", "deepspeed.zero3_init=true")

    def initial(name):
        raise AssertionError(f"{name} read from model.init_from although a checkpoint will be loaded")

    before = torch.get_rng_state()
    model = build_model(factory(cfg), cfg, MAIN, initial=initial if stage % 2 else None, from_checkpoint=True)
    assert init_calls == []
    assert parameters_on_a_device.fills == 0
    assert torch.equal(torch.get_rng_state(), before)
    for name, param in model.named_parameters():
        assert torch.count_nonzero(param) == 0, name
    # The same build without a checkpoint draws each parameter once.
    model = build_model(factory(cfg), cfg, MAIN)
    assert sorted(init_calls) == sorted(name for name, _ in model.named_parameters())


def test_a_tensor_parallel_resume_zeroes_the_cpu_model_where_it_is():
    """With tensor parallelism the whole model stays on the CPU for AutoTP to cut: a resume's zeros are written there
    and nothing is made on the training device (no whole parameter on a GPU, no copy back). The meta device stands
    in for the GPU: a tensor made there could not be copied into the CPU model."""
    cfg = config("deepspeed.zero_stage=1", "deepspeed.precision=fp32")
    on_a_gpu = dataclasses.replace(MAIN, device=torch.device("meta"), tensor_parallel=2)
    model = build_model(factory(cfg), cfg, on_a_gpu, from_checkpoint=True)
    for name, param in model.named_parameters():
        assert param.device.type == "cpu", name
        assert torch.count_nonzero(param) == 0, name
