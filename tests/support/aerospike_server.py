"""A protocol-level Aerospike server for tests: the real ``aerospike`` client talks to it over TCP.

:class:`AerospikeTestServer` listens on ``127.0.0.1`` (a free port unless one
is given) and answers the Aerospike wire protocol well enough for the
official Python client (19.x, C client 7.x) to form a one-node cluster and
run the commands the kvtier Aerospike tier uses. It exists for tests only:
it is not a product, not a default, and not a reference for Aerospike's
behaviour beyond what is listed here. The tier's tests run on a real
Aerospike server when the machine has one (tests/support/aerospike_target.py);
this emulator serves the tests that need what a real server cannot be made
to do on demand (a chosen wire-level fault or error code, a legacy reply, a
stall on a chosen request), each marked ``aerospike_emulator(reason)``, and
stands in for the real server on a clone without one.

What it implements:

* **Framing**: 8-byte proto headers (version 2; type 1 info, type 3
  message). Bodies over 128 MiB make it drop the connection, as the real
  server does.
* **Info** (type 1): ``node``, ``build`` (8.1.2.0 by default, so the client
  uses the modern batch protocol), ``edition``, ``version``,
  ``cluster-name``, ``features``, ``partition-generation``,
  ``peers-generation``, ``rebalance-generation``, ``peers-clear-std`` and
  the other peers variants (no peers), ``replicas`` (one node owns all 4096
  partitions), ``rack-ids``, ``namespaces``, ``namespace/<ns>`` (objects,
  data bytes, ``max-record-size`` or, in legacy mode, ``write-block-size``,
  ``default-ttl``, ``nsup-period`` ...; an unknown namespace answers
  ``type=unknown``) and ``user-agent-set:value=...``. Anything else answers
  ``ERROR::unrecognized command``.
* **Single-record messages** (type 3): read (all bins, named bins, metadata
  only), write (bin writes, bin deletes, touch, read-back, create-only,
  update-only, replace, create-or-replace, generation check), delete (with
  generation check), exists. Wire ops READ 1, WRITE 2, TOUCH 11, DELETE 14;
  any other op answers error 4 (parameter).
* **Batches** (field 41, the protocol of server 6.0+): per-row attribute
  bitmask, ``REPEAT`` rows, reads/exists/writes/removes/touches mixed in one
  batch, a result code per row, the reply streamed as several proto
  messages ended by a ``LAST`` header.
* **Metadata**: generation (incremented per write) and void-time (seconds
  since 2010-01-01 UTC, 0 = never) in every reply; TTL semantics of the
  write header (0 namespace default, ``0xFFFFFFFF`` never expire,
  ``0xFFFFFFFE`` keep); records expire lazily when read after their void
  time (:meth:`AerospikeTestServer.advance_clock` moves time forward);
  ``read-touch-ttl-percent`` on reads, as the 7.1+ server computes it.
* **Limits**: ``max-record-size`` enforced with the server's flat-record
  size formula (35-byte header, void-time, set name, bin count, per bin name
  and particle overhead, 4-byte end mark), so one blob bin named ``b`` in a
  set named ``test`` has 52 bytes of overhead, as measured on CE 8.1.2.0;
  TTL writes rejected with 22 when ``nsup_period`` is 0; stop-writes (error
  8 on writes, deletes still allowed).
* **Fault injection**: :attr:`latency` before every message reply,
  :meth:`fail_next` (an error code for the next N messages),
  :meth:`drop_next` (close the connection instead of replying, optionally
  after applying the command), :meth:`delay_next`, :attr:`refuse_connections`,
  :meth:`drop_connections`, and :meth:`stop`/:meth:`start` on the same port
  (records survive a restart).
* **Counters**: :attr:`counts` by command kind, for round-trip assertions;
  :attr:`bytes_received`, the bytes of every message request (proto header
  included, info excluded), for what a client uploads.

What it does not implement: security/admin (type 2), compressed messages
(type 4), TLS, queries and scans, UDFs, CDT/bit/HLL/increment operations,
expressions (filters), transactions, strong consistency, more than one
node, replication, eviction, secondary indexes, truncate, XDR, and request
socket-timeouts (field 9 is ignored).
"""

from __future__ import annotations

import base64
import collections
import contextlib
import dataclasses
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from tests.support import aerospike_usage

# --- protocol constants -------------------------------------------------------

PROTO_VERSION = 2
TYPE_INFO = 1
TYPE_MESSAGE = 3
MAX_BODY = 128 * 1024 * 1024
CITRUSLEAF_EPOCH = 1262304000  # 2010-01-01T00:00:00Z

INFO1_READ = 0x01
INFO1_GET_ALL = 0x02
INFO1_BATCH = 0x08
INFO1_NOBINDATA = 0x20
INFO2_WRITE = 0x01
INFO2_DELETE = 0x02
INFO2_GENERATION = 0x04
INFO2_CREATE_ONLY = 0x20
INFO3_LAST = 0x01
INFO3_UPDATE_ONLY = 0x08
INFO3_CREATE_OR_REPLACE = 0x10
INFO3_REPLACE_ONLY = 0x20

FIELD_NAMESPACE = 0
FIELD_SET = 1
FIELD_KEY = 2
FIELD_DIGEST = 4
FIELD_BATCH_INDEX = 41

OP_READ = 1
OP_WRITE = 2
OP_TOUCH = 11
OP_DELETE = 14

PARTICLE_NULL = 0

BATCH_REPEAT = 0x01
BATCH_INFO = 0x02
BATCH_GEN = 0x04
BATCH_TTL = 0x08
BATCH_INFO4 = 0x10

TTL_NAMESPACE_DEFAULT = 0
TTL_NEVER_EXPIRE = 0xFFFFFFFF
TTL_DONT_UPDATE = 0xFFFFFFFE
MAX_ALLOWED_TTL = 10 * 365 * 24 * 3600
READ_TOUCH_NEVER = 0xFFFFFFFF

OK = 0
ERR_NOT_FOUND = 2
ERR_GENERATION = 3
ERR_PARAMETER = 4
ERR_EXISTS = 5
ERR_OUT_OF_SPACE = 8
ERR_RECORD_TOO_BIG = 13
ERR_NAMESPACE = 20
ERR_FORBIDDEN = 22

_PROTO = struct.Struct(">Q")
_MSG = struct.Struct(
    ">BBBBBBIIIHH"
)  # header_sz info1 info2 info3 info4 result gen record_ttl txn_ttl n_fields n_ops
_FIELD = struct.Struct(">IB")
_OP = struct.Struct(">IBBBB")
_ROW = struct.Struct(">I20sB")
_FLAT_HEADER = 35  # sizeof(as_flat_record)
_END_MARK = 4
_BLOB_FLAT_OVERHEAD = 5  # particle type byte + u32 size
_RESPONSE_CHUNK = 1024 * 1024  # batch replies are split into proto messages of about this size


def _proto(msg_type: int, body: bytes | bytearray) -> bytes:
    return _PROTO.pack((PROTO_VERSION << 56) | (msg_type << 48) | len(body))


def _uintvar_size(n: int) -> int:
    size = 1
    while n >= 0x80:
        n >>= 7
        size += 1
    return size


# --- data model ------------------------------------------------------------------


@dataclass
class StoredRecord:
    """One record as the test server holds it."""

    set_name: str
    bins: dict[str, tuple[int, bytes]]  # name -> (particle type, wire value)
    generation: int
    void_time: int  # citrusleaf-epoch seconds; 0 = never expires
    last_update: int  # citrusleaf-epoch seconds
    user_key: bytes | None = None

    def flat_size(self) -> int:
        """Bytes this record counts against ``max-record-size`` (the server's formula)."""
        size = _FLAT_HEADER
        if self.void_time:
            size += 4
        if self.set_name:
            size += 1 + len(self.set_name.encode())
        if self.user_key is not None:
            size += _uintvar_size(len(self.user_key)) + len(self.user_key)
        if self.bins:
            size += _uintvar_size(len(self.bins))
        for name, (_, value) in self.bins.items():
            size += 1 + len(name.encode()) + _BLOB_FLAT_OVERHEAD + len(value)
        return size + _END_MARK


@dataclass
class NamespaceConfig:
    """Settings of one test namespace (the subset the tier reads)."""

    name: str = "kvcache"
    max_record_size: int = 1024 * 1024
    default_ttl: int = 0
    nsup_period: int = 120
    allow_ttl_without_nsup: bool = False
    default_read_touch_ttl_pct: int = 0
    data_size: int = 4 * 1024**3
    legacy_write_block_size: bool = False  # report write-block-size instead of max-record-size


@dataclass
class _Request:
    info1: int
    info2: int
    info3: int
    generation: int
    record_ttl: int
    namespace: str | None
    set_name: str
    digest: bytes | None
    user_key: bytes | None
    ops: list[tuple[int, int, str, bytes]]  # (op, particle, bin name, value)


@dataclass
class _Result:
    code: int
    generation: int = 0
    void_time: int = 0
    bins: list[tuple[str, int, bytes]] = field(default_factory=list)


@dataclass(frozen=True)
class _Fault:
    kind: str  # "fail", "drop" or "delay"
    code: int = 0
    after_apply: bool = False
    seconds: float = 0.0


class _Drop(Exception):
    """Raised inside a connection handler to close the socket without replying."""


# --- the server ------------------------------------------------------------------


class AerospikeTestServer:
    """A one-node Aerospike server speaking the wire protocol, for tests.

    Args:
        namespaces: Namespaces to serve (default: one ``kvcache`` namespace).
        port: Port to bind on ``127.0.0.1``; 0 picks a free one. After
            :meth:`stop`, :meth:`start` binds the same port again.
        build: What ``build`` answers (keep it >= 6.0 for batch writes).
        cluster_name: What ``cluster-name`` answers.

    Thread safety: every public method may be called from any thread; the
    server handles each connection in its own thread.
    """

    def __init__(
        self,
        namespaces: list[NamespaceConfig] | None = None,
        *,
        port: int = 0,
        build: str = "8.1.2.0",
        cluster_name: str = "kvtier-test",
        node_name: str = "BB9A1B2C3D4E5F6",
    ) -> None:
        self.namespaces = {ns.name: ns for ns in (namespaces or [NamespaceConfig()])}
        self.build = build
        self.cluster_name = cluster_name
        self.node_name = node_name
        self.host = "127.0.0.1"
        self.port = port
        self.latency = 0.0
        """Seconds to wait before answering each message (not info) command."""
        self.refuse_connections = False
        """Close every new connection at once (the client sees a reset)."""
        self.stop_writes = False
        """Answer writes with error 8 (stop-writes); reads and deletes keep working."""
        self.counts: collections.Counter[str] = collections.Counter()
        """Commands served, by kind: info, read, exists, write, touch, delete, batch,
        batch_rows, batch_repeat_rows, read_touch, dropped, failed."""
        self.largest_message = 0
        """Size in bytes of the largest message (not info) request received."""
        self.bytes_received = 0
        """Bytes of all message (not info) requests received, 8-byte proto headers included."""
        self._records: dict[tuple[str, bytes], StoredRecord] = {}
        self._lock = threading.Lock()
        self._clock_offset = 0
        self._faults: collections.deque[_Fault | None] = collections.deque()
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._stopping = threading.Event()

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> AerospikeTestServer:
        """Listen and serve (on the same port as before after a :meth:`stop`)."""
        if self._listener is not None:
            return self
        aerospike_usage.note(aerospike_usage.EMULATOR)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(64)
        self.port = sock.getsockname()[1]
        self._listener = sock
        self._stopping.clear()
        self._accept_thread = threading.Thread(
            target=self._accept_loop, args=(sock,), name="as-test-accept", daemon=True
        )
        self._accept_thread.start()
        return self

    def stop(self) -> None:
        """Stop listening, close every connection and join the threads. Records are kept."""
        self._stopping.set()
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=5)
            self._accept_thread = None
        threads = self.drop_connections()
        for t in threads:
            t.join(timeout=5)

    def __enter__(self) -> AerospikeTestServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def address(self) -> str:
        """``"127.0.0.1:<port>"``."""
        return f"{self.host}:{self.port}"

    # -- fault injection --------------------------------------------------------

    def fail_next(self, code: int, count: int = 1, *, skip: int = 0) -> None:
        """Answer ``count`` message commands with result ``code`` (a batch fails whole).

        Faults form one queue: each message command takes the next entry;
        ``skip`` queues that many untouched commands first.
        """
        self._queue(_Fault("fail", code=code), count, skip)

    def drop_next(self, count: int = 1, *, after_apply: bool = False, skip: int = 0) -> None:
        """Close the connection instead of answering ``count`` message commands.

        Args:
            after_apply: Apply the command first (a write lands but its reply
                is lost: the client sees an in-doubt failure).
            skip: Commands to let through first (see :meth:`fail_next`).
        """
        self._queue(_Fault("drop", after_apply=after_apply), count, skip)

    def delay_next(self, seconds: float, count: int = 1, *, skip: int = 0) -> None:
        """Hold ``count`` message commands for ``seconds`` before applying them.

        As on a real server, a request that has fully arrived is applied
        even if its client gives up or dies meanwhile.
        """
        self._queue(_Fault("delay", seconds=seconds), count, skip)

    def _queue(self, fault: _Fault, count: int, skip: int) -> None:
        with self._lock:
            self._faults.extend([None] * skip + [fault] * count)

    def drop_connections(self) -> list[threading.Thread]:
        """Close every open client connection now; returns their handler threads."""
        with self._lock:
            conns = list(self._conns.items())
        for conn, _ in conns:
            # NOTE: the peer may have closed it already; shutting it down is then moot.
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        return [t for _, t in conns]

    def clear_faults(self) -> None:
        """Remove latency, queued failures and drops, stop-writes and refusal."""
        with self._lock:
            self._faults.clear()
        self.latency = 0.0
        self.stop_writes = False
        self.refuse_connections = False

    def advance_clock(self, seconds: int) -> None:
        """Move the server's clock forward (records expire, read-touch thresholds pass)."""
        with self._lock:
            self._clock_offset += seconds

    # -- inspection -------------------------------------------------------------

    def message_count(self) -> int:
        """Message commands (not info) served so far: one per client round trip."""
        with self._lock:
            return sum(
                v
                for k, v in self.counts.items()
                if k in ("read", "exists", "write", "touch", "delete", "batch")
            )

    def reset_counts(self) -> None:
        """Zero :attr:`counts` and :attr:`bytes_received`."""
        with self._lock:
            self.counts.clear()
            self.bytes_received = 0

    def record(self, namespace: str, digest: bytes) -> StoredRecord | None:
        """The live record with this digest, or ``None``."""
        with self._lock:
            return self._live(namespace, bytes(digest))

    def digests(self, namespace: str) -> list[bytes]:
        """Digests of the live records in ``namespace``."""
        with self._lock:
            return [
                d
                for (ns, d) in list(self._records)
                if ns == namespace and self._live(ns, d) is not None
            ]

    def remove_record(self, namespace: str, digest: bytes) -> bool:
        """Delete a record behind the client's back (as eviction would)."""
        with self._lock:
            return self._records.pop((namespace, bytes(digest)), None) is not None

    def used_bytes(self, namespace: str) -> int:
        with self._lock:
            return sum(r.flat_size() for (ns, _), r in self._records.items() if ns == namespace)

    # -- internals: network -----------------------------------------------------

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._stopping.is_set():
            try:
                ready, _, _ = select.select([listener], [], [], 0.05)
            except (OSError, ValueError):
                return
            if not ready:
                continue
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            if self.refuse_connections or self._stopping.is_set():
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t = threading.Thread(
                target=self._serve_conn, args=(conn,), name="as-test-conn", daemon=True
            )
            with self._lock:
                self._conns[conn] = t
            t.start()

    def _serve_conn(self, conn: socket.socket) -> None:
        try:
            while not self._stopping.is_set():
                header = _recv_exact(conn, 8)
                if header is None:
                    return
                (word,) = _PROTO.unpack(header)
                version, msg_type, size = word >> 56, (word >> 48) & 0xFF, word & 0xFFFFFFFFFFFF
                if (
                    version != PROTO_VERSION
                    or size > MAX_BODY
                    or msg_type not in (TYPE_INFO, TYPE_MESSAGE)
                ):
                    return
                body = _recv_exact(conn, size)
                if body is None:
                    return
                if msg_type == TYPE_MESSAGE:
                    with self._lock:
                        self.largest_message = max(self.largest_message, size)
                        self.bytes_received += len(header) + size
                if msg_type == TYPE_INFO:
                    reply = self._handle_info(bytes(body))
                    conn.sendall(_proto(TYPE_INFO, reply) + reply)
                    continue
                for chunk in self._handle_message(body):
                    conn.sendall(chunk)
        except (_Drop, OSError):
            return
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    # -- internals: info --------------------------------------------------------

    def _handle_info(self, body: bytes) -> bytes:
        with self._lock:
            self.counts["info"] += 1
        names = [n for n in body.decode(errors="replace").split("\n") if n]
        out = []
        for name in names:
            out.append(f"{name}\t{self._info_value(name)}\n")
        return "".join(out).encode()

    def _info_value(self, name: str) -> str:
        if name == "node":
            return self.node_name
        if name == "build":
            return self.build
        if name == "edition":
            return "Aerospike Community Edition"
        if name == "version":
            return f"Aerospike Community Edition build {self.build}"
        if name == "cluster-name":
            return self.cluster_name
        if name == "features":
            return "batch-any;batch-index;blob-bits;cdt-list;cdt-map;float;geo;peers;pipelining;pquery;pscans;query-show;replicas;truncate-namespace;udf"
        if name in ("partition-generation", "peers-generation", "rebalance-generation"):
            return "1"
        if name.startswith("peers-"):
            return f"1,{self.port},[]"
        if name == "replicas":
            bitmap = base64.b64encode(b"\xff" * 512).decode()
            return ";".join(f"{ns}:0,1,{bitmap}" for ns in self.namespaces)
        if name == "rack-ids":
            return ";".join(f"{ns}:0" for ns in self.namespaces)
        if name == "namespaces":
            return ";".join(self.namespaces)
        if name.startswith("namespace/"):
            return self._namespace_info(name.removeprefix("namespace/"))
        if name.startswith("sets/"):
            return self._set_info(name.removeprefix("sets/"))
        if name.startswith("user-agent-set:"):
            return "ok"
        return "ERROR::unrecognized command"

    def _set_info(self, path: str) -> str:
        ns_name, _, set_name = path.partition("/")
        if ns_name not in self.namespaces:
            return "ns_type=unknown"
        with self._lock:
            now = self._now()
            live = [
                r
                for (n, _), r in self._records.items()
                if n == ns_name
                and r.set_name == set_name
                and not (r.void_time and r.void_time <= now)
            ]
        if not live:
            return ""
        used = sum(r.flat_size() for r in live)
        return f"objects={len(live)}:tombstones=0:data_used_bytes={used}:truncate_lut=0:sindexes=0:index_populating=false:truncating=false;"

    def _namespace_info(self, ns_name: str) -> str:
        ns = self.namespaces.get(ns_name)
        if ns is None:
            return "type=unknown"
        with self._lock:
            now = self._now()
            live = [
                r
                for (n, _), r in self._records.items()
                if n == ns_name and not (r.void_time and r.void_time <= now)
            ]
        used = sum(r.flat_size() for r in live)
        fields = [
            ("ns_cluster_size", 1),
            ("effective_replication_factor", 1),
            ("objects", len(live)),
            ("tombstones", 0),
            ("stop_writes", "true" if self.stop_writes else "false"),
            ("current_time", now),
            ("data_total_bytes", ns.data_size),
            ("data_used_bytes", used),
            ("data_used_pct", used * 100 // ns.data_size),
            ("data_avail_pct", 100 - used * 100 // ns.data_size),
            ("allow-ttl-without-nsup", "true" if ns.allow_ttl_without_nsup else "false"),
            ("default-read-touch-ttl-pct", ns.default_read_touch_ttl_pct),
            ("default-ttl", ns.default_ttl),
            ("nsup-period", ns.nsup_period),
            ("replication-factor", 1),
            ("storage-engine", "memory"),
            ("storage-engine.data-size", ns.data_size),
            ("storage-engine.stop-writes-used-pct", 70),
        ]
        if ns.legacy_write_block_size:
            fields.append(("storage-engine.write-block-size", ns.max_record_size))
        else:
            fields.append(("max-record-size", ns.max_record_size))
        return ";".join(f"{k}={v}" for k, v in fields)

    # -- internals: messages ----------------------------------------------------

    def _handle_message(self, body: bytearray) -> Iterator[bytes]:
        with self._lock:
            fault = self._faults.popleft() if self._faults else None
        if self.latency > 0 and self._stopping.wait(self.latency):
            raise _Drop
        if fault is not None and fault.kind == "delay" and self._stopping.wait(fault.seconds):
            raise _Drop
        if fault is not None and fault.kind == "drop" and not fault.after_apply:
            self._count("dropped")
            raise _Drop
        drop_after = fault is not None and fault.kind == "drop"
        _, info1, info2, info3, _, _, gen, record_ttl, _, n_fields, n_ops = _MSG.unpack_from(
            body, 0
        )
        fields, off = _parse_fields(body, _MSG.size, n_fields)
        is_batch = FIELD_BATCH_INDEX in fields
        if fault is not None and fault.kind == "fail":
            self._count("failed")
            self._count("batch" if is_batch else _kind(info1, info2, []))
            yield _single_reply(_Result(fault.code), last=is_batch)
            return
        if is_batch:
            replies = self._batch(fields[FIELD_BATCH_INDEX])
            if drop_after:
                self._count("dropped")
                raise _Drop
            yield from replies
            return
        ops, _ = _parse_ops(body, off, n_ops)
        req = _Request(info1, info2, info3, gen, record_ttl, *_request_fields(fields), ops)
        self._count(_kind(info1, info2, ops))
        result = self._execute(req)
        if drop_after:
            self._count("dropped")
            raise _Drop
        yield _single_reply(result, last=False)

    def _batch(self, data: bytes) -> list[bytes]:
        n_rows, _flags = struct.unpack_from(">IB", data, 0)
        off = 5
        prev: _Request | None = None
        rows: list[tuple[int, _Request]] = []
        repeats = 0
        for _ in range(n_rows):
            index, digest, row_type = _ROW.unpack_from(data, off)
            off += _ROW.size
            if row_type & BATCH_REPEAT:
                if prev is None:
                    raise _Drop  # malformed: REPEAT on the first row
                req = dataclasses.replace(prev, digest=digest, user_key=None)
                repeats += 1
            else:
                info1 = data[off]
                off += 1
                info2 = info3 = 0
                if row_type & BATCH_INFO:
                    info2, info3 = data[off], data[off + 1]
                    off += 2
                if row_type & BATCH_INFO4:
                    off += 1
                gen = ttl = 0
                if row_type & BATCH_GEN:
                    (gen,) = struct.unpack_from(">H", data, off)
                    off += 2
                if row_type & BATCH_TTL:
                    (ttl,) = struct.unpack_from(">I", data, off)
                    off += 4
                n_fields, n_ops = struct.unpack_from(">HH", data, off)
                off += 4
                fields, off = _parse_fields(data, off, n_fields)
                ops, off = _parse_ops(data, off, n_ops)
                ns, set_name, _, user_key = _request_fields(fields)
                req = _Request(info1, info2, info3, gen, ttl, ns, set_name, digest, user_key, ops)
            prev = req
            rows.append((index, req))
        self._count("batch")
        self._count("batch_rows", len(rows))
        self._count("batch_repeat_rows", repeats)
        out: list[bytes] = []
        chunk = bytearray()
        for index, req in rows:
            result = self._execute(req)
            chunk += _row_reply(result, index)
            if len(chunk) >= _RESPONSE_CHUNK:
                out.append(_proto(TYPE_MESSAGE, chunk) + chunk)
                chunk = bytearray()
        chunk += _MSG.pack(22, 0, 0, INFO3_LAST, 0, OK, 0, 0, 0, 0, 0)
        out.append(_proto(TYPE_MESSAGE, chunk) + bytes(chunk))
        return out

    def _count(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self.counts[kind] += n

    # -- internals: record semantics --------------------------------------------

    def _now(self) -> int:
        return int(time.time()) - CITRUSLEAF_EPOCH + self._clock_offset

    def _live(self, ns: str, digest: bytes) -> StoredRecord | None:
        rec = self._records.get((ns, digest))
        if rec is not None and rec.void_time and rec.void_time <= self._now():
            del self._records[(ns, digest)]
            return None
        return rec

    def _execute(self, req: _Request) -> _Result:
        if req.namespace is None or req.digest is None:
            return _Result(ERR_PARAMETER)
        ns = self.namespaces.get(req.namespace)
        if ns is None:
            return _Result(ERR_NAMESPACE)
        with self._lock:
            if req.info2 & INFO2_WRITE:
                if req.info2 & INFO2_DELETE:
                    return self._delete(ns, req)
                return self._write(ns, req)
            if req.info1 & INFO1_READ:
                return self._read(ns, req)
        return _Result(ERR_PARAMETER)

    def _read(self, ns: NamespaceConfig, req: _Request) -> _Result:
        assert req.digest is not None
        rec = self._live(ns.name, req.digest)
        if rec is None:
            return _Result(ERR_NOT_FOUND)
        result = _Result(OK, rec.generation, rec.void_time)
        if not req.info1 & INFO1_NOBINDATA:
            if req.info1 & INFO1_GET_ALL or not req.ops:
                result.bins = [(name, p, v) for name, (p, v) in rec.bins.items()]
            else:
                for op, _, name, _ in req.ops:
                    if op != OP_READ:
                        return _Result(ERR_PARAMETER)
                    if name in rec.bins:
                        p, v = rec.bins[name]
                        result.bins.append((name, p, v))
        pct = req.record_ttl
        if pct == 0:
            pct = ns.default_read_touch_ttl_pct
        elif pct == READ_TOUCH_NEVER:
            pct = 0
        elif pct > 100:
            return _Result(ERR_PARAMETER)
        if pct and rec.void_time:
            # NOTE: the same arithmetic as the server's as_read_touch_check(); the
            # reply carries the old void-time, the touch lands after it.
            write_ttl = rec.void_time - rec.last_update
            now = self._now()
            if now >= rec.void_time - write_ttl * pct // 100:
                rec.void_time = now + write_ttl
                rec.last_update = now
                rec.generation = _next_generation(rec.generation)
                self.counts["read_touch"] += 1
        return result

    def _delete(self, ns: NamespaceConfig, req: _Request) -> _Result:
        assert req.digest is not None
        rec = self._live(ns.name, req.digest)
        if rec is None:
            return _Result(ERR_NOT_FOUND)
        if req.info2 & INFO2_GENERATION and rec.generation != req.generation:
            return _Result(ERR_GENERATION)
        del self._records[(ns.name, req.digest)]
        return _Result(OK)

    def _write(self, ns: NamespaceConfig, req: _Request) -> _Result:
        assert req.digest is not None
        if self.stop_writes:
            return _Result(ERR_OUT_OF_SPACE)
        rec = self._live(ns.name, req.digest)
        if rec is not None and req.info2 & INFO2_CREATE_ONLY:
            return _Result(ERR_EXISTS)
        if rec is None and req.info3 & (INFO3_UPDATE_ONLY | INFO3_REPLACE_ONLY):
            return _Result(ERR_NOT_FOUND)
        if rec is not None and req.info2 & INFO2_GENERATION and rec.generation != req.generation:
            return _Result(ERR_GENERATION)
        ttl = req.record_ttl
        if ttl == TTL_DONT_UPDATE and rec is None:
            ttl = TTL_NAMESPACE_DEFAULT
        if not (ttl <= MAX_ALLOWED_TTL or ttl in (TTL_NEVER_EXPIRE, TTL_DONT_UPDATE)):
            return _Result(ERR_PARAMETER)
        uses_ttl = (0 < ttl <= MAX_ALLOWED_TTL) or (
            ttl == TTL_NAMESPACE_DEFAULT and ns.default_ttl != 0
        )
        if uses_ttl and ns.nsup_period == 0 and not ns.allow_ttl_without_nsup:
            return _Result(ERR_FORBIDDEN)
        replace = bool(req.info3 & (INFO3_CREATE_OR_REPLACE | INFO3_REPLACE_ONLY))
        bins = {} if rec is None or replace else dict(rec.bins)
        reads: list[str] = []
        delete = touched = False
        for op, particle, name, value in req.ops:
            if op == OP_WRITE:
                if particle == PARTICLE_NULL:
                    bins.pop(name, None)
                else:
                    bins[name] = (particle, bytes(value))
            elif op == OP_TOUCH:
                touched = True
            elif op == OP_READ:
                reads.append(name)
            elif op == OP_DELETE:
                delete = True
            else:
                return _Result(ERR_PARAMETER)
        if (
            rec is None
            and (touched or delete)
            and not any(op == OP_WRITE for op, _, _, _ in req.ops)
        ):
            return _Result(ERR_NOT_FOUND)
        if delete or not bins:
            self._records.pop((ns.name, req.digest), None)
            return _Result(OK)
        now = self._now()
        if ttl == TTL_NAMESPACE_DEFAULT:
            void_time = now + ns.default_ttl if ns.default_ttl else 0
        elif ttl == TTL_NEVER_EXPIRE:
            void_time = 0
        elif ttl == TTL_DONT_UPDATE:
            assert rec is not None
            void_time = rec.void_time
        else:
            void_time = now + ttl
        new = StoredRecord(
            set_name=req.set_name,
            bins=bins,
            generation=_next_generation(rec.generation) if rec is not None else 1,
            void_time=void_time,
            last_update=now,
            user_key=req.user_key if req.user_key is not None else (rec.user_key if rec else None),
        )
        if new.flat_size() > ns.max_record_size:
            return _Result(ERR_RECORD_TOO_BIG)
        self._records[(ns.name, req.digest)] = new
        out = [(name, *bins[name]) for name in reads if name in bins]
        return _Result(OK, new.generation, new.void_time, out)


# --- helpers -------------------------------------------------------------------------


def _recv_exact(conn: socket.socket, n: int) -> bytearray | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = conn.recv_into(view[got:], min(n - got, 4 * 1024 * 1024))
        if k == 0:
            return None
        got += k
    return buf


def _parse_fields(data: bytes | bytearray, off: int, n: int) -> tuple[dict[int, bytes], int]:
    fields: dict[int, bytes] = {}
    for _ in range(n):
        size, ftype = _FIELD.unpack_from(data, off)
        start = off + _FIELD.size
        fields[ftype] = bytes(data[start : start + size - 1])
        off = start + size - 1
    return fields, off


def _parse_ops(
    data: bytes | bytearray, off: int, n: int
) -> tuple[list[tuple[int, int, str, bytes]], int]:
    ops = []
    for _ in range(n):
        size, op, particle, _flags, name_len = _OP.unpack_from(data, off)
        name_start = off + _OP.size
        name = bytes(data[name_start : name_start + name_len]).decode()
        value_start = name_start + name_len
        value_end = off + 4 + size
        ops.append((op, particle, name, bytes(data[value_start:value_end])))
        off = value_end
    return ops, off


def _request_fields(fields: dict[int, bytes]) -> tuple[str | None, str, bytes | None, bytes | None]:
    ns = fields[FIELD_NAMESPACE].decode() if FIELD_NAMESPACE in fields else None
    set_name = fields.get(FIELD_SET, b"").decode()
    return ns, set_name, fields.get(FIELD_DIGEST), fields.get(FIELD_KEY)


def _kind(info1: int, info2: int, ops: list[tuple[int, int, str, bytes]]) -> str:
    if info2 & INFO2_WRITE:
        if info2 & INFO2_DELETE:
            return "delete"
        if ops and all(op == OP_TOUCH for op, _, _, _ in ops):
            return "touch"
        return "write"
    return "exists" if info1 & INFO1_NOBINDATA else "read"


def _next_generation(gen: int) -> int:
    return gen + 1 if gen < 0xFFFF else 1


def _ops_bytes(bins: list[tuple[str, int, bytes]]) -> bytes:
    out = bytearray()
    for name, particle, value in bins:
        raw = name.encode()
        out += _OP.pack(4 + len(raw) + len(value), OP_READ, particle, 0, len(raw))
        out += raw
        out += value
    return bytes(out)


def _single_reply(result: _Result, *, last: bool) -> bytes:
    body = _MSG.pack(
        22,
        0,
        0,
        INFO3_LAST if last else 0,
        0,
        result.code,
        result.generation,
        result.void_time,
        0,
        0,
        len(result.bins),
    )
    body += _ops_bytes(result.bins)
    return _proto(TYPE_MESSAGE, body) + body


def _row_reply(result: _Result, index: int) -> bytes:
    head = _MSG.pack(
        22, 0, 0, 0, 0, result.code, result.generation, result.void_time, index, 0, len(result.bins)
    )
    return head + _ops_bytes(result.bins)
