#!/usr/bin/env bash
# Regenerate kvtier/wire/kvtier_cache_pb2*.py and .pyi from kvtier_cache.proto.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
exec "$PY" -m kvtier.wire.generate "$@"
