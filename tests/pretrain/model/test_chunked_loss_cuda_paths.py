"""The fused LM-head loss's CUDA-only paths (pretrain/model/chunked_loss.py), exercised on the CPU (issue 47,
defects 4, 5 and 6): the chunk terms compiled only where model.compile allows it, and only a compile failure
turning them eager (an out-of-memory error goes through); backward scaling the weight's gradient in place and the
compiled terms writing no fp32 chunk x vocab buffer; the fp32-output GEMM probe leaving the global generators
alone and keeping each product's answer.

Where a path needs CUDA a stand-in takes its place: a recording torch.compile, a compiled function that raises,
and, for the GEMM probe, the CPU under a name that passes its CUDA check (CudaNamedCpu)."""
from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pretrain.model import chunked_loss
from pretrain.model.chunked_loss import chunk_loss_terms
from pretrain.model.config import ModelConfig
from pretrain.model.llama import IGNORE_INDEX, Llama

CUDA = torch.device("cuda")


def chunk_inputs(tokens: int = 24, vocab: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, vocab, generator=generator) * 4
    target = torch.randint(0, vocab, (tokens,), generator=generator)
    target[:3] = IGNORE_INDEX
    return logits, target


# -- defect 4: the compile switch, and only compile failures turn the compiled terms off --------------------------
@pytest.fixture
def fresh_compile_state(monkeypatch):
    """chunked_loss as in a new process: nothing compiled, nothing failed; torch.compile records what it is asked
    to compile and returns the function as it is."""
    compiled = []
    monkeypatch.setattr(chunked_loss, "_compiled_terms", None)
    monkeypatch.setattr(chunked_loss, "_compile_failed", False)
    monkeypatch.setattr(torch, "compile", lambda fn, **options: compiled.append(fn) or fn)
    return compiled


@pytest.mark.parametrize("mode, compiles", [("off", False), ("blocks", True), ("auto", True)])
def test_the_models_compile_switch_reaches_the_loss(mode, compiles, monkeypatch):
    """model.compile=off compiles nothing on a GPU, the loss's chunk kernel included (each compiling process starts
    its own pool of inductor workers); auto and blocks let it compile there."""
    asked = []

    def recording(device, compiled=True):
        asked.append(compiled)
        return chunk_loss_terms

    monkeypatch.setattr(chunked_loss, "loss_terms_for", recording)
    model = Llama(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                              num_kv_heads=2, max_seq_len=16, loss_chunk_tokens=8, compile=mode))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    model(ids, ids).loss.backward()
    assert asked == [compiles]


def test_loss_terms_compile_only_when_allowed_and_on_cuda(fresh_compile_state):
    assert chunked_loss.loss_terms_for(CUDA, compiled=False) is chunk_loss_terms
    assert chunked_loss.loss_terms_for(torch.device("cpu"), compiled=True) is chunk_loss_terms
    assert fresh_compile_state == []
    assert chunked_loss.loss_terms_for(CUDA, compiled=True) is chunked_loss._guarded_compiled_terms
    assert fresh_compile_state == [chunk_loss_terms]


def raising(err: BaseException):
    """A compiled function that fails as given when called."""
    def compiled(*args):
        raise err
    return compiled


def oom_raised_while_compiling() -> BaseException:
    """An out-of-memory error as dynamo hands it on from inside a backend: wrapped in BackendCompilerFailed."""
    from torch._dynamo.exc import BackendCompilerFailed

    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        except torch.OutOfMemoryError as oom:
            raise BackendCompilerFailed(chunk_loss_terms, oom, None) from oom
    except BackendCompilerFailed as wrapped:
        return wrapped


@pytest.mark.parametrize("err", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.06 GiB"),
                                 oom_raised_while_compiling(), KeyboardInterrupt(),
                                 RuntimeError("CUDA error: an illegal memory access was encountered")],
                         ids=["oom", "oom-while-compiling", "interrupt", "device-error"])
def test_errors_other_than_a_failed_compile_go_through(err, fresh_compile_state, monkeypatch):
    """Out of memory is the run's to see (the eager terms need the memory too), and it is no compile failure: the
    compiled terms stay on. So do an interrupt and an error the eager function would meet as well."""
    monkeypatch.setattr(chunked_loss, "_compiled_terms", raising(err))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "failed to build" warning either
        with pytest.raises(type(err)):
            chunked_loss._guarded_compiled_terms(*chunk_inputs(), 0.0, torch.float32)
    assert not chunked_loss._compile_failed


class TritonCompilationError(Exception):
    """Stands in for triton.compiler.errors.CompilationError (Triton is not installed on the CPU)."""


TritonCompilationError.__module__ = "triton.compiler.errors"


def compile_failures() -> list[BaseException]:
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import InductorError

    return [BackendCompilerFailed(chunk_loss_terms, RuntimeError("Cannot find a working triton installation"), None),
            InductorError(RuntimeError("NoValidChoicesError"), None),
            TritonCompilationError("at 12:4: out of resources")]


@pytest.mark.parametrize("err", compile_failures(), ids=["backend", "inductor", "triton"])
def test_a_failed_compile_turns_to_the_eager_terms_for_good(err, fresh_compile_state, monkeypatch):
    monkeypatch.setattr(chunked_loss, "_compiled_terms", raising(err))
    logits, target = chunk_inputs()
    with pytest.warns(UserWarning, match="failed to build"):
        got = chunked_loss._guarded_compiled_terms(logits, target, 1e-3, torch.bfloat16)
    for ours, eager in zip(got, chunk_loss_terms(logits, target, 1e-3, torch.bfloat16)):
        assert torch.equal(ours, eager)
    assert chunked_loss._compile_failed
    assert chunked_loss.loss_terms_for(CUDA) is chunk_loss_terms


# -- defect 5: memory at the step's peak ---------------------------------------------------------------------------
class NewTensors(TorchDispatchMode):
    """The operation, shape and dtype of every tensor made in new memory while active (not in an input's: in-place
    operations, views and detach excluded)."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[str, tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {x.untyped_storage().data_ptr() for x in [*args, *kwargs.values()] if isinstance(x, torch.Tensor)}
        if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in inputs:
            self.made.append((func.overloadpacket.__name__, tuple(out.shape), out.dtype))
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backward_makes_no_second_fp32_weight_gradient(dtype):
    """Backward scales the fp32 weight gradient made in forward in place: `grad_weight * factor` was a second fp32
    vocab x hidden copy (0.4 GB at the 1b shape), made at the start of backward, the step's peak."""
    head = chunked_loss.LMHead(48, 1000).to(dtype)
    hidden = torch.randn(40, 48).to(dtype).requires_grad_()
    labels = torch.randint(0, 1000, (40,))
    loss = head(hidden, labels, 16, torch.tensor(1 / 40.0))[0]
    with NewTensors() as backward:
        loss.backward()
    fp32_weight_sized = [made for made in backward.made if made[1:] == ((1000, 48), torch.float32)]
    assert fp32_weight_sized == [], fp32_weight_sized
    assert head.weight.grad.dtype == dtype


def test_backward_runs_once_per_forward():
    """The gradients are scaled in place, so a second backward through one forward (retain_graph) would scale them
    twice: it is refused, with a message that says why."""
    head = chunked_loss.LMHead(16, 50).bfloat16()
    hidden = torch.randn(8, 16).bfloat16().requires_grad_()
    loss = head(hidden, torch.randint(0, 50, (8,)), 4, torch.tensor(0.125))[0]
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward once per forward"):
        loss.backward()


@pytest.mark.slow
def test_the_compiled_terms_write_no_fp32_chunk_by_vocab_buffer():
    """Inductor's code for the chunk terms (built here by its CPU backend, the same graph as on CUDA) allocates one
    chunk x vocab buffer, the bf16 logit gradient: a scatter_add_ into the fp32 softmax made it materialise that
    softmax as well, 4 bytes per logit more at the step's peak. And its values are the eager terms' to rounding."""
    from torch._inductor.utils import run_and_get_code

    chunk, vocab = 64, 5000
    logits, target = chunk_inputs(chunk, vocab)
    torch._dynamo.reset()
    compiled = torch.compile(chunk_loss_terms, dynamic=False)
    got, codes = run_and_get_code(compiled, logits, target, 1e-3, torch.bfloat16)
    buffers = re.findall(r"empty_strided_\w+\(\(([\d, ]+)\), \([\d, ]+\), torch\.(\w+)\)", "\n".join(codes))
    full = [dtype for shape, dtype in buffers if [int(n) for n in shape.split(",") if n.strip()] == [chunk, vocab]]
    assert full == ["bfloat16"], buffers
    for ours, eager in zip(got, chunk_loss_terms(logits, target, 1e-3, torch.bfloat16)):
        torch.testing.assert_close(ours, eager)


# -- defect 6: the fp32-output GEMM probe ---------------------------------------------------------------------------
class CudaNamedCpu(str):
    """The CPU under a name that passes the GEMM probe's CUDA check: the probe's tensors are made on the CPU."""

    def startswith(self, prefix, *args):
        return prefix == "cuda" or str.startswith(self, prefix, *args)


@pytest.fixture
def no_gemm_answers(monkeypatch):
    """No GEMM path chosen yet in this process."""
    monkeypatch.setattr(chunked_loss, "_GEMM_PATHS", {})


def test_the_gemm_probe_leaves_the_global_generator_alone(no_gemm_answers):
    """The probe runs once, at the first bf16 chunk, which after a resume is a different point of the random
    stream than in the run resumed: a draw from the global generator there would shift every later draw."""
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    chunked_loss._fp32_out_kind(CudaNamedCpu("cpu"))  # probes: no answer kept yet (no_gemm_answers)
    assert torch.equal(torch.get_rng_state(), before)


def test_addmm_failing_leaves_mm_on(no_gemm_answers, monkeypatch, capsys):
    """Each product is probed on its own: a torch whose addmm lacks out_dtype still runs mm with it."""
    real_mm, real_addmm, used = torch.mm, torch.addmm, []

    def mm(a, b, out_dtype=None, **kwargs):  # mm with out_dtype, as CUDA has it: the fp32 product of bf16 inputs
        if out_dtype is None:
            return real_mm(a, b, **kwargs)
        used.append("mm")
        return real_mm(a.float(), b.float())

    def addmm(*args, out_dtype=None, **kwargs):  # addmm without it
        if out_dtype is not None:
            used.append("addmm")
            raise RuntimeError("addmm: out_dtype is not supported here")
        return real_addmm(*args, **kwargs)

    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch, "addmm", addmm)
    kinds = chunked_loss._fp32_out_kind(CudaNamedCpu("cpu"))
    assert kinds == {"mm": "out_dtype", "addmm": "cast"}
    said = capsys.readouterr().err.strip()
    assert said == "ayumi: the fused LM-head loss's fp32-output GEMMs on cpu: mm out_dtype, addmm cast"
    assert chunked_loss.gemm_path_choices() == {"cpu": {"mm": "out_dtype", "addmm": "cast"}}
    # kept: a second question is answered without probing or saying it again
    assert chunked_loss._fp32_out_kind(CudaNamedCpu("cpu")) == kinds
    assert used == ["mm", "addmm"] and capsys.readouterr().err == ""

    # and the loss's products follow each answer: the logits by mm with out_dtype, the accumulation by a cast
    monkeypatch.setattr(chunked_loss, "_fp32_out_kind", lambda device: kinds)
    a, b = torch.randn(4, 6).bfloat16(), torch.randn(6, 3).bfloat16()
    used.clear()
    assert chunked_loss.matmul_fp32(a, b).dtype == torch.float32
    acc = torch.zeros(4, 3)
    chunked_loss.accumulate_matmul(acc, a, b)
    assert used == ["mm"]
    torch.testing.assert_close(acc, (a @ b).float())


def test_a_cpu_asks_no_probe_and_says_cast(no_gemm_answers, monkeypatch):
    monkeypatch.setattr(torch, "mm", lambda *args, **kwargs: pytest.fail("the CPU was probed"))
    assert chunked_loss._fp32_out_kind("cpu") == {"mm": "cast", "addmm": "cast"}
    assert chunked_loss.gemm_path_choices() == {"cpu": {"mm": "cast", "addmm": "cast"}}
