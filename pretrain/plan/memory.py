"""Per-GPU peak memory of a training run, estimated from its config before anything starts.

`ayumi plan`, the trainer (on GPUs, before DeepSpeed allocates) and `ayumi doctor` call
`estimate_memory` and refuse a run whose estimate exceeds the GPU's memory, naming the knobs that
would make it fit (`fitting_changes`). It lives beside the engine because it follows what the engine
renders: ZeRO stage, offload, precision, gradient-accumulation dtype, buckets. Pure arithmetic, no torch.

What one GPU holds at the peak of a step (the start of backward), in bytes:
- **model states**: parameters, gradients, the fp32 master copy and Adam's two moments, as DeepSpeed
  0.19 keeps them per ZeRO stage, precision and offload. Mixed precision (bf16/fp16), P parameters,
  D data-parallel ranks: stage 0: 2P + 2P + 4P + 8P + 4P (fp32 gradients at the step); stage 1: 2P + 2P
  + 12P/D, its fp32 gradient partition (4P/D) existing only during the optimizer step, after backward freed
  the activations (`step_bytes`; measured at rest at 1, 2 and 4 ranks); stage 2: 2P + 18P/D; stage 3: 18P/D
  + 4 x the largest layer (gathered for compute). Stages 2 and 3 are exactly DeepSpeed's own
  `estimate_zero2/zero3_model_states_mem_needs` (tested), offload included (the optimizer states, fp32
  master and fp32 gradients move to the CPU).
- **gradient accumulation** in fp32 (`deepspeed.grad_accum_dtype`, bf16 runs with more than one micro
  batch per step): ZeRO 0-1 sum in ayumi's own fp32 buffers (pretrain/engine/grad_accum.py), 4 bytes per
  parameter on every rank; ZeRO 2-3 accumulate into the fp32 gradient partition that the step needs
  anyway, so the cost there is none.
- **communication buckets**: ZeRO 1-2 allocate `reduce_bucket_size` elements per buffer, two with
  `overlap_comm`; ZeRO-3 one reduce bucket; stage 0 flattens up to 5e8 gradient elements per all-reduce.
  One rank reduces nothing and allocates none (measured on one GPU).
- **activations** kept for backward, per block, from the tensors autograd saves in
  pretrain/model/layers.py (see `block_activation_bytes`), under the activation-checkpointing policy;
  the final norm and what the loss keeps (the plain head keeps fp32 log-probabilities [tokens x vocab],
  the chunked head only the hidden states and one float per token). Checked against measured CPU
  memory on small models (tests/pretrain/plan/test_memory.py). Compiled blocks (model.compile blocks or
  full; auto on a GPU) keep less: inductor recomputes the norms' fp32 steps and silu(gate) in backward
  (`MemoryShape.compiled`, measured the same way).
- **transients**: the largest short-lived buffer of the step, either the loss's (plain: fp32 logits,
  log-softmax and their gradient; chunked: one chunk's fp32 logits plus fp32 copies of the head's
  weight and its gradient) or a recomputed block's activations with its gradients.
- **FP8 casts** (model.fp8 on, pretrain/model/fp8.py): torchao saves each FP8 layer's input and weight for
  backward in the training dtype, as without FP8, so the activations and model states above are unchanged (an upper
  bound: compiled, inductor may keep the FP8 copies instead); what FP8 adds is one layer's FP8 copies at a time,
  of its weight, input and output gradient, each cast again transposed in backward (`fp8_cast_bytes`). Not yet
  checked against a GPU's measured peak.
- **allowance**: 10% of the above for the caching allocator's fragmentation, plus 1 GiB for the CUDA
  context, cuBLAS/NCCL workspaces (not in `torch.cuda.max_memory_allocated`, but not free either).
`peak_allocated` is the figure to compare with `torch.cuda.max_memory_allocated()`; `required` adds the
allowance and is what must fit.

With tensor parallelism (`parallel.tensor` = T, pretrain/model/tensor_parallel.py) P above is the parameters one
GPU holds: the cut projections count 1/T, the embedding, LM head and norms whole; D is the data-parallel
size (GPUs / T). Activations of the cut parts (q, K/V, the attention output, the MLP's four columns)
shrink by T; the norms', the block input's and the loss's do not (no sequence parallelism).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from curriculum.plan import planned_precision
from pretrain.model.config import ModelConfig, checkpointing_plan
from pretrain.model.flops import parameter_shapes
from pretrain.model.tensor_parallel import local_shape

GIB = 2**30
FRAGMENTATION = 0.10
"""Share of the estimated allocations added for the caching allocator's fragmentation."""
CONTEXT_BYTES = 1 * GIB
"""CUDA context, cuBLAS and NCCL workspaces: memory the GPU loses that torch never allocates."""
STAGE0_ALLREDUCE_ELEMENTS = 500_000_000
"""DeepSpeed's stage-0 all-reduce flattens gradients in buffers of up to this many elements."""


@dataclass(frozen=True)
class MemoryShape:
    """What the estimate depends on, read from the training config plus the job's size."""

    model: ModelConfig
    micro_batch: int
    seq_len: int
    precision: str
    """bf16 | fp16 | fp32 (auto is planned as bf16, as the disk plan counts it: curriculum.plan.planned_precision)."""
    zero_stage: int
    data_parallel: int
    offload_optimizer: bool = False
    offload_param: bool = False
    grad_accum_dtype: str = "fp32"
    grad_accum: int = 2
    """Micro batches per optimizer step on each rank (fp32 accumulation needs buffers only beyond 1)."""
    checkpointing: str = "none"
    reduce_bucket_size: int = 500_000_000
    overlap_comm: bool = True
    gqa_kernel: bool = True
    """The attention kernel reads grouped K/V heads in place (CUDA bf16/fp16); else K/V are repeated per query head."""
    tensor_parallel: int = 1
    """GPUs each block's projections are cut over (parallel.tensor); data_parallel counts the groups."""
    sequence_parallel: int = 1
    """GPUs each sequence is cut over (parallel.sequence); data_parallel counts the groups. ZeRO partitions over
    all of them (data_parallel x sequence_parallel); each keeps the activations of seq_len / N tokens."""

    @property
    def zero_ranks(self) -> int:
        """The ranks ZeRO partitions model states over: every rank of the data-parallel groups."""
        return self.data_parallel * self.sequence_parallel

    @property
    def local_tokens(self) -> int:
        """Tokens of a micro batch one rank computes (a sequence-parallel rank: its slice of each sequence)."""
        return self.micro_batch * self.seq_len // self.sequence_parallel

    @property
    def compiled(self) -> bool:
        """Inductor compiles the blocks (model.compile blocks or full; auto on a GPU plan, i.e. gqa_kernel): it
        recomputes cheap pointwise ops in backward and keeps fewer activations (`block_activation_bytes`)."""
        mode = self.model.compile
        return mode in ("blocks", "full") or (mode == "auto" and self.gqa_kernel)

    @property
    def compute_bytes(self) -> int:
        """Bytes of one activation element (the model's dtype)."""
        return 4 if self.precision == "fp32" else 2


@dataclass
class MemoryTerm:
    name: str
    bytes: int
    note: str = ""


@dataclass
class MemoryEstimate:
    """The breakdown; `required` must fit in the GPU's memory."""

    shape: MemoryShape
    terms: list[MemoryTerm] = field(default_factory=list)

    def term(self, name: str) -> int:
        return sum(t.bytes for t in self.terms if t.name == name)

    @property
    def model_states(self) -> int:
        return sum(self.term(name) for name in ("parameters", "gradients", "fp32 master weights", "Adam moments"))

    @property
    def peak_allocated(self) -> int:
        """Comparable with torch.cuda.max_memory_allocated()."""
        return sum(t.bytes for t in self.terms if t.name not in ("fragmentation", "CUDA context"))

    @property
    def required(self) -> int:
        return sum(t.bytes for t in self.terms)


# -- model states ---------------------------------------------------------------------------------
def local_parameter_shapes(model: ModelConfig, tensor_parallel: int = 1) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter one GPU holds (a tensor-parallel slice where the layout cuts it)."""
    return {name: local_shape(name, shape, tensor_parallel) for name, shape in parameter_shapes(model).items()}


def local_parameters(model: ModelConfig, tensor_parallel: int = 1) -> int:
    """Parameters one GPU holds before ZeRO cuts anything (all of them without tensor parallelism)."""
    return sum(math.prod(shape) for shape in local_parameter_shapes(model, tensor_parallel).values())


def largest_layer_parameters(model: ModelConfig, tensor_parallel: int = 1) -> int:
    """Parameters of the largest module (DeepSpeed's largest_layer_params: ZeRO-3 gathers one at a time)."""
    per_module: dict[str, int] = {}
    for name, shape in local_parameter_shapes(model, tensor_parallel).items():
        module = name.rsplit(".", 1)[0]
        per_module[module] = per_module.get(module, 0) + math.prod(shape)
    return max(per_module.values())


def model_state_terms(parameters: int, largest_layer: int, shape: MemoryShape) -> list[MemoryTerm]:
    """Parameters, gradients, fp32 master, Adam moments and the fp32 accumulation buffer per GPU (module doc)."""
    P, D, stage, e = parameters, shape.zero_ranks, shape.zero_stage, shape.compute_bytes
    mixed = shape.precision != "fp32"
    fp32_accum = shape.precision == "bf16" and shape.grad_accum_dtype == "fp32" and shape.grad_accum > 1
    offload = shape.offload_optimizer and stage >= 1
    part = lambda per_param: int(per_param * P / D)  # noqa: E731  (bytes of a state cut across D ranks)
    if stage == 0:
        params, grads = e * P, e * P + (4 * P if mixed else 0)  # + the optimizer's fp32 gradients at the step
        master, moments, accum = (4 * P if mixed else 0), 8 * P, (4 * P if fp32_accum else 0)
    elif stage in (1, 2):
        params = e * P
        low = e * P if stage == 1 else part(e)  # ZeRO-1 keeps whole gradients, ZeRO-2 only its partition
        # ZeRO-2 accumulates into its fp32 gradient partition, so it stays; ZeRO-1 builds it at the step only,
        # when the activations are gone (measured at rest: 2P + 2P + 12P/D at 1, 2 and 4 ranks): `step_bytes`.
        fp32_grads = part(4) if mixed and not offload and stage == 2 else 0
        accum = 4 * P if fp32_accum and stage == 1 else 0  # ayumi's fp32 sums (pretrain/engine/grad_accum.py)
        if stage == 2 and (offload or fp32_accum):  # offloaded, or accumulated straight into the fp32 partition
            low = 0
        grads, master, moments = low + fp32_grads, (0 if offload else part(4)), (0 if offload else part(8))
    else:
        gathered = 4 * largest_layer  # DeepSpeed's allowance for the layer being computed
        params = gathered + (0 if shape.offload_param else part(e))
        grads, master, moments, accum = (0 if offload else part(4)), (0 if offload else part(4)), (0 if offload else part(8)), 0
    if not mixed:
        master = part(4) if stage >= 1 and not offload else 0  # DeepSpeed's ZeRO keeps an fp32 partition even in fp32
    terms = [MemoryTerm("parameters", params, f"incl. {_gib(4 * largest_layer)} for the gathered largest layer"
                        if stage == 3 else ""),
             MemoryTerm("gradients", grads), MemoryTerm("fp32 master weights", master),
             MemoryTerm("Adam moments", moments, "on the CPU (offload)" if offload else "")]
    note = ("fp32 (deepspeed.grad_accum_dtype=fp32)" if accum else
            "fp32, into the gradient partition" if fp32_accum else
            "bf16 (deepspeed.grad_accum_dtype=bf16)" if mixed and shape.grad_accum > 1 else "")
    terms.append(MemoryTerm("gradient accumulation", accum, note))
    return terms


def step_bytes(parameters: int, shape: MemoryShape) -> int:
    """What only the optimizer step allocates, after backward freed the activations: ZeRO-1's fp32 gradient partition."""
    mixed, offload = shape.precision != "fp32", shape.offload_optimizer
    return int(4 * parameters / shape.zero_ranks) if shape.zero_stage == 1 and mixed and not offload else 0


def bucket_bytes(parameters: int, shape: MemoryShape) -> int:
    """ZeRO's gradient reduction buffers (module doc); none with one rank, where nothing is reduced (measured
    on one GPU: the peak is whole without them)."""
    e = shape.compute_bytes
    if shape.zero_ranks * shape.tensor_parallel == 1:
        return 0
    if shape.zero_stage == 0:
        return min(STAGE0_ALLREDUCE_ELEMENTS, parameters) * e
    if shape.zero_stage in (1, 2):
        return shape.reduce_bucket_size * e * (2 if shape.overlap_comm else 1)
    return min(shape.reduce_bucket_size, parameters) * e


# -- activations ------------------------------------------------------------------------------------
def attention_activation_bytes(model: ModelConfig, tokens: int, e: int, gqa_kernel: bool, seq_len: int,
                               tp: int = 1, compiled: bool = False) -> int:
    """What the attention half of a block keeps: its RMSNorm (`norm_activation_bytes`), q and K/V after RoPE,
    the attention output and its log-sum-exp. The fused kernels lay their output out token-major, so o_proj's
    input is a view of it, not another tensor. With `tp` tensor-parallel ranks each keeps its own heads (1/tp
    of them); the norm is whole on every rank."""
    n, h, heads, kv_heads = tokens, model.hidden_size, model.num_heads, model.num_kv_heads
    head_dim = h // heads
    kv = (kv_heads if gqa_kernel or kv_heads == heads else heads) * head_dim
    q, heads, kv_heads, kv = h // tp, heads // tp, kv_heads // tp, kv // tp  # this rank's heads
    kept = norm_activation_bytes(n, h, e, compiled) + e * n * q + 2 * e * n * kv + e * n * q + 4 * n * heads
    if model.qk_norm:
        kept += (4 + e) * n * (q + kv_heads * head_dim) + 4 * n * (heads + kv_heads)
    if model.attention == "eager":
        batch = n / seq_len  # sequence-parallel: a fraction, as each rank scores 1/N of the heads over all tokens
        # fp32 softmax and its model-dtype copy per head, the causal mask; a separate o_proj input, no log-sum-exp.
        kept += int((4 + e) * batch * heads * seq_len * seq_len) + seq_len * seq_len + e * n * q - 4 * n * heads
    return kept


def mlp_activation_bytes(model: ModelConfig, tokens: int, e: int, tp: int = 1, compiled: bool = False) -> int:
    """What the SwiGLU half keeps: its RMSNorm, gate, silu(gate), up and their product (1/tp of the columns each);
    compiled, gate, up and the product (silu(gate) is recomputed in backward)."""
    columns = e * tokens * (model.intermediate_size // tp)
    return norm_activation_bytes(tokens, model.hidden_size, e, compiled) + (3 if compiled else 4) * columns


def norm_activation_bytes(tokens: int, hidden: int, e: int, compiled: bool = False) -> int:
    """RMSNorm in fp32 keeps the fp32 input, 1/rms per token, the normalised and the scaled output; compiled,
    only its input and scaled output in the model dtype and 1/rms (the fp32 steps are recomputed in backward)."""
    if compiled:
        return 2 * e * tokens * hidden + 4 * tokens
    return 4 * tokens * hidden + 4 * tokens + 2 * e * tokens * hidden


def block_activation_bytes(shape: MemoryShape, recompute: str) -> int:
    """One block's kept activations for a micro batch; a recomputed part keeps only its input."""
    model, e = shape.model, shape.compute_bytes
    n = shape.local_tokens
    block_input = e * n * model.hidden_size
    if recompute == "block":
        return block_input
    attention = attention_activation_bytes(model, n, e, shape.gqa_kernel, shape.seq_len, shape.tensor_parallel,
                                           shape.compiled)
    mlp = mlp_activation_bytes(model, n, e, shape.tensor_parallel, shape.compiled)
    if recompute == "attention":
        attention = block_input
        if shape.compiled:  # measured: inductor then recomputes the MLP norm's output from its input too
            mlp -= e * n * model.hidden_size
    elif recompute == "mlp":
        mlp = block_input
    return attention + mlp


def head_activation_bytes(shape: MemoryShape) -> int:
    """The final norm and what the loss keeps for backward. Plain: the fp32 log-probabilities. Fused
    (chunked_loss.py): the gradients it made in forward, the hidden states' in place of the hidden states
    themselves (counted with the norm's output) and the weight's in fp32."""
    model, e = shape.model, shape.compute_bytes
    n = shape.local_tokens
    kept = norm_activation_bytes(n, model.hidden_size, e)
    return kept + (4 * model.vocab_size * model.hidden_size if model.loss_chunk_tokens > 0 else 4 * n * model.vocab_size)


def activation_bytes(shape: MemoryShape) -> int:
    """Everything kept for backward at the end of a training micro batch's forward."""
    plan = checkpointing_plan(shape.checkpointing, shape.model.num_layers)
    return sum(block_activation_bytes(shape, recompute) for recompute in plan) + head_activation_bytes(shape)


def transient_bytes(shape: MemoryShape) -> int:
    """The largest short-lived allocation on top of what is kept: the loss's, or a recomputed block's."""
    model, e = shape.model, shape.compute_bytes
    n = shape.local_tokens
    vocab, h = model.vocab_size, model.hidden_size
    if model.loss_chunk_tokens > 0:
        chunk = min(model.loss_chunk_tokens, n)
        forward = (4 + e) * chunk * vocab  # a chunk's fp32 logits and their gradient in the model dtype
        backward = (4 + e) * (vocab * h + n * h)  # the kept gradients scaled in fp32, then cast
        loss = max(forward, backward)
    else:
        loss = (8 + e) * n * vocab  # logits in the model dtype, fp32 copy, log-softmax gradient
    plan = checkpointing_plan(shape.checkpointing, model.num_layers)
    full = block_activation_bytes(shape, "")
    recompute = full if any(plan) else 0
    grads = 4 * e * n * h + 2 * e * n * (model.intermediate_size // shape.tensor_parallel)  # a block's gradients in flight
    return max(loss, recompute + grads)


def fp8_cast_bytes(shape: MemoryShape) -> int:
    """The FP8 copies (1 byte an element) of the largest FP8 layer's weight, input and output gradient, twice (each
    is cast again transposed for backward's GEMMs); 0 with model.fp8=off. One layer's at a time: they are freed as
    its GEMMs end, and the scales (one float per tensor or per row) are negligible beside them."""
    model = shape.model
    if model.fp8 == "off":
        return 0
    n, h, tp = shape.local_tokens, model.hidden_size, shape.tensor_parallel
    head_dim = h // model.num_heads
    # (in, out) of the blocks' projections: q/o, k/v, the MLP's gate/up and down (the LM head stays unconverted)
    layers = [(h, model.num_heads * head_dim // tp), (h, model.num_kv_heads * head_dim // tp),
              (h, model.intermediate_size // tp), (model.intermediate_size // tp, h)]
    return max(2 * (fan_in * fan_out + n * fan_in + n * fan_out) for fan_in, fan_out in layers)


# -- the estimate ---------------------------------------------------------------------------------
def estimate_memory(shape: MemoryShape) -> MemoryEstimate:
    parameters = local_parameters(shape.model, shape.tensor_parallel)
    estimate = MemoryEstimate(shape)
    estimate.terms += model_state_terms(parameters, largest_layer_parameters(shape.model, shape.tensor_parallel), shape)
    estimate.terms.append(MemoryTerm("communication buckets", bucket_bytes(parameters, shape)))
    plan = checkpointing_plan(shape.checkpointing, shape.model.num_layers)
    estimate.terms.append(MemoryTerm("activations", activation_bytes(shape),
                                     f"micro batch {shape.micro_batch} x {shape.seq_len} tokens"
                                     + (f" / {shape.sequence_parallel} ranks" if shape.sequence_parallel > 1 else "")
                                     + ", "
                                     f"checkpointing {shape.checkpointing} ({sum(1 for p in plan if p)} of "
                                     f"{len(plan)} blocks recompute)"))
    head = "fused, chunked" if shape.model.loss_chunk_tokens > 0 else "whole fp32 logits"
    # The step's own buffers come after backward freed the activations: they raise the peak only past those.
    step = step_bytes(parameters, shape) - estimate.term("activations")
    estimate.terms.append(MemoryTerm("transients", max(transient_bytes(shape), step), f"loss: {head}"))
    if shape.model.fp8 != "off":  # shown only when on: the plan says FP8 is counted, and how
        estimate.terms.append(MemoryTerm("FP8 casts", fp8_cast_bytes(shape),
                                         f"model.fp8={shape.model.fp8}: one layer's FP8 copies at a time; activations "
                                         "kept in the training dtype, as without FP8"))
    dynamic = estimate.peak_allocated
    estimate.terms.append(MemoryTerm("fragmentation", int(FRAGMENTATION * dynamic), f"{FRAGMENTATION:.0%} allowance"))
    estimate.terms.append(MemoryTerm("CUDA context", CONTEXT_BYTES, "context, cuBLAS and NCCL workspaces"))
    return estimate


def memory_shape(cfg: Any, data_parallel: int, gqa_kernel: bool = True) -> MemoryShape:
    """The shape of a composed training config (read by attribute) for `data_parallel` ranks (each a
    tensor-parallel group of parallel.tensor GPUs)."""
    ds, train = cfg.deepspeed, cfg.train
    parallel = getattr(cfg, "parallel", None)
    precision = planned_precision(ds.precision)  # auto as bf16, as the disk plan counts it
    per_step = train.micro_batch_size * max(1, data_parallel)
    accum = train.grad_accum or max(1, train.global_batch_size // per_step)
    return MemoryShape(
        model=cfg.model, micro_batch=train.micro_batch_size, seq_len=train.seq_len, precision=precision, grad_accum=accum,
        zero_stage=ds.zero_stage, data_parallel=max(1, data_parallel), offload_optimizer=ds.offload_optimizer,
        offload_param=ds.offload_param, grad_accum_dtype=getattr(ds, "grad_accum_dtype", "fp32"),
        checkpointing=str(ds.activation_checkpointing), reduce_bucket_size=ds.reduce_bucket_size,
        overlap_comm=ds.overlap_comm, gqa_kernel=gqa_kernel,
        tensor_parallel=parallel.tensor if parallel is not None else 1,
        sequence_parallel=parallel.sequence if parallel is not None else 1,
    )


# -- when it does not fit -------------------------------------------------------------------------
RECOMPUTE_ORDER = ("mlp", "attention", "every_2", "full")
"""Activation-checkpointing policies from the least recompute (and memory saved) to the most."""


def _alternatives(shape: MemoryShape, global_batch: int) -> list[list[tuple[str, MemoryShape]]]:
    """Single-knob changes by family, each family ordered from the least costly in speed: activation
    checkpointing, micro batch (the global batch kept), the chunked loss, ZeRO stage, optimizer offload."""
    policies = [(f"deepspeed.activation_checkpointing={p}", replace(shape, checkpointing=p))
                for p in RECOMPUTE_ORDER if p != shape.checkpointing]
    micro_batches, micro = [], shape.micro_batch // 2
    while micro >= 1:
        if global_batch % (micro * shape.data_parallel) == 0:
            micro_batches.append((f"train.micro_batch_size={micro}", replace(shape, micro_batch=micro)))
        micro //= 2
    chunked = [("model.loss_chunk_tokens=4096", replace(shape, model=replace(shape.model, loss_chunk_tokens=4096)))
               ] if shape.model.loss_chunk_tokens == 0 else []
    stages = [(f"deepspeed.zero_stage={stage}", replace(shape, zero_stage=stage)) for stage in range(shape.zero_stage + 1, 4)]
    offload = [("deepspeed.offload_optimizer=true", replace(shape, offload_optimizer=True))
               ] if shape.zero_stage >= 1 and not shape.offload_optimizer else []
    return [policies, micro_batches, chunked, stages, offload]


def fitting_changes(shape: MemoryShape, capacity: int, global_batch: int) -> list[str]:
    """Per knob family, the first change under which the estimate fits, with its figure."""
    fits = []
    for family in _alternatives(shape, global_batch):
        for knob, changed in family:
            estimate = estimate_memory(changed)
            if estimate.required <= capacity:
                fits.append(f"{knob} ({_gib(estimate.required)})")
                break
    return fits


def fit_advice(shape: MemoryShape, capacity: int, global_batch: int) -> str:
    """What to change so the run fits in `capacity` bytes per GPU."""
    fixes = fitting_changes(shape, capacity, global_batch)
    if fixes:
        return "it fits with any one of: " + "; ".join(fixes)
    return "no single knob makes it fit: combine a smaller micro batch, checkpointing, a higher ZeRO stage and offload, " \
           "or use more GPUs"


def memory_problem(estimate: MemoryEstimate, capacity: int, global_batch: int, where: str) -> str | None:
    """None when the run fits in `capacity` bytes per GPU; else the refusal naming the knobs."""
    if estimate.required <= capacity:
        return None
    shape = estimate.shape
    return (f"the run needs about {_gib(estimate.required)} per GPU but {where} has {_gib(capacity)} "
            f"(micro batch {shape.micro_batch}, ZeRO-{shape.zero_stage}, checkpointing {shape.checkpointing}, "
            f"{shape.data_parallel} data-parallel ranks{_tp_note(shape)}); {fit_advice(shape, capacity, global_batch)}")


def _tp_note(shape: MemoryShape) -> str:
    if shape.sequence_parallel > 1:
        return f" of sequence-parallel {shape.sequence_parallel}"
    return f" of tensor-parallel {shape.tensor_parallel}" if shape.tensor_parallel > 1 else ""


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def format_memory(estimate: MemoryEstimate, capacity: int | None = None, where: str = "") -> str:
    """The per-GPU breakdown, one term a line."""
    shape = estimate.shape
    lines = [f"memory per GPU ({shape.precision}, ZeRO-{shape.zero_stage}"
             + (", optimizer offload" if shape.offload_optimizer else "") + (", param offload" if shape.offload_param else "")
             + (f", tensor-parallel {shape.tensor_parallel}" if shape.tensor_parallel > 1 else "")
             + (f", sequence-parallel {shape.sequence_parallel}" if shape.sequence_parallel > 1 else "")
             + (f", FP8 {shape.model.fp8}" if shape.model.fp8 != "off" else "")
             + f", {shape.data_parallel} data-parallel ranks):"]
    for term in estimate.terms:
        if term.bytes or term.note:
            lines.append(f"  {term.name:<22} {_gib(term.bytes):>10}" + (f"   {term.note}" if term.note else ""))
    lines.append(f"  {'peak allocated':<22} {_gib(estimate.peak_allocated):>10}   (compare torch.cuda.max_memory_allocated)")
    total = f"  {'required':<22} {_gib(estimate.required):>10}"
    if capacity:
        total += f"   of {_gib(capacity)}{' on ' + where if where else ''}: " + ("fits" if estimate.required <= capacity else "DOES NOT FIT")
    lines.append(total)
    return "\n".join(lines)
