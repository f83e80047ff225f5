"""Where the Aerospike tier tests run: a real server when there is one, else the emulator.

The backend is chosen once per test run (:func:`backend`), in this order:

1. ``../shared/aerospike`` beside the repository: a real Aerospike CE
   cluster started for the run (:func:`session_cluster`: 2 nodes, the
   namespace of ``deploy/aerospike/aerospike.conf``), stopped at its end.
2. Else ``KVTIER_AEROSPIKE_HOST=host:port``: that real server (namespace
   ``KVTIER_AEROSPIKE_NAMESPACE``, default ``kvcache``; an in-memory namespace
   with nsup on; tests change its ``max-record-size`` with ``set-config`` and
   restore it).
3. Else the protocol-level emulator
   (:class:`~tests.support.aerospike_server.AerospikeTestServer`).

Each target gets its own set, so tests do not see each other's records.
Tests that need what a real server cannot do on demand (a chosen wire-level
fault, a malformed or legacy reply, the server's clock) use the emulator
whatever the backend, and say why with ``@pytest.mark.aerospike_emulator(reason)``.

Which server each test touched is noted (:mod:`tests.support.aerospike_usage`)
and reported at the end of the run by ``tests/conftest.py``.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from typing import Any

import aerospike

from tests.support import aerospike_cluster
from tests.support.aerospike_cluster import AerospikeCluster
from tests.support.aerospike_server import AerospikeTestServer, NamespaceConfig
from tests.support.aerospike_usage import CLUSTER, EMULATOR, EXTERNAL, note

HOST_ENV = "KVTIER_AEROSPIKE_HOST"
NAMESPACE_ENV = "KVTIER_AEROSPIKE_NAMESPACE"

_cluster: AerospikeCluster | None = None
_cluster_error: Exception | None = None
_cluster_lock = threading.Lock()
_cluster_description = ""


def real_server_address() -> str | None:
    """``host:port`` of an external real server to test against, if the environment names one."""
    return os.environ.get(HOST_ENV) or None


def backend() -> str:
    """:data:`EXTERNAL`, :data:`CLUSTER` or :data:`EMULATOR` (see the module docstring)."""
    if aerospike_cluster.available():
        return CLUSTER
    if real_server_address():
        return EXTERNAL
    return EMULATOR


def session_cluster() -> AerospikeCluster:
    """The real cluster of this test run, started on first use and stopped at exit.

    Raises:
        aerospike_cluster.ClusterError: it could not be started (every later call too).
    """
    global _cluster, _cluster_error, _cluster_description
    with _cluster_lock:
        if _cluster_error is not None:
            raise _cluster_error
        if _cluster is None:
            try:
                _cluster = AerospikeCluster(nodes=2).start()
            except Exception as e:
                _cluster_error = e
                raise
            _cluster_description = _cluster.describe()
            atexit.register(stop_session_cluster)
        note(CLUSTER)
        return _cluster


def running_cluster() -> AerospikeCluster | None:
    """The session cluster if it was started."""
    return _cluster


def stop_session_cluster() -> None:
    global _cluster
    with _cluster_lock:
        if _cluster is not None:
            _cluster.stop()
            _cluster = None


class Target:
    """A server the tier tests talk to, with the few inspection hooks they need."""

    real: bool
    address: str
    namespace: str
    set_name: str

    def record_count(self) -> int:
        """Live records in this target's set."""
        raise NotImplementedError

    def remove(self, key: bytes) -> bool:
        """Delete one record behind the tier's back (as eviction would)."""
        raise NotImplementedError

    def overwrite(self, key: bytes, bin_name: str, value: bytes) -> None:
        """Replace one bin of a record (to damage it)."""
        raise NotImplementedError

    def generation(self, key: bytes) -> int | None:
        """The record's generation, ``None`` if there is no such record."""
        raise NotImplementedError

    def ttl(self, key: bytes) -> int | None:
        """Seconds the record has left, ``None`` if there is no such record."""
        raise NotImplementedError

    def capacity(self) -> int:
        """The namespace's data capacity, summed over nodes."""
        raise NotImplementedError

    def cluster_name(self) -> str:
        raise NotImplementedError

    def set_max_record_size(self, size: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class InProcessTarget(Target):
    """The in-process protocol-level test server."""

    real = False

    def __init__(self, max_record_size: int = 1024 * 1024) -> None:
        self.namespace = "kvcache"
        self.set_name = "kvblocks"
        self.server = AerospikeTestServer(
            [NamespaceConfig(max_record_size=max_record_size)]
        ).start()
        self.address = self.server.address

    def _digest(self, key: bytes) -> bytes:
        return bytes(aerospike.calc_digest(self.namespace, self.set_name, bytearray(key)))

    def record_count(self) -> int:
        return len(self.server.digests(self.namespace))

    def remove(self, key: bytes) -> bool:
        return self.server.remove_record(self.namespace, self._digest(key))

    def overwrite(self, key: bytes, bin_name: str, value: bytes) -> None:
        rec = self.server.record(self.namespace, self._digest(key))
        assert rec is not None
        particle, _ = rec.bins[bin_name]
        rec.bins[bin_name] = (particle, value)

    def generation(self, key: bytes) -> int | None:
        rec = self.server.record(self.namespace, self._digest(key))
        return None if rec is None else rec.generation

    def ttl(self, key: bytes) -> int | None:
        client = aerospike.client({"hosts": [(self.server.host, self.server.port)]})
        try:
            _, meta = client.exists((self.namespace, self.set_name, bytearray(key)))
        finally:
            client.close()
        return None if meta is None else int(meta["ttl"])

    def capacity(self) -> int:
        return self.server.namespaces[self.namespace].data_size

    def cluster_name(self) -> str:
        return self.server.cluster_name

    def set_max_record_size(self, size: int) -> None:
        self.server.namespaces[self.namespace].max_record_size = size

    def close(self) -> None:
        self.server.stop()


class RealServerTarget(Target):
    """A real Aerospike server or cluster; one fresh set per target.

    Args:
        address: A seed ``host:port``.
        namespace: The namespace the tests use.
        max_record_size: Set on every node for this target (restored at :meth:`close`).
    """

    real = True

    def __init__(self, address: str, namespace: str, max_record_size: int = 1024 * 1024) -> None:
        host, _, port = address.rpartition(":")
        self.address = address
        self.namespace = namespace
        self.set_name = "t" + os.urandom(6).hex()
        self._client: Any = aerospike.client({"hosts": [(host, int(port))]})
        self._original_cap = int(self._namespace_infos()[0]["max-record-size"])
        self.set_max_record_size(max_record_size)

    def _info_all(self, command: str) -> list[str]:
        replies = self._client.info_all(command)
        out = []
        for error, text in replies.values():
            assert error is None and text is not None, (command, error)
            out.append(text.split("\t", 1)[1].strip() if "\t" in text else text.strip())
        return out

    def _namespace_infos(self) -> list[dict[str, str]]:
        return [
            aerospike_cluster.parse_pairs(t) for t in self._info_all(f"namespace/{self.namespace}")
        ]

    def _key(self, key: bytes) -> tuple[str, str, bytearray]:
        return (self.namespace, self.set_name, bytearray(key))

    def record_count(self) -> int:
        # A scan of the set: every record once, whatever the replication factor.
        query = self._client.query(self.namespace, self.set_name)
        query.select()
        count = [0]

        def one(_record: Any) -> None:
            count[0] += 1

        query.foreach(one, options={"nobins": True})
        return count[0]

    def remove(self, key: bytes) -> bool:
        try:
            self._client.remove(self._key(key))
        except aerospike.exception.RecordNotFound:
            return False
        return True

    def overwrite(self, key: bytes, bin_name: str, value: bytes) -> None:
        self._client.put(
            self._key(key), {bin_name: value}, policy={"ttl": aerospike.TTL_DONT_UPDATE}
        )

    def generation(self, key: bytes) -> int | None:
        _, meta = self._client.exists(self._key(key))
        return None if meta is None else int(meta["gen"])

    def ttl(self, key: bytes) -> int | None:
        _, meta = self._client.exists(self._key(key))
        return None if meta is None else int(meta["ttl"])

    def capacity(self) -> int:
        return sum(int(i["data_total_bytes"]) for i in self._namespace_infos())

    def cluster_name(self) -> str:
        return self._info_all("cluster-name")[0]

    def set_max_record_size(self, size: int) -> None:
        # Every node: the tier uses the smallest cap of the cluster.
        command = f"set-config:context=namespace;id={self.namespace};max-record-size={size}"
        for reply in self._info_all(command):
            assert reply == "ok", reply

    def close(self) -> None:
        # NOTE: retried: right after a node restarted, the client's next info call to it
        # can time out on a connection of the old process.
        for attempt in range(20):
            try:
                self._client.truncate(self.namespace, self.set_name, 0)
                self.set_max_record_size(self._original_cap)
                break
            except aerospike.exception.AerospikeError:
                if attempt == 19:
                    raise
                time.sleep(0.25)
        self._client.close()


def make_target(max_record_size: int = 1024 * 1024) -> Target:
    """A fresh set on the run's real server (see :func:`backend`), else a fresh emulator."""
    kind = backend()
    if kind == EXTERNAL:
        address = real_server_address()
        assert address is not None
        note(EXTERNAL)
        return RealServerTarget(address, os.environ.get(NAMESPACE_ENV, "kvcache"), max_record_size)
    if kind == CLUSTER:
        cluster = session_cluster()
        return RealServerTarget(cluster.address, cluster.namespace, max_record_size)
    return InProcessTarget(max_record_size)


def describe_backend() -> str:
    """One line for the test summary: which real server this run used."""
    kind = backend()
    if kind == EXTERNAL:
        return f"the real server at {HOST_ENV}={real_server_address()}"
    if kind == CLUSTER:
        started = _cluster_description or "a real cluster (it did not start)"
        return f"{started}, started from {os.path.relpath(aerospike_cluster.SHARED)}"
    return (
        f"none: {os.path.relpath(aerospike_cluster.SHARED)} is absent and {HOST_ENV} is unset, "
        "so every Aerospike test used the emulator (tests/support/aerospike_server.py)"
    )
