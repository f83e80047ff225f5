"""Where the Aerospike tier tests run: the in-process test server, or a real server.

By default tests use :class:`~tests.support.aerospike_server.AerospikeTestServer`.
With ``KVTIER_AEROSPIKE_HOST=host:port`` set, the tests written against a
:class:`Target` run against that real server instead (namespace
``KVTIER_AEROSPIKE_NAMESPACE``, default ``kvcache``; it must be an in-memory
namespace with nsup on, and the tests change its ``max-record-size`` with
``set-config`` and restore it). Each target gets its own set, so tests do not
see each other's records. Tests that need fault injection or the server's
clock always use the test server.
"""

from __future__ import annotations

import os
from typing import Any

import aerospike

from tests.support.aerospike_server import AerospikeTestServer, NamespaceConfig

HOST_ENV = "KVTIER_AEROSPIKE_HOST"
NAMESPACE_ENV = "KVTIER_AEROSPIKE_NAMESPACE"


def real_server_address() -> str | None:
    """``host:port`` of a real server to test against, if the environment names one."""
    return os.environ.get(HOST_ENV) or None


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

    def set_max_record_size(self, size: int) -> None:
        self.server.namespaces[self.namespace].max_record_size = size

    def close(self) -> None:
        self.server.stop()


class RealServerTarget(Target):
    """A real Aerospike server named by ``KVTIER_AEROSPIKE_HOST``; one fresh set per target."""

    real = True

    def __init__(self, address: str, max_record_size: int = 1024 * 1024) -> None:
        host, _, port = address.rpartition(":")
        self.address = address
        self.namespace = os.environ.get(NAMESPACE_ENV, "kvcache")
        self.set_name = "t" + os.urandom(6).hex()
        self._client: Any = aerospike.client({"hosts": [(host, int(port))]})
        self._original_cap = int(self._namespace_info()["max-record-size"])
        self.set_max_record_size(max_record_size)

    def _info(self, command: str) -> str:
        text = self._client.info_random_node(command)
        return text.split("\t", 1)[1].strip() if "\t" in text else text.strip()

    def _namespace_info(self) -> dict[str, str]:
        pairs = (
            p.split("=", 1)
            for p in self._info(f"namespace/{self.namespace}").split(";")
            if "=" in p
        )
        return dict(pairs)

    def record_count(self) -> int:
        text = self._info(f"sets/{self.namespace}/{self.set_name}")
        pairs = dict(p.split("=", 1) for p in text.strip(";").split(":") if "=" in p)
        return int(pairs.get("objects", 0))

    def remove(self, key: bytes) -> bool:
        try:
            self._client.remove((self.namespace, self.set_name, bytearray(key)))
        except aerospike.exception.RecordNotFound:
            return False
        return True

    def overwrite(self, key: bytes, bin_name: str, value: bytes) -> None:
        k = (self.namespace, self.set_name, bytearray(key))
        self._client.put(k, {bin_name: value}, policy={"ttl": aerospike.TTL_DONT_UPDATE})

    def set_max_record_size(self, size: int) -> None:
        reply = self._info(
            f"set-config:context=namespace;id={self.namespace};max-record-size={size}"
        )
        assert reply == "ok", reply

    def close(self) -> None:
        self._client.truncate(self.namespace, self.set_name, 0)
        self.set_max_record_size(self._original_cap)
        self._client.close()


def make_target(max_record_size: int = 1024 * 1024) -> Target:
    """The real server if the environment names one, else a fresh test server."""
    address = real_server_address()
    if address:
        return RealServerTarget(address, max_record_size)
    return InProcessTarget(max_record_size)
