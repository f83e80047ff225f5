"""Following the shared tier's own events (the cache server's ``GET /tier_events``).

The engines tell the router what they queue for the shared tier (``saved``);
only the tier knows what it actually holds and what it evicts. With
``--tier-events URL`` the router long-polls the cache server's log
(``kvtier.tier_events``) with a cursor: ``stored`` keys join the router's
shared set, ``removed`` keys leave it, and a ``reset`` (the server restarted,
or the router fell behind its ring) replaces the set with the server's
snapshot. A failed read is retried; the set is kept meanwhile (bounded as
always by ``max_saved_keys``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import httpx

from kvtier.router.index import PrefixIndex
from kvtier.router.metrics import RouterMetrics

log = logging.getLogger(__name__)

RETRY_S = 1.0


class TierEventFollower:
    """Follows one cache server's ``/tier_events`` on the router's loop.

    Args:
        url: The cache server's HTTP base URL.
        client: The HTTP client.
        index: Whose shared set follows the tier.
        metrics: Counts applied keys (``engine`` label: ``url``).
        wait_s: Long-poll time of one read.
        token: Bearer token (a server with ``http_require_token``).
    """

    def __init__(
        self,
        url: str,
        client: httpx.AsyncClient,
        index: PrefixIndex,
        metrics: RouterMetrics,
        *,
        wait_s: float = 5.0,
        token: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.log_id: str | None = None
        self.last_seq = 0
        self._client = client
        self._index = index
        self._metrics = metrics
        self._wait_s = wait_s
        self._headers = {"authorization": f"Bearer {token}"} if token else {}
        self._task: asyncio.Task[None] | None = None

    def apply(self, page: dict[str, Any]) -> None:
        """Applies one answer and moves the cursor.

        Raises:
            ValueError, KeyError, TypeError: for a malformed answer (the cursor is
                reset: the next read is a snapshot).
        """
        try:
            count = self._metrics.kv_events
            if page.get("reset"):
                snap = [bytes.fromhex(k) for k in (page.get("snapshot") or {}).get("stored", [])]
                self._index.replace_saved(snap)
                count.labels(self.url, "tier_snapshot").inc(len(snap))
            for ev in page.get("events", []):
                keys = [bytes.fromhex(k) for k in ev["keys"]]
                if ev["type"] == "stored":
                    self._index.add_saved(keys)
                elif ev["type"] == "removed":
                    self._index.remove_saved(keys)
                else:
                    continue  # a kind this router does not know
                count.labels(self.url, "tier_" + ev["type"]).inc(len(keys))
            self.log_id = str(page["log_id"])
            self.last_seq = int(page["last_seq"])
        except (ValueError, KeyError, TypeError):
            self.log_id, self.last_seq = None, 0
            raise

    async def read_once(self, wait_s: float) -> None:
        """One read, applied.

        Raises:
            httpx.HTTPError, ValueError: when it failed (the caller retries).
        """
        params: dict[str, Any] = {"after": self.last_seq, "wait_s": wait_s}
        if self.log_id is not None:
            params["log_id"] = self.log_id
        r = await self._client.get(
            self.url + "/tier_events", params=params, headers=self._headers, timeout=wait_s + 10
        )
        r.raise_for_status()
        self.apply(r.json())

    async def _follow(self) -> None:
        while True:
            try:
                await self.read_once(self._wait_s)
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                log.debug("tier events of %s: %s", self.url, e)
                await asyncio.sleep(RETRY_S)

    def start(self) -> None:
        """Starts following (call on the serving loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._follow())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
