"""transformers imports from a checkout, where ``kernels/`` and ``bench/kernels.py`` shadow HF's."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from kvtier.engine.models import hf_kernels
from tests.support.timeouts import timeout_scale

pytest.importorskip("transformers")

# What `python -m bench.engine` ("" with the root as cwd) and `python bench/engine.py`
# (bench/ first) put at the front of sys.path.
FRONTS = {"repository root": "", "bench/": str(hf_kernels.CHECKOUT / "bench")}


def _installed() -> bool:
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _import_transformers(front: str, bind: bool) -> subprocess.CompletedProcess[str]:
    code = (
        f"import sys; sys.path.insert(0, {front!r})\n"
        + ("from kvtier.engine.models.hf_kernels import bind_installed_kernels\n"
           "bind_installed_kernels()\n" if bind else "")
        + "from transformers import LlamaConfig\n"
        "import kernels; print(kernels.__file__)\n"
    )  # fmt: skip
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=hf_kernels.CHECKOUT,
        capture_output=True,
        text=True,
        timeout=120 * timeout_scale(),
    )


@pytest.mark.skipif(not _installed(), reason="Hugging Face's kernels is not installed")
@pytest.mark.parametrize("front", FRONTS.values(), ids=list(FRONTS))
def test_transformers_imports_from_a_checkout_once_kernels_is_bound(front: str) -> None:
    shadowed = _import_transformers(front, bind=False)
    if shadowed.returncode == 0:
        pytest.skip("this transformers imports without Hugging Face's kernels")
    assert "kernels" in shadowed.stderr  # the failure binding it fixes
    bound = _import_transformers(front, bind=True)
    assert bound.returncode == 0, bound.stderr[-2000:]
    origin = bound.stdout.strip().splitlines()[-1]
    assert not origin.startswith(str(hf_kernels.CHECKOUT) + "/kernels")
    assert not origin.startswith(str(hf_kernels.CHECKOUT) + "/bench")


def test_nothing_is_bound_without_a_checkout_on_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not hf_kernels._shadows(p)])
    monkeypatch.delitem(sys.modules, "kernels", raising=False)
    assert hf_kernels.bind_installed_kernels() is False
    assert "kernels" not in sys.modules
