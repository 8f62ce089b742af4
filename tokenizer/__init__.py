"""Merged SentencePiece tokenizer builder: per-domain models, merge, evaluation, HF export."""
