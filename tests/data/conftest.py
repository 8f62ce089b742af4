"""Session fixtures of the data tests (helpers live in tests/data/helpers.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.data.helpers import JA_PARAGRAPHS, english_texts, write_tokenizer


@pytest.fixture(scope="session")
def en_texts() -> list[str]:
    return english_texts()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, en_texts) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tok"), en_texts + JA_PARAGRAPHS * 3)


@pytest.fixture(scope="session")
def other_tokenizer_dir(tmp_path_factory, en_texts) -> Path:
    """A different tokenizer (larger vocabulary), for the sha mismatch tests."""
    return write_tokenizer(tmp_path_factory.mktemp("tok2"), en_texts + JA_PARAGRAPHS * 3, vocab_size=700)


