"""Aerospike result codes and how the tier maps them onto kvtier's errors.

======================================  ===================================================
Result code                             kvtier outcome
======================================  ===================================================
0 OK                                    value
2 RECORD_NOT_FOUND                      miss (``None`` / ``False``), never an exception
5 RECORD_EXISTS (create-only write)     the tier holds the key: ``put`` returns ``True``
3 GENERATION                            a cleanup lost a race with a new write: ignored
8 SERVER_FULL (stop-writes)             ``put`` returns ``False`` (dropped, counted); reads work
13 RECORD_TOO_BIG                       :class:`~kvtier.errors.ConfigError` naming
                                        ``segment_size`` / ``record_size_margin``
20 NAMESPACE_NOT_FOUND                  ConfigError naming ``namespace``
22 FAIL_FORBIDDEN (TTL with nsup off)   ConfigError naming ``ttl_s`` and ``nsup-period``
4, 12, 16, 21, 25, 26, -2, 151, auth    ConfigError (request the server cannot accept)
9 TIMEOUT, 14 RECORD_BUSY,              :class:`AerospikeTransientError` (a TransientError;
18 DEVICE_OVERLOAD, 1, 7, 11, 32, 152,  retried, and counted by the circuit breaker);
-15 NO_RESPONSE, -10 CONNECTION, -8,    an ``in_doubt`` write is transient too: every
-7, -6, -11, -12, -14, -9, -1           write of the tier is idempotent
anything else                           TransientError, not retried
======================================  ===================================================
"""

from __future__ import annotations

from kvtier.errors import ConfigError, KvtierError, TransientError

OK = 0
SERVER_ERROR = 1
NOT_FOUND = 2
GENERATION = 3
EXISTS = 5
STOP_WRITES = 8
TIMEOUT = 9
TOO_BIG = 13
RECORD_BUSY = 14
DEVICE_OVERLOAD = 18
NAMESPACE_NOT_FOUND = 20
FORBIDDEN = 22
NO_RESPONSE = -15
BATCH_FAILED = -16
CONNECTION = -10

TRANSIENT_CODES = frozenset(
    {
        SERVER_ERROR,
        7,  # cluster change
        TIMEOUT,
        11,  # cluster error (partition unavailable)
        RECORD_BUSY,
        DEVICE_OVERLOAD,
        32,  # XDR key busy
        152,  # batch queues full
        NO_RESPONSE,
        -1,  # generic client error (lost sockets and the like)
        -6,  # async connection
        -7,  # no more connections in the pool
        -8,  # invalid node (none reachable)
        -9,  # TLS handshake
        CONNECTION,
        -11,  # async queue full
        -12,  # max retries exceeded
        -14,  # max error rate
    }
)
"""Codes worth retrying: the server or the path to it is slow, busy or down."""

CONFIG_CODES = frozenset(
    {
        4,
        10,
        12,
        16,
        21,
        25,
        26,
        151,
        -2,
        -4,
        *range(50, 57),
        *range(60, 67),
        *range(70, 76),
        *range(80, 84),
    }
)
"""Codes that say the request can never succeed as configured."""


class AerospikeTransientError(TransientError):
    """A retryable Aerospike failure (timeout, overload, lost connection).

    Attributes:
        code: The Aerospike result code.
        in_doubt: A write may have been applied although it reported failure.
    """

    def __init__(self, message: str, code: int, in_doubt: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.in_doubt = in_doubt


def error_for(code: int, message: str, *, namespace: str, in_doubt: bool = False) -> KvtierError:
    """The kvtier error for a failed result ``code`` (not for 0, 2, 3, 5 or 8)."""
    text = f"aerospike error {code}: {message}"
    if code == TOO_BIG:
        return ConfigError(
            f"{text}: a record exceeds the namespace's max-record-size; lower the tier's "
            "segment_size or raise record_size_margin (or raise max-record-size on the server)"
        )
    if code == NAMESPACE_NOT_FOUND:
        return ConfigError(
            f"{text}: namespace {namespace!r} does not exist on the cluster; fix `namespace`"
        )
    if code == FORBIDDEN:
        return ConfigError(
            f"{text}: the server refuses records with a TTL while nsup is off; set nsup-period on "
            f"namespace {namespace!r} (or allow-ttl-without-nsup), or set ttl_s: -1"
        )
    if code in CONFIG_CODES:
        return ConfigError(f"{text}: the server cannot accept this request as configured")
    if code in TRANSIENT_CODES:
        return AerospikeTransientError(text, code, in_doubt)
    return TransientError(text)
