"""Project-wide test configuration: capability markers skip what this machine cannot run."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

import pytest

from tests.support.timeouts import SCALE_ENV, timeout_scale

REPO = Path(__file__).resolve().parent.parent


def _import_installed_kernels() -> None:
    """Binds ``kernels`` to the installed distribution, not to this repository's ``kernels/``.

    pytest puts the repository root on ``sys.path``, where ``kernels/`` (installed
    as ``kvtier.kernels``) would answer ``import kernels``. transformers >= 5.25
    imports Hugging Face's ``kernels`` distribution whenever it is installed, and
    failed on ours. Nothing in the project imports the bare name.
    """
    elsewhere = [p for p in sys.path if Path(p or ".").resolve() != REPO]
    spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
    if spec is None or spec.loader is None or "kernels" in sys.modules:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    try:
        spec.loader.exec_module(module)
    except Exception:  # a broken optional package: transformers reports it itself
        del sys.modules["kernels"]


_import_installed_kernels()

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


def pytest_report_header(config: pytest.Config) -> str:
    # NOTE: also fails the session early on a bad value (timeout_scale raises).
    return f"{SCALE_ENV}={timeout_scale():g} (tests/support/timeouts.py: waits on real I/O)"


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
