"""The hostile tenant of ``bench/soak.py --hostile``: a poisoning writer and stalled streams.

It holds a writer token of the shared namespace the honest clients use, but
is not one of its trusted writers (``server.namespaces``, docs/security.md).
Three threads:

* **poisoner**: puts, under keys the honest clients read, *wrong* blocks
  that are valid in every other respect (bound to their key, a correct
  checksum): first under every key of the key space before the honest
  clients start (so an earlier poisoned block is there when the honest put
  comes), then random batches all the time, some carrying a provenance
  trailer forged to name the honest writer;
* **staller**: keeps up to ``STALLED_STREAMS`` gRPC Put streams open that
  declare a 1 MiB block, send 1 KiB and stop (the server cancels them at its
  idle deadline; they are opened again), and each round opens silent
  data-plane sockets and half-sent HTTP requests;
* nothing else: it never reads what honest clients are served — the soak's
  ledger does, and counts every poisoned block it sees.

Every round of each is counted as an injected fault (``poison``,
``stalled_streams``).
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterator

import grpc

from kvtier.errors import KvtierError
from kvtier.provenance import stamp
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.remote_config import RemoteTierConfig
from kvtier.wire import kvtier_cache_pb2 as pb
from kvtier.wire import kvtier_cache_pb2_grpc as pbg

STALLED_STREAMS = 12
SILENT_SOCKETS = 16
HALF_SENT_HTTP = 16
POISON_BATCH = 16


class Hostile:
    """The hostile tenant's threads (see the module docstring).

    Args:
        address: The cache server's gRPC ``host:port``.
        data_port: Its data plane (0: none).
        http_port: Its HTTP side (0: none).
        token: The hostile tenant's token.
        keys: The key space the honest clients use.
        poison: The wrong block of key ``i``.
        honest_writer: The trusted writer's name (forged into trailers).
        seed: For the random batches.
    """

    def __init__(
        self,
        address: str,
        data_port: int,
        http_port: int,
        token: str,
        keys: list[bytes],
        poison: Callable[[int], bytes],
        honest_writer: str,
        seed: int,
    ) -> None:
        self.address = address
        self.data_port = data_port
        self.http_port = http_port
        self.token = token
        self.keys = keys
        self.poison = poison
        self.honest_writer = honest_writer
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._held: list[socket.socket] = []
        self._tier = RemoteTier(
            RemoteTierConfig(address=address, token=token, timeout_s=2.0, retries=0)
        )

    # -- the poisoner ------------------------------------------------------------

    def _put_poison(self, ids: list[int]) -> None:
        items = []
        for i in ids:
            block = self.poison(i)
            if self.rng.random() < 0.25:  # claim to be the trusted writer
                block = stamp(
                    block, writer=self.honest_writer, secret=b"guess" * 8, scope=self.keys[i]
                )
            items.append((self.keys[i], block))
        try:
            stored = self._tier.put(items)
            self._count("poison_blocks_put", sum(stored))
        except KvtierError:
            self._count("poison_put_failed", len(items))

    def pre_poison(self) -> None:
        """Poison every key before the honest clients start."""
        n = len(self.keys)
        for start in range(0, n, 256):
            self._put_poison(list(range(start, min(n, start + 256))))
        self._count("faults:poison")

    def _poisoner(self) -> None:
        while not self._stop.wait(0.05):
            self._put_poison(self.rng.sample(range(len(self.keys)), POISON_BATCH))
            self._count("faults:poison")

    # -- the staller ---------------------------------------------------------------

    def _stalled(self) -> Iterator[pb.PutBatch]:
        yield pb.PutBatch(frames=[pb.PutFrame(key=self.keys[0], size=1 << 20, data=bytes(1024))])
        self._stop.wait(600)

    def _staller(self) -> None:
        md = (("authorization", f"Bearer {self.token}"),)
        channel = grpc.insecure_channel(self.address)
        stub = pbg.KvCacheStub(channel)
        calls: list[grpc.Future] = []
        try:
            while not self._stop.is_set():
                calls = [c for c in calls if not c.done()]
                for _ in range(STALLED_STREAMS - len(calls)):
                    calls.append(stub.Put.future(self._stalled(), metadata=md, timeout=600))
                self._silent_sockets()
                self._count("faults:stalled_streams")
                self._stop.wait(1.0)
        finally:
            for c in calls:
                c.cancel()
            channel.close()

    def _silent_sockets(self) -> None:
        """Data-plane sockets that never handshake and HTTP requests never finished."""
        held: list[socket.socket] = []
        for port, n, data in (
            (self.data_port, SILENT_SOCKETS, b""),
            (self.http_port, HALF_SENT_HTTP, b"GET /api/stats HTTP/1.1\r\nHost: x\r\n"),
        ):
            if not port:
                continue
            for _ in range(n):
                try:
                    s = socket.create_connection(("127.0.0.1", port), timeout=2)
                    if data:
                        s.sendall(data)
                    held.append(s)
                except OSError:
                    self._count("silent_refused")
        with self._lock:
            old, self._held = self._held, held
        for s in old:  # the previous round's, if the server has not closed them yet
            with contextlib.suppress(OSError):
                s.close()

    # -- running ---------------------------------------------------------------------

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] += n

    def start(self) -> Hostile:
        for target, name in ((self._poisoner, "poisoner"), (self._staller, "staller")):
            t = threading.Thread(target=target, name=f"soak-hostile-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def faults(self) -> Counter[str]:
        """Rounds of each hostile kind, as injected faults."""
        with self._lock:
            return Counter({k.removeprefix("faults:"): v for k, v in self.counts.items()
                            if k.startswith("faults:")})  # fmt: skip

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)
        for s in self._held:
            with contextlib.suppress(OSError):
                s.close()
        self._tier.close()

    def __enter__(self) -> Hostile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
