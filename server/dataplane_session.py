"""One data-plane connection on the server: handshake, then GET and PUT requests until it ends.

The wire format is in :mod:`kvtier.wire.dataplane`. A session runs on
its own thread (:mod:`kvtier.server.dataplane` accepts and starts it) and
passes the server's :class:`~kvtier.server.gate.Gate` exactly like a gRPC
call: the HELLO's token is authenticated by the same tenant directory
(counted as ``data.Connect``), each request is authorized by role, counted
(``data.Get``, ``data.Put``) and refused while draining, and a PUT's blocks
go through the same :class:`~kvtier.server.receiver.BlockReceiver` (put
budget, ``verify_block``, storage) as a gRPC Put stream.

A refusal answers a STATUS and ends the connection. No request can end the
process: anything unexpected is logged, answered INTERNAL where possible,
and closes only this connection.

Deadlines: the handshake must arrive within ``data_handshake_timeout_s``;
after it each read or write of a request must progress within
``data_io_timeout_s`` (the idle bound) and a whole request must end within
``call_timeout_s`` (the total bound), so a client that stalls or drips
bytes holds its thread and its put reservation for a bounded time.
"""

from __future__ import annotations

import logging
import select
import time
from collections.abc import Callable

import grpc

from kvtier.server.access import BlockAccess
from kvtier.server.admission import RequestError, draining, invalid, over_limit, unauthenticated
from kvtier.server.gate import Gate
from kvtier.server.metrics import ServerMetrics
from kvtier.server.receiver import BlockReceiver
from kvtier.server.service import GET_BATCH
from kvtier.server.tenants import Tenant
from kvtier.server_config import UNAUTHENTICATED_LABEL, ServerConfig
from kvtier.wire import dataplane as wire
from kvtier.wire.sockio import Stream, StreamError, StreamTimeoutError

log = logging.getLogger(__name__)

_INTERNAL = grpc.StatusCode.INTERNAL.value[0]
_METHODS = {wire.OP_GET: "data.Get", wire.OP_PUT: "data.Put"}
_DRAIN_AFTER_REFUSAL_S = 1.0
"""How long what a refused client still sends is read and dropped, so it can
finish sending and read the refusal instead of a reset."""


class _ReplyStarted(Exception):
    """A GET reply began (OK sent); a later failure must be an error ITEM, not a STATUS."""


class DataPlaneSession:
    """Serves one connection.

    Args:
        stream: The connection (TLS handshake done), armed with the handshake timeout.
        access: Block data as each tenant may see and store it.
        gate: Authentication, roles, draining, accounting, the put budgets.
        config: Limits.
        metrics: Server metrics.
        wake_fd: Becomes readable when the server stops (ends an idle wait).
        on_authenticated: Told the tenant once the handshake authenticated it;
            returns a refusal when the connection may not stay (too many of
            the tenant's), else ``None``.
    """

    def __init__(
        self,
        stream: Stream,
        access: BlockAccess,
        gate: Gate,
        config: ServerConfig,
        metrics: ServerMetrics,
        wake_fd: int,
        on_authenticated: Callable[[Tenant], RequestError | None] | None = None,
    ) -> None:
        self.stream = stream
        self.access = access
        self.gate = gate
        self.config = config
        self.metrics = metrics
        self.wake_fd = wake_fd
        self._on_authenticated = on_authenticated

    def run(self) -> None:
        """Handshake, then serve requests until the client leaves, idles out, or the server stops."""
        try:
            tenant = self._handshake()
            while tenant is not None and self._wait_for_request():
                if not self._request(tenant):
                    break
        except StreamError as e:
            log.debug("data-plane connection ended: %s", e)
        finally:
            self.stream.close()

    # -- the handshake -------------------------------------------------------------

    def _handshake(self) -> Tenant | None:
        start = time.perf_counter()
        self.gate.enter()
        label, code = UNAUTHENTICATED_LABEL, grpc.StatusCode.INTERNAL
        try:
            magic, version, token_len = wire.HELLO.unpack(self.stream.read_exact(wire.HELLO.size))
            if magic != wire.MAGIC:
                raise invalid("not a kvtier data-plane handshake (bad magic)")
            if version != wire.DATA_PROTOCOL_VERSION:
                raise RequestError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"data-plane protocol {version} is not spoken here; this server speaks "
                    f"{wire.DATA_PROTOCOL_VERSION} (gRPC Get/Put always work)",
                    "invalid",
                )
            if token_len > wire.MAX_TOKEN:
                raise invalid(f"a token is at most {wire.MAX_TOKEN} bytes, not {token_len}")
            raw = self.stream.read_exact(token_len) if token_len else b""
            try:
                token = raw.decode() if raw else None
            except UnicodeDecodeError:
                raise unauthenticated("the token is not UTF-8") from None
            tenant = self.gate.authenticate(token)
            self.gate.authorize(tenant, "reader", "a token in the data-plane handshake")
            assert tenant is not None
            label = tenant.label
            refusal = self._on_authenticated(tenant) if self._on_authenticated else None
            if refusal is not None:
                raise refusal
            self.stream.set_timeout(self.config.data_io_timeout_s)
            self.stream.write([wire.hello_reply(wire.OK)])
            code = grpc.StatusCode.OK
            return tenant
        except RequestError as e:
            code = e.code
            self.gate.refused(e)
            self._send_quietly(wire.hello_reply(e.code.value[0], e.message))
            self._drain_input()
            return None
        except StreamError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            self.gate.leave("data.Connect", label, code, start)

    # -- requests ------------------------------------------------------------------

    def _wait_for_request(self) -> bool:
        """Wait for the next request; ``False`` when the client left, idled out, or the server stops."""
        if self.stream.readable():
            return True
        poller = select.poll()
        poller.register(self.stream.sock, select.POLLIN)
        poller.register(self.wake_fd, select.POLLIN)
        ready = dict(poller.poll(self.config.data_idle_timeout_s * 1000))
        # the socket ready: a request, or the client's close (the read will tell)
        return self.stream.sock.fileno() in ready

    def _request(self, tenant: Tenant) -> bool:
        """Serve one request; ``False`` when the connection must end."""
        head = self.stream.read_exact(wire.REQUEST.size)
        op, count = wire.REQUEST.unpack(head)
        method = _METHODS.get(op, "data.Unknown")
        start = time.perf_counter()
        self.gate.enter()
        code = grpc.StatusCode.INTERNAL
        self.stream.set_deadline(time.monotonic() + self.config.call_timeout_s, keep_timeout=True)
        try:
            if self.gate.draining:
                raise draining()
            if op == wire.OP_GET:
                self.gate.authorize(tenant, "reader")
                self._get(tenant, count)
            elif op == wire.OP_PUT:
                self.gate.authorize(tenant, "writer")
                self._put(tenant, count)
            else:
                raise invalid(f"unknown data-plane op {op} (1: GET, 2: PUT)")
            code = grpc.StatusCode.OK
            self.stream.set_deadline(None)  # back to the idle bound between requests
            return True
        except RequestError as e:
            code = e.code
            self.gate.refused(e)
            self._send_quietly(wire.status(e.code.value[0], e.message))
            self._drain_input()
            return False
        except _ReplyStarted:
            return False  # the error ITEM was sent; code stays INTERNAL
        except StreamError as e:
            code = grpc.StatusCode.CANCELLED  # the client went away or stalled
            if isinstance(e, StreamTimeoutError):
                self.metrics.cancelled_calls.labels(
                    "deadline" if "deadline" in str(e) else "idle"
                ).inc()
            log.debug("data-plane %s ended early: %s", method, e)
            return False
        except Exception:
            log.exception("data-plane %s failed", method)
            self._send_quietly(wire.status(_INTERNAL, f"{method}: internal error (see server log)"))
            self._drain_input()
            return False
        finally:
            self.gate.leave(method, tenant.label, code, start)

    def _check_count(self, count: int, what: str) -> None:
        if count > self.config.max_keys_per_call:
            raise over_limit(
                f"{count} {what} in one request; this server takes at most "
                f"{self.config.max_keys_per_call}"
            )

    def _get(self, tenant: Tenant, count: int) -> None:
        self._check_count(count, "keys")
        raw = self.stream.read_exact(wire.KEY_SIZE * count) if count else b""
        keys = [raw[i : i + wire.KEY_SIZE] for i in range(0, len(raw), wire.KEY_SIZE)]
        hits = sent = 0
        started = False
        try:
            for base in range(0, count, GET_BATCH):
                blocks = self.access.get(tenant, keys[base : base + GET_BATCH])
                # header bytes and views of the stored blocks, sent by one gathered write
                parts: list[bytes] = [] if started else [wire.OK_STATUS]
                for block in blocks:
                    if block is None:
                        parts.append(wire.MISS_ITEM)
                        continue
                    parts.append(wire.ITEM.pack(wire.KIND_HIT, len(block)))
                    parts.append(block)
                    hits += 1
                    sent += len(block)
                self.stream.write(parts)
                started = True
            if not started:
                self.stream.write([wire.OK_STATUS])  # no keys: just the OK
        except StreamError:
            raise
        except Exception as e:
            if not started:
                raise  # nothing sent yet: the caller answers a STATUS
            log.exception("data-plane GET failed after its reply began")
            self._send_quietly(
                wire.ITEM.pack(wire.KIND_ERROR, 0)
                + wire.status(_INTERNAL, "data.Get: internal error (see server log)")
            )
            raise _ReplyStarted() from e
        finally:
            self.metrics.keys.labels(tenant.label, "get", "requested").inc(count)
            self.metrics.keys.labels(tenant.label, "get", "hit").inc(hits)
            self.metrics.bytes.labels(tenant.label, "out").inc(sent)

    def _put(self, tenant: Tenant, count: int) -> None:
        self._check_count(count, "blocks")
        receiver = BlockReceiver(
            tenant,
            self.access,
            self.gate.put_budget,
            self.gate.tenant_budget(tenant),
            self.config,
            self.metrics,
        )
        try:
            for _ in range(count):
                key, length = wire.PUT_ITEM.unpack(self.stream.read_exact(wire.PUT_ITEM.size))
                receiver.begin(key, length)  # limits and the budget, before reading the bytes
                receiver.add(self.stream.read_block(length))  # verified and stored when whole
            receiver.finish()
        finally:
            receiver.abandon()
        self.stream.write([wire.OK_STATUS + wire.PUT_DONE.pack(receiver.blocks, receiver.bytes)])

    # -- helpers -------------------------------------------------------------------

    def _send_quietly(self, data: bytes) -> None:
        """Send a last answer if the client still listens (it may be gone)."""
        try:
            self.stream.write([data])
        except StreamError:
            return

    def _drain_input(self) -> None:
        """After a refusal: end our side, then read and drop what the client still sends (briefly).

        The client may still be sending (a PUT's blocks, pipelined requests);
        closing with unread bytes would reset the connection, which can
        destroy the refusal before the client reads it.
        """
        self.stream.shutdown_write()
        self.stream.discard(min(_DRAIN_AFTER_REFUSAL_S, self.config.data_io_timeout_s))
