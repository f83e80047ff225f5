"""The README's examples run as written (the curl ones are run by tests/engine/test_server_openai.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.config import load_config

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_opens_with_the_two_commands_and_ci_runs_the_second() -> None:
    text = README.read_text()
    first_two = re.findall(r"```bash\n(.*?)```", text, flags=re.S)[:2]
    assert text.index("```bash") < text.index("\n\n", text.index("# kvtier")) + 3
    setup, tests = (b.strip() for b in first_two)
    assert "pip install torch==2.13.0" in setup and setup.endswith("kvtier demo")
    assert tests.endswith("pytest -q") and "ruff check" in tests and "mypy" in tests
    ci = (README.parent / ".ci" / "run").read_text()
    assert "n==2" in ci  # .ci/run executes the README's second bash block, nothing else


def test_the_readme_config_is_valid(tmp_path: Path) -> None:
    (yaml_block,) = _blocks("yaml")
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml_block)
    cfg = load_config(path, env={})
    assert [t.type for t in cfg.tiers] == ["cpu", "disk"]


@pytest.mark.smollm2
def test_the_readme_python_example(smollm2: Path, tmp_path: Path) -> None:
    (source,) = _blocks("python")
    (yaml_block,) = _blocks("yaml")
    (tmp_path / "kvtier.yaml").write_text(yaml_block)
    env = {**os.environ, "HOME": str(tmp_path), "KVTIER_MODEL_DIR": str(smollm2.parent)}
    out = subprocess.run(
        [sys.executable, "-c", source],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Paris" in out.stdout
    assert (tmp_path / ".cache" / "kvtier" / "blocks").is_dir()  # the disk tier of the example
