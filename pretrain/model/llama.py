"""ayumi's Llama: the model, its loss, init, and the helpers the optimizer and telemetry need.

Parameter names equal Hugging Face `LlamaForCausalLM`'s, so `model.state_dict()` loads into
transformers directly (see `pretrain/tools/export.py`). No parallelism code lives here: DeepSpeed wraps
the module as it is. Counting (parameters, FLOPs) is in `pretrain/model/flops.py`.
"""
from __future__ import annotations

import hashlib
import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from pretrain.model.chunked_loss import LMHead
from pretrain.model.config import ModelConfig, ModelConfigError, checkpointing_plan, validate_config
from pretrain.model.documents import attention_mask, document_ids, mask_kernel, positions_in_document
from pretrain.model.inductor_cache import use_isa_keyed_cache
from pretrain.model.layers import Block, RMSNorm, RotaryEmbedding
from pretrain.model.sequence_parallel import SequenceSlice

IGNORE_INDEX = -100
"""Label value that contributes no loss (padding, document masks)."""


@dataclass
class LlamaOutput:
    """What `Llama.forward` returns (DeepSpeed's engine passes it through unchanged)."""

    loss: Tensor | None
    """Scalar to backprop: mean token cross-entropy (+ z_loss * mean logsumexp^2); None without labels."""
    ce_loss: Tensor | None = None
    """Mean token cross-entropy alone, detached (what to log as train/loss)."""
    sample_loss: Tensor | None = None
    """[B] per-sample mean cross-entropy over its labelled tokens, detached (0 where none); for per-domain loss."""
    sample_tokens: Tensor | None = None
    """[B] number of labelled (!= -100) tokens per sample, to weight sample_loss when aggregating."""
    logits: Tensor | None = None
    """[B, T, vocab] in the model dtype; only when return_logits or labels is None."""


def parameter_seed(seed: int, name: str) -> int:
    """The seed of parameter `name`'s own generator: 64 bits of BLAKE2b over the run's seed and the name (stable
    across processes and Python versions, where Python's own hash of a string is salted per process)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class SkipInitializers(TorchFunctionMode):
    """While active, the random initializers modules call as they are built (nn.Linear's kaiming_uniform_ and
    uniform_, nn.Embedding's normal_) leave their tensor as it is: Llama.init_parameter sets every value afterwards,
    so those draws only cost time (once the larger part of a CPU start-up). Works inside deepspeed.zero.Init."""

    FILLS = frozenset([
        torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.random_, torch.Tensor.bernoulli_,
        torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.cauchy_, torch.Tensor.log_normal_,
        torch.nn.init.uniform_, torch.nn.init.normal_, torch.nn.init.trunc_normal_, torch.nn.init.kaiming_uniform_,
        torch.nn.init.kaiming_normal_, torch.nn.init.xavier_uniform_, torch.nn.init.xavier_normal_,
        torch.nn.init.orthogonal_, torch.nn.init.sparse_,
    ])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FILLS:  # a Tensor method gets its tensor first; nn.init's functions pass it by name
            return args[0] if args else kwargs.get("tensor")
        return func(*args, **kwargs)


def draw_each(named: list[tuple[str, Tensor]], draw: Callable[[str, Tensor], None], on_cpu: bool) -> None:
    """`draw(name, tensor)` for each pair. Drawn on the CPU (`on_cpu`), several run at once, one per intra-op
    thread (a CPU's normal_ runs on one thread; each parameter has its own generator, so the order changes no
    value, and torch releases the GIL inside its kernels); on an accelerator one after another (each draw
    fills the device).
    `draw` must turn gradients off itself: grad mode is per thread."""
    threads = min(torch.get_num_threads(), len(named))
    if threads < 2 or not on_cpu:
        for name, tensor in named:
            draw(name, tensor)
        return
    largest_first = sorted(named, key=lambda item: -item[1].numel())  # the pool ends with small ones: balanced
    with ThreadPoolExecutor(threads) as pool:
        for future in [pool.submit(draw, name, tensor) for name, tensor in largest_first]:
            future.result()


class Decoder(nn.Module):
    """Embedding, blocks and final norm; named `model` inside Llama to match HF's `LlamaModel`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.hidden_size // cfg.num_heads, cfg.max_seq_len, cfg.rope_theta,
                                         cfg.rope_scaling)


class Llama(nn.Module):
    """Decoder-only Llama (RMSNorm, RoPE, SwiGLU, GQA) with ayumi's stability options."""

    def __init__(self, cfg: ModelConfig, init_weights: bool = True, seed: int | None = None):
        """Built without the modules' own initializers (nothing is drawn while the layers are made), then
        initialized by `init_weights(seed)`. `init_weights=False` leaves the init to the caller: the parameters
        hold whatever memory they were given (pretrain.engine.train_engine.build_model draws them on the
        training device, copies a Hugging Face folder in, or leaves them to a checkpoint load)."""
        super().__init__()
        validate_config(cfg)
        if cfg.attention == "document" and cfg.document_end_id < 0:
            raise ModelConfigError("model.attention=document needs model.document_end_id, the token that ends a "
                                   "document (training takes it from the data's manifest)")
        self.cfg = cfg
        with SkipInitializers():  # init_parameter sets every value: nn.Linear's and nn.Embedding's draws are waste
            self.model = Decoder(cfg)
            self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.recompute = [""] * cfg.num_layers  # per block: "", "block", "attention" or "mlp"
        self.sequence: SequenceSlice | None = None  # this rank's slice under sequence parallelism (in training)
        if init_weights:
            self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Llama init: N(0, std) for matrices, std/sqrt(2L) for residual outputs, norms = 1.

        Each parameter draws from a generator of its own, seeded from (`seed`, its name) (parameter_seed) on the
        device it lives on, so the values depend on neither the order of the draws nor on what else was drawn:
        on a CPU they are drawn by several threads at once. `seed=None`: the seed the CPU generator was last
        given (torch.initial_seed(), so `torch.manual_seed(s); Llama(cfg)` equals build_model's model at seed s)."""
        seed = torch.initial_seed() if seed is None else seed
        named = list(self.named_parameters())
        draw_each(named, lambda name, p: self.init_parameter(name, p, seed), all(p.is_cpu for _, p in named))

    @torch.no_grad()
    def init_parameter(self, name: str, p: Tensor, seed: int) -> None:
        """Initialize one (whole) parameter in place by its name, from its own generator on `p`'s device.

        Drawn in fp32 and rounded into `p`'s dtype, so a bf16 parameter (ZeRO-3's partitioned build) holds the
        fp32 model's values cast, as a whole model cast to bf16 does. The same (seed, name, shape) gives the same
        values on every device of one type; a CPU's and a GPU's generators give different ones."""
        if p.is_meta:
            return  # a shape without storage (a model built on the meta device): no values to draw
        if p.ndim == 1:
            p.fill_(1.0)  # only norm scales are 1-D
            return
        std = self.cfg.init_std
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            std = std / math.sqrt(2 * self.cfg.num_layers)  # keeps the residual stream's variance flat in depth
        generator = torch.Generator(device=p.device).manual_seed(parameter_seed(seed, name))
        value = p if p.dtype == torch.float32 else torch.empty(p.shape, dtype=torch.float32, device=p.device)
        value.normal_(0.0, std, generator=generator)
        if value is not p:
            p.copy_(value)

    def compile_for(self, mode: str, device_type: str) -> str:
        """Apply model.compile in place (parameter names unchanged); returns what was done: off, blocks or full.

        `dynamic=False`: shapes are static in training (micro batch x seq_len), so each block compiles
        once; a different shape (an eval batch of another size) compiles one more variant. On the CPU inductor's
        cache is first keyed by the CPU instruction-set setting (inductor_cache.py says why).
        """
        if mode == "auto":
            mode = "blocks" if device_type == "cuda" else "off"
        if mode in ("blocks", "full") and device_type == "cpu":  # GPU kernels are Triton's: no CPU ISA in them
            use_isa_keyed_cache()
        if mode == "blocks":
            for block in self.model.layers:
                block.compile(dynamic=False)
        elif mode == "full":
            self.compile(dynamic=False)
        return mode

    def set_activation_checkpointing(self, policy: str | bool) -> None:
        """Which activations to recompute in backward instead of storing (checkpointing_plan's policies;
        True/False: every block / none)."""
        self.recompute = checkpointing_plan(policy, self.cfg.num_layers)

    def forward(self, input_ids: Tensor, labels: Tensor | None = None, return_logits: bool = False) -> LlamaOutput:
        """input_ids, labels: [B, T]; labels are already shifted (labels[:, t] is the target at t).

        Under sequence parallelism (`self.sequence`, training only) every rank of the group gets the whole
        [B, T] and computes its own slice of T/N tokens; the loss is weighted over the group
        (pretrain/model/sequence_parallel.py), and return_logits gives this rank's slice."""
        split = self.sequence if self.training else None
        cos, sin = self.model.rotary_emb(input_ids.shape[1])
        mask = None
        if self.cfg.attention == "document":  # from the whole sequence: attention sees all of it
            documents = document_ids(input_ids, self.cfg.document_end_id)
            mask = attention_mask(documents, mask_kernel(input_ids.device))
            if self.cfg.restart_positions:  # each document's positions from 0: [B, 1, T, head_dim] tables
                positions = positions_in_document(documents)
                cos, sin = cos[positions][:, None], sin[positions][:, None]
        whole_labels = labels
        if split is not None:
            input_ids, cos, sin = split.take(input_ids), split.take(cos, -2), split.take(sin, -2)
            labels = split.take(labels) if labels is not None else None
        h = self.model.embed_tokens(input_ids)
        alpha = self.cfg.embedding_grad_alpha
        if alpha < 1.0:
            # GLM-130B's a*h + (1-a)*h.detach(), written so the forward value is bit-identical to h.
            h = h.detach() + alpha * (h - h.detach())
        for block, recompute in zip(self.model.layers, self.recompute):
            if recompute == "block" and self.training:
                h = checkpoint(block, h, cos, sin, "", mask, use_reentrant=False)
            else:
                h = block(h, cos, sin, recompute if self.training else "", mask)
        h = self.model.norm(h)
        chunk = self.cfg.loss_chunk_tokens
        if labels is not None and chunk > 0 and not return_logits:  # never the whole [B, T, vocab] logits
            scale = self.loss_scale(labels, whole_labels, split)
            # model.compile=off compiles nothing, the loss's chunk kernel included (chunked_loss.loss_terms_for).
            loss, token_ce, token_lse = self.lm_head(h, labels, chunk, scale, self.cfg.z_loss,
                                                     compiled=self.cfg.compile != "off")
            return self.loss_from_tokens(token_ce, token_lse, labels, whole_labels, split, loss=loss)
        logits = self.lm_head(h)
        if labels is None:
            return LlamaOutput(loss=None, logits=logits)
        out = self.compute_loss(logits, labels, whole_labels, split)
        if return_logits:
            out.logits = logits
        return out

    def compute_loss(self, logits: Tensor, labels: Tensor, whole_labels: Tensor | None = None,
                     split: SequenceSlice | None = None) -> LlamaOutput:
        """Token cross-entropy (+ z-loss) in fp32, per token from torch's fused cross-entropy.

        `F.cross_entropy` (one log-softmax pass, backward = softmax - one-hot) is ~10% of a CPU
        step faster than a separate logsumexp and gather, and keeps one fewer full-size tensor for
        backward. The z-loss needs log Z, which is the token's CE plus its target logit.
        """
        logits32 = logits.float()  # the one full-size fp32 copy; freed once backward used it
        mask = labels != IGNORE_INDEX
        token_ce = F.cross_entropy(logits32.flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="none").view_as(labels)  # 0 where ignored
        token_lse = None
        if self.cfg.z_loss > 0:
            # log Z = CE + target logit (only the z-loss needs it).
            target = labels.masked_fill(~mask, 0).unsqueeze(-1)
            token_lse = token_ce + logits32.gather(-1, target).squeeze(-1)
        del logits32
        return self.loss_from_tokens(token_ce, token_lse, labels, whole_labels, split)

    @staticmethod
    def loss_scale(labels: Tensor, whole_labels: Tensor | None = None, split: SequenceSlice | None = None) -> Tensor:
        """What a sum over this rank's tokens is multiplied by to give the batch's mean: 1/tokens, times the
        group size under sequence parallelism (loss_from_tokens says why); a 0-dim fp32 tensor on the device."""
        counted = labels if split is None else whole_labels
        tokens = (counted != IGNORE_INDEX).sum().clamp(min=1)  # all-ignored batch: loss 0, not NaN
        return (split.size if split is not None else 1) / tokens.float()

    def loss_from_tokens(self, token_ce: Tensor, token_lse: Tensor | None, labels: Tensor,
                         whole_labels: Tensor | None = None, split: SequenceSlice | None = None,
                         loss: Tensor | None = None) -> LlamaOutput:
        """Mean loss, z-loss and per-sample losses from per-token CE and log Z (0 where ignored) of either path.

        `loss`, when given, is the fused head's (chunked_loss.py): the same value, with its gradient already
        made, and the per-token values are then detached. Sequence-parallel (`split`): `labels` are this
        rank's slice, `whole_labels` the whole sequences; the sums are this slice's, divided by the whole
        sequences' token counts and times the group size, so the group's mean is the whole batch's
        (pretrain/model/sequence_parallel.py)."""
        mask = labels != IGNORE_INDEX
        counted = mask if split is None else whole_labels != IGNORE_INDEX
        tokens = counted.sum()
        ce = token_ce.sum() / tokens.clamp(min=1)  # all-ignored batch: loss 0, not NaN
        if split is not None:
            ce = ce * split.size
        if loss is None:
            loss = ce
            if self.cfg.z_loss > 0:
                # PaLM z-loss: pulls log Z toward 0 so the softmax normaliser cannot drift.
                z = (token_lse.square() * mask).sum() / tokens.clamp(min=1)
                loss = ce + self.cfg.z_loss * (z if split is None else z * split.size)
        sample_tokens = counted.sum(dim=1)
        sample_loss = token_ce.sum(dim=1).detach() / sample_tokens.clamp(min=1)
        if split is not None:
            sample_loss = sample_loss * split.size
        return LlamaOutput(loss=loss, ce_loss=ce.detach(), sample_loss=sample_loss, sample_tokens=sample_tokens)


def no_weight_decay(name: str, param: Tensor) -> bool:
    """True for parameters excluded from weight decay: 1-D ones (norm scales) and biases."""
    shape = getattr(param, "ds_shape", param.shape)  # a ZeRO-3 partitioned parameter is 1-D here: its full shape
    return len(shape) < 2 or name.endswith(".bias")


# Wrappers that prefix parameter names: DeepSpeed's engine, torch.compile, non-reentrant checkpoint wrappers.
_WRAPPER_PREFIX = re.compile(r"^(?:module\.|_orig_mod\.|_checkpoint_wrapped_module\.)+")
_BLOCK = re.compile(r"^model\.layers\.(\d+)\.")


def layer_groups(name: str) -> str:
    """Telemetry group of a parameter name: embedding, block_{i}, final_norm or lm_head."""
    bare = _WRAPPER_PREFIX.sub("", name).replace("._checkpoint_wrapped_module", "")
    if bare.startswith("model.embed_tokens."):
        return "embedding"
    if match := _BLOCK.match(bare):
        return f"block_{match.group(1)}"
    if bare.startswith("model.norm."):
        return "final_norm"
    if bare.startswith("lm_head."):
        return "lm_head"
    raise ValueError(f"parameter {name!r} belongs to no telemetry group (embedding, block_i, final_norm, lm_head)")
