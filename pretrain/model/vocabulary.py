"""`model.vocab_size=0`: the model's vocabulary follows the tokenizer, padded up to `model.vocab_multiple`.

As Megatron-LM pads the tokenizer's vocabulary (--make-vocab-size-divisible-by 128) and torchtitan takes
vocab_size from the tokenizer, a run need not repeat its tokenizer's size by hand. The size is the vocabulary
recorded in data.root's manifest.json (the tokenizer that made the shards), else data.tokenizer_dir's (an ayumi
folder, a SentencePiece .model or a Hugging Face folder, as `ayumi data prepare` accepts them).

`pretrain.config.composed_from_args` calls `follow_tokenizer` once, after model.init_from's shape, so every
command and every rank sees the same number, `--cfg job` prints it, and the run's config.yaml records it (export
and eval read that). Imports no torch.
"""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pretrain.model.hf_import import padded_vocab

FOLLOWS_TOKENIZER = 0
"""The model.vocab_size that means "the tokenizer's vocabulary, padded to model.vocab_multiple"."""


def recorded_vocabulary(root: str | Path) -> tuple[int | None, str | None]:
    """(the vocabulary data.root's manifest.json records, why a manifest that is there gives none): (N, None) when it
    reads, (None, None) without a manifest, (None, its own line naming the file and the fix) when it is damaged,
    edited by hand or of another format."""
    from data.manifest import MANIFEST_NAME, load_manifest

    path = Path(root) / MANIFEST_NAME
    if not path.is_file():
        return None, None
    try:
        return int(load_manifest(root)["tokenizer"]["vocab_size"]), None
    except (OSError, ValueError) as err:  # ManifestError among them: the data check would say the same
        return None, str(err)
    except (KeyError, TypeError):
        return None, f"{path} records no tokenizer vocabulary. Fix: re-run `ayumi data prepare`"


def tokenizer_dir_vocabulary(tokenizer_dir: str | None) -> int | None:
    """The ids data.tokenizer_dir's tokenizer needs (pretrain.startup.checks.load_tokenizer_identity's reading), or None."""
    if not tokenizer_dir:
        return None
    from tokenizer.declared import load_declared_tokenizer

    try:
        return load_declared_tokenizer(tokenizer_dir).vocab_size
    except (OSError, ValueError, KeyError):  # TokenizerNotFoundError is an OSError; the run's checks name it
        return None


def tokenizer_vocabulary(root: str | Path, tokenizer_dir: str | None) -> int | None:
    """The tokenizer's vocabulary: the data root's record first (what the model must embed), else the tokenizer's."""
    recorded, _ = recorded_vocabulary(root)
    return recorded if recorded is not None else tokenizer_dir_vocabulary(tokenizer_dir)


def follow_tokenizer(composed: DictConfig) -> None:
    """model.vocab_size=0 replaced, in place, by the tokenizer's vocabulary padded to model.vocab_multiple;
    ValueError of one line naming what was looked at and the fix when there is no tokenizer to follow."""
    model, data = composed.model, composed.data
    if int(model.vocab_size) != FOLLOWS_TOKENIZER:
        return
    multiple = int(model.vocab_multiple)
    if multiple < 1:  # refused by the range check too; here it would divide by zero first
        raise ValueError(f"model.vocab_multiple={multiple} must be >= 1 (1 = no padding)")
    recorded, damaged = recorded_vocabulary(data.root)
    pieces = recorded if recorded is not None else tokenizer_dir_vocabulary(data.get("tokenizer_dir"))
    if pieces is None:
        raise ValueError(no_tokenizer_message(data.root, data.get("tokenizer_dir"), damaged))
    OmegaConf.update(composed, "model.vocab_size", padded_vocab(pieces, multiple), merge=False)


def no_tokenizer_message(root: str, tokenizer_dir: str | None, damaged: str | None) -> str:
    """Why model.vocab_size=0 has nothing to follow, and the fixes, in one line. damaged: recorded_vocabulary's line
    for a manifest that is there but gives no vocabulary."""
    if damaged:  # the manifest's own line names the file and its fix, as the data check would say it
        return f"model.vocab_size=0 follows the tokenizer, but {damaged}"
    # A mistyped data.root is the usual cause: say so rather than speak of a manifest inside nothing.
    data = "does not exist" if not Path(root).exists() else "has no readable manifest.json"
    tokenizer = f"data.tokenizer_dir={tokenizer_dir} cannot be read" if tokenizer_dir else "data.tokenizer_dir is unset"
    return (f"model.vocab_size=0 follows the tokenizer, but data.root={root} {data} and {tokenizer}. Fix: prepare "
            "the data (`ayumi data prepare`) or give its data.root, set data.tokenizer_dir, or set model.vocab_size")


def vocabulary_line(vocab_size: int, multiple: int, tokenizer: int | None) -> str:
    """The plan's line: the model's vocabulary and the tokenizer's ids it holds."""
    if tokenizer is None:
        return f"vocabulary: model {vocab_size:,} (tokenizer unknown: no readable data.root manifest or data.tokenizer_dir)"
    if vocab_size == padded_vocab(tokenizer, multiple):
        padding = "" if multiple == 1 else f", padded to a multiple of {multiple}"
        return f"vocabulary: model {vocab_size:,} (tokenizer {tokenizer:,} ids{padding})"
    return f"vocabulary: model {vocab_size:,}, tokenizer {tokenizer:,} ids"
