"""The fleet-wide tier: blocks in an Aerospike namespace, via the official client.

Layout (see :mod:`kvtier.tiers.aerospike_layout`): a block that fits under
the namespace's ``max-record-size`` (minus a safety margin) is one record
with one bin. A larger block is segment records, under keys that carry the
chunk key's *canonical nonce* (derived from the key alone:
:func:`~kvtier.tiers.aerospike_layout.canonical_nonce`), plus one manifest
record under the chunk key that names them and holds the block's checksum.
A put is **one request** (one ``batch_write``, split only above
``max_batch_bytes``): single records, every segment and the manifest naming
them, all create-only. What makes that safe:

* A reader reads the chunk key and, when the tier knows the segment count,
  the canonical segments in one batch (else the segments in a second one),
  reassembles and checks it: any bytes against the manifest's xxh3 of the
  block; a block in kvtier's format by each segment's tag (whose block it
  belongs to), the head and the block's identity, leaving the body to the
  checksum its consumer verifies (no pass over the block here:
  :mod:`~kvtier.tiers.aerospike_layout`). A manifest whose segments are
  missing or another block's is a miss, never a mix of writers' bytes. The server may apply the
  rows of one request in any order, so such a manifest may be a write in
  flight: the reader removes it (only if its generation is unchanged) and the
  segments it names only when the server last wrote it longer ago than
  ``cleanup_grace_s`` (a filter expression on the remove), never sooner.
* A writer reads its rows' results: every segment created and the manifest
  created is a stored block. A segment row that failed takes the writer's
  manifest and created segments with it (removed; the put answers ``False``).
  A manifest that already existed (another writer's) with none of our
  segments created means the chunk is held: nothing was stored, the put
  answers ``True`` (content addressing: a block is immutable). Segments we
  created under an existing manifest: under a random-nonce manifest they are
  orphans (removed, ``True``); under the canonical nonce with our checksum
  they are part of that block (``True``); with another checksum the put
  answers ``False`` and leaves them to that manifest's writer (below).
* Canonical segment keys that already held records under our new manifest
  (a concurrent writer, or a dead writer's leftovers) are read back once: the
  same bytes (engines often compute identical KV) and the block is complete;
  other bytes and the writer writes its segments again under a random nonce
  (:data:`~kvtier.tiers.aerospike_layout.NONCE_BYTES` of ``os.urandom``), which
  no one else can name, replaces its manifest with one naming them, and
  removes every canonical segment of the chunk (no manifest names them).
* A writer that dies in its request can leave a manifest naming segments
  that never landed: a miss, cleaned by the first reader after the grace;
  segments without a manifest are invisible and expire with their TTL
  (``ttl_s``; with ``-1`` they leak — see the config module).

Write dedup (``skip_existing``, off by default): blocks are content-addressed
and immutable, so a put can first ask which blocks the namespace already holds
*complete* and upload only the others — one more round trip for every put,
which saves the upload of a held block. One batch read of the chunk keys
fetches only the manifest bin (a single-record block answers with no bins:
it is complete, a record is written whole); one batch exists of every
segment the found manifests name follows. A segmented block counts as held
only if all its segments are there. Skipped blocks count in
``kvtier_tier_puts_skipped_total``. Without it a held block is found by the
create-only write itself, which stores nothing, after its bytes travelled.

Connection: the tier connects at construction. If the cluster cannot be
reached then, construction still succeeds: the breaker is opened, calls
fail fast with :class:`~kvtier.errors.TierUnavailableError` for the
cool-down, and the next call after it (the breaker's probe) connects again.
A namespace that does not exist, or a TTL the namespace cannot honour,
raises :class:`~kvtier.errors.ConfigError` from every call until fixed;
:meth:`AerospikeTier.connect` raises it at once for owners that want to
fail loudly at start.

Failure handling: every call has a total timeout (``total_timeout_ms`` for
reads, ``write_timeout_ms`` for writes). Within it the client retries a read
on the next replica (``replica_retries``: a dead or paused master's keys are
read from the replica) and never retries a write; each round trip is
retried by a :class:`~kvtier.retry.Retry` for transient errors only.
Repeated failed calls open a :class:`~kvtier.breaker.CircuitBreaker`: the
tier is then skipped without network I/O until the cool-down ends. Reads
and writes have a breaker each, so saves failing on a lost node's
partitions never stop the loads its replica serves. The
error mapping is in :mod:`kvtier.tiers.aerospike_errors`.

Deadlines (``get`` / ``contains`` / ``prefix_length`` with ``deadline=``):
one instant bounds the whole call — every round trip (the chunk-key batch,
every segment batch, a best-effort cleanup or touch) and every retry. Each
attempt's ``total_timeout`` and ``socket_timeout`` are the configured ones
cut to what is left (whole milliseconds, at least 1); a retry starts only if
more than :data:`MIN_ATTEMPT_S` is left after its backoff; a deadline that
has passed raises :class:`~kvtier.errors.DeadlineExceededError` without I/O
(and without a verdict for the breaker). The client enforces each attempt's
timeout by polling its socket, so a call returns within a few milliseconds
of the deadline. A tier that is not connected yet connects on a background
thread, and the caller waits for it only until its deadline.

Recency: with ``recency: read_touch`` (default) reads carry the server's
``read-touch-ttl-percent`` (server 7.1+): a read in the last part of a
record's life resets its TTL on the server, for the manifest and every
segment alike, at no extra round trip and without a write per read. With
``touch`` the tier sends an explicit batch touch after each hit (any server
version, one more round trip); ``none`` leaves TTLs alone. ``contains`` never
refreshes recency.

Thread safety: every method may be called from any thread; the client is
thread-safe and the tier's own state is locked.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import aerospike
from aerospike import exception as aerospike_exception
from aerospike_helpers import expressions as exp
from aerospike_helpers.batch.records import BatchRecords, Remove, Write
from aerospike_helpers.operations import operations as as_ops

from kvtier.breaker import BreakerState, CircuitBreaker
from kvtier.errors import (
    ConfigError,
    DeadlineExceededError,
    TierUnavailableError,
    TransientError,
)
from kvtier.metrics import StoreMetrics
from kvtier.retry import ExponentialBackoff, Retry
from kvtier.tiers.aerospike_config import AerospikeTierConfig
from kvtier.tiers.aerospike_errors import (
    BATCH_FAILED,
    EXISTS,
    NOT_FOUND,
    OK,
    STOP_WRITES,
    TOO_BIG,
    TRANSIENT_CODES,
    AerospikeTransientError,
    error_for,
)
from kvtier.tiers.aerospike_layout import (
    BIN_BLOCK,
    BIN_MANIFEST,
    BIN_SEGMENT,
    BIN_TAG,
    NONCE_BYTES,
    Manifest,
    ManifestError,
    canonical_nonce,
    segment_key,
)
from kvtier.tiers.aerospike_metrics import AerospikeMetrics, AerospikeStats, StatsRecorder
from kvtier.tiers.aerospike_namespace import (
    RecordLimits,
    check_ttl,
    client_config,
    parse_info,
    read_policy,
    record_limits,
)
from kvtier.tiers.base import Tier, TierUsage

log = logging.getLogger(__name__)

T = TypeVar("T")

_ROW_OVERHEAD = 64  # bytes a batch row adds besides its payload (digest, fields, op header)

MIN_ATTEMPT_S = 0.002
"""With a deadline, a round trip (or a retry) starts only if more than this is left."""


@dataclass(frozen=True)
class _Row:
    """One record to write in a batch."""

    index: int  # which put item it belongs to
    key: bytes
    bin: str
    data: bytes
    mode: str  # "create" (create-only), "upsert" (create or replace), "replace" (replace only)
    part: int = -1  # a segment's index in its block
    tag: bytes | None = None  # a kind-2 segment's tag (bin "t"): whose block it belongs to


@dataclass
class _Landed:
    """What one put request did with a segmented block's records."""

    created: list[bytes] = field(default_factory=list)  # segment keys this put created
    taken: list[int] = field(default_factory=list)  # segments whose keys already held a record
    failed: bool = False  # a segment row failed (not written)
    manifest: int | None = None  # the manifest row's result code


@dataclass
class _ConnectAttempt:
    """A connection being made on a background thread for callers with deadlines."""

    done: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None


def _expired(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _bounded(policy: dict[str, Any], deadline: float | None) -> dict[str, Any]:
    """A read or write ``policy`` with its timeouts cut to what is left before ``deadline``.

    Whole milliseconds, rounded down so an attempt never outlives the
    deadline, and at least 1 (0 would mean "no timeout" to the client).
    When the deadline cuts the total, a read's socket timeout is cut to its
    share of it, so the client's retry on the replica still fits (a paused
    master must not take all the time left).
    """
    if deadline is None:
        return policy
    left_ms = max(1, int((deadline - time.monotonic()) * 1000))
    total = min(policy["total_timeout"], left_ms)
    socket_ms = policy["socket_timeout"]
    tries = 1 + policy.get("max_retries", 0)
    if total < policy["total_timeout"] and tries > 1:
        share = max(1, total // tries)
        socket_ms = min(socket_ms, share) if socket_ms else share
    return {
        **policy,
        "total_timeout": total,
        "socket_timeout": min(socket_ms, total) if socket_ms else 0,
    }


class AerospikeTier(Tier):
    """Blocks in Aerospike. See the module docstring for layout and failure handling.

    Args:
        config: The tier's configuration.
        metrics: The store's metrics; the tier registers its own series
            (:class:`~kvtier.tiers.aerospike_metrics.AerospikeMetrics`) on
            its registry.
        aerospike_metrics: Pass a shared instance instead when several
            Aerospike tiers use one registry.
        clock: Monotonic clock for the breaker and usage cache (tests).
        sleep: Sleep used between retries (tests).
    """

    fast = False
    verifies_reads = False

    def __init__(
        self,
        config: AerospikeTierConfig,
        metrics: StoreMetrics | None = None,
        *,
        aerospike_metrics: AerospikeMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.config = config
        self.name = config.name
        self._metrics = metrics
        if aerospike_metrics is None and metrics is not None:
            aerospike_metrics = AerospikeMetrics(metrics.registry)
        self._stats = StatsRecorder(self.name, aerospike_metrics)
        self._clock = clock
        # NOTE: reads and writes have a breaker each. With a node lost, writes whose master
        # it was fail until the cluster re-forms while reads are served by the replica: one
        # breaker opened by the failed saves would turn every load into a recompute.
        self._not_closed: set[str] = set()  # "reads" / "writes" whose breaker is not closed
        self._lock_breakers = threading.Lock()
        self._breaker = CircuitBreaker(
            config.breaker_threshold,
            config.breaker_cooldown_s,
            clock=clock,
            on_state_change=lambda old, new: self._on_breaker_change("reads", new),
        )
        self._write_breaker = CircuitBreaker(
            config.breaker_threshold,
            config.breaker_cooldown_s,
            clock=clock,
            on_state_change=lambda old, new: self._on_breaker_change("writes", new),
        )
        self._retry = Retry(
            ExponentialBackoff(
                base=config.retry_backoff_ms / 1000, cap=config.retry_backoff_cap_ms / 1000
            ),
            config.max_retries,
            (AerospikeTransientError,),
            min_attempt=MIN_ATTEMPT_S,
            sleep=sleep,
        )
        self._lock = threading.Lock()
        self._connecting: _ConnectAttempt | None = None
        self._segment_guess = 0  # segments of the last manifest seen: what a get speculates
        self._connecting_lock = threading.Lock()
        self._client: Any = None
        self._limits: RecordLimits | None = None
        self._closed = False
        self._usage = TierUsage(used_bytes=0, capacity_bytes=None, num_blocks=None)
        self._usage_at = -math.inf
        self._ttl = aerospike.TTL_NEVER_EXPIRE if config.ttl_s == -1 else config.ttl_s
        read = read_policy(config)
        touch_pct = config.read_touch_ttl_percent if config.recency == "read_touch" else -1
        self._read_policy = {**read, "read_touch_ttl_percent": touch_pct}
        self._exists_policy = {**read, "read_touch_ttl_percent": -1}
        self._write_policy = {
            "total_timeout": config.write_timeout_ms,
            "socket_timeout": config.socket_timeout_ms,
            "max_retries": 0,
        }
        self._create_row = {
            "ttl": self._ttl,
            "exists": aerospike.POLICY_EXISTS_CREATE,
            "key": aerospike.POLICY_KEY_DIGEST,
        }
        self._replace_row = {
            "ttl": self._ttl,
            "exists": aerospike.POLICY_EXISTS_CREATE_OR_REPLACE,
            "key": aerospike.POLICY_KEY_DIGEST,
        }
        self._replace_only_row = {
            "ttl": self._ttl,
            "exists": aerospike.POLICY_EXISTS_REPLACE,
            "key": aerospike.POLICY_KEY_DIGEST,
        }
        grace_ms = round(config.cleanup_grace_s * 1000)
        self._stale_filter = (
            exp.GT(exp.SinceUpdateTime(), grace_ms).compile() if grace_ms > 0 else None
        )
        try:
            self.connect()
        except TransientError as e:
            log.warning(
                "aerospike tier %r: cannot connect to %s%s (%s); retrying after %.1fs",
                self.name,
                self._hosts_text(),
                f" as cluster {config.cluster_name!r}" if config.cluster_name else "",
                e,
                config.breaker_cooldown_s,
            )
            self._stats.failure("connect")
            self._breaker.trip()
            self._write_breaker.trip()
        except ConfigError as e:
            log.error("%s", e)
            self._stats.failure("config")

    # -- public helpers ------------------------------------------------------------

    def connect(self) -> RecordLimits:
        """Connect (if not connected) and learn the record limits; idempotent.

        Raises:
            TransientError: the cluster cannot be reached.
            ConfigError: the namespace does not exist, the TTL cannot work
                with its nsup settings, or the segment size does not fit.
        """
        with self._lock:
            if self._closed:
                raise TierUnavailableError(f"aerospike tier {self.name!r} is closed")
            if self._client is None:
                self._stats.round_trip("connect")
                try:
                    # NOTE: the 19.x client connects in aerospike.client(); connect()
                    # is then a no-op kept for older clients.
                    client = aerospike.client(client_config(self.config)).connect()
                except aerospike_exception.AerospikeError as e:
                    raise self._error(e) from None
                self._client = client
            if self._limits is None:
                self._limits = self._learn_limits(self._client)
            return self._limits

    @property
    def limits(self) -> RecordLimits | None:
        """The record limits learned at connect (``None`` before a connection)."""
        return self._limits

    @property
    def breaker(self) -> CircuitBreaker:
        """The breaker of reads (``get``, ``contains``, ``prefix_length``)."""
        return self._breaker

    @property
    def write_breaker(self) -> CircuitBreaker:
        """The breaker of writes (``put``, ``delete``)."""
        return self._write_breaker

    def stats(self) -> AerospikeStats:
        """The tier's own counters (round trips, retries, drops ...)."""
        return self._stats.snapshot()

    # -- Tier ----------------------------------------------------------------------

    def contains(self, keys: Sequence[bytes], *, deadline: float | None = None) -> list[bool]:
        """One batch exists call (per ``max_batch_keys`` keys); no recency refresh.

        Raises:
            TransientError: a failure, or the deadline passed (see the module docstring).
        """
        if not keys:
            return []
        return self._guard(lambda client: self._contains(client, list(keys), deadline), deadline)

    def get(self, keys: Sequence[bytes], *, deadline: float | None = None) -> list[bytes | None]:
        """One batch read of the chunk keys, one more for all segments of segmented hits.

        Raises:
            TransientError: a failure, or the deadline passed (see the module docstring).
        """
        if not keys:
            return []
        return self._guard(lambda client: self._get(client, list(keys), deadline), deadline)

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        """Single records, segments and manifests in one batch write (see the module docstring).

        Returns ``False`` for items dropped by stop-writes or failed rows.

        Raises:
            ConfigError: a record was too big for the server (names the setting).
            TransientError: the whole call failed (timeout, connection).
        """
        if not items:
            return []
        return self._guard(lambda client: self._put(client, list(items)), write=True)

    def delete(self, keys: Sequence[bytes]) -> int:
        """Reads the manifests (one batch), then removes records and segments (one batch)."""
        if not keys:
            return 0
        return self._guard(lambda client: self._delete(client, list(keys)), write=True)

    def usage(self) -> TierUsage:
        """The set's bytes (``sets/<ns>/<set>``) and the namespace's capacity, summed over nodes.

        Never raises and never waits on a failing cluster: it answers from a
        cache refreshed at most every ``usage_refresh_s`` and only while the
        breaker is closed. ``used_bytes`` includes replicas; ``capacity_bytes``
        is the whole namespace's (shared with any other set); ``num_blocks``
        is ``None`` because segmented blocks are several records.
        """
        now = self._clock()
        if now - self._usage_at < self.config.usage_refresh_s:
            return self._usage
        client = self._client
        if client is None or self._breaker.state is not BreakerState.CLOSED:
            return self._usage
        self._usage_at = now
        try:
            # NOTE: no retries: a metrics scrape must not wait out backoffs.
            set_infos = self._info(
                client, f"sets/{self.config.namespace}/{self.config.set_name}", ":", retry=False
            )
            ns_infos = self._info(client, f"namespace/{self.config.namespace}", ";", retry=False)
        except (TransientError, ConfigError) as e:
            log.debug("aerospike tier %r: usage unavailable: %s", self.name, e)
            return self._usage
        used = sum(int(i.get("data_used_bytes", 0)) for i in set_infos)
        totals = [int(i["data_total_bytes"]) for i in ns_infos if "data_total_bytes" in i]
        self._usage = TierUsage(
            used_bytes=used, capacity_bytes=sum(totals) if totals else None, num_blocks=None
        )
        return self._usage

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except aerospike_exception.AerospikeError as e:
                log.debug("aerospike tier %r: close: %s", self.name, e)

    # -- guard: breaker, connection, error accounting -------------------------------

    def _guard(
        self, fn: Callable[[Any], T], deadline: float | None = None, *, write: bool = False
    ) -> T:
        if self._closed:
            raise TierUnavailableError(f"aerospike tier {self.name!r} is closed")
        if _expired(deadline):
            self._stats.failure("deadline")
            raise DeadlineExceededError(f"aerospike tier {self.name!r}: the deadline has passed")
        breaker = self._write_breaker if write else self._breaker
        if not breaker.allow():
            self._stats.failure("skipped")
            what = "writes" if write else "reads"
            raise TierUnavailableError(
                f"aerospike tier {self.name!r}: {what} skipped for {breaker.retry_after():.1f}s after repeated failures"
            )
        try:
            self._connect_by(deadline)
            result = fn(self._client)
        except DeadlineExceededError:
            breaker.release()  # the caller ran out of time: no verdict on the cluster
            self._stats.failure("deadline")
            raise
        except TransientError:
            breaker.record_failure()
            self._stats.failure("transient")
            raise
        except ConfigError:
            breaker.record_success()  # the cluster answered
            self._stats.failure("config")
            raise
        except BaseException:
            breaker.release()
            raise
        breaker.record_success()
        return result

    def _on_breaker_change(self, path: str, new: BreakerState) -> None:
        # NOTE: called under the changing breaker's lock: never ask a breaker its state here.
        with self._lock_breakers:
            if new is BreakerState.CLOSED:
                self._not_closed.discard(path)
            else:
                self._not_closed.add(path)
            is_open = bool(self._not_closed)
        self._stats.breaker_changed(opened=new is BreakerState.OPEN, is_open=is_open)
        if new is BreakerState.OPEN:
            log.warning(
                "aerospike tier %r: circuit open for %s, skipping them for %.1fs",
                self.name,
                path,
                self.config.breaker_cooldown_s,
            )
        elif new is BreakerState.CLOSED:
            log.info("aerospike tier %r: circuit closed for %s, serving again", self.name, path)

    def _round_trip(
        self,
        op: str,
        fn: Callable[[dict[str, Any]], T],
        policy: dict[str, Any],
        deadline: float | None = None,
    ) -> T:
        """One client call ``fn(policy)``, retried for transient errors, with errors mapped.

        With a ``deadline`` each attempt gets ``policy`` with its timeouts cut
        to what is left, and no attempt starts without :data:`MIN_ATTEMPT_S` left.
        """

        def attempt() -> T:
            self._stats.round_trip(op)
            try:
                return fn(_bounded(policy, deadline))
            except aerospike_exception.AerospikeError as e:
                raise self._error(e) from None

        return self._retry.call(
            attempt, on_retry=lambda _e, _n: self._stats.retry(), deadline=deadline
        )

    def _error(self, e: aerospike_exception.AerospikeError) -> Exception:
        code = e.code if isinstance(e.code, int) else -1
        return error_for(
            code,
            str(e.msg),
            namespace=self.config.namespace,
            in_doubt=bool(getattr(e, "in_doubt", False)),
        )

    def _rows(self, res: Any) -> list[tuple[int, Any]]:
        """Per-row ``(result, record)``; raises if the batch failed as a whole.

        The client does not raise for a failed batch: it sets ``res.result``
        and leaves every row it got no answer for at NO_RESPONSE (-15). When
        every row failed transiently the call failed: raise, so the retry and
        the breaker see it (with the batch's own code, e.g. 20 for a namespace
        the server does not know).
        """
        rows = [(br.result, br.record) for br in res.batch_records]
        if rows and all(code in TRANSIENT_CODES for code, _ in rows):
            code = res.result if res.result not in (OK, BATCH_FAILED) else rows[0][0]
            in_doubt = any(br.in_doubt for br in res.batch_records)
            raise error_for(
                code, "batch failed", namespace=self.config.namespace, in_doubt=in_doubt
            )
        return rows

    def _row_failed(self, code: int) -> None:
        """A row failed: count it (a miss / a dropped write), or raise if it is a config error."""
        err = error_for(code, "batch row failed", namespace=self.config.namespace)
        if isinstance(err, ConfigError):
            raise err
        self._stats.failure("row")

    # -- connection ----------------------------------------------------------------

    def _hosts_text(self) -> str:
        return ",".join(str(h) for h in self.config.hosts)

    def _info(
        self, client: Any, command: str, sep: str, *, retry: bool = True
    ) -> list[dict[str, str]]:
        """``command`` on every node, each reply parsed into a dict (``sep`` between pairs)."""
        policy = {"timeout": self.config.connect_timeout_ms}

        def call(p: dict[str, Any]) -> Any:
            return client.info_all(command, policy=p)

        if retry:
            replies = self._round_trip("info", call, policy)
        else:
            self._stats.round_trip("info")
            try:
                replies = call(policy)
            except aerospike_exception.AerospikeError as e:
                raise self._error(e) from None
        try:
            return parse_info(command, replies, sep)
        except ValueError as e:
            raise AerospikeTransientError(str(e), -1) from None

    def _learn_limits(self, client: Any) -> RecordLimits:
        infos = self._info(client, f"namespace/{self.config.namespace}", ";")
        limits = record_limits(self.config, infos, self._hosts_text())
        if not check_ttl(self.config, infos):
            log.warning(
                "aerospike tier %r: records in %r never expire: orphan segments of crashed writers "
                "are never reclaimed and the namespace cannot evict them",
                self.name,
                self.config.namespace,
            )
        log.info(
            "aerospike tier %r: max-record-size %d, segments of %d bytes (%s)",
            self.name,
            limits.max_record_size,
            limits.segment_size,
            limits.source,
        )
        return limits

    def _relearn_limits(self) -> None:
        with self._lock:
            client = self._client
        if client is None:
            return
        try:
            limits = self._learn_limits(client)
        except (TransientError, ConfigError) as e:
            log.debug("aerospike tier %r: cannot re-read limits: %s", self.name, e)
            return
        with self._lock:
            self._limits = limits

    def _connect_by(self, deadline: float | None) -> None:
        """:meth:`connect`, but waiting no later than ``deadline``.

        Connecting (bounded by ``connect_timeout_ms`` per seed and info call)
        can take longer than a caller's deadline allows, so with a deadline a
        missing connection is made on a background thread — one attempt at a
        time, shared by every caller — and the caller waits for it only until
        its deadline. A later call finds the connection made, or its error.

        Raises:
            DeadlineExceededError: still connecting at the deadline.
            TransientError, ConfigError: as :meth:`connect`.
        """
        if deadline is None:
            self.connect()
            return
        if self._client is not None and self._limits is not None:
            return
        with self._connecting_lock:
            attempt = self._connecting
            if attempt is None:
                attempt = self._connecting = _ConnectAttempt()
                threading.Thread(
                    target=self._connect_in_background,
                    args=(attempt,),
                    name=f"aerospike-connect-{self.name}",
                    daemon=True,
                ).start()
        if not attempt.done.wait(max(0.0, deadline - time.monotonic())):
            raise DeadlineExceededError(
                f"aerospike tier {self.name!r}: still connecting to {self._hosts_text()} at the deadline"
            )
        if attempt.error is not None:
            raise attempt.error

    def _connect_in_background(self, attempt: _ConnectAttempt) -> None:
        try:
            self.connect()
        except Exception as e:  # handed to the waiting callers, who raise it
            attempt.error = e
        finally:
            with self._connecting_lock:
                self._connecting = None
            attempt.done.set()

    # -- keys ----------------------------------------------------------------------

    def _akey(self, key: bytes) -> tuple[str, str, bytearray]:
        # NOTE: a bytearray, never bytes: the Python client hashes a ``bytes`` key
        # as a C string (type STRING, cut at the first NUL byte), so random
        # 16-byte keys would collide; a bytearray is hashed whole as a BLOB key.
        return (self.config.namespace, self.config.set_name, bytearray(key))

    # -- reads ---------------------------------------------------------------------

    def _read_rows(
        self,
        client: Any,
        op: str,
        keys: list[bytes],
        bins: list[str] | None,
        policy: dict[str, Any],
        deadline: float | None = None,
    ) -> list[tuple[int, Any]]:
        """Batch-read ``keys`` (chunks of ``max_batch_keys``); per key ``(result, record)``."""
        out: list[tuple[int, Any]] = []
        step = self.config.max_batch_keys
        for start in range(0, len(keys), step):
            out += self._batch_read(client, op, keys[start : start + step], bins, policy, deadline)
        return out

    def _batch_read(
        self,
        client: Any,
        op: str,
        keys: list[bytes],
        bins: list[str] | None,
        policy: dict[str, Any],
        deadline: float | None,
    ) -> list[tuple[int, Any]]:
        akeys = [self._akey(k) for k in keys]
        if bins is None:
            return self._round_trip(
                op, lambda p: self._rows(client.batch_read(akeys, policy=p)), policy, deadline
            )
        return self._round_trip(
            op, lambda p: self._rows(client.batch_read(akeys, bins, policy=p)), policy, deadline
        )

    def _contains(self, client: Any, keys: list[bytes], deadline: float | None) -> list[bool]:
        found = []
        for code, _ in self._read_rows(client, "contains", keys, [], self._exists_policy, deadline):
            if code not in (OK, NOT_FOUND):
                self._row_failed(code)
            found.append(code == OK)
        return found

    def _get(self, client: Any, keys: list[bytes], deadline: float | None) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(keys)
        manifests: list[tuple[int, Manifest, int]] = []  # every manifest found
        pending: list[tuple[int, Manifest, int]] = []  # ... whose segments are still to read
        broken: list[tuple[bytes, int, Manifest | None]] = []
        guess = self._segment_guess
        spec = self._speculated(len(keys), guess)
        # NOTE: for the first `spec` keys the batch also asks for the segments a writer
        # with the canonical nonce made (as many as the last manifest this tier saw):
        # a block written that way comes back in this one round trip.
        read_keys: list[bytes] = []
        at: list[int] = []
        for i, key in enumerate(keys):
            at.append(len(read_keys))
            read_keys.append(key)
            if i < spec:
                nonce = canonical_nonce(key)
                read_keys += [segment_key(key, nonce, j) for j in range(guess)]
        rows = self._read_rows(client, "get", read_keys, None, self._read_policy, deadline)
        for i, key in enumerate(keys):
            code, record = rows[at[i]]
            if code == NOT_FOUND:
                continue
            if code != OK:
                self._row_failed(code)
                continue
            _, meta, bins = record
            bins = bins or {}
            gen = int(meta.get("gen", 0)) if meta else 0
            if BIN_BLOCK in bins:
                out[i] = bytes(bins[BIN_BLOCK])
            elif BIN_MANIFEST in bins:
                try:
                    m = Manifest.decode(bins[BIN_MANIFEST])
                except ManifestError as e:
                    log.warning("aerospike tier %r: bad manifest (%s); deleting it", self.name, e)
                    broken.append((key, gen, None))
                    continue
                manifests.append((i, m, gen))
                self._segment_guess = m.n_segments
                if i < spec and m.nonce == canonical_nonce(key) and m.n_segments <= guess:
                    start = at[i] + 1
                    parts = rows[start : start + m.n_segments]
                    self._take_segments(key, i, m, gen, parts, out, broken)
                else:
                    pending.append((i, m, gen))
            else:
                broken.append((key, gen, None))
        if pending:
            self._read_segments(client, keys, pending, out, broken, deadline)
        if broken:
            self._cleanup_broken(client, broken, deadline)
        if self.config.recency == "touch":
            self._touch_hits(client, keys, out, manifests, deadline)
        return out

    def _speculated(self, n_keys: int, guess: int) -> int:
        """How many leading keys of a get also ask for ``guess`` canonical segments: as many
        as one batch of ``max_batch_bytes`` and ``max_batch_keys`` holds."""
        limits = self._limits
        if not guess or limits is None:
            return 0
        by_bytes = self.config.max_batch_bytes // (guess * limits.segment_size)
        by_rows = self.config.max_batch_keys // (guess + 1)
        return min(n_keys, by_bytes, by_rows)

    def _read_segments(
        self,
        client: Any,
        keys: list[bytes],
        manifests: list[tuple[int, Manifest, int]],
        out: list[bytes | None],
        broken: list[tuple[bytes, int, Manifest | None]],
        deadline: float | None,
    ) -> None:
        """Read the segments of every manifest, as few batches as ``max_batch_bytes`` allows
        (all within the one ``deadline``)."""
        groups: list[list[tuple[int, Manifest, int]]] = [[]]
        size = rows = 0
        for entry in manifests:
            m = entry[1]
            if groups[-1] and (
                size + m.length > self.config.max_batch_bytes
                or rows + m.n_segments > self.config.max_batch_keys
            ):
                groups.append([])
                size = rows = 0
            groups[-1].append(entry)
            size += m.length
            rows += m.n_segments
        for group in groups:
            seg_keys = [k for i, m, _ in group for k in m.segment_keys(keys[i])]
            results = self._read_rows(
                client,
                "get_segments",
                seg_keys,
                [BIN_SEGMENT, BIN_TAG],
                self._read_policy,
                deadline,
            )
            pos = 0
            for i, m, gen in group:
                parts = results[pos : pos + m.n_segments]
                pos += m.n_segments
                self._take_segments(keys[i], i, m, gen, parts, out, broken)

    def _take_segments(
        self,
        key: bytes,
        i: int,
        m: Manifest,
        gen: int,
        part_rows: list[tuple[int, Any]],
        out: list[bytes | None],
        broken: list[tuple[bytes, int, Manifest | None]],
    ) -> None:
        """The block of manifest ``m`` from its segments' rows into ``out[i]``, or a miss.

        Missing or wrong segments make the manifest broken (cleaned up); a transient
        row failure is a miss without cleanup (the manifest may be fine).
        """
        parts: list[bytes | bytearray] = []
        tags: list[bytes | bytearray | None] = []
        missing = failed = False
        for code, record in part_rows:
            if code == OK and record[2] and BIN_SEGMENT in record[2]:
                parts.append(record[2][BIN_SEGMENT])  # joined once by assemble: no copy here
                tags.append(record[2].get(BIN_TAG))
            elif code in (OK, NOT_FOUND):
                missing = True
            else:
                self._row_failed(code)
                failed = True
        if failed:
            return
        block = None if missing else m.assemble(parts, tags)
        if block is None:
            # NOTE: info, not warning: a manifest whose segments are still in flight is
            # one of these, and the cleanup spares it (cleanup_grace_s).
            log.info(
                "aerospike tier %r: manifest with %s segments; a miss, removed if older than %gs",
                self.name,
                "missing" if missing else "wrong",
                self.config.cleanup_grace_s,
            )
            broken.append((key, gen, m))
            return
        out[i] = block
        self._stats.segmented("get")

    def _cleanup_broken(
        self,
        client: Any,
        broken: list[tuple[bytes, int, Manifest | None]],
        deadline: float | None = None,
    ) -> None:
        """Delete broken manifests (only if unchanged since read) and the segments they name.

        Best effort, within the read's ``deadline``: a failure (or no time
        left) is logged and counted, never raised (the read is already
        answered); the next reader cleans up instead.
        """
        records = []
        for key, gen, m in broken:
            self._stats.broken_manifest()
            records.append(self._remove_stale(key, gen))
            if m is not None:
                records += [self._remove_stale(k) for k in m.segment_keys(key)]
        try:
            self._write_batch(client, "cleanup", records, deadline)
        except TransientError as e:
            self._stats.failure("row")
            log.debug("aerospike tier %r: cleanup failed: %s", self.name, e)

    def _touch_hits(
        self,
        client: Any,
        keys: list[bytes],
        out: list[bytes | None],
        manifests: list[tuple[int, Manifest, int]],
        deadline: float | None = None,
    ) -> None:
        """Explicit recency refresh (``recency: touch``): one batch touch of hit records.

        Best effort, within the read's ``deadline``."""
        touch = [keys[i] for i, block in enumerate(out) if block is not None]
        touch += [k for i, m, _ in manifests if out[i] is not None for k in m.segment_keys(keys[i])]
        if not touch:
            return
        akeys = [self._akey(k) for k in touch]
        try:
            self._round_trip(
                "touch",
                lambda p: client.batch_operate(
                    akeys, [as_ops.touch()], policy_batch=p, policy_batch_write={"ttl": self._ttl}
                ),
                self._write_policy,
                deadline,
            )
        except (TransientError, ConfigError) as e:
            self._stats.failure("row")
            log.debug("aerospike tier %r: touch failed: %s", self.name, e)

    # -- writes ----------------------------------------------------------------------

    def _write_batch(
        self, client: Any, op: str, records: list[tuple[Any, int]], deadline: float | None = None
    ) -> list[int]:
        """``batch_write`` of ``(record, payload bytes)`` pairs, in chunks bounded by
        ``max_batch_bytes`` and ``max_batch_keys`` (the server drops requests over 128 MiB);
        the result code of every record. ``deadline``: only for best-effort writes of a read."""
        codes: list[int] = []
        chunk: list[Any] = []
        size = 0
        limit, max_rows = self.config.max_batch_bytes, self.config.max_batch_keys

        def flush() -> None:
            batch = BatchRecords(list(chunk))
            rows = self._round_trip(
                op,
                lambda p: self._rows(client.batch_write(batch, policy_batch=p)),
                self._write_policy,
                deadline,
            )
            codes.extend(code for code, _ in rows)

        for rec, payload in records:
            rec_size = _ROW_OVERHEAD + payload
            if chunk and (size + rec_size > limit or len(chunk) >= max_rows):
                flush()
                chunk, size = [], 0
            chunk.append(rec)
            size += rec_size
        if chunk:
            flush()
        return codes

    def _write_record(self, row: _Row) -> tuple[Any, int]:
        policy = {
            "create": self._create_row,
            "upsert": self._replace_row,
            "replace": self._replace_only_row,
        }[row.mode]
        ops = [as_ops.write(row.bin, row.data)]
        if row.tag is not None:
            ops.append(as_ops.write(BIN_TAG, row.tag))
        return Write(self._akey(row.key), ops, policy=policy), len(row.data)

    def _remove_record(self, key: bytes, generation: int | None = None) -> tuple[Any, int]:
        """A remove of a record this put wrote itself (no conditions)."""
        if generation is None:
            return Remove(self._akey(key)), 0
        return Remove(
            self._akey(key), policy={"gen": aerospike.POLICY_GEN_EQ, "generation": generation}
        ), 0

    def _remove_stale(self, key: bytes, generation: int | None = None) -> tuple[Any, int]:
        """A reader's remove of another writer's record: only if unchanged since read
        (``generation``) and, with ``cleanup_grace_s``, not written within it (the server's
        clock: its write may still be in flight)."""
        policy: dict[str, Any] = {}
        if generation is not None:
            policy.update(gen=aerospike.POLICY_GEN_EQ, generation=generation)
        if self._stale_filter is not None:
            policy["expressions"] = self._stale_filter
        return Remove(self._akey(key), policy=policy or None), 0

    def _put(self, client: Any, items: list[tuple[bytes, bytes]]) -> list[bool]:
        limits = self._limits
        assert limits is not None
        held = [False] * len(items)
        dropped: set[int] = set()
        segmented: dict[int, Manifest] = {}
        rows: list[_Row] = []
        skip = self._held_complete(client, items) if self.config.skip_existing else set()
        for i, (key, block) in enumerate(items):
            if i in skip:
                held[i] = True
            elif len(block) <= limits.segment_size:
                rows.append(_Row(i, key, BIN_BLOCK, block, "create"))
            else:
                m = Manifest.for_block(block, limits.segment_size, nonce=canonical_nonce(key))
                segmented[i] = m
                rows += self._segment_rows(i, key, block, m, "create")
                rows.append(_Row(i, key, BIN_MANIFEST, m.encode(), "create"))

        # One request: single records, and every segment followed by the manifest naming it,
        # all create-only under the canonical nonce. A reader that finds the manifest before
        # its segments landed misses (and cleans up only after cleanup_grace_s).
        landed, too_big = self._write_rows(client, rows, held, dropped)
        orphans: list[bytes] = []
        taken: list[int] = []
        raced: list[int] = []
        for i, m in segmented.items():
            got = landed[i]
            if got.manifest == OK:
                if got.failed:  # our manifest names a segment that did not land
                    orphans += [items[i][0], *got.created]
                elif got.taken:  # canonical keys not all ours: kept only if they hold our bytes
                    taken.append(i)
                else:
                    held[i] = True
                    self._segment_guess = m.n_segments
                    self._stats.segmented("put")
            elif got.manifest == EXISTS:
                if got.created:
                    raced.append(i)
                else:
                    held[i] = True  # nothing of ours landed: the chunk is another writer's
            elif got.manifest in (STOP_WRITES, TOO_BIG):
                orphans += got.created  # the manifest did not land
            # else: the manifest is in doubt: the segments are left to their TTL rather
            # than deleted under a manifest that may have landed.
        if taken:
            taken = self._not_ours(client, items, segmented, landed, taken, held)
        if taken:
            again_too_big = self._move_to_random_nonces(
                client, items, segmented, landed, taken, held, dropped, orphans
            )
            too_big = too_big or again_too_big
        if raced:
            lost, unheld = self._lost_races(client, items, segmented, landed, raced)
            orphans += lost
            for i in raced:
                held[i] = i not in unheld and not landed[i].failed
        if orphans:
            self._remove_orphans(client, orphans)
        if dropped:
            self._stats.stop_writes_drop(len(dropped))
        if too_big:
            self._relearn_limits()
            raise error_for(TOO_BIG, "record too big", namespace=self.config.namespace)
        return held

    def _not_ours(
        self,
        client: Any,
        items: list[tuple[bytes, bytes]],
        segmented: dict[int, Manifest],
        landed: dict[int, _Landed],
        taken: list[int],
        held: list[bool],
    ) -> list[int]:
        """Of the blocks whose manifest landed but some of whose canonical segment keys
        already held records, the ones where those records are not this block's bytes.

        One batch read of those segments: a concurrent writer of the same bytes (engines
        often compute identical KV) made them, and the block is complete as it is; other
        bytes (another writer's, a dead writer's) or no answer: not ours. The others are
        held.
        """
        keys: list[bytes] = []
        want: list[tuple[int, bytes]] = []  # (item, expected bytes) per key read
        for i in taken:
            key, block = items[i]
            m = segmented[i]
            seg_keys = m.segment_keys(key)
            size = m.segment_size
            for j in landed[i].taken:
                keys.append(seg_keys[j])
                want.append((i, block[j * size : (j + 1) * size]))
        try:
            rows = self._read_rows(
                client, "put_check_segments", keys, [BIN_SEGMENT, BIN_TAG], self._exists_policy
            )
        except TransientError as e:
            log.debug("aerospike tier %r: cannot read taken segments: %s", self.name, e)
            return taken
        differ: set[int] = set()
        for (i, expected), (code, record) in zip(want, rows, strict=True):
            bins = record[2] if code == OK and record else None
            # NOTE: a kind-2 reader checks tags, not bytes: the same bytes under another
            # block's tag (two blocks that agree in a segment) would make ours unreadable.
            if (
                not bins
                or bins.get(BIN_SEGMENT) != expected
                or bins.get(BIN_TAG) != segmented[i].tag
            ):
                differ.add(i)
        for i in taken:
            if i not in differ:
                held[i] = True
                self._segment_guess = segmented[i].n_segments
                self._stats.segmented("put")
        return [i for i in taken if i in differ]

    def _move_to_random_nonces(
        self,
        client: Any,
        items: list[tuple[bytes, bytes]],
        segmented: dict[int, Manifest],
        landed: dict[int, _Landed],
        taken: list[int],
        held: list[bool],
        dropped: set[int],
        orphans: list[bytes],
    ) -> bool:
        """Our manifest landed but some canonical segment keys held other bytes (another
        writer's, a dead writer's): write the segments again under a random nonce no one else
        can name and replace our manifest with one naming them, in one request.

        Then no manifest names the chunk's canonical segments: all of them are removed, the
        ones this put created and the ones it found (every row a concurrent writer created
        landed before ours found it; that writer, seeing our canonical manifest with
        another checksum, leaves them to us). Returns whether a record was too big."""
        rows: list[_Row] = []
        canonical: dict[int, list[bytes]] = {}
        for i in taken:
            key, block = items[i]
            canonical[i] = segmented[i].segment_keys(key)
            segmented[i] = replace(segmented[i], nonce=os.urandom(NONCE_BYTES))
            rows += self._segment_rows(i, key, block, segmented[i], "upsert")
            rows.append(_Row(i, key, BIN_MANIFEST, segmented[i].encode(), "replace"))
        again, too_big = self._write_rows(client, rows, held, dropped)
        for i in taken:
            got = again[i]
            if got.manifest == OK and not got.failed:
                orphans += canonical[i]
                held[i] = True
                self._stats.segmented("put")
            elif got.manifest == NOT_FOUND:  # ours is gone (evicted): nothing names these
                orphans += got.created
            else:  # remove ours: a manifest naming segments that are not all there
                orphans += [items[i][0], *got.created]
        return too_big

    @staticmethod
    def _segment_rows(i: int, key: bytes, block: bytes, m: Manifest, mode: str) -> list[_Row]:
        tag = m.tag
        return [
            _Row(i, seg_key, BIN_SEGMENT, part, mode, j, tag)
            for j, (seg_key, part) in enumerate(
                zip(m.segment_keys(key), m.split(block), strict=True)
            )
        ]

    def _write_rows(
        self, client: Any, rows: list[_Row], held: list[bool], dropped: set[int]
    ) -> tuple[dict[int, _Landed], bool]:
        """One batch write of single records, segments and manifests (split only by
        ``max_batch_bytes`` / ``max_batch_keys``); single records' results into ``held`` and
        ``dropped``.

        Returns what landed of each segmented item, and whether a record was too big.
        """
        landed: dict[int, _Landed] = {}
        if not rows:
            return landed, False
        codes = self._write_batch(client, "put", [self._write_record(r) for r in rows])
        too_big = False
        for row, code in zip(rows, codes, strict=True):
            got = landed.setdefault(row.index, _Landed()) if row.bin != BIN_BLOCK else None
            if got is not None and row.bin == BIN_MANIFEST:
                got.manifest = code
            if code == OK or (code == EXISTS and row.bin != BIN_SEGMENT):
                if got is None:
                    held[row.index] = True
                elif row.bin == BIN_SEGMENT:
                    got.created.append(row.key)
                continue
            if got is not None and row.bin == BIN_SEGMENT:
                if code == EXISTS:
                    got.taken.append(row.part)
                    continue
                got.failed = True
            if code == STOP_WRITES:
                dropped.add(row.index)
            elif code == TOO_BIG:
                too_big = True
            elif not (code == NOT_FOUND and row.mode == "replace"):
                self._row_failed(code)
        return landed, too_big

    def _held_complete(self, client: Any, items: list[tuple[bytes, bytes]]) -> set[int]:
        """Indices of ``items`` the namespace already holds complete (see the module docstring).

        Two small round trips at most, no block bytes: the chunk keys' manifest
        bin, then the existence of the found manifests' segments. A row that
        fails, or a key in doubt, is written. Counts what it skips.
        """
        keys = [k for k, _ in items]
        rows = self._read_rows(client, "put_check", keys, [BIN_MANIFEST], self._exists_policy)
        held: set[int] = set()
        manifests: list[tuple[int, Manifest, int]] = []
        broken: list[tuple[bytes, int, Manifest | None]] = []
        for i, (code, record) in enumerate(rows):
            if code != OK:
                continue  # not there (or unknown): write it
            _, meta, bins = record
            gen = int(meta.get("gen", 0)) if meta else 0
            raw = (bins or {}).get(BIN_MANIFEST)
            if raw is None:
                held.add(i)  # a single-record block: records are written whole
                continue
            try:
                manifests.append((i, Manifest.decode(raw), gen))
            except ManifestError:
                broken.append((keys[i], gen, None))
        if manifests:
            seg_keys = [k for i, m, _ in manifests for k in m.segment_keys(keys[i])]
            seg_rows = self._read_rows(
                client, "put_check_segments", seg_keys, [], self._exists_policy
            )
            pos = 0
            for i, m, gen in manifests:
                codes = [code for code, _ in seg_rows[pos : pos + m.n_segments]]
                pos += m.n_segments
                if all(code == OK for code in codes):
                    held.add(i)
                elif all(code in (OK, NOT_FOUND) for code in codes):
                    broken.append((keys[i], gen, m))  # segments evicted: remove, write again
        if broken:
            self._cleanup_broken(client, broken)
        if held:
            self._stats.skipped_puts(len(held))
            if self._metrics is not None:
                self._metrics.put_skipped(self.name, len(held), sum(len(items[i][1]) for i in held))
        return held

    def _lost_races(
        self,
        client: Any,
        items: list[tuple[bytes, bytes]],
        segmented: dict[int, Manifest],
        landed: dict[int, _Landed],
        raced: list[int],
    ) -> tuple[list[bytes], list[int]]:
        """After "record exists" on manifests of blocks some of whose segments this put
        created: the segments safe to delete, and the items the namespace does not hold.

        Another writer's manifest (a random nonce) won: our segments are orphans, the
        key is held. A manifest with the canonical nonce and our checksum names the same
        bytes (another writer of the same block, or our own in-doubt attempt that had
        landed): the segments we created are part of it, the key is held. With the
        canonical nonce and another checksum our put did not store the block; our
        segments stay: a concurrent writer whose manifest that is reads back the keys it
        did not create, keeps those holding its own bytes (ours may, where the blocks
        agree) and otherwise moves to a random nonce and removes every canonical segment;
        an older writer's manifest whose segments were evicted now names bytes that fail
        its checksum, and a reader removes it and them after the grace. A manifest gone
        by the time we read it: not held.
        """
        try:
            rows = self._read_rows(
                client,
                "put_manifests",
                [items[i][0] for i in raced],
                [BIN_MANIFEST],
                self._exists_policy,
            )
        except TransientError as e:
            log.debug("aerospike tier %r: cannot check raced manifests: %s", self.name, e)
            return [], []
        lost: list[bytes] = []
        unheld: list[int] = []
        for i, (code, record) in zip(raced, rows, strict=True):
            if code != OK:
                unheld.append(i)  # gone again, or unknown: leave our segments to their TTL
                continue
            bins = record[2] or {}
            raw = bins.get(BIN_MANIFEST)
            try:
                theirs = Manifest.decode(raw) if raw is not None else None
            except ManifestError:
                theirs = None
            ours = segmented[i]
            if theirs is None or theirs.nonce != ours.nonce:
                lost += landed[i].created
            elif not theirs.same_block(ours):
                unheld.append(i)
        return lost, unheld

    def _remove_orphans(self, client: Any, keys: list[bytes]) -> None:
        """Delete segment records no manifest will name. Best effort; TTL reclaims what fails."""
        try:
            codes = self._write_batch(client, "cleanup", [self._remove_record(k) for k in keys])
        except (TransientError, ConfigError) as e:
            log.debug("aerospike tier %r: orphan cleanup failed: %s", self.name, e)
            return
        self._stats.orphan_cleanup(sum(1 for c in codes if c == OK))

    # -- delete --------------------------------------------------------------------

    def _delete(self, client: Any, keys: list[bytes]) -> int:
        records: list[tuple[Any, int]] = []
        is_primary: list[bool] = []
        rows = self._read_rows(client, "delete", keys, [BIN_MANIFEST], self._exists_policy)
        for key, (code, record) in zip(keys, rows, strict=True):
            if code == NOT_FOUND:
                continue
            if code != OK:
                self._row_failed(code)
                continue
            records.append(self._remove_record(key))
            is_primary.append(True)
            raw = (record[2] or {}).get(BIN_MANIFEST)
            if raw is None:
                continue
            try:
                segment_keys = Manifest.decode(raw).segment_keys(key)
            except ManifestError as e:
                log.debug("aerospike tier %r: deleting a bad manifest (%s)", self.name, e)
                continue
            records += [self._remove_record(k) for k in segment_keys]
            is_primary += [False] * len(segment_keys)
        if not records:
            return 0
        removed = 0
        for primary, code in zip(
            is_primary, self._write_batch(client, "delete", records), strict=True
        ):
            if code == OK:
                removed += primary
            elif code != NOT_FOUND:
                self._row_failed(code)
        return removed
