"""The engines behind the router: health, load, and health checks that take them out and put them back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvtier.router.config import EngineSpec, Role
from kvtier.router.metrics import RouterMetrics
from kvtier.router.policy import Reservation
from kvtier.router.scaling_report import RouterSignals

log = logging.getLogger(__name__)

# Gauges an engine reports its queue with: kvtier's engine, vLLM.
LOAD_GAUGES = (
    "kvtier_engine_requests_running",
    "kvtier_engine_requests_waiting",
    "kvtier_engine_requests_loading",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
)
KVTIER_BLOCK_TOKENS = 16  # the bundled engine's block size (EngineConfig.block_size)


@dataclass
class Engine:
    """One engine as the router sees it (touched only on the router's event loop).

    Attributes:
        url: Base URL (no ``/v1``).
        role: ``both``, ``prefill`` or ``decode``.
        healthy: Passed its last health check (and no request failed on it since).
        in_flight: Requests the router has sent it that have not ended.
        pending_prefill_tokens: Prompt tokens of those requests it has not started
            answering (the router's estimate, after cache hits).
        reported_load: Running + waiting requests, from its last ``/metrics``.
        kv_capacity_tokens: Tokens its G1 holds, from its ``/metrics`` (0: unknown).
        reservations: G1 memory its requests in flight hold, as the router
            counts it (prompt + ``max_tokens`` each), oldest first.
        warming: Joined the router and is being warmed (``warmup.py``): not
            routed to until that is done or cancelled.
        joined: Added at runtime (``POST /engines``), which decides its first warm-up.
        was_up: Has passed a health check before.
    """

    url: str
    role: Role
    healthy: bool = False
    in_flight: int = 0
    pending_prefill_tokens: int = 0
    reported_load: int = 0
    kv_capacity_tokens: int = 0
    reservations: list[Reservation] = field(default_factory=list)
    warming: bool = False
    joined: bool = False
    was_up: bool = False

    @property
    def load(self) -> int:
        """Requests it is busy with: the router's count, or the engine's if it says more."""
        return max(self.in_flight, self.reported_load)


def parse_load(text: str) -> int | None:
    """Running + waiting requests from an engine's Prometheus text (None if it has none)."""
    total, seen = 0.0, False
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in LOAD_GAUGES:
                    total += s.value
                    seen = True
    except ValueError:
        return None
    return int(total) if seen else None


def parse_kv_capacity(text: str) -> int | None:
    """Tokens an engine's KV memory (G1) holds, from its Prometheus text (None if not there).

    The bundled engine: ``kvtier_engine_kv_blocks_total`` blocks of 16 tokens;
    vLLM: the ``num_gpu_blocks`` and ``block_size`` labels of ``vllm:cache_config_info``.
    """
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "kvtier_engine_kv_blocks_total" and s.value > 0:
                    return int(s.value) * KVTIER_BLOCK_TOKENS
                if s.name == "vllm:cache_config_info":
                    blocks, size = s.labels.get("num_gpu_blocks"), s.labels.get("block_size")
                    if blocks and size and blocks.isdigit() and size.isdigit():
                        return int(blocks) * int(size)
    except ValueError:
        return None
    return None


class EnginePool:
    """The engines, and the task that checks them.

    Args:
        specs: The configured engines.
        client: The HTTP client (shared with the proxy).
        metrics: Where health and in-flight counts go.
        interval_s: Seconds between two rounds of checks.
        timeout_s: A check slower than this fails.
        headers: Sent with every check (an API key).
        on_down: Called with an engine's URL when it is taken out.
        on_up: Called with an engine when a health check puts it in (back), before
            anything is routed to it — except an engine added at runtime on its first
            check (whoever added it decides its warm-up).
        signals: Told of every attempt and ``/metrics`` scrape (scaling signals).
    """

    def __init__(
        self,
        specs: tuple[EngineSpec, ...],
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        *,
        interval_s: float,
        timeout_s: float,
        headers: dict[str, str] | None = None,
        on_down: Callable[[str], None] | None = None,
        on_up: Callable[[Engine], None] | None = None,
        signals: RouterSignals | None = None,
    ) -> None:
        self.engines = [Engine(s.url, s.role) for s in specs]
        self.by_url = {e.url: e for e in self.engines}
        self._client = client
        self._metrics = metrics
        self._interval = interval_s
        self._timeout = timeout_s
        self._headers = headers or {}
        self._on_down = on_down
        self._on_up = on_up
        self._signals = signals
        self._task: asyncio.Task[None] | None = None
        for e in self.engines:
            metrics.healthy.labels(e.url).set(0)
            metrics.in_flight.labels(e.url).set(0)

    def serving(self, roles: tuple[Role, ...]) -> list[Engine]:
        """Healthy engines of the given roles, in configured order (warming ones left out)."""
        return [e for e in self.engines if e.healthy and not e.warming and e.role in roles]

    async def add(self, spec: EngineSpec, warming: bool = False) -> Engine:
        """An engine joins at runtime (checked once at once, then with the others).

        Raises:
            ValueError: if its URL is already in the pool.
        """
        if spec.url in self.by_url:
            raise ValueError(f"engine {spec.url} is already in the pool")
        engine = Engine(spec.url, spec.role, warming=warming, joined=True)
        self.engines.append(engine)
        self.by_url[engine.url] = engine
        self._metrics.healthy.labels(engine.url).set(0)
        self._metrics.in_flight.labels(engine.url).set(0)
        await self.check(engine)
        return engine

    # ---- health --------------------------------------------------------------------------

    async def check(self, engine: Engine) -> None:
        """One health check (and load scrape) of ``engine``."""
        ok = False
        try:
            r = await self._client.get(
                engine.url + "/health", timeout=self._timeout, headers=self._headers
            )
            ok = r.status_code == 200
            if ok:
                m = await self._client.get(
                    engine.url + "/metrics", timeout=self._timeout, headers=self._headers
                )
                load = parse_load(m.text) if m.status_code == 200 else None
                engine.reported_load = load if load is not None else 0
                capacity = parse_kv_capacity(m.text) if m.status_code == 200 else None
                engine.kv_capacity_tokens = capacity or 0
                if self._signals is not None and m.status_code == 200:
                    self._signals.engine_scraped(engine.url, m.text)
        except httpx.HTTPError as e:
            log.debug("health check of %s failed: %s", engine.url, e)
        self.set_health(engine, ok)

    def set_health(self, engine: Engine, ok: bool) -> None:
        """Takes an engine out (``ok`` False) or puts it back."""
        if ok == engine.healthy:
            return
        engine.healthy = ok
        self._metrics.healthy.labels(engine.url).set(1 if ok else 0)
        if ok:
            first, engine.was_up = not engine.was_up, True
            if self._on_up is not None and not (first and engine.joined):
                self._on_up(engine)
            log.warning("engine %s is back", engine.url)
        else:
            log.warning("engine %s is out (failed a health check or a request)", engine.url)
            engine.reported_load = 0
            if self._on_down is not None:
                self._on_down(engine.url)

    async def check_all(self) -> None:
        """One round of checks, all engines at once."""
        await asyncio.gather(*(self.check(e) for e in self.engines))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.check_all()

    def start(self) -> None:
        """Starts checking in the background (call on the serving loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stops the checks."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # ---- accounting ----------------------------------------------------------------------

    def begin(
        self, engine: Engine, prefill_tokens: int, reservation: Reservation | None = None
    ) -> None:
        """A request was sent to ``engine`` (holding ``reservation`` of its G1 until it ends)."""
        engine.in_flight += 1
        if reservation is not None:
            engine.reservations.append(reservation)
        engine.pending_prefill_tokens += prefill_tokens
        self._metrics.in_flight.labels(engine.url).set(engine.in_flight)
        if self._signals is not None:
            self._signals.begin(engine.url, prefill_tokens)

    def first_byte(self, engine: Engine, prefill_tokens: int) -> None:
        """``engine`` started answering: its prefill is done."""
        engine.pending_prefill_tokens = max(0, engine.pending_prefill_tokens - prefill_tokens)
        if self._signals is not None:
            self._signals.first_byte(engine.url)

    def end(self, engine: Engine, reservation: Reservation | None = None) -> None:
        """A request on ``engine`` ended (however); ``reservation``: what ``begin`` was given."""
        engine.in_flight = max(0, engine.in_flight - 1)
        if reservation is not None:
            # NOTE: by identity: two requests of one shape reserve equal values
            engine.reservations = [r for r in engine.reservations if r is not reservation]
        if engine.in_flight == 0:
            engine.pending_prefill_tokens = 0
            engine.reservations.clear()
        self._metrics.in_flight.labels(engine.url).set(engine.in_flight)
