"""Hugging Face's ``kernels`` package, not a checkout's own ``kernels`` module.

transformers (5.25 and later) imports the distribution ``kernels`` whenever it
is installed, which it is as transformers' own dependency. From a checkout of
this repository, the import can find the wrong module instead:

* ``python -m bench.engine`` (and pytest) put the repository root on
  ``sys.path``, where ``kernels/`` (installed as ``kvtier.kernels``) answers;
* ``python bench/engine.py`` puts ``bench/``, where ``bench/kernels.py`` does.

transformers then fails on its first import ("cannot import name
'CUDAProperties' from 'kernels'"). Nothing in kvtier imports the bare name
``kernels``. :func:`bind_installed_kernels`, called before transformers is
imported, binds it to the first ``kernels`` on ``sys.path`` outside the
checkout. Installed from a wheel there is no checkout on ``sys.path``, and it
binds nothing.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
"""The repository root when this file is ``engine/models/hf_kernels.py`` of a checkout."""


def _shadows(entry: str) -> bool:
    """Whether ``sys.path`` entry ``entry`` holds one of the checkout's ``kernels`` modules."""
    where = Path(entry or ".").resolve()
    return where in (CHECKOUT, CHECKOUT / "bench") and (
        (where / "kernels" / "__init__.py").is_file() or (where / "kernels.py").is_file()
    )


def bind_installed_kernels() -> bool:
    """Import the installed ``kernels`` as ``sys.modules["kernels"]``, skipping the checkout.

    Returns whether it bound one now. It binds nothing when the name is bound
    already, when no entry of ``sys.path`` shadows it, when the distribution is
    not installed, or when importing it fails (transformers then reports that
    itself, as it would without a checkout in the way).
    """
    elsewhere = [p for p in sys.path if not _shadows(p)]
    if "kernels" in sys.modules or len(elsewhere) == len(sys.path):
        return False
    spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
    if spec is None or spec.loader is None:
        return False
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules["kernels"]
        return False
    return True
