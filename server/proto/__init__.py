"""The cache server's wire protocol: ``kvtier_cache.proto`` and its generated stubs.

The stubs (``kvtier_cache_pb2*.py``, ``.pyi``) are committed; regenerate them
with ``scripts/gen_proto.sh`` (``python -m kvtier.server.proto.generate``)
after editing the ``.proto``. A test fails when they are stale.
"""

PROTOCOL_VERSION = 1
"""Bumped with every incompatible change to ``kvtier_cache.proto`` (the package is ``kvtier.cache.v1``)."""
