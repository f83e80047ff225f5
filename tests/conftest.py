"""Project-wide test configuration: capability markers skip what this machine cannot run."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.engine.models.hf_kernels import bind_installed_kernels
from tests.support.timeouts import SCALE_ENV, timeout_scale

REPO = Path(__file__).resolve().parent.parent


# NOTE: before any test imports transformers (see kvtier.engine.models.hf_kernels).
bind_installed_kernels()

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


# -- Aerospike: which server the tests ran against --------------------------------------------

_aerospike_runs: dict[str, set[str]] = {}
_aerospike_reasons: dict[str, str] = {}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "aerospike_emulator(reason): uses the protocol-level emulator for what a real Aerospike "
        "server cannot be made to do on demand (the reason says what)",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    from tests.support.aerospike_usage import take_notes

    take_notes()
    yield
    touched = take_notes()
    if touched:
        _aerospike_runs[item.nodeid] = touched
        marker = item.get_closest_marker("aerospike_emulator")
        if marker is not None and marker.args:
            _aerospike_reasons[item.nodeid] = str(marker.args[0])


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _aerospike_runs:
        return
    from tests.support.aerospike_target import describe_backend
    from tests.support.aerospike_usage import EMULATOR

    real = [n for n, kinds in _aerospike_runs.items() if kinds - {EMULATOR}]
    emulated = [n for n, kinds in _aerospike_runs.items() if EMULATOR in kinds]
    tr = terminalreporter
    tr.section("Aerospike")
    tr.write_line(f"{len(real)} tests ran against a real Aerospike server: {describe_backend()}")
    why: dict[str, int] = {}
    for nodeid in emulated:
        reason = _aerospike_reasons.get(nodeid, "no reason given (aerospike_emulator marker)")
        why[reason] = why.get(reason, 0) + 1
    tr.write_line(
        f"{len(emulated)} tests used the emulator (tests/support/aerospike_server.py)"
        + (":" if why else "")
    )
    for reason, count in sorted(why.items(), key=lambda kv: -kv[1]):
        tr.write_line(f"  {count:4d}  {reason}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # NOTE: only a run that imported it can have started a cluster; importing it here would
    # need the Aerospike client, which a run of other tests may not have (a GPU machine).
    target = sys.modules.get("tests.support.aerospike_target")
    if target is not None:
        target.stop_session_cluster()
