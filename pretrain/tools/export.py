"""Export a trained model as a Hugging Face `LlamaForCausalLM` folder (`ayumi export hf`).

ayumi's parameter names are HF's, so the export is: check the keys and shapes, cast, write
config.json + generation_config.json + model.safetensors (+ the tokenizer files), all into a
temporary sibling folder that is renamed into place only when complete. The folder and its files get the modes
the user's umask gives (0755 and 0644 under 022, so teammates can read them; 0700 and 0600 under 077).
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from pretrain.model.config import ModelConfig
from pretrain.model.flops import count_parameters, parameter_shapes
from common.files import modes_as_umask, replace_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
"""Files copied from the tokenizer's HF export folder when one is given."""

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ExportError(RuntimeError):
    """The model or the destination cannot be exported as asked; the message says why and what to do."""


def to_hf_config(cfg: ModelConfig, *, bos_id: int | None = None, eos_id: int | None = None,
                 pad_id: int | None = None, dtype: torch.dtype = torch.float32):
    """The `transformers.LlamaConfig` describing the same network as `cfg`."""
    if cfg.qk_norm:
        raise ExportError(
            f"model {cfg.name!r} uses QK-norm (model.qk_norm=true), which LlamaForCausalLM cannot represent: "
            "its attention has no q_norm/k_norm. Train with model.qk_norm=false to export as Llama, or load the "
            "state dict into an architecture with per-head QK RMSNorm before RoPE (e.g. Qwen3, with its own mapping)."
        )
    from transformers import LlamaConfig

    from pretrain.model.hf_import import scaling_to_hf

    # Dynamic scaling grows theta past max_position_embeddings in transformers: that must stay the original length.
    positions = cfg.rope_scaling.original_max_seq_len or cfg.max_seq_len if cfg.rope_scaling.type == "dynamic" \
        else cfg.max_seq_len
    hf = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        hidden_act="silu",
        max_position_embeddings=positions,
        initializer_range=cfg.init_std,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        rope_scaling=scaling_to_hf(cfg.rope_scaling, cfg.max_seq_len),
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    hf.architectures = ["LlamaForCausalLM"]
    # transformers 5 calls the field `dtype`, 4.x `torch_dtype`.
    setattr(hf, "dtype" if hasattr(hf, "dtype") else "torch_dtype", str(dtype).removeprefix("torch."))
    hf.ayumi_preset = cfg.name  # provenance only; transformers ignores unknown keys
    return hf


def export_hf(state_dict: dict[str, Tensor], cfg: ModelConfig, out_dir: Path, *, bos_id: int | None = None,
              eos_id: int | None = None, pad_id: int | None = None, tokenizer_dir: Path | None = None,
              dtype: torch.dtype = torch.float32, overwrite: bool = False) -> Path:
    """Write a `from_pretrained`-loadable folder at out_dir, atomically; returns out_dir."""
    out_dir = Path(out_dir)
    # SentencePiece says -1 for a special token it lacks (Llama 2 has no pad); HF wants None.
    bos_id, eos_id, pad_id = (None if i is None or i < 0 else i for i in (bos_id, eos_id, pad_id))
    hf_config = to_hf_config(cfg, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, dtype=dtype)
    tensors = _hf_tensors(state_dict, cfg, dtype)
    tokenizer_files = _tokenizer_files(Path(tokenizer_dir)) if tokenizer_dir is not None else []
    _check_destination(out_dir, overwrite)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_folder(tmp, hf_config, tensors, tokenizer_files, bos_id, eos_id, pad_id)
        modes_as_umask(tmp)  # mkdtemp's 0700 and safetensors' 0600: an export is for others to read too
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _hf_tensors(state_dict: dict[str, Tensor], cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Tensor]:
    """Check names and shapes against the config; cast; drop a tied lm_head (HF re-ties it on load)."""
    expected = parameter_shapes(cfg)
    given = dict(state_dict)
    if cfg.tie_embeddings and "lm_head.weight" in given:
        lm_head = given.pop("lm_head.weight")
        if not torch.equal(lm_head, given.get("model.embed_tokens.weight", lm_head)):
            raise ExportError("model.tie_embeddings=true but lm_head.weight differs from model.embed_tokens.weight")
    missing, unexpected = sorted(expected.keys() - given.keys()), sorted(given.keys() - expected.keys())
    if missing or unexpected:
        raise ExportError(
            f"state dict does not match model {cfg.name!r}: missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}. "
            "Pass the consolidated module state dict (no 'module.' prefix) of the model this config describes."
        )
    for name, shape in expected.items():
        if tuple(given[name].shape) != shape:
            raise ExportError(f"{name}: shape {tuple(given[name].shape)} but the model config says {shape}")
    return {name: _standalone(given[name].detach().to("cpu", dtype)) for name in expected}


def _standalone(t: Tensor) -> Tensor:
    """A contiguous tensor owning exactly its storage: safetensors refuses views and shared storage."""
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset() != 0:
        t = t.clone()
    return t


def _tokenizer_files(tokenizer_dir: Path) -> list[Path]:
    files = [tokenizer_dir / name for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file()]
    if not files:
        raise ExportError(
            f"tokenizer_dir {tokenizer_dir} holds none of {', '.join(TOKENIZER_FILES)}; "
            "point it at the folder written by `ayumi tokenizer export`"
        )
    return files


def _check_destination(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"{out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ExportError(f"{out_dir} is not empty; choose another folder or pass --overwrite")


def _write_folder(tmp: Path, hf_config, tensors: dict[str, Tensor], tokenizer_files: list[Path],
                  bos_id: int | None, eos_id: int | None, pad_id: int | None) -> None:
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    hf_config.save_pretrained(tmp)
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id).save_pretrained(tmp)
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})  # transformers requires "pt"
    for src in tokenizer_files:
        shutil.copyfile(src, tmp / src.name)
    for path in tmp.iterdir():  # on disk before the rename makes the folder visible
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def older_checkpoint_fix(damaged: Path, args: argparse.Namespace) -> str:
    """What to do about a damaged checkpoint: export the newest older one of its run that is not damaged (named,
    with the command, this call's options kept), or, when none is left, how to look for an intact copy."""
    from pretrain.checkpoint import integrity

    found = integrity.newest_intact_before(damaged.parent, damaged.name)
    if found is None:
        return (f"no older checkpoint beside it is intact; put an intact copy back, or list what verifies with "
                f"`ayumi checkpoint verify {shlex.quote(str(damaged.parent))}`")
    tag, verdict = found
    how = ("that verifies" if verdict.status == integrity.VERIFIED
           else "that is not damaged (it records no checksums, so it is exported unverified)")
    return f"export the newest older checkpoint {how}, {tag}: {export_command(damaged.parent / tag, args)}"


def export_command(checkpoint: Path, args: argparse.Namespace) -> str:
    """`ayumi export hf CHECKPOINT OUT_DIR` with the options this call was given, ready to paste."""
    words = ["ayumi", "export", "hf", str(checkpoint), str(args.out_dir)]
    if args.dtype != "fp32":
        words += ["--dtype", args.dtype]
    if args.tokenizer_dir:
        words += ["--tokenizer-dir", str(args.tokenizer_dir)]
    if args.overwrite:
        words.append("--overwrite")
    return shlex.join(words)


def main(argv: list[str]) -> int:
    """`ayumi export hf CHECKPOINT OUT_DIR [--overwrite] [--dtype fp32|bf16|fp16] [--tokenizer-dir DIR]`."""
    from common.conf import config_help
    from common.status import BAD_INPUT

    reads = config_help("no config from conf/: the checkpoint's ayumi.json (the run's model config and tokenizer)",
                        overrides=False)
    parser = argparse.ArgumentParser(prog="ayumi export", description="Export a training checkpoint.", epilog=reads)
    sub = parser.add_subparsers(dest="format", required=True)
    hf = sub.add_parser("hf", help="a transformers LlamaForCausalLM folder (config, safetensors, tokenizer)",
                        description="A transformers LlamaForCausalLM folder (config, safetensors, tokenizer).",
                        epilog=reads)
    hf.add_argument("checkpoint", type=Path, help="a checkpoint folder of a training run (verified against the "
                    "checksums recorded at save first: a damaged one is refused, exit 2)")
    hf.add_argument("out_dir", type=Path, help="folder to create")
    hf.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    hf.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weight dtype on disk (default fp32)")
    hf.add_argument("--tokenizer-dir", type=Path, default=None,
                    help="HF tokenizer folder to copy (default: the one recorded in the checkpoint)")
    args = parser.parse_args(argv)

    from pretrain.checkpoint.checkpointer import (  # here: --help stays fast
        CheckpointCorrupt, CheckpointError, load_for_export, resolve_checkpoint,
    )
    from pretrain.checkpoint.recorded import RecordedPathOutside, recorded_tokenizer

    try:
        state_dict, cfg, extra = load_for_export(args.checkpoint)
        # A recorded tokenizer is copied only from inside the run: ayumi.json could name any folder of this machine.
        recorded = extra.get("tokenizer_dir")
        tokenizer_dir = args.tokenizer_dir or (
            recorded_tokenizer(Path(*resolve_checkpoint(args.checkpoint)), recorded) if recorded else None)
        out = export_hf(
            state_dict, cfg, args.out_dir,
            bos_id=extra.get("bos_id"), eos_id=extra.get("eos_id"), pad_id=extra.get("pad_id"),
            tokenizer_dir=tokenizer_dir,
            dtype=DTYPES[args.dtype], overwrite=args.overwrite,
        )
    except CheckpointCorrupt as err:  # the run may hold an intact older one: say which, and how to export it
        print(f"ayumi export hf: {err}. Fix: {older_checkpoint_fix(err.tag_dir, args)}", file=sys.stderr)
        return BAD_INPUT
    except (ExportError, CheckpointError, RecordedPathOutside, FileNotFoundError) as err:
        # Bad input (a folder that holds no checkpoint, an OUT_DIR in the way): one line, exit 2.
        print(f"ayumi export hf: {err}", file=sys.stderr)
        return BAD_INPUT
    if not extra.get("verified"):
        print(f"note: {args.checkpoint} records no checksums (saved before ayumi recorded them): exported without "
              "verifying its files", file=sys.stderr)
    tokenizer_note = "" if tokenizer_dir else " (no tokenizer: none recorded or given)"
    print(f"wrote {out}: {cfg.name}, {count_parameters(cfg):,} parameters, {args.dtype}{tokenizer_note}")
    return 0
