"""Which Aerospike server the running test talks to, for the test run's summary.

:class:`~tests.support.aerospike_server.AerospikeTestServer` notes
:data:`EMULATOR` when it starts; the real backends of
:mod:`tests.support.aerospike_target` note theirs when a test gets one.
``tests/conftest.py`` takes the notes after each test and reports the counts.
"""

from __future__ import annotations

CLUSTER, EXTERNAL, EMULATOR = "cluster", "external", "emulator"

_touched: set[str] = set()


def note(kind: str) -> None:
    """Record that the running test talks to ``kind``."""
    _touched.add(kind)


def take_notes() -> set[str]:
    """What the test that just ran touched; clears the record."""
    out = set(_touched)
    _touched.clear()
    return out
