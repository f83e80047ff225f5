"""Networked peers for ``bench/store.py``: a ``kvtier serve`` process and a Redis server.

* :class:`ServerProcess` runs ``kvtier serve`` as a subprocess on free
  loopback ports (gRPC and, since ``port`` is 0, the data plane too) with
  CPU-only storage (no disk, no TLS, open), so the figure is the protocol
  and the transport, not a disk.
* :class:`RedisProcess` runs ``redis-server`` on a free port with no
  persistence and an LRU memory cap (the same policy as the CPU tier);
  :class:`RedisTier` puts and gets blocks with redis-py + hiredis, one
  pipelined round trip per batch (SET / GET per key), so it is measured
  through the same :class:`~kvtier.tiers.base.Tier` calls as kvtier's tiers.

Both processes are stopped (SIGTERM, then SIGKILL) when their context exits.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from kvtier.tiers.base import Tier, TierUsage

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ServerProcess:
    """``kvtier serve`` in a subprocess, CPU tier only.

    Args:
        capacity: CPU tier bytes on the server.
        chunk_size: Frame size of the server (bytes).
        threads: gRPC threads of the server.
    """

    def __init__(
        self,
        capacity: int,
        chunk_size: int = 1 << 20,
        threads: int = 8,
        options: dict[str, str] | None = None,
    ) -> None:
        self.capacity = capacity
        self.chunk_size = chunk_size
        self.threads = threads
        self.options = dict(options or {})  # more ``server:`` settings (name -> YAML value)
        self.address = ""
        self._tmp = tempfile.TemporaryDirectory(prefix="kvtier-bench-serve-")
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        tmp = Path(self._tmp.name)
        config = tmp / "serve.yaml"
        max_message = max(4 << 20, self.chunk_size + (1 << 20))
        config.write_text(
            f"tiers:\n  - type: cpu\n    capacity: {self.capacity}\n"
            f"server:\n  host: 127.0.0.1\n  port: 0\n  http_port: null\n  open: true\n"
            f"  threads: {self.threads}\n  chunk_size: {self.chunk_size}\n"
            f"  max_message_size: {max_message}\n"
            + "".join(f"  {k}: {v}\n" for k, v in self.options.items())
        )
        ready = tmp / "ready"
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvtier.cli",
                "serve",
                "--config",
                str(config),
                "--ready-file",
                str(ready),
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 120
        while not (ready.exists() and ready.read_text().endswith("\n")):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                _stop(self._proc)
                raise RuntimeError("kvtier serve did not start")
            time.sleep(0.05)
        self.address = f"127.0.0.1:{ready.read_text().split()[0]}"
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._proc is not None:
            _stop(self._proc)
        self._tmp.cleanup()


class RedisProcess:
    """``redis-server`` on a free loopback port: no RDB, no AOF, ``allkeys-lru`` at ``maxmemory``."""

    def __init__(self, maxmemory: int) -> None:
        self.maxmemory = maxmemory
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def available() -> bool:
        return shutil.which("redis-server") is not None

    def __enter__(self) -> RedisProcess:
        import redis

        self.port = _free_port()
        self._proc = subprocess.Popen(
            [
                "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no",
                "--maxmemory", str(self.maxmemory), "--maxmemory-policy", "allkeys-lru",
                "--protected-mode", "no",
            ],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    _stop(self._proc)
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        client.close()
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._proc is not None:
            _stop(self._proc)


class RedisTier(Tier):
    """Blocks in Redis under their raw 16-byte keys (benchmark peer, not a product tier)."""

    def __init__(self, port: int, name: str = "redis") -> None:
        import redis

        self.name = name
        self._client = redis.Redis(port=port, single_connection_client=True)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        pipe = self._client.pipeline(transaction=False)
        for k in keys:
            pipe.exists(k)
        return [bool(n) for n in pipe.execute()]

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        pipe = self._client.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        return list(pipe.execute())

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        pipe = self._client.pipeline(transaction=False)
        for k, b in items:
            pipe.set(k, b)
        return [bool(ok) for ok in pipe.execute()]

    def delete(self, keys: Sequence[bytes]) -> int:
        return int(self._client.delete(*keys)) if keys else 0

    def usage(self) -> TierUsage:
        return TierUsage(int(self._client.info("memory")["used_memory"]), None, None)

    def close(self) -> None:
        self._client.close()
