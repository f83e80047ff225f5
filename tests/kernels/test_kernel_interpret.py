"""Runs the Triton-vs-reference cases under ``TRITON_INTERPRET=1`` in a child pytest.

The interpreter must be chosen before triton is first imported in a process,
and must not leak into the other tests of this session (a GPU run wants the
compiled kernels), hence the separate process. See ``interpret_cases.py``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

CASES_FILE = Path(__file__).with_name("interpret_cases.py")
REPO_ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("triton")


def test_triton_kernels_match_reference_in_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES_FILE)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    report = proc.stdout[-8000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, report
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed is not None and int(passed.group(1)) >= 16, report
    assert "skipped" not in proc.stdout and "failed" not in proc.stdout, report
