"""The load generator of ``bench/serve.py``: streamed chat requests and the lanes that send them.

Every request is ``POST /v1/chat/completions`` with ``stream: true``,
``stream_options.include_usage``, ``temperature: 0``, ``ignore_eos: true``
and ``max_tokens`` = the workload's answer length. Per request it records:

* **TTFT**: from sending the request to the first chunk whose
  ``delta.content`` is not empty (a role-only chunk does not count);
* **inter-token latencies**: the gaps between successive content chunks.
  NOTE: one sample per *chunk*, as vLLM's ``benchmark_serving`` does; a
  server that packs several tokens into one chunk yields fewer, longer gaps
  (the count of tokens comes from ``usage`` and is compared with the count
  of chunks in ``content_chunks``). ``tpot_s`` (time per output token after
  the first, from ``usage.completion_tokens``) is the per-token view;
* **end-to-end** latency, to ``data: [DONE]``;
* ``usage``: ``prompt_tokens``, ``completion_tokens`` and
  ``prompt_tokens_details.cached_tokens`` when the server sends them.

A request that fails — an HTTP error status, a refused or dropped
connection, a stream that ends before ``[DONE]``, an ``error`` event, the
per-request timeout — becomes a record with ``error`` set; it never stops
the run. Its conversation (lane) then ends: later rounds would re-send a
history the server never completed.

Bounds: no request is sent after ``duration_s`` from the start or beyond
``max_requests``; requests in flight at the deadline finish (each is
bounded by ``request_timeout_s``), so a run lasts at most
``duration_s + request_timeout_s``.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvtier.bench.lib.serve_workloads import Lane, Workload


@dataclass
class RequestRecord:
    """One request as the client saw it (times in seconds; ``*_s`` from the run's start)."""

    lane: str
    turn: int
    scheduled_s: float
    sent_s: float
    e2e_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    content_chunks: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None

    @property
    def send_delay_s(self) -> float:
        """How late the request left against its arrival time (its lane was busy)."""
        return self.sent_s - self.scheduled_s

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first (None without usage or a second token)."""
        n = self.completion_tokens
        if self.ttft_s is None or n is None or n < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (n - 1)

    def error_kind(self) -> str:
        """The class of the error (``http_503``, ``timeout``, ``dropped`` ...), '' if none."""
        return (self.error or "").split(":", 1)[0]

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass
class RunResult:
    """Every record of one run, how long it lasted and how many planned requests were not sent.

    ``send_window_s`` is the time after which no request was sent (the run's
    ``duration_s``); requests still in flight then finished afterwards.
    """

    records: list[RequestRecord]
    duration_s: float
    not_sent: int
    send_window_s: float | None = None

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.error is None]

    @property
    def pending_at_end(self) -> int:
        """Requests sent but not completed when the send window closed (the server's backlog)."""
        end = self.send_window_s if self.send_window_s is not None else self.duration_s
        return sum(1 for r in self.records if r.sent_s < end < r.sent_s + r.e2e_s)

    def busy_fraction(self) -> float | None:
        """Fraction of the send window with at least one request in the server.

        NOTE: measured from the client, so it means the same for every server:
        while a request is in flight the server is queueing or computing for it.
        """
        end = self.send_window_s if self.send_window_s is not None else self.duration_s
        spans = sorted((r.sent_s, min(r.sent_s + r.e2e_s, end)) for r in self.records)
        if not spans or end <= spans[0][0]:
            return None
        start = spans[0][0]
        busy, cur_lo, cur_hi = 0.0, None, None
        for lo, hi in spans:
            if hi <= lo:
                continue
            if cur_hi is None or lo > cur_hi:
                if cur_hi is not None and cur_lo is not None:
                    busy += cur_hi - cur_lo
                cur_lo, cur_hi = lo, hi
            else:
                cur_hi = max(cur_hi, hi)
        if cur_hi is not None and cur_lo is not None:
            busy += cur_hi - cur_lo
        return busy / (end - start)


@dataclass(frozen=True)
class Limits:
    """Bounds of one run."""

    duration_s: float = 600.0
    max_requests: int | None = None
    request_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("duration_s and request_timeout_s must be positive")
        if self.max_requests is not None and self.max_requests < 0:
            raise ValueError(f"max_requests must be >= 0, got {self.max_requests}")


def chat_payload(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """The body of one benchmark request."""
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _read_event(rec: RequestRecord, data: str, now: float, last: float | None) -> float | None:
    """Folds one ``data:`` event into ``rec``; returns the time of the last content chunk."""
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise ValueError(f"event is not an object: {data[:80]}")
    if obj.get("error") is not None:
        err = obj["error"]
        message = err.get("message", err) if isinstance(err, dict) else err
        rec.error = f"server_error: {message}"
    for choice in obj.get("choices") or ():
        content = (choice.get("delta") or {}).get("content")
        if content:
            rec.text += content
            rec.content_chunks += 1
            if last is None:
                rec.ttft_s = now
            else:
                rec.itl_s.append(now - last)
            last = now
        if choice.get("finish_reason"):
            rec.finish_reason = choice["finish_reason"]
    usage = obj.get("usage")
    if usage:
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.completion_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        rec.cached_tokens = details.get("cached_tokens")
    return last


async def _stream(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], rec: RequestRecord, t0: float
) -> None:
    async with client.stream("POST", url, json=payload) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode("utf-8", "replace")
            rec.error = f"http_{resp.status_code}: {body[:200]}"
            return
        last: float | None = None
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            last = _read_event(rec, data, time.perf_counter() - t0, last)
        if rec.error is None:
            rec.error = "dropped: stream ended before [DONE]"


async def stream_chat(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    *,
    timeout_s: float,
    origin: float,
    lane: str = "",
    turn: int = 0,
    scheduled_s: float = 0.0,
) -> RequestRecord:
    """Sends one streamed chat request and records it; never raises for a failed request.

    Args:
        client: The HTTP client (its connection pool is shared by all lanes).
        url: The full ``.../v1/chat/completions`` URL.
        payload: The request body (see :func:`chat_payload`).
        timeout_s: Bound of the whole request, first byte to ``[DONE]``.
        origin: ``time.perf_counter()`` at the start of the run.
        lane, turn, scheduled_s: Where the request sits in the workload.
    """
    t0 = time.perf_counter()
    rec = RequestRecord(lane=lane, turn=turn, scheduled_s=scheduled_s, sent_s=t0 - origin)
    try:
        async with asyncio.timeout(timeout_s):
            await _stream(client, url, payload, rec, t0)
    except TimeoutError:
        rec.error = f"timeout: no [DONE] within {timeout_s:g} s"
    except httpx.HTTPError as e:
        kind = "connect" if isinstance(e, httpx.ConnectError) else "dropped"
        rec.error = f"{kind}: {type(e).__name__}: {e}"
    except (ValueError, AttributeError, TypeError) as e:  # malformed JSON or event shapes
        rec.error = f"bad_event: {type(e).__name__}: {e}"
    rec.e2e_s = time.perf_counter() - t0
    return rec


class _Budget:
    """How many more requests the run may send (None: no cap)."""

    def __init__(self, cap: int | None) -> None:
        self.left = cap

    def take(self) -> bool:
        if self.left is None:
            return True
        if self.left <= 0:
            return False
        self.left -= 1
        return True


async def run_workload(base_url: str, model: str, workload: Workload, limits: Limits) -> RunResult:
    """Runs every lane of ``workload`` against ``base_url`` (``http://host:port``) within ``limits``."""
    url = base_url.rstrip("/") + "/v1/chat/completions"
    records: list[RequestRecord] = []
    budget = _Budget(limits.max_requests)
    origin = time.perf_counter()
    deadline = limits.duration_s

    async def run_lane(client: httpx.AsyncClient, lane: Lane) -> None:
        ready = 0.0  # when the lane may send again: its previous answer plus think time
        for turn, at in enumerate(lane.arrivals):
            at = max(at, ready)
            if at >= deadline:
                return
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - origin)))
            if time.perf_counter() - origin >= deadline or not budget.take():
                return
            payload = chat_payload(model, lane.session.messages(), workload.max_tokens)
            rec = await stream_chat(
                client,
                url,
                payload,
                timeout_s=limits.request_timeout_s,
                origin=origin,
                lane=lane.name,
                turn=turn,
                scheduled_s=at,
            )
            records.append(rec)
            if rec.error is not None:
                return
            lane.session.answered(rec.text)
            ready = rec.sent_s + rec.e2e_s + lane.think_s

    pool = httpx.Limits(max_connections=max(16, len(workload.lanes)), max_keepalive_connections=64)
    timeout = httpx.Timeout(limits.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=pool, trust_env=False) as client:
        await asyncio.gather(*(run_lane(client, lane) for lane in workload.lanes))
    ends = [r.sent_s + r.e2e_s for r in records]
    duration = max(ends) if ends else time.perf_counter() - origin
    return RunResult(records, duration, workload.planned - len(records), deadline)


async def warm_up(
    base_url: str, model: str, messages: list[dict[str, str]], *, timeout_s: float = 120.0
) -> RequestRecord:
    """One request outside the measurement (one-time costs: kernels, a connector's first save)."""
    url = base_url.rstrip("/") + "/v1/chat/completions"
    payload = chat_payload(model, messages, 4)
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
        return await stream_chat(
            client, url, payload, timeout_s=timeout_s, origin=time.perf_counter()
        )
