"""Structured configs for training: one dataclass per concern, registered with Hydra.

`conf/config.yaml` composes these with the groups under `conf/` (model, optim, deepspeed,
logging, stability, experiment). Hydra merges every YAML into the dataclasses below, so an
unknown key or a wrongly typed value fails at composition with the key's full name.

Configs hold values only; each dataclass lists the allowed range of its numeric fields in
`RANGES` (pretrain/ranges.py), and `config_problems` (ranges, names, model shapes, the declared
data's tokenizer) and
`check_config` (cross-field checks) run in the launching process before any rank starts, and
again in every rank before distributed init. A ConfigError names the field, the value and the fix.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar, TextIO

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from curriculum.config import CurriculumConfig
from curriculum.declared import tokenizer_missing
from downstream.config import DownstreamConfig, config_problems as downstream_problems
from pretrain.model.config import ModelConfig, checkpointing_plan, shape_problems
from pretrain.job.hang_watchdog import HangConfig
from pretrain.ranges import Range, Rule, above, at_least, between, one_of, range_problems
from pretrain.model.sequence_parallel import sequence_parallel_problems
from pretrain.model.tensor_parallel import tensor_parallel_problems
from pretrain.stages import stage_problems
from pretrain.stability.config import StabilityConfig, StabilityConfigError, check_stability_config
from common.status import BAD_INPUT
from common.conf import (
    CONF_DIR, ConfigCompositionError, compose, composed_from, conf_label, config_help, fields_help, group_options,
    override_key, unset_environment,
)


PRECISIONS = ("auto", "bf16", "fp16", "fp32")
"""What deepspeed.precision accepts; every value but `auto` is used as given (pretrain/engine/precision.py)."""


class ConfigError(ValueError):
    """A configuration value is inconsistent; the message names the field(s) and the fix."""


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule (a pure function of the step, see pretrain/engine/optimizer.py)."""

    lr: float = 3e-4
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float = 3e-5
    """Learning rate at the end of the decay (cosine, linear, wsd)."""
    schedule: str = "cosine"
    """After warmup: cosine | linear | constant | wsd (warmup-stable-decay)."""
    warmup_steps: int = 100
    """Linear warmup from 0 to lr over this many optimizer steps (keep it <= ~10% of the run)."""
    wsd_decay_fraction: float = 0.2
    """wsd only: share of the run spent in the final linear decay to min_lr."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2 (0.95 is the large-LM norm; 0.999 is torch's default)."""
    eps: float = 1e-8
    """Adam epsilon; lowering it counters the shallow-layer second-moment collapse behind some spikes."""
    weight_decay: float = 0.1
    """Decoupled weight decay; norms and biases are never decayed."""
    grad_clip: float = 1.0
    """Clip the global gradient L2 norm to this value; 0 turns clipping off."""

    RANGES: ClassVar[dict[str, Range]] = {
        "lr": above(0), "min_lr": at_least(0), "warmup_steps": at_least(0), "wsd_decay_fraction": between(0, 1),
        "beta1": between(0, 1, high_open=True), "beta2": between(0, 1, high_open=True), "eps": above(0),
        "weight_decay": at_least(0), "grad_clip": at_least(0, "0 = no clipping"),
    }
    """Allowed values, checked before any rank starts (pretrain/ranges.py)."""


@dataclass
class DeepSpeedConfig:
    """ZeRO stage, precision and memory options; rendered to DeepSpeed's JSON in pretrain/engine/train_engine.py."""

    zero_stage: int = 0
    """ZeRO stage 0 (plain data parallel), 1 (optimizer states), 2 (+gradients) or 3 (+parameters)."""
    precision: str = "auto"
    """auto | bf16 | fp16 (dynamic loss scaling) | fp32. auto: bf16 on GPUs that have it (else fp16), and on CPUs
    with native bf16, AVX512-BF16/AMX/Arm BF16 (else fp32); see pretrain/engine/precision.py. A resumed auto run keeps
    its precision."""
    offload_optimizer: bool = False
    """ZeRO 1-3: keep optimizer states (and the step) on the CPU (ZeRO-Offload)."""
    offload_param: bool = False
    """ZeRO 3 only: keep parameters on the CPU (ZeRO-Infinity style)."""
    zero3_init: bool = True
    """ZeRO 3 only: build the model already partitioned (deepspeed.zero.Init), so no rank ever holds
    all of it; the same init values as without. Needed from a few billion parameters per node."""
    initial_scale_power: int = 16
    """fp16: the loss scale starts at 2**this."""
    loss_scale_window: int = 1000
    """fp16: steps without overflow before the scale doubles."""
    hysteresis: int = 2
    """fp16: overflows tolerated before the scale halves (ZeRO 1-3)."""
    min_loss_scale: float = 1.0
    """fp16: the scale never drops below this; DeepSpeed raises if an overflow happens here."""
    bf16_skip_nonfinite: bool = True
    """bf16: skip a step whose gradients hold inf/NaN (otherwise DeepSpeed applies it and the model is lost)."""
    grad_accum_dtype: str = "fp32"
    """bf16 runs: dtype the micro-batch gradients are summed in. fp32 (as Megatron): costs 4 bytes/parameter on every
    rank under ZeRO 0-1 (a whole fp32 gradient, kept by ayumi when grad accum > 1) and 2 bytes/parameter / data-parallel
    size under ZeRO 2-3 (DeepSpeed's fp32 gradient partitions). bf16 saves that memory but loses precision as the
    micro-batches per step grow (16-64 on a cluster). fp32 and fp16 precisions are unaffected."""
    activation_checkpointing: str = "none"
    """Activations recomputed in backward instead of stored: none; full (every block: least memory, ~30% more
    compute); every_K (every K-th block, e.g. every_2); attention or mlp (that half of every block). true/false
    mean full/none."""
    overlap_comm: bool = True
    """ZeRO 1-3: overlap gradient reduction with the backward pass."""
    reduce_bucket_size: int = 500_000_000
    """ZeRO: elements per gradient reduce-scatter bucket."""
    allgather_bucket_size: int = 500_000_000
    """ZeRO 1-2: elements per parameter all-gather bucket."""
    stage3_prefetch_bucket_size: int = 50_000_000
    """ZeRO 3: elements of parameters prefetched ahead of use."""

    RANGES: ClassVar[dict[str, Rule]] = {
        "zero_stage": between(0, 3), "initial_scale_power": between(0, 64), "loss_scale_window": at_least(1),
        "hysteresis": at_least(1), "min_loss_scale": above(0), "reduce_bucket_size": at_least(1),
        "allgather_bucket_size": at_least(1), "stage3_prefetch_bucket_size": at_least(0),
        "grad_accum_dtype": one_of("fp32", "bf16", note="bf16 saves memory; fp32 keeps long accumulations exact"),
    }
    """Allowed values, checked before any rank starts (pretrain/ranges.py)."""


@dataclass
class ParallelConfig:
    """How the ranks share the model beyond data parallelism (docs/multinode.md, "Tensor parallelism")."""

    tensor: int = 1
    """Tensor-parallel size T (DeepSpeed AutoTP): each block's projections are cut over T consecutive ranks,
    which see the same samples; data-parallel size = ranks / T. Keep T within a node (<= its GPUs); it must
    divide the ranks, model.num_heads, model.num_kv_heads and model.intermediate_size. 1 = off."""

    sequence: int = 1
    """Sequence-parallel size N (DeepSpeed Ulysses): each sequence is cut into N consecutive slices over N
    consecutive ranks, which see the same samples; attention exchanges heads for the whole sequence
    (all-to-all), so model.num_heads, model.num_kv_heads and train.seq_len must divide by N. Data-parallel
    size = ranks / N; ZeRO still partitions over all ranks. Not with parallel.tensor > 1. 1 = off."""

    RANGES: ClassVar[dict[str, Range]] = {"tensor": at_least(1, "1 = off"), "sequence": at_least(1, "1 = off")}
    """Allowed values, checked before any rank starts (pretrain/ranges.py)."""

    @property
    def ranks_per_sample(self) -> int:
        """Ranks that see the same samples: a tensor- or a sequence-parallel group."""
        return self.tensor * self.sequence


@dataclass
class DataConfig:
    """Where the training tokens come from (shards written by `ayumi data prepare`)."""

    root: str = "${oc.env:AYUMI_DATA_ROOT,.cache}/shards/tiny"
    """DATA_ROOT holding <domain>/{train,val}/*.idx|bin and manifest.json."""
    domains: list[str] = field(default_factory=list)
    """Domains to train on (sub-directories of root); empty = every domain found."""
    tokenizer_dir: str | None = None
    """The run's tokenizer directory; shards made with another tokenizer are refused. None skips the check."""
    validation: bool = True
    """Evaluate on each domain's val/ shards when present."""
    verify: str = "auto"
    """Shard checks at start: sizes (files, byte sizes, counts, recorded ids), full (also each .bin's sha256),
    auto (full when the run reads at most 1 GiB of shards, else sizes). Every sample's ids are checked anyway."""
    prefetch_batches: int = 2
    """Micro-batches assembled ahead in a background thread (0 = assemble inline)."""
    exclude: str | None = None
    """A file of documents (`domain shard document` a line, as `ayumi batch` names them) the run stops training on
    from the step this session starts at; kept in the checkpoints, so later resumes honour it (data/exclude.py)."""

    RANGES: ClassVar[dict[str, Range]] = {"prefetch_batches": at_least(0, "0 = assemble inline")}
    """Allowed values, checked before any rank starts (pretrain/ranges.py)."""


@dataclass
class TrainConfig:
    """Run length (in tokens), batch geometry, evaluation cadence."""

    tokens: int = 200_000
    """Tokens to train on; the number of optimizer steps is derived from it and printed before step 1."""
    seq_len: int = 128
    """Tokens per sample (the model sees seq_len inputs and predicts seq_len labels)."""
    micro_batch_size: int = 4
    """Samples per rank per forward/backward."""
    global_batch_size: int = 8
    """Samples per optimizer step over all ranks = micro_batch_size x grad_accum x data-parallel size."""
    grad_accum: int = 0
    """Micro-batches accumulated per step; 0 derives it from the global batch."""
    seed: int = 1234
    """Seed of model init, data order and every rank's RNG."""
    eval_interval: int = 50
    """Evaluate every this many steps (and at the end); 0 = only at the end."""
    eval_dense_interval: int = 0
    """Early in training evaluate every this many steps instead (instabilities hide between sparse evals); 0 = off."""
    eval_dense_until: int = 0
    """The dense evaluation schedule applies to steps <= this."""
    eval_samples: int = 32
    """Samples per validation set per evaluation, split over ranks (the same samples at any world size)."""
    log_interval: int = 1
    """Write metrics every this many steps."""
    max_steps: int = 0
    """Stop after this many steps even if tokens remain (smoke tests); 0 = no limit. Never use it to set run length."""
    device: str = "auto"
    """auto (CUDA if available, else CPU) | cpu | cuda."""
    num_gpus: int = 0
    """GPUs the run will train on (its data-parallel size), for plans made away from the job (`ayumi plan` on a
    login node): ZeRO cuts states by it. 0 = the GPUs visible where the plan runs, else 1; the trainer uses its own."""
    gpu_memory_gib: float = 0.0
    """Memory of each GPU (GiB) the memory plan checks against where no GPU is visible (`ayumi plan` on a login
    node; e.g. 80 for an H100 80GB); 0 = only a visible GPU's own memory (torch.cuda), which always wins."""

    RANGES: ClassVar[dict[str, Range]] = {
        "tokens": at_least(1), "seq_len": at_least(1), "micro_batch_size": at_least(1),
        "global_batch_size": at_least(1), "grad_accum": at_least(0, "0 = derived from the global batch"),
        "seed": at_least(0), "eval_interval": at_least(0, "0 = only at the end"),
        "eval_dense_interval": at_least(0, "0 = off"), "eval_dense_until": at_least(0), "eval_samples": at_least(1),
        "log_interval": at_least(1), "max_steps": at_least(0, "0 = no limit"),
        "num_gpus": at_least(0, "0 = the GPUs visible, else 1"), "gpu_memory_gib": at_least(0, "0 = a visible GPU's own"),
    }
    """Allowed values, checked before any rank starts (pretrain/ranges.py)."""


@dataclass
class CheckpointConfig:
    """When and where to save, what to keep, and how to resume."""

    interval: int = 100
    """Save every this many steps; 0 = only on signals and at the end."""
    keep_last: int = 3
    """Keep this many newest checkpoints (older ones are deleted after a new one is complete); 0 = keep every one."""
    dir: str = "${run_dir}/checkpoints"
    """Checkpoint root: step_XXXXXXX/ folders and the `latest` pointer."""
    resume: bool = True
    """Resume from `latest` in dir when it exists (exactly: model, optimizer, RNG, data position, counters)."""
    load_from: str | None = None
    """Start from this checkpoint folder instead (another run's); None = dir's latest."""
    save_on_signal: bool = True
    """On SIGTERM/SIGINT finish the current step, save, and exit 0 (SLURM preemption)."""
    save_final: bool = True
    """Save when training ends."""
    save_initial: bool = False
    """Save before the first step of a fresh run (step 0): the starting weights, e.g. to export a model
    started from model.init_from unchanged or to compare against later."""

    async_save: str = "auto"
    """auto (on with a GPU, off on CPU) | true | false. On: a save returns once the tensors are copied to
    host memory and each rank writes its files in a background thread; `ayumi.json` and `latest`
    follow only when every rank's files are fsynced, so a crash mid-write resumes from the previous
    checkpoint. The next save, a rollback, a signal stop and the run's end wait for the write first.
    Keeps one host-memory copy of the rank's checkpoint from save to save (two with the recovery ring)."""
    inject_write_delay_s: float = 0.0
    """Fault drill: the background writer sleeps this long before writing (tests kill a run mid-write)."""
    on_corrupt: str = "fallback"
    """What a resume (or a rollback) does when the checkpoint it would load is damaged: its files do not match the
    checksums recorded at save, or the state it loads holds non-finite weights or Adam moments.
    fallback: set the folder aside as `step_XXXXXXX.corrupt` (kept, never chosen again), write a `checkpoint_corrupt`
    event, and load the newest checkpoint that verifies. refuse: stop before any rank trains, exit status 2, one
    line naming the checkpoint and the file. A `load_from` checkpoint (another run's) is always refused, never
    renamed."""

    RANGES: ClassVar[dict[str, Rule]] = {
        "interval": at_least(0, "0 = only on signals and at the end"),
        "keep_last": at_least(0, "0 = keep every checkpoint"),
        "inject_write_delay_s": at_least(0),
        "on_corrupt": one_of("fallback", "refuse", note="fallback: set it aside and load the newest that verifies"),
    }
    """Allowed values, checked before any rank starts (pretrain/ranges.py)."""


@dataclass
class WandbConfig:
    """Weights & Biases (only metrics.py imports wandb)."""

    enabled: bool = True
    """Log to W&B at all (metrics.jsonl is always written)."""
    mode: str = "offline"
    """offline (default; `wandb sync` later) | online (needs WANDB_API_KEY) | disabled."""
    project: str = "ayumi"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user); None = the key's default."""
    group: str | None = None
    """W&B group, e.g. a sweep or an experiment family."""
    tags: list[str] = field(default_factory=list)
    """W&B tags."""
    name: str | None = None
    """W&B run name; None = the ayumi run name."""


@dataclass
class LoggingConfig:
    """Console, metrics.jsonl and W&B."""

    console: bool = True
    """Print progress lines on rank 0."""
    console_interval: int = 1
    """Print a progress line every this many steps (metrics.jsonl and W&B still get every log step)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """W&B settings."""

    RANGES: ClassVar[dict[str, Range]] = {"console_interval": at_least(1)}
    """Allowed values, checked before any rank starts (pretrain/ranges.py)."""


@dataclass
class EvalConfig:
    """Evaluation beyond the validation loss (the validation loss itself: train.eval_interval and friends)."""

    downstream: DownstreamConfig = field(default_factory=DownstreamConfig)
    """Downstream tasks scored in the loop and by `ayumi eval` (downstream/config.py, docs/downstream-eval.md)."""


def async_checkpoints(cfg: "AyumiConfig", device) -> bool:
    """checkpoint.async_save resolved: auto = on when training on a GPU."""
    value = str(cfg.checkpoint.async_save).lower()
    return value == "true" or (value == "auto" and getattr(device, "type", str(device)) == "cuda")


@dataclass
class ResumeConfig:
    """What this resume acknowledges changing in the run's future (pretrain/startup/resume.py, docs/training.md)."""

    accept: list[str] = field(default_factory=list)
    """Config keys whose change this resume accepts although it changes the LR or the data stream from the resume
    step on: e.g. resume.accept=[train.tokens] to extend a run, [curriculum.stages] for a stage not yet begun,
    [optim.wsd_decay_fraction]. A key names itself and everything under it. Only this command line's: a later
    resume never replays it."""


@dataclass
class AyumiConfig:
    """The whole training configuration (`conf/config.yaml`)."""

    name: str = "debug"
    """Run name; the run dir is run_root/name, so the same name resumes the same run. One folder name:
    not empty, no path separator, not `.` or `..` (see name_problems)."""
    run_root: str = "${oc.env:AYUMI_RUN_ROOT,runs}"
    """Where run directories are created."""
    run_dir: str = "${run_root}/${name}"
    """This run's directory, shared by all ranks: config.yaml, metrics.jsonl, checkpoints/, wandb/."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The Llama architecture (conf/model/)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and LR schedule (conf/optim/)."""
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    """ZeRO and precision (conf/deepspeed/)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor and sequence parallelism (parallel.tensor, parallel.sequence)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training data (shards)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Run length, batches, evaluation."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Console, metrics.jsonl, W&B (conf/logging/)."""
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    """Stability machinery (conf/stability/)."""
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    """Staged data curriculum (conf/curriculum/); no stages = all domains shuffled together."""
    hang: HangConfig = field(default_factory=HangConfig)
    """The hang and straggler watchdog (pretrain/job/hang_watchdog.py)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Downstream evaluation (eval.downstream)."""
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    """What a resume acknowledges changing (resume.accept)."""


SCHEMA_NAME = "ayumi_schema"


def register_configs() -> None:
    """Register the schema so `conf/config.yaml` can name it first in its defaults list."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=AyumiConfig)


PLAIN_ENTRIES = {"eval.downstream.tasks": "path"}
"""A task given by its file alone in a list of tasks on the command line (`[{path:A,delimiter:""},B]`) is {path:B}."""


def compose_config(overrides: list[str] | tuple[str, ...] = (), config_name: str = "config") -> DictConfig:
    """Compose conf/<config_name>.yaml with Hydra overrides (no output dir, no cwd change).

    A mistake is a ConfigError of one line when it is a usual one (common.conf.composition_problem), else
    Hydra's whole explanation.
    """
    try:
        return compose(config_name, overrides, register_configs, conf_dir=CONF_DIR, schema=AyumiConfig,
                       plain_entries=PLAIN_ENTRIES)
    except ConfigCompositionError as err:
        raise ConfigError(str(err)) from err


def to_object(cfg: DictConfig) -> AyumiConfig:
    """The composed config as typed dataclasses, every interpolation resolved."""
    return OmegaConf.to_object(cfg)


def split_cli_args(argv: list[str]) -> tuple[list[str], bool]:
    """Hydra overrides and whether `--cfg job` was asked; drops the launcher's `--local_rank=N`.

    The deepspeed launcher appends `--local_rank=N`, which Hydra would reject; the rank is read
    from the environment instead, so the flag is simply ignored here.
    """
    overrides: list[str] = []
    print_cfg = False
    args = iter(argv)
    for arg in args:
        if arg.startswith("--local_rank") or arg.startswith("--local-rank"):
            if "=" not in arg:
                next(args, None)
            continue
        if arg in ("--cfg", "-c"):
            what = next(args, "job")
            if what not in ("job", "all"):
                raise ConfigError(f"--cfg takes 'job', got {what!r}")
            print_cfg = True
            continue
        if arg.startswith("-"):
            raise ConfigError(f"unknown option {arg!r}: training takes Hydra overrides key=value (and --cfg job)")
        overrides.append(arg)
    return overrides, print_cfg


def data_parallel_size(parallel: ParallelConfig, world_size: int) -> int:
    """Data-parallel ranks of a job of `world_size` ranks: world_size / (parallel.tensor x parallel.sequence);
    ConfigError when the ranks do not form whole tensor- or sequence-parallel groups."""
    group = parallel.ranks_per_sample
    if group < 1 or world_size % group:
        kind = "sequence" if parallel.sequence > 1 else "tensor"
        key, size = f"parallel.{kind}", getattr(parallel, kind)
        fits = [n for n in range(group, 8 * group + 1, group)][:4]
        raise ConfigError(f"{key}={size} must divide the {world_size} rank(s) of this job ({kind}-parallel "
                          f"groups of {group} ranks); start {', '.join(map(str, fits))} ... ranks, or choose a "
                          f"{key} that divides {world_size}")
    return world_size // group


def data_parallel_grad_accum(train: TrainConfig, world_size: int) -> int:
    """Gradient-accumulation steps implied by the batch settings for `world_size` data-parallel ranks (with
    tensor parallelism: data_parallel_size, not the number of ranks); ConfigError when they disagree."""
    per_step = train.micro_batch_size * world_size
    if train.micro_batch_size < 1 or train.global_batch_size < 1:
        raise ConfigError(
            f"train.micro_batch_size ({train.micro_batch_size}) and train.global_batch_size "
            f"({train.global_batch_size}) must be >= 1"
        )
    if train.grad_accum == 0:
        if train.global_batch_size % per_step:
            raise ConfigError(
                f"train.global_batch_size={train.global_batch_size} is not a multiple of "
                f"train.micro_batch_size={train.micro_batch_size} x {world_size} data-parallel ranks "
                f"= {per_step}; choose a global batch that divides, e.g. {per_step * max(1, train.global_batch_size // per_step)}"
            )
        return train.global_batch_size // per_step
    if train.global_batch_size != per_step * train.grad_accum:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} != train.micro_batch_size="
            f"{train.micro_batch_size} x train.grad_accum={train.grad_accum} x {world_size} data-parallel ranks "
            f"= {per_step * train.grad_accum}; fix one of them or set train.grad_accum=0 to derive it"
        )
    return train.grad_accum


def tokens_per_step(train: TrainConfig) -> int:
    return train.global_batch_size * train.seq_len


def total_steps(train: TrainConfig) -> int:
    """Optimizer steps needed to see train.tokens tokens (the last step may overshoot a little)."""
    if train.tokens <= 0:
        raise ConfigError(f"train.tokens must be positive, got {train.tokens}")
    return math.ceil(train.tokens / tokens_per_step(train))


EXIT_CONFIG_ERROR = BAD_INPUT
"""Exit status of `ayumi train` and pretrain.train for a configuration error (nothing was started); the
statuses of every ayumi command are in common/status.py."""

CHECKED_BY_LAUNCHER_ENV = "AYUMI_CONFIG_CHECKED"
"""Set by `ayumi train` for the ranks it starts: it has checked the config and said what runs."""


def name_problems(name: str) -> list[str]:
    """The run name must be one folder name: the run dir is run_root/name, shared by every rank.

    Empty, `.` or `..` would make the run dir the run root itself (or its parent), and a path
    separator would put it in a sub-folder or outside run_root.
    """
    if not name.strip():
        return [f"name={name!r} is empty: the run would write straight into run_root; give the run a name, "
                "e.g. name=my_run"]
    if name in (".", "..") or any(sep in name for sep in {"/", "\\", os.sep}):
        safe = name.replace("\\", "_").replace("/", "_").strip("._") or "my_run"
        return [f"name={name} must be one folder name (no / or \\, not . or ..): the run dir is run_root/name; "
                f"e.g. name={safe}"]
    return []


def config_problems(cfg: AyumiConfig) -> list[str]:
    """Every problem found without hardware, one line each: `key=value must be ...` or the fix.

    The run name, every field's range (each section's RANGES, pretrain/ranges.py) and the model's
    shape rules. check_config reports them all at once before its cross-field checks.
    """
    problems = name_problems(cfg.name) + range_problems(cfg) + shape_problems(cfg.model) + declared_data_problems(cfg)
    problems += downstream_problems(cfg.eval.downstream)
    if cfg.eval.downstream.tasks and not cfg.data.tokenizer_dir:
        problems.append("eval.downstream.tasks need data.tokenizer_dir (the tokenizer that made the data): it turns "
                        "the tasks' text into ids")
    if not problems:  # the tensor- and sequence-parallel rules divide by the sizes checked above
        problems = tensor_parallel_problems(cfg) + sequence_parallel_problems(cfg)
        problems += stage_problems(cfg.curriculum.stages, cfg.model, cfg.train.seq_len, cfg.train.micro_batch_size)
    return problems


def declared_data_problems(cfg: AyumiConfig) -> list[str]:
    """A curriculum that declares Megatron data needs data.tokenizer_dir: its ids are checked against that tokenizer."""
    if cfg.curriculum.domains and not cfg.data.tokenizer_dir:
        return [tokenizer_missing([str(name) for name in cfg.curriculum.domains])]
    return []


def check_config(cfg: AyumiConfig) -> None:
    """Every check that needs no hardware; the trainer adds the world-size ones.

    Raises ConfigError listing all of config_problems (one line each), else the first failed
    cross-field check.
    """
    problems = config_problems(cfg)
    if problems:
        raise ConfigError("\n".join(problems))
    if cfg.train.seq_len > cfg.model.max_seq_len:
        raise ConfigError(
            f"train.seq_len={cfg.train.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}; "
            "raise model.max_seq_len or lower train.seq_len"
        )
    if cfg.deepspeed.precision not in PRECISIONS:
        raise ConfigError(f"deepspeed.precision must be {', '.join(PRECISIONS[:-1])} or {PRECISIONS[-1]}, "
                          f"got {cfg.deepspeed.precision!r}")
    if cfg.deepspeed.offload_param and cfg.deepspeed.zero_stage != 3:
        raise ConfigError("deepspeed.offload_param needs deepspeed.zero_stage=3")
    if cfg.deepspeed.offload_optimizer and cfg.deepspeed.zero_stage == 0:
        raise ConfigError("deepspeed.offload_optimizer needs deepspeed.zero_stage >= 1")
    try:
        checkpointing_plan(cfg.deepspeed.activation_checkpointing, cfg.model.num_layers)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if str(cfg.checkpoint.async_save).lower() not in ("auto", "true", "false"):
        raise ConfigError(f"checkpoint.async_save={cfg.checkpoint.async_save!r}: use auto, true or false")
    if cfg.data.verify not in ("auto", "full", "sizes"):
        raise ConfigError(f"data.verify must be auto, full or sizes, got {cfg.data.verify!r}")
    if cfg.optim.schedule not in ("cosine", "linear", "constant", "wsd"):
        raise ConfigError(f"optim.schedule must be cosine, linear, constant or wsd, got {cfg.optim.schedule!r}")
    if cfg.optim.min_lr > cfg.optim.lr:
        raise ConfigError(f"optim.min_lr={cfg.optim.min_lr} is above optim.lr={cfg.optim.lr}")
    try:
        check_stability_config(cfg.stability, cfg.deepspeed.min_loss_scale)
    except StabilityConfigError as err:
        raise ConfigError(str(err)) from None
    if cfg.logging.wandb.mode not in ("offline", "online", "disabled"):
        raise ConfigError(f"logging.wandb.mode must be offline, online or disabled, got {cfg.logging.wandb.mode!r}")
    total_steps(cfg.train)


def checked_config(composed: DictConfig) -> AyumiConfig:
    """The composed config as dataclasses, every check that needs no hardware passed (check_config).

    What the launcher and every rank run before anything starts; a failed interpolation (e.g. an
    unset ${oc.env:...} without default) is a ConfigError here too, not a traceback.
    """
    from omegaconf.errors import OmegaConfBaseException

    from common.conf import describe_error

    try:
        cfg = to_object(composed)
    except OmegaConfBaseException as err:
        raise ConfigError(describe_error(err)) from None
    check_config(cfg)
    return cfg


def composed_from_args(args: list[str]) -> tuple[DictConfig, bool]:
    """(the composed training config, whether `--cfg job` asks for it printed) from command-line arguments (Hydra
    overrides, `--cfg job`, the launcher's `--local_rank`), model.* read from model.init_from's folder, then
    model.vocab_size=0 replaced by the tokenizer's vocabulary (vocab_from_tokenizer); unchecked.
    Raises ConfigError. Imports no torch or DeepSpeed."""
    overrides, print_cfg = split_cli_args(args)
    composed = compose_config(overrides)
    unset = unset_environment(composed)
    if unset:
        raise ConfigError("\n".join(unset))
    if _init_from(composed):
        shape_from_hf_folder(composed, overrides)
    vocab_from_tokenizer(composed)
    return composed, print_cfg


def config_from_args(args: list[str]) -> AyumiConfig | None:
    """The checked training config from command-line arguments (composed_from_args, then check_config); None once
    `--cfg job` has printed the resolved config.

    The commands (`ayumi train`, `ayumi plan`, every rank of pretrain.train) call
    pretrain.startup.checks.config_before_launch, which adds the checks of the files the config names and makes
    `--cfg job` refuse what they would. Raises ConfigError. Imports no torch or DeepSpeed.
    """
    composed, print_cfg = composed_from_args(args)
    if print_cfg:
        print(OmegaConf.to_yaml(composed, resolve=True), end="")
        return None
    return checked_config(composed)


def _init_from(composed: DictConfig) -> str | None:
    """model.init_from, resolved (an experiment may take it from an environment variable)."""
    from omegaconf.errors import OmegaConfBaseException

    from common.conf import describe_error

    try:
        return composed.model.get("init_from")
    except OmegaConfBaseException as err:
        raise ConfigError(describe_error(err)) from None


def vocab_from_tokenizer(composed: DictConfig) -> None:
    """model.vocab_size=0 (follow the tokenizer) made the tokenizer's vocabulary padded to model.vocab_multiple, in
    place (pretrain/model/vocabulary.py): here, the one function every command and every rank composes through, so all
    of them train, plan and record the same number. ConfigError when there is no tokenizer to follow."""
    from omegaconf.errors import OmegaConfBaseException

    from common.conf import describe_error
    from pretrain.model.vocabulary import follow_tokenizer

    try:
        follow_tokenizer(composed)
    except OmegaConfBaseException as err:  # e.g. data.root interpolating a key that does not exist
        raise ConfigError(describe_error(err)) from None
    except ValueError as err:
        raise ConfigError(str(err)) from None


def shape_from_hf_folder(composed: DictConfig, overrides: list[str]) -> None:
    """model.* from model.init_from's config.json, in place; ConfigError for an unsupported folder or an
    override on the command line that contradicts it (a preset's value is simply replaced)."""
    from pretrain.model.hf_import import (
        HFImportError, contradictions, model_fields, padded_vocab, read_hf_config, tokenizer_vocab,
    )

    folder = composed.model.init_from
    try:
        fields = model_fields(read_hf_config(folder), folder)
    except HFImportError as err:
        raise ConfigError(str(err)) from None
    explicit = {}
    for override in overrides:
        key, value = override_key(override), override.partition("=")[2]
        if key.startswith("model."):
            explicit[key.removeprefix("model.")] = value
    problems = contradictions(fields, explicit)
    if problems:
        raise ConfigError("\n".join(problems))
    if "vocab_size" in explicit:
        fields["vocab_size"] = int(explicit["vocab_size"])  # equal, or larger: the vocabulary grows
    else:  # an expanded tokenizer for the data: grow to it, padded for GPUs
        pieces = tokenizer_vocab(composed.data.get("tokenizer_dir"))
        if pieces and pieces > fields["vocab_size"]:
            fields["vocab_size"] = padded_vocab(pieces)
    for key, value in fields.items():
        if key == "rope_scaling":  # field by field: a context extension may set some on the command line
            for name, setting in value.items():
                if f"rope_scaling.{name}" not in explicit:
                    OmegaConf.update(composed, f"model.rope_scaling.{name}", setting, merge=False)
        elif key not in explicit or key == "vocab_size":  # what the command line sets (no contradiction) stays
            OmegaConf.update(composed, f"model.{key}", value, merge=False)


def print_config_error(prog: str, err: Exception, file: TextIO | None = None) -> None:
    """Print a ConfigError (or a refused plan) as one `prog: ...` line per problem (stderr by default)."""
    for line in str(err).splitlines():
        print(f"{prog}: {line}", file=file or sys.stderr)


TRAINING_GROUPS = ("model", "optim", "deepspeed", "logging", "stability", "curriculum")
"""The config groups of the training config besides experiment (folders of conf/)."""


def training_config_help(cfg_job: bool = True) -> str:
    """The end of the help of every command that reads the training config (train, plan, doctor): the `config:`
    paragraph, then every field of AyumiConfig with its default and docstring."""
    groups = ", ".join(f"{group}=" for group in TRAINING_GROUPS)
    reads = config_help(f"{composed_from('config', 'experiment', CONF_DIR)}, with the groups {groups} "
                        f"(each a folder of {conf_label(CONF_DIR)})", cfg_job=cfg_job)
    return f"{reads}\n\n{fields_help(AyumiConfig, 'pretrain/config.py and the sections it imports')}"


def experiment_given(overrides: list[str] | tuple[str, ...]) -> bool:
    """Whether the overrides pick a named run (experiment=NAME, also with + or ++)."""
    return any(override_key(override) == "experiment" for override in overrides)


def default_run_notice(prog: str, overrides: list[str] | tuple[str, ...], cfg: AyumiConfig) -> str | None:
    """The line said at start when no experiment= was given (it silently trained the debug model before)."""
    if experiment_given(overrides):
        return None
    return (f"{prog}: no experiment= given: running the defaults of {conf_label(CONF_DIR)}config.yaml "
            f"(model={cfg.model.name}, name={cfg.name}); pick a run with experiment=NAME "
            f"({', '.join(group_options('experiment', CONF_DIR))})")


def config_as_yaml(cfg: DictConfig | AyumiConfig) -> str:
    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg)
    return OmegaConf.to_yaml(node, resolve=True)


def advisable_settings(cfg: AyumiConfig) -> dict[str, Any]:
    """Current values of the settings a stability stop message may advise changing (it quotes them)."""
    return {"optim.lr": cfg.optim.lr, "optim.warmup_steps": cfg.optim.warmup_steps,
            "stability.clip.enabled": cfg.stability.clip.enabled, "optim.eps": cfg.optim.eps,
            "model.embedding_grad_alpha": cfg.model.embedding_grad_alpha, "model.z_loss": cfg.model.z_loss,
            "model.qk_norm": cfg.model.qk_norm}
