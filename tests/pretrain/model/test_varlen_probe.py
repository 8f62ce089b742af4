"""Whether a device runs document masking's flash varlen kernel (pretrain/model/documents.py, varlen_device): asked
once per device and process, whatever the caller's grad mode, under every name of the device, and never kept when
the check was only cut short (issue 47, defect 1).

The CPU has no flash varlen kernel, so a GPU is stood in for: torch answers as on an H100 (CUDA available, flash
built in, capability 9.0, device 0 current), and the check's tensors go to the CPU, where
test_document_kernels.ReferenceVarlen (causal SDPA over each span, differentiable) stands in for the kernel."""
from __future__ import annotations

import pytest
import torch

from pretrain.model import documents
from tests.pretrain.model.test_document_kernels import ReferenceVarlen


def forget_answers() -> None:
    """The process as if the probe had never run (its answers are cached per process)."""
    documents._KERNELS.clear()


@pytest.fixture
def a_gpu(monkeypatch):
    """torch answering as on an H100 with flash attention, device 0 current; the probe's answers forgotten before
    and after."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    forget_answers()
    yield
    forget_answers()


@pytest.fixture
def kernel_on_cpu(a_gpu, monkeypatch):
    """a_gpu, with the real varlen check run on the CPU against the stand-in kernel: returns the kernel, which
    counts its calls."""
    kernel = ReferenceVarlen()
    check = documents.varlen_works
    monkeypatch.setattr(documents, "flash_varlen", kernel)
    monkeypatch.setattr(documents, "varlen_works", lambda device: check(torch.device("cpu")))
    return kernel


def test_a_first_check_under_no_grad_still_finds_varlen(kernel_on_cpu):
    """The downstream scoring before step 0 runs under no_grad: the check's backward must run anyway, and its
    answer (varlen) stays for the training that follows."""
    with torch.no_grad():
        assert documents.varlen_device(torch.device("cuda"))
        assert documents.mask_kernel(torch.device("cuda"), torch.bfloat16, 128) == "varlen"
    assert documents.varlen_device(torch.device("cuda"))
    assert kernel_on_cpu.calls == 1  # checked once: the later calls are answered from the cache


def test_the_check_runs_its_backward_under_no_grad_and_inference_mode(monkeypatch):
    monkeypatch.setattr(documents, "flash_varlen", ReferenceVarlen())
    with torch.no_grad():
        assert documents.varlen_works(torch.device("cpu"))
    with torch.inference_mode():
        assert documents.varlen_works(torch.device("cpu"))


def test_cuda_and_cuda_0_are_one_device_checked_once(a_gpu, monkeypatch):
    checked = []
    monkeypatch.setattr(documents, "varlen_works", lambda device: checked.append(device) or True)
    assert documents.varlen_device(torch.device("cuda"))
    assert documents.varlen_device(torch.device("cuda:0"))
    assert documents.mask_kernel(torch.device("cuda")) == documents.mask_kernel(torch.device("cuda", 0)) == "varlen"
    assert checked == [torch.device("cuda", 0)]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # `cuda` is the current device, whichever it is
    assert documents.varlen_device(torch.device("cuda"))
    assert checked == [torch.device("cuda", 0), torch.device("cuda", 1)]


def test_a_check_cut_short_by_out_of_memory_is_asked_again(kernel_on_cpu, monkeypatch, capsys):
    """Out of memory says nothing about the kernel: the dense mask this once, and the next call checks again."""
    calls = []

    def full_then_fine(*args):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return kernel_on_cpu(*args)

    monkeypatch.setattr(documents, "flash_varlen", full_then_fine)
    assert not documents.varlen_device(torch.device("cuda"))
    said, kept = capsys.readouterr().err, documents.kernel_choices()
    assert documents.varlen_device(torch.device("cuda"))
    assert documents.varlen_device(torch.device("cuda:0")) and len(calls) == 2
    assert "cut short" in said and kept == {}  # said so, and nothing kept from the first call


def test_a_kernel_that_cannot_run_is_kept_off(kernel_on_cpu, monkeypatch):
    """An error that says varlen_attn does not run here (other arguments, no backward) is the answer for the process."""
    calls = []

    def other_arguments(*args):
        calls.append(1)
        raise TypeError("varlen_attn() got an unexpected keyword argument 'window_size'")

    monkeypatch.setattr(documents, "flash_varlen", other_arguments)
    assert not documents.varlen_device(torch.device("cuda"))
    assert not documents.varlen_device(torch.device("cuda:0"))
    assert len(calls) == 1
    assert documents.kernel_choices() == {"cuda:0": {"kernel": "sdpa",
                                                     "why": "varlen_attn failed its check against SDPA"}}


def test_the_choice_is_said_once_and_kept_for_the_results(kernel_on_cpu, capsys):
    for _ in range(3):
        documents.mask_kernel(torch.device("cuda"))
    documents.mask_kernel(torch.device("cpu"))
    lines = capsys.readouterr().err.splitlines()
    assert [line for line in lines if "cuda:0" in line] == ["ayumi: document masking on cuda:0 runs varlen "
                                                             "(flash varlen attention)"]
    choices = documents.kernel_choices()
    assert choices["cuda:0"] == {"kernel": "varlen", "why": "flash varlen attention passed its check"}
    assert choices["cpu"]["kernel"] == "sdpa"
    choices["cuda:0"]["kernel"] = "changed"  # a copy: the caller cannot change what was decided
    assert documents.kernel_choices()["cuda:0"]["kernel"] == "varlen"
