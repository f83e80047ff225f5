"""Fixtures of the router tests: a tiny model (its tokenizer sizes prompts and keys)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.tiny_models import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama directory with a byte-level BPE tokenizer and a chat template."""
    path, _ = write_tiny_model(tmp_path_factory.mktemp("router-tiny"), "llama", seed=23)
    return path
