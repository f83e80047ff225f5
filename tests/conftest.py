"""Project-wide test configuration: capability markers skip what this machine cannot run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """Where ``kvtier model fetch smollm2`` puts the default model."""
    root = os.environ.get("KVTIER_MODEL_DIR")
    base = Path(root) if root else Path("~/.cache/kvtier/models").expanduser()
    return base / SMOLLM2_FILE


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_gpu = pytest.mark.skip(reason="needs a CUDA device")
    no_model = pytest.mark.skip(reason=f"needs {smollm2_path()} (run: kvtier model fetch smollm2)")
    has_gpu = _cuda_available()
    has_model = smollm2_path().exists()
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(no_gpu)
        if "smollm2" in item.keywords and not has_model:
            item.add_marker(no_model)


@pytest.fixture
def smollm2() -> Path:
    """Path of the real SmolLM2 GGUF (tests using it are marked ``smollm2``)."""
    path = smollm2_path()
    if not path.exists():
        pytest.skip(f"needs {path}")
    return path
