"""Fixtures shared by the training tests."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import write_tiny_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A tiny two-domain corpus of real text (tests.helpers.write_tiny_corpus), written once per test module."""
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus"))
