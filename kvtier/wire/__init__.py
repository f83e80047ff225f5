"""The cache server's wire protocol, shared by the server and its client (the remote tier).

``kvtier_cache.proto`` and its generated stubs (the control plane), the bulk
data plane's framing (``dataplane.py``, ``frames.py``, ``sockio.py``) and the
channel options both ends use (``transport.py``). It imports nothing of the
server or of the store, so the core's remote tier and the server both stand
on it.

The stubs (``kvtier_cache_pb2*.py``, ``.pyi``) are committed; regenerate them
with ``scripts/gen_proto.sh`` (``python -m kvtier.wire.generate``)
after editing the ``.proto``. A test fails when they are stale.
"""

PROTOCOL_VERSION = 1
"""Bumped with every incompatible change to ``kvtier_cache.proto`` (the package is ``kvtier.cache.v1``)."""
