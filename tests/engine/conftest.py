"""Fixtures shared by the engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.tiny_models import write_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint directory (with a byte-level BPE tokenizer)."""
    path, _ = write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=21)
    return path
