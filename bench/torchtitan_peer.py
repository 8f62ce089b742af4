"""The second peer: torchtitan's own Llama 3 model and training loop at ayumi's 1b shape, on one GPU.

bench/gpu_acceptance.py runs this as the part `peer_torchtitan` and compares ayumi's `speed_1b_2048` tokens/s with
it (`RESULT gpu_acceptance_vs_torchtitan`). What runs, and what is ayumi's:
- the model: torchtitan's `Llama3Model`, from a flavor registered here (`ayumi_1b`) with torchtitan's own building
  blocks and inits (`_build_llama3_layers`), in the shape of ayumi's preset: width, layers, query and K/V heads, MLP
  width, vocabulary, RoPE base, norm epsilon, untied embeddings. Its fused QKV projection and complex-valued RoPE
  are the same parameters and FLOPs as ayumi's (shape_check counts both models' parameters on the meta device);
- the loop: torchtitan's `Trainer`, built from its config and run by its own `train()`: FSDP2 over one rank (its
  mixed-precision policy: bf16 compute over fp32 parameters, fp32 gradient reduction), `torch.compile` of each
  block and of the loss, its chunked cross-entropy fused with the LM head, AdamW, gradient clipping and its
  warm-up schedule. The optimizer takes ayumi's learning rate, betas, epsilon and weight decay;
- attention: torchtitan's default for Llama 3, FlexAttention (compiled, causal). torchtitan 0.3.0 offers no plain
  SDPA for language models (flex, flex_flash or varlen);
- the data: random token ids (as the transformers peer), each row one document (positions 0..T-1, so the mask is
  causal), and no tokenizer. These two stand-ins are ayumi's; torchtitan's own load a Hugging Face dataset.

torchtitan's trainer runs on CUDA only (it asks torch.cuda for its device whatever the machine has), so on a CPU
(--cpu-smoke) the part builds the flavor and both models on the meta device and checks the shapes, builds the
trainer's config, data loader and tokenizer and checks one batch (config_check), and trains nothing.

torchtitan is a benchmark dependency only, never one of ayumi's: bench/torchtitan-requirements.txt pins it and what
its modules import, installed without their declared dependencies into a folder of its own (./ayumi makes
.venv/torchtitan-site; on a GPU machine, the wheels bench/gpu_wheels.sh carries). Installed beside ayumi it would pin
datasets below 4.8, and importing its models needs triton, which a CPU build of torch lacks. It declares no torch
requirement, so it cannot replace the installed torch.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass

FLAVOR = "ayumi_1b"
"""The torchtitan flavor registered for ayumi's preset (register_flavor)."""
ATTENTION = "flex"
"""torchtitan's attention backend: its default for Llama 3."""
SITE_ENV = "AYUMI_TORCHTITAN_SITE"
"""Names the folder torchtitan and its imports are installed in, where it is not .venv/torchtitan-site."""


def site_folder() -> str | None:
    """The folder holding torchtitan for the peer's process: $AYUMI_TORCHTITAN_SITE, else .venv/torchtitan-site
    beside this interpreter's venv when it exists, else None (torchtitan importable as it is, e.g. carried wheels)."""
    import sys
    from pathlib import Path

    if os.environ.get(SITE_ENV):
        return os.environ[SITE_ENV]
    folder = Path(sys.prefix) / "torchtitan-site"
    return str(folder) if folder.is_dir() else None


def flavor_config(model, attn_backend: str = ATTENTION, tp_gemm_backend: str = "default"):
    """torchtitan's Llama3Model.Config in the shape of ayumi's ModelConfig `model`, from torchtitan's own parts."""
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    dim, vocab = model.hidden_size, model.vocab_size
    return llama3.Llama3Model.Config(
        dim=dim, vocab_size=vocab, enable_weight_tying=model.tie_embeddings,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, eps=model.norm_eps, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
        layers=[_with_norm_eps(layer, model.norm_eps) for layer in llama3._build_llama3_layers(
            n_layers=model.num_layers, dim=dim, n_heads=model.num_heads, n_kv_heads=model.num_kv_heads,
            hidden_dim=model.intermediate_size, fuse_qkv=True, attn_backend=attn_backend,
            tp_gemm_backend=tp_gemm_backend,
            rope=ComplexRoPE.Config(dim=dim // model.num_heads, max_seq_len=max(model.max_seq_len, 4096),
                                    theta=model.rope_theta))])


def _with_norm_eps(layer, eps: float):
    """A block config whose two RMSNorms use `eps` (torchtitan's builder leaves its default, 1e-5)."""
    layer.attention_norm.eps = eps
    layer.ffn_norm.eps = eps
    return layer


def register_flavor(model) -> None:
    """Add FLAVOR to torchtitan's Llama 3 registry, in `model`'s shape (torchtitan's model_registry then builds it)."""
    from torchtitan.models import llama3

    llama3.llama3_configs[FLAVOR] = lambda attn_backend=ATTENTION, tp_gemm_backend="default": flavor_config(
        model, attn_backend, tp_gemm_backend)


def shape_check(model, seq_len: int) -> dict:
    """torchtitan's model of FLAVOR against ayumi's Llama of `model`, both built on the meta device: parameter counts
    (all, and without the embedding table), matrix shapes by kind, and each one's FLOPs per token at `seq_len`
    (ayumi's pretrain/model/flops.py; torchtitan's own get_nparams_and_flops)."""
    import torch

    from pretrain.model.flops import flops_per_token
    from pretrain.model.llama import Llama
    from torchtitan.models.llama3 import model_registry

    register_flavor(model)
    spec = model_registry(FLAVOR, attn_backend=ATTENTION)
    with torch.device("meta"):
        theirs = spec.model.build()
        ours = Llama(model, init_weights=False)
    their_params, their_flops = spec.model.get_nparams_and_flops(theirs, seq_len)
    ours_total = sum(p.numel() for p in ours.parameters())
    theirs_total = sum(p.numel() for p in theirs.parameters())
    embedding = model.vocab_size * model.hidden_size
    return {"flavor": FLAVOR, "attention": ATTENTION, "params_ayumi": ours_total, "params_torchtitan": theirs_total,
            "params_torchtitan_counted": their_params, "embedding_params": embedding,
            "same_params": ours_total == theirs_total, "shapes": matrix_shapes(ours, theirs),
            "flops_per_token_ayumi": flops_per_token(model, seq_len), "flops_per_token_torchtitan": their_flops}


def matrix_shapes(ours, theirs) -> dict:
    """Each model's first block's matrices and its embedding and LM head, as {name: [rows, columns]}: the fields a
    reader compares (torchtitan fuses Q, K and V into one matrix)."""
    def first_block(module) -> dict:
        return {name: list(p.shape) for name, p in module.named_parameters()
                if p.dim() == 2 and (".0." in name or "embed" in name or "lm_head" in name or name.startswith("output"))}
    return {"ayumi": first_block(ours), "torchtitan": first_block(theirs)}


# -- training (CUDA only) --------------------------------------------------------------------------------------
def random_tokens_loader():
    """A torchtitan dataloader of random token ids (rows of seq_len + 1, split into input and labels), each row one
    document: positions 0..T-1, from which torchtitan's FlexAttention builds a causal mask."""
    import torch
    from torchtitan.components.dataloader import BaseDataLoader

    class RandomTokens(BaseDataLoader):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            vocab_size: int = 0
            seed: int = 0

        def __init__(self, config, *, seq_len: int, local_batch_size: int, **runtime):
            self.config, self.seq_len, self.batch = config, seq_len, local_batch_size
            self.generator = torch.Generator().manual_seed(config.seed)

        def __iter__(self):
            positions = torch.arange(self.seq_len).expand(self.batch, -1)
            while True:
                ids = torch.randint(0, self.config.vocab_size, (self.batch, self.seq_len + 1), generator=self.generator)
                yield {"input": ids[:, :-1], "positions": positions}, ids[:, 1:]

        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state_dict: dict) -> None:
            pass

    return RandomTokens


def no_tokenizer():
    """A torchtitan tokenizer that is never asked anything (the data are token ids already)."""
    from torchtitan.components.tokenizer import BaseTokenizer

    class NoTokenizer(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = 0

        def __init__(self, config, *, tokenizer_path=None, **runtime):
            self.config = config

        def encode(self, *args, **kwargs) -> list[int]:
            raise NotImplementedError("the peer's data are token ids")

        def decode(self, *args, **kwargs) -> str:
            raise NotImplementedError("the peer's data are token ids")

        def get_vocab_size(self) -> int:
            return self.config.vocab_size

    return NoTokenizer


def trainer_config(cfg, seq: int, micro: int, accum: int, steps: int, folder: str):
    """torchtitan's Trainer.Config for FLAVOR at ayumi's optimizer settings: micro x accum rows of seq tokens a step,
    `steps` steps, compiled model and loss, no activation checkpointing, checkpoints and validation off."""
    from dataclasses import replace

    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.validate import Validator
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import model_registry
    from torchtitan.trainer import Trainer

    register_flavor(cfg.model)
    # No Hugging Face folder: nothing is loaded or saved, so the state-dict adapter (which reads one) is not built.
    spec = replace(model_registry(FLAVOR, attn_backend=ATTENTION), state_dict_adapter=None)
    optim = cfg.optim
    return Trainer.Config(
        model_spec=spec, hf_assets_path=folder, dump_folder=folder,
        tokenizer=no_tokenizer().Config(vocab_size=cfg.model.vocab_size),
        dataloader=random_tokens_loader().Config(vocab_size=cfg.model.vocab_size),
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))),
        optimizer=default_adamw(lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
                                weight_decay=optim.weight_decay),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=min(2, steps - 1)),
        training=TrainingConfig(local_batch_size=micro, global_batch_size=micro * accum, seq_len=seq, steps=steps,
                                max_norm=optim.grad_clip, mixed_precision_param="bfloat16"),
        metrics=MetricsProcessor.Config(log_freq=max(1, steps)), checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=None, compile=CompileConfig(enable=True, components=["model", "loss"]),
        validator=Validator.Config(enable=False),
    )


def config_check(cfg, seq: int, micro: int, accum: int, steps: int, folder: str) -> dict:
    """What can be checked of the training set-up without CUDA: torchtitan's Trainer.Config for FLAVOR builds (its own
    validation runs), and the data loader and tokenizer it names build and give one batch of the expected shapes."""
    config = trainer_config(cfg, seq, micro, accum, steps, folder)
    loader = config.dataloader.build(dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=seq, local_batch_size=micro,
                                     snapshot_every_n_steps=None)
    inputs, labels = next(iter(loader))
    tokenizer = config.tokenizer.build(tokenizer_path=folder)
    return {"training": {field: getattr(config.training, field) for field in
                         ("local_batch_size", "global_batch_size", "seq_len", "steps", "max_norm",
                          "mixed_precision_param", "disable_cuda_graphs")},
            "compile": list(config.compile.components) if config.compile.enable else [],
            "optimizer": dict(config.optimizer.param_groups[0].optimizer_kwargs),
            "batch": {key: list(value.shape) for key, value in {**inputs, "labels": labels}.items()},
            "vocab_size": tokenizer.get_vocab_size()}


def train(cfg, seq: int, micro: int, accum: int, warmup: int, steps: int, folder: str, progress=None) -> dict:
    """Train FLAVOR with torchtitan's Trainer on one GPU for warmup + steps steps (its own train()), each step timed
    (the device synchronised at its end); then one more step profiled for the attention kernels. `progress(figures)`
    is called after every step. Returns the figures: tokens/s of the median timed step, max_memory_allocated over the
    timed steps, each step's loss."""
    import torch

    os.environ.update({key: value for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                                                      ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"))
                       if key not in os.environ})
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    started = time.perf_counter()
    trainer = trainer_config(cfg, seq, micro, accum, warmup + steps, folder).build()
    figures = {"micro_batch": micro, "grad_accum": accum, "seq_len": seq, "tokens_per_step": micro * accum * seq,
               "build_seconds": time.perf_counter() - started, "warmup_seconds": [], "step_seconds": [], "losses": [],
               "flavor": FLAVOR, "attention": ATTENTION, "max_allocated": 0, "tokens_per_s": None}
    step_losses = []
    forward_backward = trainer.forward_backward_step

    def counted_forward_backward(**kwargs):
        loss = forward_backward(**kwargs)
        # A copy: under torchtitan's CUDA graph (its default) the loss lives in the graph's memory, which the next
        # micro batch's replay overwrites.
        step_losses.append(loss.detach().clone())
        return loss

    train_step = trainer.train_step

    def timed_train_step(data_iterator):
        begun = time.perf_counter()
        train_step(data_iterator)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - begun
        timed = len(figures["warmup_seconds"]) >= warmup
        figures["step_seconds" if timed else "warmup_seconds"].append(seconds)
        figures["losses"].append(float(sum(loss.float() for loss in step_losses)))
        step_losses.clear()
        if len(figures["warmup_seconds"]) == warmup and not figures["step_seconds"]:
            torch.cuda.reset_peak_memory_stats()  # the peak of steady training, as ayumi's parts measure it
        if figures["step_seconds"]:
            figures["tokens_per_s"] = figures["tokens_per_step"] / statistics.median(figures["step_seconds"])
            figures["max_allocated"] = torch.cuda.max_memory_allocated()
        if progress:
            progress(figures)

    trainer.forward_backward_step = counted_forward_backward
    trainer.train_step = timed_train_step
    trainer.train()
    figures["attention_kernels"] = profiled_attention(trainer, train_step)
    trainer.close()
    figures["losses_finite"] = all(math.isfinite(loss) for loss in figures["losses"])
    return figures


def profiled_attention(trainer, train_step) -> list[str]:
    """The attention kernels (by GPU time) of one more step of `trainer`, profiled."""
    import torch

    from bench.gpu_speed import attention_kernels

    data_iterator = trainer.batch_generator(trainer.dataloader)
    trainer.step += 1
    return attention_kernels(lambda: train_step(data_iterator), torch.device("cuda"))


def free_port() -> int:
    """A TCP port nothing listens on now (torch.distributed's rendezvous on one machine)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
