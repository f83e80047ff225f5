"""How long tests wait on real I/O, scaled for a busy host.

Timeouts in tests bound waits on real sockets, processes and threads. Sized
for an idle machine they fail spuriously when other work keeps the CPUs busy
(a 1 s Aerospike batch timeout against the in-process test server, a child
process that starts slowly). :func:`scaled` multiplies a base value by
``KVTIER_TEST_TIMEOUT_SCALE`` (default :data:`DEFAULT_SCALE`); raise it on a
slow or overloaded host. Only limits that must not fire in a passing test are
scaled; a test that checks a timeout *does* fire keeps its own value.
"""

from __future__ import annotations

import os

SCALE_ENV = "KVTIER_TEST_TIMEOUT_SCALE"
DEFAULT_SCALE = 4.0


def timeout_scale() -> float:
    """The factor from ``KVTIER_TEST_TIMEOUT_SCALE`` (a positive number), else the default.

    Raises:
        ValueError: the variable is set but is not a positive number.
    """
    raw = os.environ.get(SCALE_ENV, "").strip()
    if not raw:
        return DEFAULT_SCALE
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{SCALE_ENV}={raw!r} is not a number") from None
    if not value > 0:
        raise ValueError(f"{SCALE_ENV}={raw!r} must be positive")
    return value


def scaled(seconds: float) -> float:
    """``seconds`` times the scale: a limit that must not fire in a passing test."""
    return seconds * timeout_scale()


def scaled_ms(ms: int) -> int:
    """:func:`scaled` for client settings given in whole milliseconds."""
    return max(1, round(ms * timeout_scale()))


def aerospike_timeouts() -> dict[str, int]:
    """The Aerospike tier's default timeouts, scaled: defaults for tests whose I/O must succeed."""
    return {
        "connect_timeout_ms": scaled_ms(1000),
        "total_timeout_ms": scaled_ms(1000),
        "write_timeout_ms": scaled_ms(2000),
        "socket_timeout_ms": scaled_ms(500),
    }
