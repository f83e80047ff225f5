"""Imports run one way (``scripts/check_imports.py``): no cycle, no import against the layers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_imports.py"


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_imports", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_imports"] = module
    spec.loader.exec_module(module)
    return module


def test_the_product_imports_run_one_way() -> None:
    check = _checker()
    edges = check.graph(check.modules())
    assert edges["kvtier.connectors.scheduler_side"]  # the graph is really read
    assert "kvtier.keys" in edges["kvtier.engine.block_manager"]
    assert "kvtier.bench.lib.serve_workloads" in edges["kvtier.bench.serve"]  # the benchmarks too
    assert check.cycles(edges) == []
    assert check.layer_violations(edges) == []


def test_the_checker_finds_a_lazy_cycle_and_a_sideways_import(tmp_path: Path) -> None:
    check = _checker()
    lazy = "def f():\n    from kvtier.b import x\n"
    typed = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvtier.engine.e import E\n"
    )
    files = {
        "a.py": lazy,
        "b.py": "import kvtier.a\n",
        "c.py": typed,  # only for the type checker: not an import
        "d.py": "from kvtier.engine import e\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    mods = {f"kvtier.{n[:-3]}": tmp_path / n for n in files}
    mods["kvtier.engine.e"] = tmp_path / "e.py"
    (tmp_path / "e.py").write_text("")
    edges = check.graph(mods)
    assert check.cycles(edges) == [["kvtier.a", "kvtier.b"]]
    assert check.layer_violations(edges) == ["kvtier.d (core) imports kvtier.engine.e (engine)"]
