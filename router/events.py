"""Following the engines' KV events (``GET /kv_events``, long polling with a cursor).

One task per engine: it reads the events after its cursor, applies them to
the ``PrefixIndex``, and keeps the engine's namespace and block size (the
router computes a prompt's keys in it). A restarted engine has another
``engine_id``: its answer is a snapshot that replaces what the router knew.
An engine that publishes no events (404: vLLM, an engine without them) is
asked again now and then; its G1 stays unknown (empty).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import httpx

from kvtier.keys import CacheNamespace
from kvtier.router.index import PrefixIndex
from kvtier.router.metrics import RouterMetrics

log = logging.getLogger(__name__)

RETRY_S = 1.0  # after a failed read
NO_EVENTS_RETRY_S = 30.0  # after a 404


@dataclass
class EventCursor:
    """Where the router is in one engine's event log."""

    engine_id: str | None = None
    last_seq: int = 0
    namespace: CacheNamespace | None = None
    block_size: int = 16
    supported: bool | None = None  # None until the engine answered once


def apply_page(
    index: PrefixIndex,
    engine: str,
    cursor: EventCursor,
    page: dict[str, Any],
    metrics: RouterMetrics,
) -> None:
    """Applies one ``/kv_events`` answer to the index and moves the cursor.

    Raises:
        ValueError, KeyError, TypeError: for a malformed answer (nothing half-applied
            is kept: the cursor is reset so the next read is a snapshot).
    """
    try:
        ns = page.get("namespace")
        namespace = CacheNamespace.from_json(ns) if ns is not None else None
        block_size = int(page.get("block_size", 16))
        if page.get("reset"):
            snap = page.get("snapshot") or {}
            stored = [bytes.fromhex(k) for k in snap.get("stored", [])]
            saved = [bytes.fromhex(k) for k in snap.get("saved", [])]
            index.reset(engine, stored, saved)
            metrics.kv_events.labels(engine, "snapshot").inc(len(stored) + len(saved))
        for ev in page.get("events", []):
            keys = [bytes.fromhex(k) for k in ev["keys"]]
            kind = ev["type"]
            if kind == "stored":
                index.stored(engine, keys)
            elif kind == "evicted":
                index.evicted(engine, keys)
            elif kind == "saved":
                index.add_saved(keys)
            elif kind == "unsaved":  # the engine's store evicted it from its last tier
                index.remove_saved(keys)
            else:
                continue  # a kind this router does not know: skipped
            metrics.kv_events.labels(engine, kind).inc(len(keys))
        cursor.engine_id = str(page["engine_id"])
        cursor.last_seq = int(page["last_seq"])
        cursor.namespace = namespace
        cursor.block_size = block_size
    except (ValueError, KeyError, TypeError):
        cursor.engine_id, cursor.last_seq = None, 0
        index.forget(engine)
        raise


class EventFollower:
    """Follows every engine's events on the router's loop.

    Args:
        urls: The engines' base URLs.
        client: The HTTP client.
        index: Where the events go.
        metrics: Counts applied keys.
        wait_s: Long-poll time of one read.
        headers: Sent with every read (an API key).
    """

    def __init__(
        self,
        urls: list[str],
        client: httpx.AsyncClient,
        index: PrefixIndex,
        metrics: RouterMetrics,
        *,
        wait_s: float = 5.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.cursors = {u: EventCursor() for u in urls}
        self._client = client
        self._index = index
        self._metrics = metrics
        self._wait_s = wait_s
        self._headers = headers or {}
        self._tasks: list[asyncio.Task[None]] = []
        self._given: dict[str, tuple[CacheNamespace, int]] = {}

    def set_namespace(self, url: str, namespace: CacheNamespace, block_size: int) -> None:
        """The namespace of an engine whose events come another way (vLLM's, over ZMQ)."""
        self._given[url] = (namespace, block_size)

    def namespace(self, url: str) -> tuple[CacheNamespace, int] | None:
        """The namespace and block size of ``url``'s keys (None until known)."""
        if url in self._given:
            return self._given[url]
        c = self.cursors.get(url)
        if c is None or c.namespace is None:
            return None
        return c.namespace, c.block_size

    def engine_down(self, url: str) -> None:
        """An engine was taken out: what it held is unknown until it answers again."""
        self._index.forget(url)
        c = self.cursors.get(url)
        if c is not None:
            c.engine_id, c.last_seq = None, 0

    async def read_once(self, url: str, wait_s: float) -> None:
        """One read of ``url``'s events, applied.

        Raises:
            httpx.HTTPError, ValueError: when it failed (the caller retries).
        """
        c = self.cursors[url]
        params: dict[str, Any] = {"after": c.last_seq, "wait_s": wait_s}
        if c.engine_id is not None:
            params["engine_id"] = c.engine_id
        r = await self._client.get(
            url + "/kv_events", params=params, headers=self._headers, timeout=wait_s + 10.0
        )
        if r.status_code == 404:
            c.supported = False
            return
        r.raise_for_status()
        c.supported = True
        apply_page(self._index, url, c, r.json(), self._metrics)

    async def _follow(self, url: str) -> None:
        while True:
            try:
                await self.read_once(url, self._wait_s)
                if self.cursors[url].supported is False:
                    await asyncio.sleep(NO_EVENTS_RETRY_S)
            except (httpx.HTTPError, ValueError) as e:
                log.debug("kv events of %s: %s", url, e)
                await asyncio.sleep(RETRY_S)

    def follow(self, url: str) -> None:
        """Follows one more engine (one that joined at runtime; on the serving loop)."""
        if url in self.cursors:
            return
        self.cursors[url] = EventCursor()
        if self._tasks:
            self._tasks.append(asyncio.get_running_loop().create_task(self._follow(url)))

    def start(self) -> None:
        """Starts one follower task per engine (call on the serving loop)."""
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._follow(u)) for u in self.cursors]

    async def stop(self) -> None:
        """Stops following."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []
