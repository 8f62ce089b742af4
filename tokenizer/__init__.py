"""Merged SentencePiece tokenizer builder: per-domain models, merge, evaluation, HF export.

Import-light on purpose: sentencepiece/transformers load only inside the modules that use them.
Downstream packages use `load_tokenizer_info` / `TokenizerInfo` (identity = sha256 of tokenizer.model);
the corpus readers it samples from live in `common.corpus`.

May import: `common` only.
"""
from tokenizer.info import TokenizerInfo, TokenizerNotFoundError, load_tokenizer_info, tokenizer_sha256

__all__ = ["TokenizerInfo", "TokenizerNotFoundError", "load_tokenizer_info", "tokenizer_sha256"]
