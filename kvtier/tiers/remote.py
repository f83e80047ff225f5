"""The remote tier: a kvtier cache server (``kvtier serve``) as a tier of an engine's store.

One gRPC channel per tier (HTTP/2 multiplexes every call over it), a deadline
on every call, bounded retries of transient failures, and a circuit breaker
that makes calls fail fast (:class:`~kvtier.errors.TierUnavailableError`)
while the server is down, so the store serves from the tiers above and
recomputes the rest. How gRPC statuses map onto kvtier errors:
:mod:`kvtier.tiers.remote_errors`.

On first use the tier asks the server's Health for its limits (largest block,
keys per call, frame size), its data plane, and checks the protocol version
and the token; every later call stays within those limits, splitting batches
as needed. ``prefix_length`` is one Lookup call (per ``max_keys_per_call`` keys).

**Two planes.** Block bytes of ``get`` and ``put`` travel over the server's
bulk data plane when it advertises one (:mod:`kvtier.tiers.remote_dataplane`:
plain TCP or TLS, no protobuf or HTTP/2 framing, a fraction of gRPC's CPU per
byte); everything else, and Get/Put whenever the data plane cannot be
reached, goes over gRPC. A data plane that cannot be reached is left alone
for ``breaker_reset_s`` (Get/Put use gRPC meanwhile) and counted in
:meth:`RemoteTier.transport`. Both planes share the retries and the breaker.

**Write dedup.** Blocks are content-addressed, so ``put`` first asks the
server which keys it already holds (one Exists call per ``max_keys_per_call``
keys) and sends only the others (``skip_existing``, on by default); the
skipped ones count in ``kvtier_tier_puts_skipped_total``. The server answers
Exists from the slots this tenant reads, so a trusted writer is never told
that an untrusted writer's block holds its key. A token of role reader
sends no puts (they would be refused).

**Bad blocks.** ``report_bad`` (the store's answer to a corrupt block, and
sampled verification's to a mismatch) is a Delete marked
``failed_verification``: the server deletes the block even for a reader and
counts it against the writer that stored it.

**Deadlines.** ``get``, ``contains`` and ``prefix_length`` take an optional
``deadline`` (a :func:`time.monotonic` instant) for the whole call: the
``Health`` asked on first use, every batch of ``max_keys_per_call`` keys,
every retry and backoff, and a data-plane attempt together with its gRPC
fallback. Each gRPC call gets ``timeout=`` the smaller of its configured
timeout and what is left; the data plane bounds connecting, the handshake
and every socket read and write by what is left; a retry starts only if more
than :data:`MIN_ATTEMPT_S` is left after its backoff. A deadline already past
raises :class:`~kvtier.errors.DeadlineExceededError` without I/O. gRPC ends a
call at its deadline; a data-plane read may overrun by up to a tenth of
the time that was left when it started (its socket timeout is re-armed
only when it drifts by more than 10 %).

Blocks are not verified here (``verifies_reads = False``): the store verifies
what a non-verifying tier returns, and deletes a corrupt block.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import grpc

from kvtier.breaker import CircuitBreaker
from kvtier.errors import (
    ConfigError,
    DeadlineExceededError,
    TierUnavailableError,
    TransientError,
)
from kvtier.metrics import StoreMetrics
from kvtier.retry import ExponentialBackoff, Retry
from kvtier.tiers.base import Tier, TierUsage
from kvtier.tiers.remote_config import RemoteTierConfig
from kvtier.tiers.remote_dataplane import DataPlaneClient
from kvtier.tiers.remote_errors import (
    DataPlaneUnavailableError,
    RemoteAuthError,
    RemoteProtocolError,
    RemoteRetryableError,
    map_rpc_error,
)
from kvtier.tiers.remote_planes import PlaneSelector, TransportCounts
from kvtier.wire import PROTOCOL_VERSION
from kvtier.wire import kvtier_cache_pb2 as pb
from kvtier.wire.dataplane import DATA_PROTOCOL_VERSION
from kvtier.wire.frames import (
    FrameError,
    FrameParts,
    batches,
    decode_get_batch,
    put_frame,
)
from kvtier.wire.transport import CLIENT_MAX_RECEIVE, channel_options, method

T = TypeVar("T")

log = logging.getLogger(__name__)

_LIMIT_CODES = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT})

MIN_ATTEMPT_S = 0.002
"""With a deadline, a call (or a retry) starts only if more than this is left."""


def _timeout(configured: float, deadline: float | None) -> float:
    """Seconds one gRPC call may take: ``configured``, cut to what is left before ``deadline``."""
    if deadline is None:
        return configured
    return max(0.001, min(configured, deadline - time.monotonic()))


def _identity(b: bytes) -> bytes:
    return b


def _read_ca(config: RemoteTierConfig) -> bytes | None:
    if config.ca_file is None:
        return None
    try:
        return config.ca_file.read_bytes()
    except OSError as e:
        raise ConfigError(
            f"tiers[{config.name}].ca_file: cannot read {config.ca_file}: {e.strerror or e}"
        ) from None


def open_channel(config: RemoteTierConfig) -> grpc.Channel:
    """A channel to the server (connects lazily, reconnects by itself).

    Reconnection backoff is capped at the breaker's cool-down, so when the
    breaker lets a probe through after an outage the channel is already
    trying to connect again (gRPC's default cap is two minutes).
    """
    reconnect_ms = max(100, int(config.breaker_reset_s * 1000))
    options = [
        *channel_options(CLIENT_MAX_RECEIVE),
        ("grpc.initial_reconnect_backoff_ms", min(200, reconnect_ms)),
        ("grpc.min_reconnect_backoff_ms", min(200, reconnect_ms)),
        ("grpc.max_reconnect_backoff_ms", reconnect_ms),
    ]
    if config.server_name:
        options.append(("grpc.ssl_target_name_override", config.server_name))
    if config.uses_tls:
        creds = grpc.ssl_channel_credentials(root_certificates=_read_ca(config))
        return grpc.secure_channel(
            config.address, creds, options=options, compression=grpc.Compression.NoCompression
        )
    return grpc.insecure_channel(
        config.address, options=options, compression=grpc.Compression.NoCompression
    )


class RemoteTier(Tier):
    """A :class:`Tier` backed by a kvtier cache server.

    Args:
        config: Address, token, timeouts, retry and breaker settings.
        env: Where ``token_env`` is read (``os.environ`` by default).
        breaker: Injected for tests; built from ``config`` if ``None``.

    Raises:
        ConfigError: the token variable is unset or the CA file unreadable.

    Thread-safe. Network failures raise :class:`~kvtier.errors.TransientError`
    (:class:`~kvtier.errors.TierUnavailableError` while the breaker is open);
    a refused token raises :class:`RemoteAuthError` and a protocol mismatch
    :class:`RemoteProtocolError`, both :class:`~kvtier.errors.ConfigError`.
    """

    fast = False
    verifies_reads = False

    def __init__(
        self,
        config: RemoteTierConfig,
        *,
        env: Mapping[str, str] | None = None,
        breaker: CircuitBreaker | None = None,
        metrics: StoreMetrics | None = None,
    ) -> None:
        self.name = config.name
        self.config = config
        token = config.resolve_token(env)
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        self._channel = open_channel(config)
        ch = self._channel
        keys_req = pb.KeysRequest.SerializeToString
        self._lookup = ch.unary_unary(
            method("Lookup"),
            request_serializer=keys_req,
            response_deserializer=pb.LookupResponse.FromString,
        )
        self._exists = ch.unary_unary(
            method("Exists"),
            request_serializer=keys_req,
            response_deserializer=pb.ExistsResponse.FromString,
        )
        self._get = ch.unary_stream(
            method("Get"), request_serializer=keys_req, response_deserializer=_identity
        )
        self._put = ch.stream_unary(
            method("Put"),
            request_serializer=_identity,
            response_deserializer=pb.PutResponse.FromString,
        )
        self._delete = ch.unary_unary(
            method("Delete"),
            request_serializer=keys_req,
            response_deserializer=pb.DeleteResponse.FromString,
        )
        self._stats = ch.unary_unary(
            method("Stats"),
            request_serializer=pb.StatsRequest.SerializeToString,
            response_deserializer=pb.StatsResponse.FromString,
        )
        self._health = ch.unary_unary(
            method("Health"),
            request_serializer=pb.HealthRequest.SerializeToString,
            response_deserializer=pb.HealthResponse.FromString,
        )
        self.breaker = (
            breaker
            if breaker is not None
            else CircuitBreaker(config.breaker_failures, config.breaker_reset_s)
        )
        self._retry = Retry(
            ExponentialBackoff(base=config.retry_backoff_s, cap=config.retry_backoff_cap_s),
            config.retries,
            errors=(RemoteRetryableError,),
            min_attempt=MIN_ATTEMPT_S,
        )
        self._limits: pb.Limits | None = None
        self._role = ""  # the tenant's role, from Health (a reader's puts are not sent)
        self._limits_lock = threading.Lock()
        fallback = None
        if metrics is not None:
            counter = metrics.tier_errors.labels(config.name, "data_plane_fallback")
            fallback = counter.inc
        self._planes = PlaneSelector(
            config, token, on_limit_refusal=self._forget_limits, on_fallback=fallback
        )
        self._usage = TierUsage(0, None, None)
        self._usage_at = -float("inf")
        self._metrics = metrics
        self.skipped_writes = 0

    # -- plumbing ----------------------------------------------------------------

    def _call(self, op: str, fn: Callable[[], T], deadline: float | None = None) -> T:
        """Run one logical call: breaker check, retried attempts, breaker verdict.

        With a ``deadline``, no attempt starts after it (``fn`` bounds each
        attempt by what is left), and a deadline already past raises
        :class:`~kvtier.errors.DeadlineExceededError` without I/O.
        """
        if deadline is not None and time.monotonic() >= deadline:
            raise DeadlineExceededError(f"remote tier {self.name!r}: {op}: the deadline has passed")
        if not self.breaker.allow():
            raise TierUnavailableError(
                f"remote tier {self.name!r}: circuit breaker open "
                f"({self.breaker.retry_after():.1f} s before the next probe)"
            )

        def attempt() -> T:
            try:
                return fn()
            except grpc.RpcError as e:
                if e.code() in _LIMIT_CODES:
                    # A server restarted with other limits: ask Health again next time.
                    self._forget_limits()
                raise map_rpc_error(e, self.name, op) from None

        try:
            result = self._retry.call(attempt, deadline=deadline)
        except DeadlineExceededError:
            self.breaker.release()  # the caller ran out of time: no verdict on the server
            raise
        except TransientError:
            self.breaker.record_failure()
            raise
        except BaseException:
            self.breaker.release()
            raise
        self.breaker.record_success()
        return result

    def limits(self, deadline: float | None = None) -> pb.Limits:
        """The server's limits, from its Health answer (asked once, then kept).

        ``deadline``: bounds the Health call when the limits must be asked.

        Raises:
            RemoteAuthError: the server refuses the token, or needs one and none is set.
            RemoteProtocolError: the server speaks another protocol version.
        """
        with self._limits_lock:
            if self._limits is not None:
                return self._limits
        health = self.health(deadline)
        if health.protocol_version != PROTOCOL_VERSION:
            raise RemoteProtocolError(
                f"remote tier {self.name!r}: server speaks protocol {health.protocol_version}, "
                f"this client {PROTOCOL_VERSION}"
            )
        if not health.tenant:
            raise RemoteAuthError(
                f"remote tier {self.name!r}: the server at {self.config.address} needs a token "
                "(set token_env or token)"
            )
        lim = health.limits
        if not (lim.chunk_size and lim.max_keys_per_call and lim.max_block_size):
            raise RemoteProtocolError(f"remote tier {self.name!r}: server sent no limits")
        speaks = health.data_protocol_version == DATA_PROTOCOL_VERSION
        self._planes.advertised(int(health.data_port) if speaks else 0)
        with self._limits_lock:
            self._limits = lim
            self._role = health.role
        return lim

    def _forget_limits(self) -> None:
        """Ask Health again on the next call (the server may have restarted with other settings)."""
        with self._limits_lock:
            self._limits = None

    def health(self, deadline: float | None = None) -> pb.HealthResponse:
        """The server's Health answer (status, version, limits, who we are)."""
        return self._call(
            "health",
            lambda: self._health(
                pb.HealthRequest(),
                timeout=_timeout(self.config.timeout_s, deadline),
                metadata=self._metadata,
            ),
            deadline,
        )

    def server_stats(self) -> pb.StatsResponse:
        """The server's Stats answer (every tenant if our role is admin)."""
        return self._call(
            "stats",
            lambda: self._stats(
                pb.StatsRequest(), timeout=self.config.timeout_s, metadata=self._metadata
            ),
        )

    def _batches(self, n: int, deadline: float | None = None) -> Iterator[tuple[int, int]]:
        if n == 0:
            return  # nothing to ask: no call, not even Health
        step = self.limits(deadline).max_keys_per_call
        for start in range(0, n, step):
            yield start, min(n, start + step)

    # -- the Tier interface ----------------------------------------------------

    def contains(self, keys: Sequence[bytes], *, deadline: float | None = None) -> list[bool]:
        out: list[bool] = []
        for a, b in self._batches(len(keys), deadline):
            req = pb.KeysRequest(keys=keys[a:b])
            resp = self._call(
                "exists",
                lambda req=req: self._exists(  # type: ignore[misc]
                    req,
                    timeout=_timeout(self.config.timeout_s, deadline),
                    metadata=self._metadata,
                ),
                deadline,
            )
            if len(resp.present) != b - a:
                raise RemoteProtocolError(
                    f"remote tier {self.name!r}: Exists answered {len(resp.present)} of {b - a} keys"
                )
            out.extend(resp.present)
        return out

    def prefix_length(self, keys: Sequence[bytes], *, deadline: float | None = None) -> int:
        total = 0
        for a, b in self._batches(len(keys), deadline):
            req = pb.KeysRequest(keys=keys[a:b])
            resp = self._call(
                "lookup",
                lambda req=req: self._lookup(  # type: ignore[misc]
                    req,
                    timeout=_timeout(self.config.timeout_s, deadline),
                    metadata=self._metadata,
                ),
                deadline,
            )
            hit = int(resp.prefix_length)
            if hit > b - a:
                raise RemoteProtocolError(
                    f"remote tier {self.name!r}: Lookup answered {hit} for {b - a} keys"
                )
            total += hit
            if hit < b - a:
                break
        return total

    def get(self, keys: Sequence[bytes], *, deadline: float | None = None) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(keys)
        for a, b in self._batches(len(keys), deadline):
            batch = keys[a:b]
            out[a:b] = self._call(
                "get",
                lambda batch=batch: self._get_attempt(batch, deadline),  # type: ignore[misc]
                deadline,
            )
        return out

    def _get_attempt(
        self, keys: Sequence[bytes], deadline: float | None = None
    ) -> list[bytes | None]:
        """One attempt: over the data plane if there is one, else (or if it is unreachable) gRPC.

        Both planes share ``deadline``: a fallback gets only what the data plane left.
        """
        # NOTE: the limits as last learned, never asked here: this runs inside _call, and
        # a nested call (Health) would take a second breaker slot.
        lim = self._limits
        data = self._planes.client() if lim is not None else None
        if data is not None and lim is not None:
            try:
                blocks = data.get(
                    keys,
                    max_block_size=lim.max_block_size,
                    timeout_s=self.config.transfer_timeout_s,
                    deadline=deadline,
                )
            except DataPlaneUnavailableError as e:
                self._data_unavailable(data, e)
                if deadline is not None and time.monotonic() >= deadline:
                    raise DeadlineExceededError(
                        f"remote tier {self.name!r}: no time left for gRPC after the data plane failed"
                    ) from None
            else:
                self._planes.count("data_gets")
                return blocks
        self._planes.count("grpc_gets")
        return self._get_once(pb.KeysRequest(keys=keys), len(keys), deadline)

    def _get_once(
        self, req: pb.KeysRequest, n: int, deadline: float | None = None
    ) -> list[bytes | None]:
        """One gRPC Get stream, reassembled (a whole attempt: retried from scratch on failure).

        The stream, every frame of it included, ends by ``transfer_timeout_s``
        or ``deadline``, whichever comes first.
        """
        out: list[bytes | None] = [None] * n
        seen = [False] * n
        parts: list[memoryview] = []
        cur, size, got = -1, 0, 0
        stream = self._get(
            req,
            timeout=_timeout(self.config.transfer_timeout_s, deadline),
            metadata=self._metadata,
        )
        try:
            for raw in stream:
                try:
                    batch = decode_get_batch(raw)
                except FrameError as e:
                    raise self._broken(f"malformed GetBatch: {e}") from None
                for f in batch:
                    if f.index >= n:
                        raise self._broken(f"frame for key #{f.index} of {n}")
                    if f.offset == 0:
                        if cur >= 0:
                            raise self._broken(f"block #{cur} ended after {got} of {size} bytes")
                        if seen[f.index]:
                            raise self._broken(f"key #{f.index} answered twice")
                        seen[f.index] = True
                        if not f.found:
                            continue
                        cur, size, got, parts = f.index, f.size, 0, []
                    elif f.index != cur or f.offset != got or f.size != size:
                        raise self._broken(f"out-of-order frame for key #{f.index} at {f.offset}")
                    parts.append(f.data)
                    got += len(f.data)
                    if got > size:
                        raise self._broken(f"block #{cur} is longer than its declared {size} bytes")
                    if got == size:
                        # NOTE: the one copy of the block on this side: frames -> bytes.
                        out[cur] = b"".join(parts)
                        cur, parts = -1, []
        finally:
            stream.cancel()  # no-op once finished; frees the call if we stop early
        if cur >= 0:
            raise self._broken(f"stream ended inside block #{cur} ({got} of {size} bytes)")
        if not all(seen):
            raise self._broken(f"{seen.count(False)} of {n} keys were not answered")
        return out

    def _broken(self, what: str) -> RemoteProtocolError:
        return RemoteProtocolError(
            f"remote tier {self.name!r}: Get stream broke the protocol: {what}"
        )

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        if not items:
            return []
        lim = self.limits()
        if self._role == "reader":  # a read-only token: the server would refuse every put
            return [False] * len(items)
        stored = [len(block) <= lim.max_block_size for _, block in items]
        todo = [i for i, ok in enumerate(stored) if ok]
        if todo and self.config.skip_existing:
            present = self.contains([items[i][0] for i in todo])
            held = [i for i, p in zip(todo, present, strict=True) if p]
            todo = [i for i, p in zip(todo, present, strict=True) if not p]
            self._count_skipped(held, items)
        batch: list[int] = []
        batch_bytes = 0
        for i in todo:
            size = len(items[i][1])
            if batch and (
                len(batch) >= lim.max_keys_per_call
                or batch_bytes + size > self.config.put_batch_bytes
            ):
                self._put_batch(items, batch, lim.chunk_size)
                batch, batch_bytes = [], 0
            batch.append(i)
            batch_bytes += size
        if batch:
            self._put_batch(items, batch, lim.chunk_size)
        return stored

    def _count_skipped(self, held: list[int], items: Sequence[tuple[bytes, bytes]]) -> None:
        """Puts not sent because the server already holds those keys (one Exists call asked)."""
        self.skipped_writes += len(held)
        if self._metrics is not None:
            self._metrics.put_skipped(self.name, len(held), sum(len(items[i][1]) for i in held))

    def _put_batch(
        self, items: Sequence[tuple[bytes, bytes]], batch: list[int], chunk: int
    ) -> None:
        stored = self._call("put", lambda: self._put_attempt(items, batch, chunk))
        if stored != len(batch):
            raise RemoteProtocolError(
                f"remote tier {self.name!r}: Put stored {stored} of {len(batch)} blocks"
            )

    def _put_attempt(
        self, items: Sequence[tuple[bytes, bytes]], batch: list[int], chunk: int
    ) -> int:
        """One attempt of a batch: the data plane if there is one, else (or if unreachable) gRPC."""
        data = self._planes.client()
        if data is not None:
            try:
                stored = data.put(
                    [items[i] for i in batch], timeout_s=self.config.transfer_timeout_s
                )
            except DataPlaneUnavailableError as e:
                self._data_unavailable(data, e)
            else:
                self._planes.count("data_puts")
                return stored

        def frames() -> Iterator[FrameParts]:
            for i in batch:
                key, block = items[i]
                view = memoryview(block)
                yield put_frame(key, len(block), view[:chunk])
                for off in range(chunk, len(block), chunk):
                    yield put_frame(data=view[off : off + chunk])

        self._planes.count("grpc_puts")
        resp = self._put(
            batches(frames(), chunk),
            timeout=self.config.transfer_timeout_s,
            metadata=self._metadata,
        )
        return int(resp.blocks)

    # -- the data plane --------------------------------------------------------

    def _data_unavailable(self, data: DataPlaneClient, e: DataPlaneUnavailableError) -> None:
        """Leave this data plane alone for ``breaker_reset_s`` (gRPC meanwhile) and ask Health
        again: a restarted server may listen on another data port."""
        self._planes.unavailable(data)
        self._forget_limits()
        log.warning("%s; using gRPC for %.1f s", e, self.config.breaker_reset_s)

    def transport(self) -> TransportCounts:
        """How many Get and Put attempts each plane carried, and the fallbacks to gRPC."""
        return self._planes.counts()

    def delete(self, keys: Sequence[bytes]) -> int:
        return self._delete_keys(keys, failed_verification=False)

    def report_bad(self, keys: Sequence[bytes]) -> int:
        """Tell the server these blocks are wrong: it deletes what this tenant would be
        served (also for a reader) and counts it against the writer that stored it."""
        return self._delete_keys(keys, failed_verification=True)

    def _delete_keys(self, keys: Sequence[bytes], *, failed_verification: bool) -> int:
        removed = 0
        for a, b in self._batches(len(keys)):
            req = pb.KeysRequest(keys=keys[a:b], failed_verification=failed_verification)
            resp = self._call(
                "delete",
                lambda req=req: self._delete(  # type: ignore[misc]
                    req, timeout=self.config.timeout_s, metadata=self._metadata
                ),
            )
            removed += int(resp.deleted)
        return removed

    def usage(self) -> TierUsage:
        """The server's usage: bytes and blocks of its largest tier; capacity unknown (``None``).

        Reuses the last answer for ``usage_refresh_s`` and never raises: a
        server that cannot be asked leaves the last known figures (this runs
        during metrics scrapes).
        """
        now = time.monotonic()
        if now - self._usage_at < self.config.usage_refresh_s:
            return self._usage
        self._usage_at = now
        try:
            stats = self.server_stats()
        except (TransientError, RemoteAuthError, RemoteProtocolError):
            return self._usage
        if stats.tiers:
            largest = max(stats.tiers, key=lambda t: t.used_bytes)
            self._usage = TierUsage(int(largest.used_bytes), None, int(largest.blocks))
        return self._usage

    def close(self) -> None:
        self._planes.close()
        self._channel.close()

    def describe(self) -> dict[str, Any]:
        """Address, breaker state and learned limits (for logs and the CLI)."""
        lim = self._limits
        return {
            "address": self.config.address,
            "tls": self.config.uses_tls,
            "breaker": self.breaker.state.value,
            "data_plane": self._planes.address(),
            "transport": vars(self.transport()),
            "limits": None
            if lim is None
            else {
                "max_block_size": lim.max_block_size,
                "max_keys_per_call": lim.max_keys_per_call,
                "chunk_size": lim.chunk_size,
            },
        }
