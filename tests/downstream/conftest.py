"""Session fixtures of the downstream tests: a small real SentencePiece tokenizer (English and Japanese)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.data.helpers import JA_PARAGRAPHS, english_texts, write_tokenizer
from tokenizer.declared import DeclaredTokenizer, load_declared_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
TOKENIZER_VOCAB = 500
"""Below the tiny models' 512 rows (ModelConfig's default, and the random transformers Llama's)."""


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """An ayumi tokenizer folder (its HF files are placeholders: the parity test exports real ones)."""
    return write_tokenizer(tmp_path_factory.mktemp("tok"), english_texts() + JA_PARAGRAPHS * 3, TOKENIZER_VOCAB)


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir) -> DeclaredTokenizer:
    return load_declared_tokenizer(tokenizer_dir)
