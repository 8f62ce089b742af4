"""Llama model shape and options as one documented dataclass (`conf/model/*.yaml` are its presets).

`model_problems` holds the rules a shape must follow (ranges, divisibility); the training config
checks them before any rank starts, and the model checks them again when it is built.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar

from pretrain.ranges import Range, above, at_least, between, range_problems

ATTENTION_KERNELS = ("sdpa", "eager", "document")
COMPILE_MODES = ("auto", "off", "blocks", "full")
FP8_RECIPES = ("off", "tensorwise", "rowwise")
"""model.fp8's values: off, or torchao.float8's recipe of that name (pretrain/model/fp8.py)."""


SCALING_TYPES = ("none", "linear", "dynamic", "yarn", "llama3")
"""RoPE scalings ayumi computes; "none" is plain RoPE (transformers' "default")."""


@dataclass
class RopeScaling:
    """RoPE scaling for context extension (transformers' `rope_scaling` fields); type none = plain RoPE."""

    type: str = "none"
    """none, linear, dynamic, yarn or llama3 (pretrain/model/rope.py says what each computes)."""
    factor: float = 1.0
    """How many times the original length the model is stretched to (Llama 3.1: 8)."""
    original_max_seq_len: int = 0
    """The length the model was pretrained at (transformers' original_max_position_embeddings; Llama 3.1: 8192);
    dynamic: the length past which theta grows. 0 = model.max_seq_len."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths beyond original_max_seq_len / this are fully interpolated (Llama 3.1: 1)."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_seq_len / this are kept as they are (Llama 3.1: 4)."""
    beta_fast: float = 32.0
    """yarn: dimensions turning more than this many times over the original length are kept (extrapolated)."""
    beta_slow: float = 1.0
    """yarn: dimensions turning fewer than this many times are fully interpolated."""
    attention_factor: float = 0.0
    """yarn: what the cos/sin tables are multiplied by; 0 = from factor (0.1 ln(factor) + 1, or with mscale)."""
    mscale: float = 0.0
    """yarn: with mscale_all_dim, the default attention factor is mscale'(factor, mscale) / mscale'(factor,
    mscale_all_dim), mscale'(f, m) = 0.1 m ln(f) + 1; 0 = unused."""
    mscale_all_dim: float = 0.0
    """yarn: see mscale; 0 = unused."""
    truncate: bool = True
    """yarn: round the ramp's dimension bounds outward to whole dimensions (transformers' default)."""


def scaling_problems(scaling: RopeScaling, prefix: str = "model.rope_scaling.") -> list[str]:
    """One line per value of `scaling` that cannot work."""
    if scaling.type not in SCALING_TYPES:
        return [f"{prefix}type={scaling.type!r}: choose one of {', '.join(SCALING_TYPES)}"]
    problems = []
    if scaling.type != "none" and not scaling.factor > 0:
        problems.append(f"{prefix}factor={scaling.factor}: must be > 0 (how many times the original length)")
    if scaling.original_max_seq_len < 0:
        problems.append(f"{prefix}original_max_seq_len={scaling.original_max_seq_len}: must be >= 0 "
                        "(0 = model.max_seq_len)")
    if scaling.type == "llama3" and not 0 < scaling.low_freq_factor < scaling.high_freq_factor:
        problems.append(f"{prefix}low_freq_factor={scaling.low_freq_factor} and {prefix}high_freq_factor="
                        f"{scaling.high_freq_factor}: need 0 < low_freq_factor < high_freq_factor (Llama 3.1: 1 and 4)")
    if scaling.type == "yarn" and not 0 < scaling.beta_slow <= scaling.beta_fast:
        problems.append(f"{prefix}beta_slow={scaling.beta_slow} and {prefix}beta_fast={scaling.beta_fast}: need "
                        "0 < beta_slow <= beta_fast (YaRN: 1 and 32)")
    return problems


@dataclass
class ModelConfig:
    """The architecture; every field is one line of documentation (litgpt style)."""

    name: str = "debug"
    """Preset name, for logs and the exported HF config."""
    vocab_size: int = 512
    """Vocabulary size: embedding and LM-head rows, at least the tokenizer's ids. 0 = follow the tokenizer: the
    vocabulary data.root's manifest records (else data.tokenizer_dir's), padded up to a multiple of vocab_multiple;
    the resolved number is what `--cfg job` prints and the run's config.yaml records (pretrain/model/vocabulary.py)."""
    vocab_multiple: int = 128
    """vocab_size=0 pads the tokenizer's vocabulary up to a multiple of this (Megatron-LM's
    --make-vocab-size-divisible-by: GPU-friendly GEMM shapes); 1 = no padding. Unused when vocab_size is set."""
    hidden_size: int = 64
    """Width of the residual stream."""
    intermediate_size: int = 176
    """Width of the SwiGLU feed-forward's hidden layer."""
    num_layers: int = 2
    """Number of transformer blocks."""
    num_heads: int = 4
    """Attention query heads; hidden_size must divide by it."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); num_heads must divide by it. = num_heads is MHA."""
    max_seq_len: int = 128
    """Longest sequence the RoPE tables are built for."""
    rope_theta: float = 10000.0
    """RoPE base frequency θ (Llama-2: 1e4, Llama-3: 5e5; raising it is one way to extend the context)."""
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    """RoPE scaling for context extension (linear, dynamic, yarn, llama3), as transformers' rope_scaling."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the input embedding matrix with the output projection (lm_head)."""
    init_std: float = 0.02
    """Std of the normal init; residual output projections use init_std / sqrt(2 * num_layers)."""
    z_loss: float = 0.0
    """Coefficient of the PaLM z-loss (log Z)^2 that keeps the softmax normaliser near 1; 0 = off (1e-4 typical)."""
    qk_norm: bool = False
    """RMSNorm on queries and keys per head before RoPE (stabilises attention logits)."""
    embedding_grad_alpha: float = 1.0
    """GLM-130B embedding-gradient shrink: emb = a*emb + (1-a)*emb.detach(); 1.0 = off, 0.1 as in GLM-130B."""
    attention: str = "sdpa"
    """Attention: sdpa (torch scaled_dot_product_attention, causal; flash/efficient kernels on GPU), eager (a
    reference), or document: causal within each document of a packed sample, documents ending with
    document_end_id (flash varlen attention on CUDA in bf16/fp16, SDPA with a mask elsewhere; pretrain/model/documents.py)."""
    document_end_id: int = -1
    """attention=document: the token that ends a document; -1 = the data's end-of-document id (its manifest)."""
    restart_positions: bool = False
    """attention=document: each document's RoPE positions start at 0, as if it were alone in its sample."""
    compile: str = "auto"
    """torch.compile: blocks (each decoder block, static shapes), full (the whole model), off; auto = blocks on
    CUDA, off on CPU (where compiling costs more than it saves on small runs). A recompile happens only when a
    shape changes (another micro batch or sequence length, e.g. a last partial batch) or the checkpointing policy does."""
    loss_chunk_tokens: int = 4096
    """LM head fused with its cross-entropy, in chunks of this many tokens, gradients made in the forward pass
    with GEMMs in the training dtype (pretrain/model/chunked_loss.py): the whole [tokens x vocab] logits never
    exist, and nothing is recomputed. 0 = the plain path: whole logits, then cross-entropy (what transformers
    does; more memory, and no faster)."""
    init_from: str | None = None
    """A local Hugging Face Llama folder (config.json + safetensors) to start from: its config.json sets the shape
    (a model.* override that contradicts it is an error), its weights replace the random init at step 0. With a
    larger tokenizer (data.tokenizer_dir from `ayumi tokenizer expand`) the vocabulary grows to it, padded to 64."""
    new_token_init: str = "base_mean"
    """Rows of a grown vocabulary: base_mean (mean of the base rows of the base tokenizer's split of the new piece,
    as Swallow), mean (mean of all base rows) or random (normal, init_std)."""
    fp8: str = "off"
    """FP8 training of the blocks' Linear layers (torchao.float8, pretrain/model/fp8.py): off, tensorwise (one scale
    per tensor: the faster recipe) or rowwise (one scale per row: finer scales, slower). The embedding, the LM head and any
    Linear whose sizes do not divide by 16 stay in the training dtype; weights, optimizer states and checkpoints are
    unchanged, so a run resumes with it on or off. Needs a GPU of compute capability 8.9+ (H100, H200, L4, RTX 4090),
    ZeRO 0-2 and no tensor parallelism; refused before launch otherwise (docs/performance.md, "FP8")."""
    fp8_emulate: bool = False
    """For tests only: model.fp8 through torchao's emulation (FP8 rounding, matmuls in the training dtype), which runs
    on the CPU and on any GPU, and is slower than model.fp8=off."""

    def __post_init__(self):
        # A config read back from JSON (a checkpoint's record, dataclasses.asdict) holds the scaling as a dict.
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        # YAML reads an unquoted `fp8: off` as the boolean false (and a str field then holds "False"): it means off.
        if self.fp8 is False or str(self.fp8).lower() == "false":
            self.fp8 = "off"

    RANGES: ClassVar[dict[str, Range]] = {
        **{size: at_least(1) for size in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                                          "num_kv_heads", "max_seq_len")},
        # 0 never reaches a check from the command line: composed_from_args has put the tokenizer's number there.
        "vocab_size": at_least(1, "0, to follow the tokenizer, is resolved as the config is composed"),
        "vocab_multiple": at_least(1, "1 = no padding"),
        "rope_theta": above(0), "norm_eps": above(0), "init_std": above(0), "z_loss": at_least(0, "0 = off"),
        "embedding_grad_alpha": between(0, 1, low_open=True, note="1.0 = off"),
        "loss_chunk_tokens": at_least(0, "0 = the plain path, whole logits"),
    }
    """Allowed values (pretrain/ranges.py); shapes must also divide, see model_problems."""


def model_problems(cfg: ModelConfig, prefix: str = "model.") -> list[str]:
    """Every problem of a model config, one line each: ranges, then shape_problems."""
    return range_problems(cfg, prefix) + shape_problems(cfg, prefix)


def shape_problems(cfg: ModelConfig, prefix: str = "model.") -> list[str]:
    """The attention kernel, and the divisibility attention needs: heads split hidden, kv heads split heads, RoPE pairs."""
    problems = []
    if cfg.new_token_init not in ("base_mean", "mean", "random"):
        problems.append(f"{prefix}new_token_init={cfg.new_token_init!r}: choose one of base_mean, mean, random")
    if cfg.compile not in COMPILE_MODES:
        problems.append(f"{prefix}compile={cfg.compile!r}: choose one of {', '.join(COMPILE_MODES)}")
    if cfg.attention not in ATTENTION_KERNELS:
        problems.append(f"{prefix}attention={cfg.attention!r}: choose one of {', '.join(ATTENTION_KERNELS)}")
    if cfg.fp8 not in FP8_RECIPES:
        problems.append(f"{prefix}fp8={cfg.fp8!r}: choose one of {', '.join(FP8_RECIPES)}")
    problems += scaling_problems(cfg.rope_scaling, f"{prefix}rope_scaling.")
    if cfg.num_heads < 1 or cfg.num_kv_heads < 1 or cfg.hidden_size < 1:
        return problems  # the divisions below need positive sizes; the range check says what to fix
    if cfg.hidden_size % cfg.num_heads:
        problems.append(f"{prefix}hidden_size={cfg.hidden_size} must divide by {prefix}num_heads={cfg.num_heads}")
    elif (cfg.hidden_size // cfg.num_heads) % 2:
        problems.append(f"head_dim = {prefix}hidden_size / {prefix}num_heads = {cfg.hidden_size // cfg.num_heads} "
                        "must be even for RoPE")
    if cfg.num_heads % cfg.num_kv_heads:
        problems.append(f"{prefix}num_heads={cfg.num_heads} must divide by {prefix}num_kv_heads={cfg.num_kv_heads}")
    return problems


class ModelConfigError(ValueError):
    """A ModelConfig whose fields contradict each other."""


def validate_config(cfg: ModelConfig) -> None:
    """Raise ModelConfigError naming each field, its value and the fix when shapes don't fit.

    Here, beside the rules, so that counting parameters (pretrain/model/flops.py) and checking a
    config need no torch; the model calls it too, guarding models built directly.
    """
    problems = model_problems(cfg)
    if problems:
        raise ModelConfigError("\n".join(problems))


CHECKPOINTING_POLICIES = ("none", "full", "every_K", "attention", "mlp")
"""deepspeed.activation_checkpointing: none; full (every block); every_K (blocks 0, K, 2K, ...); attention or mlp
(that half of every block). Memory falls and recompute grows from none to full (torchtitan's selective AC)."""


def checkpointing_plan(policy: str | bool, num_layers: int) -> list[str]:
    """Per block: "" (keep activations), "block", "attention" or "mlp"; ValueError for an unknown policy."""
    policy = {"true": "full", "false": "none"}.get(str(policy).lower(), str(policy))
    if policy == "none":
        return [""] * num_layers
    if policy == "full":
        return ["block"] * num_layers
    if policy in ("attention", "mlp"):
        return [policy] * num_layers
    match = re.fullmatch(r"every_(\d+)", policy)
    if match and int(match.group(1)) >= 1:
        every = int(match.group(1))
        return ["block" if index % every == 0 else "" for index in range(num_layers)]
    raise ValueError(f"deepspeed.activation_checkpointing={policy!r}: choose none, full, every_K (K >= 1, e.g. every_2), "
                     "attention or mlp")
