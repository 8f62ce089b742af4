"""Every check that can run before launch, in one function: `check_before_launch`.

`ayumi plan`, `ayumi train ... --cfg job` and `ayumi train` (before its launcher starts any rank) call it through
`config_before_launch`, so what the ranks would refuse after torchrun has started is refused there, with the same
line and exit status 2 (common/status.py):

- what a resume means (pretrain/startup/resume.py, first: it answers from the run's record alone): the run's own
  overrides replayed, the past refused, a change of the LR or the data stream ahead refused unless acknowledged,
  "already complete";
- the config's own rules (pretrain.config.check_config): ranges, names, model shapes, and each curriculum stage's
  length and RoPE (pretrain/stages.py);
- the vocabulary: the data root was made by the run's tokenizer, and model.vocab_size has a row for every id in it
  (`check_vocabulary`, which every rank runs again before it opens a shard; model.vocab_size=0 has already become
  the tokenizer's, padded: pretrain/model/vocabulary.py);
- the task files of eval.downstream, read and tokenized as the ranks read them (`read_downstream_tasks`), one line
  per bad file.
- model.fp8 against the hardware and the layout (`fp8_problems`): a GPU of compute capability 8.9+ on every visible
  device (none on a CPU unless model.fp8_emulate), ZeRO 0-2, no tensor or sequence parallelism, torchao installed.

The ranks call the same `check_vocabulary`, `read_downstream_tasks` and `check_fp8` (pretrain/train.py), so a run started some
other way (a launch script under launch/) refuses the same mistakes, only later. What needs the shards or the GPUs
(budgets, repetition, disk, memory) is the plan's (pretrain/plan/run_plan.py).

Imports no torch or DeepSpeed: a plan on a login node answers at once, and `ayumi train` starts nothing heavy
before its ranks do.
"""
from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from curriculum.plan import DATA_ERRORS
from data.manifest import MANIFEST_NAME, ManifestError, check_manifest_tokenizer, load_manifest

from pretrain.config import AyumiConfig, ConfigError, check_config
from pretrain.model.hf_import import padded_vocab
from pretrain.startup.resume import Settled, settle
from tokenizer.info import TokenizerNotFoundError


def config_before_launch(args: list[str], check_files: bool = True) -> AyumiConfig | None:
    """The training config of a command that plans or starts ranks (settled_before_launch); None once `--cfg job`
    has printed it. Raises ConfigError."""
    settled = settled_before_launch(args, check_files)
    return None if settled.printed else settled.cfg


def settled_before_launch(args: list[str], check_files: bool = True) -> Settled:
    """The training config of a command that plans or starts ranks, its resume decided (pretrain/startup/resume.py)
    and checked by check_before_launch.

    `--cfg job` prints the resolved config (what was asked, the run's replayed overrides included) and then refuses
    what `ayumi train` would, files included. `check_files=False` keeps to the config's own rules (check_config): a
    dry run, whose files may live on the cluster, and the ranks, which read those files themselves. Raises
    ConfigError.
    """
    settled = settle(args)
    if check_files or settled.printed:
        check_before_launch(settled.cfg)
    return settled


def check_before_launch(cfg: AyumiConfig) -> None:
    """Raise ConfigError listing every problem found before any rank starts, one line each (see the module doc)."""
    check_config(cfg)
    problems = fp8_problems(cfg) + vocabulary_problems(cfg) + task_file_problems(cfg)
    if problems:
        raise ConfigError("\n".join(problems))


# -- the vocabulary ------------------------------------------------------------------------------------------
def load_tokenizer_identity(tokenizer_dir: str | None) -> dict:
    """sha256 and special ids of the run's tokenizer (empty when the run names none).

    An ayumi tokenizer folder, or any tokenizer `ayumi data prepare` accepts as declared (a SentencePiece
    .model, a Hugging Face folder: the tokenizer existing Megatron data was made with).
    """
    if not tokenizer_dir:
        return {}
    from tokenizer import load_tokenizer_info
    from tokenizer.declared import load_declared_tokenizer

    declared = load_declared_tokenizer(tokenizer_dir)
    if declared.kind == "ayumi":
        info = load_tokenizer_info(tokenizer_dir)
        return {"tokenizer_dir": str(info.path), "tokenizer_sha256": info.sha256, "tokenizer_vocab_size": info.vocab_size,
                "bos_id": info.bos_id, "eos_id": info.eos_id, "pad_id": info.pad_id}
    return {"tokenizer_dir": str(declared.path), "tokenizer_sha256": declared.sha256,
            "tokenizer_vocab_size": declared.vocab_size, "bos_id": declared.bos_id, "eos_id": declared.eod_id,
            "pad_id": None}


def check_vocabulary(cfg: AyumiConfig, manifest: dict, tokenizer: dict, root: Path) -> None:
    """The data root's tokenizer must be the run's, its record must agree with that tokenizer, and the
    model must have an embedding row for every id."""
    recorded = manifest["tokenizer"]
    manifest_path = root / MANIFEST_NAME
    if tokenizer:
        check_manifest_tokenizer(manifest, tokenizer["tokenizer_sha256"], tokenizer["tokenizer_dir"], str(root))
        if recorded["vocab_size"] != tokenizer["tokenizer_vocab_size"]:
            raise ManifestError(
                f"{manifest_path} records a vocabulary of {recorded['vocab_size']} for tokenizer sha256 "
                f"{recorded['sha256'][:12]}…, but that tokenizer ({tokenizer['tokenizer_dir']}) has "
                f"{tokenizer['tokenizer_vocab_size']}: the record was edited or damaged. Fix: re-run `ayumi data prepare`")
    if recorded["vocab_size"] > cfg.model.vocab_size:
        # The suggestion is the padded number model.vocab_size=0 would have given: the GPU-friendly size that fits.
        padded = padded_vocab(recorded["vocab_size"], cfg.model.vocab_multiple)
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the vocabulary of the tokenizer that made "
            f"{root} ({recorded['vocab_size']} ids, {manifest_path}). Fix: model.vocab_size=0 (follows the tokenizer) "
            f"or >= {padded}")


def vocabulary_problems(cfg: AyumiConfig) -> list[str]:
    """check_vocabulary's refusal against data.root's manifest, as one line; none without a manifest to read.

    A missing or unreadable data root is not said here: the plan reports it as a `data` problem (exit 1, with the
    rest of the plan) and `ayumi train` refuses it in its data check, which opens the shards.
    """
    root = Path(cfg.data.root)
    try:
        manifest = load_manifest(root)
    except (*DATA_ERRORS, OSError, ValueError):
        return []
    try:
        check_vocabulary(cfg, manifest, load_tokenizer_identity(cfg.data.tokenizer_dir), root)
    except (ConfigError, *DATA_ERRORS) as err:
        return [str(err)]
    return []


# -- the downstream task files -------------------------------------------------------------------------------
def read_downstream_tasks(settings: Any, tokenizer_dir: str, max_len: int,
                          on_error: Callable[[str], None] | None = None) -> tuple[list, Any]:
    """(eval.downstream's tasks read and tokenized with the run's tokenizer, that tokenizer): what the ranks score.

    A mistake in a file raises TaskError (one line naming the file), or goes to `on_error` with the task left out
    when settings.strict is false (downstream.evaluate.prepare_tasks). Loads no torch (the scoring does).
    """
    from downstream.evaluate import prepare_tasks
    from tokenizer.declared import load_declared_tokenizer

    tokenizer = load_declared_tokenizer(tokenizer_dir)
    prepared = prepare_tasks(settings, tokenizer, max_len, tokenizer.bos_id, tokenizer.eod_id, on_error)
    return prepared, tokenizer


def task_file_problems(cfg: AyumiConfig) -> list[str]:
    """One line per task file of eval.downstream the ranks would refuse (strict), read as they read it.

    With strict=false the ranks leave a bad task out and say so, so nothing is refused; without data.tokenizer_dir
    config_problems has said what is missing.
    """
    from downstream.tasks import TaskError

    settings = cfg.eval.downstream
    if not (settings.tasks and settings.strict and cfg.data.tokenizer_dir):
        return []
    problems: list[str] = []
    try:  # leniently, to hear of every bad file, not only the first
        read_downstream_tasks(replace(settings, strict=False), cfg.data.tokenizer_dir, cfg.model.max_seq_len,
                              problems.append)
    except (TaskError, TokenizerNotFoundError) as err:  # the prefix token or the tokenizer: no task can be read
        problems.append(str(err))
    return problems


# -- FP8 (model.fp8) -------------------------------------------------------------------------------------------
FP8_MIN_CAPABILITY = (8, 9)
"""The first CUDA compute capability with FP8 tensor cores (Ada: L4, RTX 4090; Hopper 9.0: H100, H200)."""


def fp8_device_problem(recipe: str, emulate: bool, gpus: list[tuple[str, tuple[int, int]]]) -> str | None:
    """Why model.fp8=`recipe` cannot run on `gpus` ((name, compute capability) of each device the ranks use;
    empty for CPU training), as one line; None when it can. Emulation (tests) runs anywhere."""
    if recipe == "off" or emulate:
        return None
    need = ".".join(map(str, FP8_MIN_CAPABILITY))
    fix = "Fix: model.fp8=off (model.fp8_emulate=true runs torchao's emulation, for tests only)"
    if not gpus:
        return (f"model.fp8={recipe} needs an NVIDIA GPU of compute capability {need}+ (H100, H200, L4, RTX 4090); "
                f"this run trains on the CPU. {fix}")
    for index, (name, capability) in enumerate(gpus):
        if tuple(capability) < FP8_MIN_CAPABILITY:
            have = ".".join(map(str, capability))
            return (f"model.fp8={recipe} needs a GPU of compute capability {need}+ (FP8 tensor cores: H100, H200, L4, "
                    f"RTX 4090); GPU {index}, {name}, has compute capability {have}. {fix}")
    return None


def fp8_setup_problems(cfg: AyumiConfig) -> list[str]:
    """The layouts model.fp8 is refused under, one line each with the reason; none when it is off."""
    recipe = cfg.model.fp8
    if recipe == "off":
        return []
    problems = []
    if cfg.deepspeed.zero_stage == 3:
        # Float8Linear keeps the weight ZeRO-3 partitions, but nothing here has trained it gathered by ZeRO-3's hooks
        # (torchao's own float8 all-gather is FSDP2's); refused rather than shipped untried.
        problems.append(f"model.fp8={recipe} is not supported with deepspeed.zero_stage=3 (not verified: the FP8 layers "
                        "under ZeRO-3's parameter gathering are untested). Fix: deepspeed.zero_stage=1 or 2, or model.fp8=off")
    if cfg.parallel.tensor > 1:
        # AutoTP (inside deepspeed.initialize) swaps the blocks' nn.Linear layers for its own sharded ones, which
        # would drop the FP8 casts without a word.
        problems.append(f"model.fp8={recipe} cannot be combined with parallel.tensor={cfg.parallel.tensor}: DeepSpeed's "
                        "AutoTP replaces the blocks' Linear layers with its own, undoing the FP8 conversion. Fix: "
                        "parallel.tensor=1 (ZeRO 1-2 data parallelism), or model.fp8=off")
    if cfg.parallel.sequence > 1:
        problems.append(f"model.fp8={recipe} is not supported with parallel.sequence={cfg.parallel.sequence} (not verified). "
                        "Fix: parallel.sequence=1, or model.fp8=off")
    if importlib.util.find_spec("torchao") is None:
        problems.append(f"model.fp8={recipe} needs torchao (an ayumi dependency: reinstall with ./ayumi, or "
                        "pip install 'torchao>=0.18')")
    return problems


def fp8_problems(cfg: AyumiConfig) -> list[str]:
    """fp8_setup_problems, and fp8_device_problem against the GPUs visible here (before launch).

    With no GPU visible but GPUs planned (train.num_gpus or train.gpu_memory_gib: a plan made on a login node for
    the cluster) their kind is not known here: the ranks check their own device (check_fp8)."""
    if cfg.model.fp8 == "off":
        return []
    from pretrain.plan.hardware import visible_gpu_capabilities

    problems = fp8_setup_problems(cfg)
    gpus = visible_gpu_capabilities()
    if gpus or not (cfg.train.num_gpus or cfg.train.gpu_memory_gib > 0):
        problem = fp8_device_problem(cfg.model.fp8, cfg.model.fp8_emulate, gpus)
        problems += [problem] if problem else []
    return problems


def check_fp8(cfg: AyumiConfig, device_type: str, device_index: int | None = None) -> None:
    """A rank's own check of model.fp8 on the device it trains on (cuda or cpu): ConfigError, one line per problem,
    as before launch; for a run started some other way (launch/ scripts, a plan made elsewhere)."""
    if cfg.model.fp8 == "off":
        return
    from pretrain.plan.hardware import gpu_capability, gpu_properties

    gpus = []
    if device_type == "cuda":
        index = device_index or 0
        gpus = [(gpu_properties(index)[0], gpu_capability(index))]
    problem = fp8_device_problem(cfg.model.fp8, cfg.model.fp8_emulate, gpus)
    problems = fp8_setup_problems(cfg) + ([problem] if problem else [])
    if problems:
        raise ConfigError("\n".join(problems))
