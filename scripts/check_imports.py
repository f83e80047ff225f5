#!/usr/bin/env python3
"""Checks that kvtier's imports run one way: no import cycle, no import against the layers.

    python scripts/check_imports.py        # exit 1 and say what is wrong, else print a summary

Every ``.py`` of the product (the folders ``setup.py`` maps onto ``kvtier.*``)
and of the benchmarks (``bench/``, the package ``kvtier.bench``) is parsed, not imported; every ``import`` counts, at module level or inside a
function (a lazy import that closes a cycle is still a cycle), except those
under ``if TYPE_CHECKING:``. Two checks:

* **No cycle** between modules (strongly connected components of the graph).
* **Layers** between components::

      kernels  ←  core (kvtier/: keys, prefix, block format, tiers, store, wire, net, ...)
                    ↑            ↑
                  engine       server
                    ↑
      connectors (engine adapters)      router (prompt rendering is the engine server's)

  A component imports only the components below it; the benchmarks may import
  anything, nothing imports them. The core's command line
  loads the engine's and the server's commands by module name (``importlib``),
  which this check does not see, on purpose.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

ROOTS = {  # import name -> folder (as setup.py maps them)
    "kvtier.kernels": "kernels",
    "kvtier.engine": "engine",
    "kvtier.connectors": "connectors",
    "kvtier.server": "server",
    "kvtier.router": "router",
    "kvtier.bench": "bench",
    "kvtier": "kvtier",
}

ALLOWED = {  # component -> components it may import (besides itself)
    "kernels": set(),
    "core": {"kernels"},
    "engine": {"core", "kernels"},
    "server": {"core", "kernels"},
    "connectors": {"engine", "core", "kernels"},
    "router": {"engine", "core", "kernels"},
    "bench": {"kernels", "core", "engine", "server", "connectors", "router"},
}


def component(module: str) -> str:
    """The component a ``kvtier.*`` module belongs to."""
    for name in ROOTS:
        if name != "kvtier" and (module == name or module.startswith(name + ".")):
            return name.removeprefix("kvtier.")
    return "core"


def modules() -> dict[str, Path]:
    """Every product and benchmark module: import name -> file."""
    out: dict[str, Path] = {}
    for name, folder in ROOTS.items():
        root = REPO / folder
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            mod = ".".join([name, *parts])
            if name == "kvtier" and any(
                mod.startswith(r + ".") or mod == r for r in ROOTS if r.startswith("kvtier.")
            ):
                continue
            out[mod] = path
    return out


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[str, list[str]]]:
    """(imported module, names imported from it) for every import outside TYPE_CHECKING."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if is_package else 0)
                base = ".".join(parts[:keep] + ([base] if base else []))
            yield base, [a.name for a in node.names]
        stack.extend(ast.iter_child_nodes(node))


def graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> product modules it imports."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        for target, names in _imports(tree, mod, path.name == "__init__.py"):
            if not (target == "kvtier" or target.startswith("kvtier.")):
                continue
            hits = {f"{target}.{n}" for n in names if f"{target}.{n}" in mods}
            if target in mods and (not names or len(hits) < len(names)):
                hits.add(target)
            edges[mod] |= hits - {mod}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    scc.append(m)
                    if m == node:
                        break
                if len(scc) > 1:
                    out.append(sorted(scc))
    return out


def layer_violations(edges: dict[str, set[str]]) -> list[str]:
    """``a -> b`` imports from a component ``a`` may not import."""
    out = []
    for mod, targets in sorted(edges.items()):
        here = component(mod)
        for t in sorted(targets):
            there = component(t)
            if there != here and there not in ALLOWED[here]:
                out.append(f"{mod} ({here}) imports {t} ({there})")
    return out


def main() -> int:
    mods = modules()
    edges = graph(mods)
    found = cycles(edges)
    bad = layer_violations(edges)
    for scc in found:
        print("import cycle: " + " <-> ".join(scc), file=sys.stderr)
    for line in bad:
        print("against the layers: " + line, file=sys.stderr)
    if found or bad:
        return 1
    n = sum(len(t) for t in edges.values())
    print(f"imports run one way: {len(mods)} modules, {n} imports, no cycle, layers kept")
    return 0


if __name__ == "__main__":
    sys.exit(main())
