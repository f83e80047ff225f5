"""Maps the top-level source folders onto import names under ``kvtier.``.

The repository keeps each component in its own top-level folder (``engine/``,
``kernels/`` ...) while every import name stays under ``kvtier.``. Packages are
discovered below each root, so a new subpackage needs no edit here.
"""

from setuptools import find_packages, setup

ROOTS = {
    "kvtier": "kvtier",
    "kvtier.kernels": "kernels",
    "kvtier.engine": "engine",
    "kvtier.connectors": "connectors",
    "kvtier.server": "server",
    "kvtier.router": "router",
    # the benchmarks ship like vllm.benchmarks: `python bench/serve.py` imports them as kvtier.bench
    "kvtier.bench": "bench",
}


def _packages() -> list[str]:
    names = []
    for name, folder in ROOTS.items():
        names.append(name)
        names.extend(f"{name}.{sub}" for sub in find_packages(folder))
    return names


setup(packages=_packages(), package_dir=ROOTS)
