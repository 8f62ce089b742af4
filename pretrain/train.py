"""Training entry point: `deepspeed --module pretrain.train experiment=NAME key=value ...`.

Also runs under `torchrun -m pretrain.train ...` and as a plain 1-process `python -m
pretrain.train ...`. The config is composed with Hydra's Compose API (no output dir, no cwd
change, and the deepspeed launcher's `--local_rank=N` is dropped), so every rank resolves the
same run dir: RUN_ROOT/NAME. The whole config is checked before distributed init (a bad value
exits with status 2, one line per problem, on rank 0), and `--help` is answered before torch and
DeepSpeed are even imported.
"""
from __future__ import annotations

import json
import os
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

from common.conf import asks_for_help

PROG = "pretrain.train"
USAGE = "python -m pretrain.train [key=value ...] [--cfg job]"
ABOUT = """\
Train: one process per GPU (or 2 on CPU), each running this module under a launcher:
  deepspeed --num_gpus N --module pretrain.train experiment=NAME ...
  torchrun --nproc_per_node N -m pretrain.train experiment=NAME ...
  python -m pretrain.train experiment=NAME ...     (one process, no launcher)
`ayumi train` picks the launcher for this machine. The config is checked before distributed init:
a mistake exits with status 2 and one line per problem, before anything starts."""


def train_help() -> str:
    from pretrain.config import training_config_help

    return f"usage: {USAGE}\n\n{ABOUT}\n\n{training_config_help()}"


if __name__ == "__main__" and asks_for_help(sys.argv[1:]):
    # Answered before the imports below: torch and DeepSpeed take seconds, and help starts nothing.
    print(train_help())
    sys.exit(0)

# The imports below come after the --help answer on purpose (E402).
import torch
from omegaconf import OmegaConf

from curriculum.config import CurriculumError
from curriculum.declared import register_curriculum_domains
from curriculum.mixer import Mixer
from curriculum.plan import PlanRefused, checkpoint_shape, raise_if_refused
from data.exclude import ExcludeError
from data.manifest import MANIFEST_NAME, ManifestError, load_manifest
from data.packed import CorruptShardError, DataChangedError, PackedSamples, ShuffledDomains
from data.shards import ShardFormatError, TokenizerMismatchError
from downstream.tasks import TaskError
from pretrain.checkpoint.checkpointer import CheckpointError, Checkpointer, CheckpointWriteFailed
from pretrain.checkpoint.trust import choose_start, resume_start
from pretrain.config import (
    CHECKED_BY_LAUNCHER_ENV, EXIT_CONFIG_ERROR, AyumiConfig, ConfigError, async_checkpoints, check_config, config_as_yaml,
    data_parallel_grad_accum, default_run_notice, print_config_error, total_steps,
)
from pretrain.engine.train_engine import DistInfo, TrainEngine, build_model
from pretrain.engine.distributed import (
    all_reduce_tensor, any_rank, barrier, broadcast_object, finalize_distributed, first_problem, init_distributed,
    leave_now,
)
from pretrain.engine.ds_config import save_ds_config
from pretrain.evaluation import DownstreamTasks
from pretrain.job.exit_status import record_exit
from pretrain.job.hang_watchdog import HangWatchdog, process_group_timeout_s
from pretrain.loader import BatchLoader
from pretrain.plan.memory import format_memory
from pretrain.plan.hardware import Hardware, gpu_properties
from pretrain.plan.run_plan import run_plan
from pretrain.startup.checks import (
    check_fp8, check_vocabulary, load_tokenizer_identity, read_downstream_tasks, settled_before_launch,
)
from pretrain.startup.record import (
    ConfigVersion, absolute_paths, commit, keep_tokenizer, kept_tokenizer, resolved_config,
)
from pretrain.startup.resume import ResumeDecision, Settled, data_identity
from pretrain.stream import open_training_data, sample_source
from pretrain.metrics import MetricsLogger, NullLogger
from pretrain.model.flops import count_parameters
from pretrain.model.fp8 import convert_to_fp8
from pretrain.model.hf_import import HFImportError
from pretrain.model.llama import Llama
from pretrain.job.run_lock import RunDirLock, RunDirLocked
from pretrain.engine.precision import CAPABILITY_ORDER, PrecisionChoice, agreed, kept_from_checkpoint, resolve_precision
from pretrain.trainer import Trainer, TrainResult
from common.status import STABILITY_STOP
from tokenizer.info import TokenizerNotFoundError


# DeepSpeed's ZeRO calls a torch collective that torch now deprecates, once per step and rank.
warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)

INPUT_ERRORS = (ConfigError, PlanRefused, CurriculumError, ShardFormatError, TokenizerMismatchError, ManifestError,
                TokenizerNotFoundError, CheckpointError, DataChangedError, HFImportError, RunDirLocked, TaskError, ExcludeError)
"""Mistakes in what the run was given (config, plan, shards, tokenizer, checkpoint): a clear line and status 2."""

EXIT_STABILITY_STOP = STABILITY_STOP
"""Exit status when the stability machinery stopped the run (state saved; see events.jsonl; common/status.py)."""


def job_hardware(dist: DistInfo) -> Hardware:
    """The job's own size and GPU for the memory plan (on the CPU, memory is not checked)."""
    if dist.device.type != "cuda":
        return Hardware.cpu(dist.world_size, dist.tensor_parallel, dist.sequence_parallel)
    name, total_memory = gpu_properties(dist.device.index or 0)
    return Hardware(dist.dp_size, total_memory, f"this {name}", dist.tensor_parallel,
                    sequence_parallel=dist.sequence_parallel)


def build_data(cfg: AyumiConfig, tokenizer: dict,
               hardware: Hardware) -> tuple[ShuffledDomains | Mixer, dict[str, PackedSamples]]:
    """The training stream (the curriculum's mixer, or all domains shuffled) and per-domain validation sets.

    Every shard comes from what the data root's manifest lists, checked against it (data/integrity.py);
    the tokenizer and vocabulary checks below run before any shard is opened. `hardware` is the job's own
    (`job_hardware`): the plan checks the batch against its data-parallel size and memory against its GPU.
    """
    root = Path(cfg.data.root)
    manifest = load_manifest(root)
    check_vocabulary(cfg, manifest, tokenizer, root)
    settle_document_end(cfg, manifest, root)
    train, val = open_training_data(cfg)
    # The same checks as `ayumi plan`: budgets vs run length, repetition, disk, GPU memory. Refuse before step 1.
    plan = run_plan(cfg, count_parameters(cfg.model), hardware, domains=train)
    raise_if_refused(plan.plan)
    if hardware.gpu_bytes and int(os.environ.get("RANK", 0)) == 0:
        print(format_memory(plan.memory, hardware.gpu_bytes, hardware.where), flush=True)
    return sample_source(cfg, train), val


def register_declared_data(cfg: AyumiConfig, dist: DistInfo) -> None:
    """The curriculum's own Megatron domains into data.root before any rank reads its manifest.

    Rank 0 checks and writes (nothing when the root is up to date, as after `ayumi train`'s own check)
    while the others wait for its answer, so no two processes write one root. A refusal stops every
    rank: rank 0's error names the prefix or key and the fix (and is the one printed); the others
    raise a stand-in that main() does not print.
    """
    if not cfg.curriculum.domains:
        return
    error: Exception | None = None
    if dist.is_main:
        try:
            register_curriculum_domains(cfg)
        except INPUT_ERRORS as err:
            error = err
    if any_rank(error is not None):
        raise error or ShardFormatError("rank 0 refused the curriculum's declared domains (it says why)")


def settle_document_end(cfg: AyumiConfig, manifest: dict, root: Path) -> None:
    """model.document_end_id from the data (its manifest's end-of-document id) for document masking, unless set."""
    if cfg.model.attention != "document" or cfg.model.document_end_id >= 0:
        return
    end = manifest["tokenizer"].get("eos_id")
    if end is None:
        raise ConfigError(f"model.attention=document: {root / MANIFEST_NAME} records no end-of-document id; set "
                          "model.document_end_id to the token that ends each document")
    cfg.model.document_end_id = int(end)
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"attention within documents: a document ends with token {end} (the data's end-of-document id)",
              flush=True)


def data_vocab_size(cfg: AyumiConfig) -> int:
    """The vocabulary of the tokenizer that made the run's data (its manifest's record; check_vocabulary
    has held it equal to data.tokenizer_dir's): the ids that can occur in training."""
    return int(load_manifest(Path(cfg.data.root))["tokenizer"]["vocab_size"])


def build_trainer(cfg: AyumiConfig, dist: DistInfo, resolved: dict, watchdog: HangWatchdog | None = None,
                  settled: Settled | None = None) -> tuple[Trainer, NullLogger]:
    """Everything the loop needs, in data-flow order: data, model, engine, checkpoints, metrics.

    `settled`: the command line as decided before launch (its overrides and what the resume changes); the run's
    config record is written from it once everything has been checked and loaded (record_config)."""
    grad_accum = data_parallel_grad_accum(cfg.train, dist.dp_size)
    run_dir = Path(cfg.run_dir)
    ckpt = cfg.checkpoint
    checkpointer = Checkpointer(Path(ckpt.dir), ckpt.keep_last, dist.rank, barrier, dist.world_size,
                                cfg.deepspeed.zero_stage, any_rank, async_writes=async_checkpoints(cfg, dist.device),
                                write_delay_s=ckpt.inject_write_delay_s, tensor_parallel=dist.tensor_parallel,
                                first_problem=first_problem)
    # The checkpoint this run starts from, its files verified before anything is built: a damaged one is set aside
    # for an older one or the run refused (checkpoint.on_corrupt). None for a fresh run.
    start = choose_start(ckpt.load_from, ckpt.resume, ckpt.on_corrupt, checkpointer)
    precision = settle_precision(cfg, dist, start.meta.get("precision") if start else None)
    tokenizer = load_tokenizer_identity(cfg.data.tokenizer_dir)
    register_declared_data(cfg, dist)
    source, val_sets = build_data(cfg, tokenizer, job_hardware(dist))
    downstream = downstream_tasks(cfg, tokenizer, dist)  # a mistake in a task file stops the run here, untrained

    check_fp8(cfg, dist.device.type, dist.device.index)  # before the model: one line, not a rank's traceback
    # The same init on every rank, drawn from cfg.train.seed (build_model). A run that starts from a checkpoint draws
    # nothing: resume_start below loads one or stops the run (a fallback only ever picks an older checkpoint).
    model = build_model(lambda init_weights: Llama(cfg.model, init_weights=init_weights), cfg, dist,
                        initial=None if start else hf_initial_weights(cfg), from_checkpoint=start is not None)
    announce_fp8(cfg, convert_to_fp8(model, cfg.model.fp8, cfg.model.fp8_emulate), dist)  # before DeepSpeed, compile
    engine = TrainEngine(model, cfg, dist)
    checkpointer.expected_bytes = checkpoint_shape(cfg, count_parameters(cfg.model)).size  # the precision is settled
    # Each rank gets its own stream of randomness (dropout-free today, but user code may add it).
    torch.manual_seed(cfg.train.seed + 1000 * dist.rank)
    # Loaded (each rank's RNG restored) and its state checked (an older one if that state cannot be trained from),
    # before the metrics files are opened: they are cut back to the step the run really starts from.
    resumed = resume_start(start, checkpointer, engine)
    # Only a resume of this run cuts its metrics back (another run's checkpoint starts this run's files afresh).
    resume_step = None if cfg.checkpoint.load_from or resumed is None else resumed.step
    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_ds_config(engine.ds_config, run_dir / "deepspeed_config.json")
        logger: NullLogger = MetricsLogger(cfg, run_dir, resolved, resume_step)
    else:
        logger = NullLogger()
    barrier()
    # By data-parallel rank: the ranks of a tensor- or sequence-parallel group read the same samples.
    loader = BatchLoader(source, cfg.train.micro_batch_size, grad_accum, dist.dp_rank, dist.dp_size, dist.device,
                         prefetch=cfg.data.prefetch_batches)
    run_meta = {"name": cfg.name, "model": asdict(cfg.model), "world_size": dist.world_size,
                "tensor_parallel": dist.tensor_parallel, "sequence_parallel": dist.sequence_parallel,
                "zero_stage": cfg.deepspeed.zero_stage, "precision": cfg.deepspeed.precision,
                "precision_reason": precision.reason, **tokenizer, "config": resolved,
                "data": data_identity(cfg.data.root)}
    kept = kept_tokenizer(tokenizer.get("tokenizer_dir"))
    if kept is not None:  # the checkpoints record the run's own copy (keep_tokenizer makes it), never a path outside
        run_meta["tokenizer_dir"] = str(kept)
    trainer = Trainer(cfg, dist, engine, loader, val_sets, logger, checkpointer, total_steps(cfg.train), run_meta,
                      watchdog=watchdog, downstream=downstream)
    decision = settled.resume if settled and resume_step is not None else None
    trainer.resume_if_possible(resumed, decision.lengths if decision else None)
    if dist.is_main:  # every check has passed and the checkpoint is loaded: now the run's record may change
        keep_tokenizer(run_dir, tokenizer.get("tokenizer_dir"))
        record_config(cfg, resolved, settled.overrides if settled else [], resume_step or 0, decision, logger,
                      trainer.state.tokens)
    return trainer, logger


def record_config(cfg: AyumiConfig, resolved: dict, overrides: list[str], step: int,
                  decision: ResumeDecision | None, logger: NullLogger, tokens: int) -> None:
    """A new version of the run's config on record when it differs from the last (pretrain/startup/record.py), and
    a resume's accepted changes as a `config_change` event (events.jsonl, W&B, the report)."""
    from pretrain.startup.record import is_new_version, last_version

    previous = last_version(cfg.run_dir)
    changes = decision.recorded() if decision else []
    if is_new_version(previous, resolved, overrides):
        commit(cfg.run_dir, ConfigVersion(step, resolved, overrides, changes), config_as_yaml(OmegaConf.create(resolved)))
    if changes:
        listed = "; ".join(change.shown() for change in decision.changes)
        logger.event("config_change", step, tokens, f"resumed with a changed config: {listed}", changes=changes)


def announce_fp8(cfg: AyumiConfig, converted: list[str], dist: DistInfo) -> None:
    """Rank 0 says which layers model.fp8 put in FP8 (none when it is off)."""
    if converted and dist.is_main:
        how = "torchao's emulation, for tests" if cfg.model.fp8_emulate else "torchao float8"
        print(f"FP8 ({cfg.model.fp8}, {how}): {len(converted)} Linear layers of the blocks; the embedding, the LM head "
              "and the rest stay in the training dtype", flush=True)


def downstream_tasks(cfg: AyumiConfig, tokenizer: dict, dist: DistInfo) -> DownstreamTasks:
    """eval.downstream's task files read and tokenized with the run's tokenizer, before the model is built.

    Every rank prepares the same requests (the files are small). A mistake raises TaskError (exit 2) unless
    eval.downstream.strict=false: then rank 0 says which task is left out and why, and the run goes on.
    """
    settings = cfg.eval.downstream
    if not settings.tasks:
        return DownstreamTasks()

    def left_out(message: str) -> None:
        if dist.is_main:
            print(f"eval.downstream: task left out (strict=false): {message}", file=sys.stderr, flush=True)
    # The same reading as the check before launch (pretrain/startup/checks.py), which has refused a bad file already
    # when `ayumi train` started this rank.
    prepared, text_tokenizer = read_downstream_tasks(settings, tokenizer["tokenizer_dir"], cfg.model.max_seq_len,
                                                     left_out)
    eos = text_tokenizer.eod_id
    return DownstreamTasks(prepared, text_tokenizer, (eos,) if eos is not None else ())


def hf_initial_weights(cfg: AyumiConfig, data_vocab: int | None = None):
    """model.init_from's tensor reader (checked against the model's shapes), or None for a random init.

    A resumed run never reads it: its weights come from the checkpoint. A vocabulary larger than the
    folder's grows (pretrain/model/resize.py): ids below `data_vocab` (the vocabulary of the tokenizer
    that made the data; read from the data root's manifest when not given) are new pieces, the rows above
    it padding.
    """
    from pretrain.model.hf_import import check_init_from, read_hf_config

    model_cfg = cfg.model
    weights = check_init_from(model_cfg)
    if weights is None:
        return None
    base_vocab = int(read_hf_config(model_cfg.init_from)["vocab_size"])
    if model_cfg.vocab_size == base_vocab:
        return weights.tensor
    data_vocab = data_vocab_size(cfg) if data_vocab is None else data_vocab  # only a grown model needs it
    new_count = max(0, min(data_vocab, model_cfg.vocab_size) - base_vocab)
    return grown_weights(cfg, weights, base_vocab, new_count).tensor


def grown_weights(cfg: AyumiConfig, weights, base_vocab: int, new_count: int):
    """The folder's weights with the embedding and LM head grown to model.vocab_size: `new_count` rows for
    the tokenizer's new pieces (model.new_token_init), the rest padding (the mean of the base rows)."""
    from pretrain.model.resize import GrownWeights, base_splits

    model_cfg = cfg.model
    splits: list[list[int]] = []
    if model_cfg.new_token_init == "base_mean" and new_count:  # padding rows need no pieces
        new_model, base_model = base_mean_tokenizers(cfg)
        splits = base_splits(new_model, base_model, base_vocab)
        if len(splits) < new_count:
            raise HFImportError(
                f"{new_model} has {base_vocab + len(splits)} pieces, but the data's tokenizer has {base_vocab + new_count} "
                "ids: model.new_token_init=base_mean cannot split the others. Fix: data.tokenizer_dir = the "
                "tokenizer that made the data, or model.new_token_init=mean")
    return GrownWeights(weights, model_cfg.vocab_size, new_count, model_cfg.new_token_init, model_cfg.init_std,
                        cfg.train.seed, splits)


def base_mean_tokenizers(cfg: AyumiConfig) -> tuple[Path, Path]:
    """(the new tokenizer's SentencePiece model, the base's) that base_mean splits new pieces with."""
    from tokenizer.expand import expansion_record

    tokenizer_dir = cfg.data.tokenizer_dir
    new_model = None
    if tokenizer_dir:  # an ayumi or Hugging Face folder holding tokenizer.model, or a bare SentencePiece .model
        new_model = Path(tokenizer_dir) if Path(tokenizer_dir).is_file() else Path(tokenizer_dir) / "tokenizer.model"
    base_model = Path(cfg.model.init_from) / "tokenizer.model"
    record = expansion_record(tokenizer_dir) if tokenizer_dir and Path(tokenizer_dir).is_dir() else None
    if not base_model.is_file() and record:
        base_model = Path(record["base"])
    if new_model is None or not new_model.is_file() or not base_model.is_file():
        raise HFImportError(
            f"model.new_token_init=base_mean needs the new tokenizer's pieces (data.tokenizer_dir={tokenizer_dir}, a "
            f"SentencePiece tokenizer folder) and the base tokenizer ({base_model}: the base folder's tokenizer.model, "
            "or the base recorded by `ayumi tokenizer expand`). Fix: set those, or model.new_token_init=mean")
    return new_model, base_model


def settle_precision(cfg: AyumiConfig, dist: DistInfo, saved: str | None = None) -> PrecisionChoice:
    """Resolve deepspeed.precision (auto) for this hardware, the same on every rank, and write it into cfg.

    Every rank resolves for its own device, then all take the least capable answer (a job must
    train in one precision); a resumed `auto` run keeps the precision its checkpoint was saved in (`saved`).
    Rank 0 prints the choice and its reason, and a warning when an explicit choice will be slow.
    """
    choice = resolve_precision(cfg.deepspeed.precision, dist.device)
    lowest = all_reduce_tensor(torch.tensor([float(CAPABILITY_ORDER[choice.precision])]), op="min").item()
    choice = kept_from_checkpoint(agreed(choice, int(lowest)), saved)
    cfg.deepspeed.precision = choice.precision
    if dist.is_main:
        print(choice.describe(), flush=True)
        if choice.warning:
            print(f"WARNING: {choice.warning}", file=sys.stderr, flush=True)
    return choice


def lock_run_dir(cfg: AyumiConfig, dist: DistInfo) -> RunDirLock | None:
    """Rank 0 locks the run dir for this job (pretrain/job/run_lock.py); every rank hears a refusal."""
    lock, refusal = None, None
    if dist.is_main:
        try:
            lock = RunDirLock(Path(cfg.run_dir)).acquire()
            if lock.note:
                print(f"{PROG}: {lock.note}", file=sys.stderr, flush=True)
        except RunDirLocked as err:
            refusal = str(err)
    refusal = broadcast_object(refusal)
    if refusal:
        raise RunDirLocked(refusal)
    return lock


def run(cfg: AyumiConfig, resolved: dict, settled: Settled | None = None) -> TrainResult:
    check_config(cfg)
    dist = init_distributed(cfg.train.device, process_group_timeout_s(cfg.hang), cfg.parallel.tensor,
                            cfg.parallel.sequence)
    logger: NullLogger = NullLogger()
    lock = None
    watchdog = HangWatchdog(cfg.hang, Path(cfg.run_dir), dist.rank, dist.world_size)
    try:
        lock = lock_run_dir(cfg, dist)
        watchdog.start()  # from here on a stuck rank ends the job with a report (startup included)
        trainer, logger = build_trainer(cfg, dist, resolved, watchdog, settled)
        result = trainer.run()
        logger.summary({"final/steps": result.steps, "final/tokens": result.tokens,
                        **{f"final/val/{k}/loss": v for k, v in result.val_losses.items()}})
        return result
    except (CorruptShardError, CheckpointWriteFailed) as err:
        # Only this rank read the damaged sample; the others wait for it in a collective, so the
        # barrier below would hang until the process-group timeout. Say why and leave at once: the
        # launcher sees the exit and stops the other ranks.
        exit_now(refuse(err, say=True))
        raise  # not reached
    finally:
        logger.close()
        finalize_distributed()
        watchdog.stop()
        if lock is not None:
            lock.release()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if asks_for_help(argv):
        print(train_help())
        return 0
    first = int(os.environ.get("RANK", 0)) == 0  # every rank checks; one says it
    try:
        # Before init_distributed: a mistake costs no rank start. The files the config names are read below (build_data,
        # downstream_tasks) with the checks `ayumi train` made before starting this rank; `--cfg job` makes them here.
        settled = settled_before_launch(argv, check_files=False)
    except ConfigError as err:
        if not first:
            linger_before_refusing()
        return refuse(err, say=first)
    if settled.printed:  # --cfg job printed it
        return 0
    cfg = settled.cfg
    said_by_launcher = bool(os.environ.get(CHECKED_BY_LAUNCHER_ENV))
    notice = default_run_notice(PROG, argv, cfg)
    if notice and first and not said_by_launcher:
        print(notice, file=sys.stderr, flush=True)
    for line in settled.resume.lines() if settled.resume and first and not said_by_launcher else []:
        print(f"{PROG}: {line}", flush=True)
    if settled.resume and settled.resume.complete:
        return 0
    absolute_paths(cfg)
    resolved = resolved_config(cfg)
    try:
        result = run(cfg, resolved, settled)
    except INPUT_ERRORS as err:
        # Every rank reads the same data, tokenizer and checkpoint, so every rank fails alike: one
        # says why, without a traceback per rank (the message names the file and the fix). A damaged
        # sample is the exception: only the rank that read it knows, so that rank says it (run()).
        return refuse(err, say=first)
    if os.environ.get("AYUMI_RESULT_FILE") and first:
        Path(os.environ["AYUMI_RESULT_FILE"]).write_text(json.dumps(asdict(result)))
    # A stability stop saved its state but needs a person: a distinct status keeps schedulers
    # with automatic requeue from restarting into the same spike.
    if result.stopped_by_stability:
        record_exit(EXIT_STABILITY_STOP)
        return EXIT_STABILITY_STOP
    return 0


UNSAID_REFUSAL_WAIT_S = 3.0
"""How long a rank that leaves a config refusal to rank 0 waits before exiting (linger_before_refusing)."""


def linger_before_refusing() -> None:
    """Wait a moment before a silent refusal made before distributed init. The ranks are not in step yet, and
    torchrun or the deepspeed launcher stop every rank once one exits: a rank quicker to exit could cut rank 0 off
    before its line is out (a data root that model.vocab_size=0 cannot read is refused here, as any config error)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        time.sleep(UNSAID_REFUSAL_WAIT_S)


def refuse(err: Exception, say: bool) -> int:
    """A mistake in what the run was given: printed by the rank that `say`s it (one line per problem, no traceback)
    and left for `ayumi train`, which the launcher would otherwise tell only "1". Returns EXIT_CONFIG_ERROR."""
    if say:
        print_config_error(PROG, err)
    record_exit(EXIT_CONFIG_ERROR, str(err) if say else "")
    return EXIT_CONFIG_ERROR


def exit_now(status: int) -> None:
    """Leave without Python's shutdown, where gloo's worker threads can still abort a finished rank
    ("terminate called without an active exception"; pretrain.engine.distributed.exit_process says why).

    No barrier here, unlike exit_process: a rank that refuses alone (a bad id in its batch) leaves while the
    others are inside a collective, and a barrier would hang it. A run that ends well has passed main's
    barrier and destroyed the process group already.
    """
    leave_now(status)


if __name__ == "__main__":
    exit_now(main())
