"""The gRPC service: every call authenticated, validated, scoped to its tenant, counted.

Handlers are registered as a generic handler for ``kvtier.cache.v1.KvCache``
(the service of ``kvtier_cache.proto``): small messages go through the
generated protobuf classes, the bulk frames of Get and Put through the
copy-lean codec in :mod:`kvtier.wire.frames` (same wire format).

No request can stop the process: a refusal is a :class:`RequestError` turned
into its status, and anything unexpected is logged and answered INTERNAL.

No tenant can take the server: each may have ``tenant_max_calls`` calls in
flight (fewer than the pool's threads), and a Get or Put stream that makes
no progress for ``stream_idle_timeout_s``, or runs past ``call_timeout_s``,
is cancelled by the :class:`~kvtier.server.deadlines.Reaper`. Block data is
read and written through :class:`~kvtier.server.access.BlockAccess`
(namespaces, trust, provenance stamps).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from importlib import metadata
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from kvtier.server.access import BlockAccess
from kvtier.server.admission import (
    RequestError,
    check_keys,
    draining,
    invalid,
    unauthenticated,
)
from kvtier.server.deadlines import Reaper, Watch
from kvtier.server.gate import Gate
from kvtier.server.metrics import ServerMetrics
from kvtier.server.receiver import BlockReceiver
from kvtier.server.stats import History
from kvtier.server.tenants import Tenant
from kvtier.server_config import UNAUTHENTICATED_LABEL, Role, ServerConfig
from kvtier.wire import PROTOCOL_VERSION
from kvtier.wire import kvtier_cache_pb2 as pb
from kvtier.wire.dataplane import DATA_PROTOCOL_VERSION
from kvtier.wire.frames import (
    FrameError,
    FrameParts,
    batches,
    decode_put_batch,
    get_frame,
)
from kvtier.wire.transport import SERVICE_NAME

log = logging.getLogger(__name__)

GET_BATCH = 16
"""Keys fetched from the store at a time by one Get (bounds the blocks held in memory)."""

T = TypeVar("T")


def _identity(b: bytes) -> bytes:
    return b


def _parse(message_type: type[Message], raw: bytes) -> Any:
    """Deserialize a request; a malformed one is INVALID_ARGUMENT (gRPC would answer INTERNAL)."""
    try:
        return message_type.FromString(raw)
    except DecodeError as e:
        raise invalid(f"malformed {message_type.__name__}: {e}") from None


def server_version() -> str:
    """The installed kvtier version."""
    try:
        return metadata.version("kvtier")
    except metadata.PackageNotFoundError:
        return "unknown"


def bearer_token(context: grpc.ServicerContext) -> str | None:
    """The token of ``authorization: Bearer <token>`` metadata, ``None`` if absent.

    Raises:
        RequestError: UNAUTHENTICATED if the metadata is there but malformed.
    """
    for key, value in context.invocation_metadata() or ():
        if key != "authorization":
            continue
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        scheme, _, token = text.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise unauthenticated("authorization metadata must be 'Bearer <token>'")
        return token
    return None


class KvCacheService:
    """The handlers of one server.

    Args:
        access: Block data, as each tenant may see and store it (the server owns the store).
        gate: Tenants, roles, draining, the put budgets, per-tenant calls and
            per-call metrics (shared with the data plane).
        config: Limits.
        metrics: Server metrics.
        history: Figures for the Stats call.
        reaper: Cancels streams that idle or overrun.
    """

    def __init__(
        self,
        access: BlockAccess,
        gate: Gate,
        config: ServerConfig,
        metrics: ServerMetrics,
        history: History,
        reaper: Reaper,
    ) -> None:
        self.access = access
        self.store = access.store
        self.gate = gate
        self.reaper = reaper
        self.config = config
        self.metrics = metrics
        self.history = history
        self.version = server_version()
        self.started = time.time()
        self.put_budget = gate.put_budget
        self.data_port = 0
        """The data plane's port for Health (0: none); set by the server once bound."""

    # -- lifecycle -------------------------------------------------------------

    def drain(self) -> None:
        """Refuse new calls (UNAVAILABLE) on both planes; calls in flight go on."""
        self.gate.drain()

    @property
    def draining(self) -> bool:
        return self.gate.draining

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no call (gRPC or data plane) is being served; ``False`` on timeout."""
        return self.gate.wait_idle(timeout)

    def generic_handler(self) -> grpc.GenericRpcHandler:
        """The service's handlers, for ``grpc.Server.add_generic_rpc_handlers``."""
        handlers = {
            "Lookup": grpc.unary_unary_rpc_method_handler(
                self._unary("Lookup", "reader", self._lookup, pb.KeysRequest),
                request_deserializer=_identity,
                response_serializer=pb.LookupResponse.SerializeToString,
            ),
            "Exists": grpc.unary_unary_rpc_method_handler(
                self._unary("Exists", "reader", self._exists, pb.KeysRequest),
                request_deserializer=_identity,
                response_serializer=pb.ExistsResponse.SerializeToString,
            ),
            "Get": grpc.unary_stream_rpc_method_handler(
                self._stream_out("Get", "reader", self._get, pb.KeysRequest),
                request_deserializer=_identity,
                response_serializer=_identity,
            ),
            "Put": grpc.stream_unary_rpc_method_handler(
                self._unary("Put", "writer", self._put),
                request_deserializer=_identity,
                response_serializer=pb.PutResponse.SerializeToString,
            ),
            "Delete": grpc.unary_unary_rpc_method_handler(
                # reader: a report of blocks that failed verification; a plain delete needs writer
                self._unary("Delete", "reader", self._delete, pb.KeysRequest),
                request_deserializer=_identity,
                response_serializer=pb.DeleteResponse.SerializeToString,
            ),
            "Stats": grpc.unary_unary_rpc_method_handler(
                self._unary("Stats", "reader", self._stats, pb.StatsRequest),
                request_deserializer=_identity,
                response_serializer=pb.StatsResponse.SerializeToString,
            ),
            "Health": grpc.unary_unary_rpc_method_handler(
                self._unary("Health", None, self._health, pb.HealthRequest),
                request_deserializer=_identity,
                response_serializer=pb.HealthResponse.SerializeToString,
            ),
        }
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)

    # -- the wrapper every call goes through ---------------------------------

    def _authenticate(self, context: grpc.ServicerContext) -> Tenant | None:
        return self.gate.authenticate(bearer_token(context))

    def _authorize(self, tenant: Tenant | None, role: Role | None) -> None:
        self.gate.authorize(tenant, role, "'authorization: Bearer <token>' metadata")

    def _refuse(self, context: grpc.ServicerContext, e: RequestError) -> None:
        self.gate.refused(e)
        context.abort(e.code, e.message)

    def _unary(
        self,
        method: str,
        role: Role | None,
        fn: Callable[[Tenant | None, Any, grpc.ServicerContext], T],
        request_type: type[Message] | None = None,
    ) -> Callable[[Any, grpc.ServicerContext], T]:
        """Wrap ``fn``: parse (if ``request_type``), authenticate, authorize, count, map errors."""

        def handler(request: Any, context: grpc.ServicerContext) -> T:
            start = time.perf_counter()
            self.gate.enter()
            label = UNAUTHENTICATED_LABEL
            code = grpc.StatusCode.INTERNAL
            admitted: Tenant | None = None
            try:
                if self.gate.draining and method != "Health":
                    raise draining()
                tenant = self._authenticate(context)
                if tenant is not None:
                    label = tenant.label
                self._authorize(tenant, role)
                if tenant is not None and method != "Health":
                    self.gate.admit(tenant)
                    admitted = tenant
                if request_type is not None:
                    request = _parse(request_type, request)
                result = fn(tenant, request, context)
                code = grpc.StatusCode.OK
                return result
            except RequestError as e:
                code = e.code
                self._refuse(context, e)
                raise AssertionError("unreachable: abort raises") from None
            except grpc.RpcError:
                code = grpc.StatusCode.CANCELLED  # the client went away mid-call
                raise
            except Exception:
                log.exception("%s failed", method)
                context.abort(
                    grpc.StatusCode.INTERNAL, f"{method}: internal error (see server log)"
                )
                raise AssertionError("unreachable: abort raises") from None
            finally:
                if admitted is not None:
                    self.gate.release(admitted)
                self.gate.leave(method, label, code, start)

        return handler

    def _stream_out(
        self,
        method: str,
        role: Role,
        fn: Callable[[Tenant, Any, grpc.ServicerContext], Iterator[bytes]],
        request_type: type[Message],
    ) -> Callable[[Any, grpc.ServicerContext], Iterator[bytes]]:
        def handler(request: Any, context: grpc.ServicerContext) -> Iterator[bytes]:
            start = time.perf_counter()
            self.gate.enter()
            label = UNAUTHENTICATED_LABEL
            code = grpc.StatusCode.INTERNAL
            admitted: Tenant | None = None
            try:
                if self.gate.draining:
                    raise draining()
                tenant = self._authenticate(context)
                if tenant is not None:
                    label = tenant.label
                self._authorize(tenant, role)
                assert tenant is not None
                self.gate.admit(tenant)
                admitted = tenant
                yield from fn(tenant, _parse(request_type, request), context)
                code = grpc.StatusCode.OK if context.is_active() else grpc.StatusCode.CANCELLED
            except RequestError as e:
                code = e.code
                self._refuse(context, e)
            except GeneratorExit:
                code = grpc.StatusCode.CANCELLED
                raise
            except Exception:
                log.exception("%s failed", method)
                context.abort(
                    grpc.StatusCode.INTERNAL, f"{method}: internal error (see server log)"
                )
            finally:
                if admitted is not None:
                    self.gate.release(admitted)
                self.gate.leave(method, label, code, start)

        return handler

    def _watch(self, context: grpc.ServicerContext) -> Watch:
        """Watch a stream: cancelled when idle for stream_idle_timeout_s or past call_timeout_s."""
        return self.reaper.watch(
            context.cancel,
            idle_s=self.config.stream_idle_timeout_s,
            total_s=self.config.call_timeout_s,
        )

    # -- the calls -------------------------------------------------------------

    def _keys(self, request: pb.KeysRequest) -> list[bytes]:
        keys = list(request.keys)
        check_keys(keys, self.config.max_keys_per_call)
        return keys

    def _lookup(
        self, tenant: Tenant | None, request: pb.KeysRequest, context: grpc.ServicerContext
    ) -> pb.LookupResponse:
        assert tenant is not None
        keys = self._keys(request)
        hit = self.access.prefix(tenant, keys) if keys else 0
        self.metrics.keys.labels(tenant.label, "lookup", "requested").inc(len(keys))
        self.metrics.keys.labels(tenant.label, "lookup", "hit").inc(hit)
        return pb.LookupResponse(prefix_length=hit)

    def _exists(
        self, tenant: Tenant | None, request: pb.KeysRequest, context: grpc.ServicerContext
    ) -> pb.ExistsResponse:
        assert tenant is not None
        keys = self._keys(request)
        return pb.ExistsResponse(present=self.access.present(tenant, keys) if keys else [])

    def _get(
        self, tenant: Tenant, request: pb.KeysRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        keys = self._keys(request)
        counts = [0, 0]  # hits, bytes sent
        watch = self._watch(context)
        try:
            for batch in batches(self._get_frames(tenant, keys, counts), self.config.chunk_size):
                yield batch
                watch.touch()  # the client took the last batch
        finally:
            watch.close()
            self.metrics.keys.labels(tenant.label, "get", "requested").inc(len(keys))
            self.metrics.keys.labels(tenant.label, "get", "hit").inc(counts[0])
            self.metrics.bytes.labels(tenant.label, "out").inc(counts[1])

    def _get_frames(
        self, tenant: Tenant, keys: list[bytes], counts: list[int]
    ) -> Iterator[FrameParts]:
        chunk = self.config.chunk_size
        for base in range(0, len(keys), GET_BATCH):
            blocks = self.access.get(tenant, keys[base : base + GET_BATCH])
            for j, block in enumerate(blocks):
                index = base + j
                if block is None:
                    yield get_frame(index, False)
                    continue
                size = len(block)
                view = memoryview(block)
                for off in range(0, size, chunk):
                    yield get_frame(index, True, size, off, view[off : off + chunk])
                counts[0] += 1
                counts[1] += size

    def _put(
        self, tenant: Tenant | None, frames: Iterable[bytes], context: grpc.ServicerContext
    ) -> pb.PutResponse:
        assert tenant is not None
        receiver = BlockReceiver(
            tenant,
            self.access,
            self.put_budget,
            self.gate.tenant_budget(tenant),
            self.config,
            self.metrics,
        )
        watch = self._watch(context)
        try:
            for raw in frames:
                watch.touch()
                try:
                    batch = decode_put_batch(raw)
                except FrameError as e:
                    raise invalid(f"malformed PutBatch: {e}") from None
                for frame in batch:
                    receiver.feed(frame)
            if watch.reason is not None:
                raise over_limit_stream(watch.reason, self.config)
            receiver.finish()
        finally:
            watch.close()
            receiver.abandon()
        return pb.PutResponse(blocks=receiver.blocks, bytes=receiver.bytes)

    def _delete(
        self, tenant: Tenant | None, request: pb.KeysRequest, context: grpc.ServicerContext
    ) -> pb.DeleteResponse:
        assert tenant is not None
        keys = self._keys(request)
        if request.failed_verification:
            return pb.DeleteResponse(deleted=self.access.report_bad(tenant, keys) if keys else 0)
        self._authorize(tenant, "writer")
        return pb.DeleteResponse(deleted=self.access.delete(tenant, keys))

    def _stats(
        self, tenant: Tenant | None, request: pb.StatsRequest, context: grpc.ServicerContext
    ) -> pb.StatsResponse:
        assert tenant is not None
        snap = self.history.source.snapshot()
        recent = self.history.recent()
        visible = [t for t in snap.tenants if tenant.sees_everyone or t.name == tenant.label]
        response = pb.StatsResponse(
            version=self.version,
            uptime_s=time.time() - self.started,
            lookup_keys=snap.lookup_keys,
            lookup_hits=snap.lookup_hits,
            get_keys=snap.get_keys,
            get_hits=snap.get_hits,
            bytes_in=snap.bytes_in,
            bytes_out=snap.bytes_out,
            requests=snap.requests,
            errors=snap.errors,
            tiers=[
                pb.TierStats(
                    name=t.name,
                    used_bytes=t.used_bytes,
                    capacity_bytes=t.capacity_bytes or 0,
                    blocks=t.blocks or 0,
                    get_hits=t.get_hits,
                    get_misses=t.get_misses,
                    contains_hits=t.contains_hits,
                    contains_misses=t.contains_misses,
                    evictions=t.evictions,
                    errors=t.errors,
                    bytes_read=t.bytes_read,
                    bytes_written=t.bytes_written,
                )
                for t in snap.tiers
            ],
            tenants=[
                pb.TenantStats(
                    name=t.name,
                    requests=t.requests,
                    errors=t.errors,
                    bytes_in=t.bytes_in,
                    bytes_out=t.bytes_out,
                    lookup_keys=t.lookup_keys,
                    lookup_hits=t.lookup_hits,
                    get_keys=t.get_keys,
                    get_hits=t.get_hits,
                )
                for t in visible
            ],
        )
        if recent is not None:
            response.recent.CopyFrom(
                pb.RecentRates(
                    window_s=recent.window_s,
                    lookup_hit_rate=-1.0
                    if recent.lookup_hit_rate is None
                    else recent.lookup_hit_rate,
                    get_hit_rate=-1.0 if recent.get_hit_rate is None else recent.get_hit_rate,
                    bytes_in_per_s=recent.bytes_in_per_s,
                    bytes_out_per_s=recent.bytes_out_per_s,
                    requests_per_s=recent.requests_per_s,
                )
            )
        return response

    def _health(
        self, tenant: Tenant | None, request: pb.HealthRequest, context: grpc.ServicerContext
    ) -> pb.HealthResponse:
        c = self.config
        return pb.HealthResponse(
            status=pb.HealthResponse.DRAINING if self.gate.draining else pb.HealthResponse.SERVING,
            version=self.version,
            protocol_version=PROTOCOL_VERSION,
            limits=pb.Limits(
                max_block_size=c.max_block_size,
                max_keys_per_call=c.max_keys_per_call,
                chunk_size=c.chunk_size,
                max_message_size=c.max_message_size,
            ),
            tenant=tenant.name if tenant is not None else "",
            role=tenant.role if tenant is not None else "",
            data_port=self.data_port,
            data_protocol_version=DATA_PROTOCOL_VERSION if self.data_port else 0,
        )


def over_limit_stream(reason: str, config: ServerConfig) -> RequestError:
    """The refusal of a stream the server cancelled (DEADLINE_EXCEEDED)."""
    what = (
        f"no frame for {config.stream_idle_timeout_s:g} s"
        if reason == "idle"
        else f"longer than {config.call_timeout_s:g} s"
    )
    return RequestError(
        grpc.StatusCode.DEADLINE_EXCEEDED, f"the stream was cancelled: {what}", "limit"
    )
