"""The router's one typed configuration."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from kvtier.errors import ConfigError
from kvtier.keys import CacheNamespace

Policy = Literal["round_robin", "least_loaded", "cache_aware"]
POLICIES: tuple[Policy, ...] = ("round_robin", "least_loaded", "cache_aware")
Role = Literal["both", "prefill", "decode"]


class RouterConfigError(ValueError):
    """A router option that cannot work (names the option)."""


@dataclass(frozen=True)
class EngineSpec:
    """One engine behind the router: its base URL and what it serves."""

    url: str
    role: Role = "both"

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise RouterConfigError(
                f"engine URL must start with http:// or https://, got {self.url!r}"
            )
        object.__setattr__(self, "url", self.url.rstrip("/").removesuffix("/v1"))
        if self.role not in ("both", "prefill", "decode"):
            raise RouterConfigError(
                f"engine role must be both, prefill or decode, got {self.role!r}"
            )


@dataclass(frozen=True)
class VllmEventSource:
    """Where a vLLM engine publishes its KV events (its ``--kv-events-config``).

    Attributes:
        engine: The engine's base URL (one of the configured engines).
        endpoint: vLLM's PUB ``endpoint``, as the router connects to it
            (``tcp://host:5557``; vLLM binds ``tcp://*:5557``).
        replay_endpoint: vLLM's ``replay_endpoint`` (``tcp://host:5558``): the
            router fills gaps from it; None: a gap forgets the engine's G1.
        topic: vLLM's ``topic`` (default empty: every message).
        namespace: The namespace of the engine's kvtier connector, so the
            router's keys for this engine also name its shared-tier objects;
            None: a namespace of the router's own (G1 only).
    """

    engine: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    namespace: CacheNamespace | None = None

    @classmethod
    def parse(cls, text: str) -> VllmEventSource:
        """``URL=ENDPOINT[,replay=ENDPOINT][,topic=T][,namespace=FILE]`` (``--vllm-kv-events``);
        FILE holds a namespace as JSON (``CacheNamespace.to_json``).

        Raises:
            RouterConfigError: naming what is wrong.
        """
        url, sep, rest = text.partition("=")
        parts = rest.split(",")
        if not sep or not parts[0]:
            raise RouterConfigError(f"expected URL=tcp://host:port[,replay=...], got {text!r}")
        opts: dict[str, str] = {}
        for part in parts[1:]:
            name, eq, value = part.partition("=")
            if not eq or name not in ("replay", "topic", "namespace"):
                raise RouterConfigError(
                    f"unknown KV events option {part!r} (replay=, topic=, namespace=)"
                )
            opts[name] = value
        namespace = None
        if "namespace" in opts:
            try:
                with open(opts["namespace"], encoding="utf-8") as f:
                    namespace = CacheNamespace.from_json(json.load(f))
            except (OSError, ValueError, TypeError, KeyError, ConfigError) as e:
                raise RouterConfigError(f"namespace file {opts['namespace']!r}: {e}") from None
        return cls(url, parts[0], opts.get("replay"), opts.get("topic", ""), namespace)

    @classmethod
    def from_body(cls, url: str, body: object) -> VllmEventSource:
        """``POST /engines``' ``vllm_kv_events``: ``{"endpoint", "replay", "topic",
        "namespace"}`` (the namespace as JSON, not a file: the router's host may not have it).

        Raises:
            RouterConfigError: naming what is wrong.
        """
        if not isinstance(body, dict) or not isinstance(body.get("endpoint"), str):
            raise RouterConfigError("vllm_kv_events must be an object with an 'endpoint'")
        unknown = set(body) - {"endpoint", "replay", "topic", "namespace"}
        if unknown:
            raise RouterConfigError(
                f"unknown vllm_kv_events keys {sorted(unknown)} (endpoint, replay, topic, namespace)"
            )
        replay, topic = body.get("replay"), body.get("topic", "")
        if not (replay is None or isinstance(replay, str)) or not isinstance(topic, str):
            raise RouterConfigError("vllm_kv_events 'replay' and 'topic' must be strings")
        namespace = None
        if body.get("namespace") is not None:
            try:
                namespace = CacheNamespace.from_json(body["namespace"])
            except (ValueError, TypeError, KeyError, AttributeError, ConfigError) as e:
                raise RouterConfigError(f"vllm_kv_events namespace: {e}") from None
        return cls(url, body["endpoint"], replay, topic, namespace)

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine", EngineSpec(self.engine).url)
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            if not str(value).startswith(("tcp://", "ipc://", "inproc://")) or "*" in str(value):
                raise RouterConfigError(
                    f"KV events {name} must be a ZMQ address to connect to (tcp://host:port, "
                    f"ipc://path), got {value!r}"
                )


@dataclass(frozen=True)
class RouterConfig:
    """How the router routes.

    Attributes:
        engines: The engines, each with its role. With any ``prefill`` engine
            the router runs P/D: a new request's prompt goes to a prefill
            engine first (``max_tokens`` 1), then the request to a decode engine.
        policy: How an engine is picked (``docs/router.md``).
        model: Tokenizer source (a known model name, a ``.gguf`` file or an HF
            directory): the router tokenizes prompts as the engines do. None:
            no keys, so ``cache_aware`` falls back to load alone.
        health_interval_s: Seconds between two health checks of an engine.
        health_timeout_s: A health check slower than this fails.
        connect_timeout_s: Connecting to an engine.
        request_timeout_s: Longest silence from an engine on a request.
        max_attempts: Engines tried for one request before its first byte is sent.
        kv_events: Follow the engines' ``/kv_events``.
        events_wait_s: Long-poll time of one ``/kv_events`` read.
        vllm_events: vLLM engines whose KV events (ZMQ) the router follows
            instead of ``/kv_events`` (``docs/router.md``, vLLM's KV events).
        tier_events: Base URL of the cache server's HTTP side: the router
            follows its ``/tier_events`` (blocks stored in and evicted from the
            shared tier); None: only the engines' ``saved`` events.
        tier_events_token: Bearer token for ``/tier_events`` (a cache server
            with ``http_require_token``).
        decode_cost_tokens: ``cache_aware``: a request an engine is already
            serving costs as much as this many prompt tokens to compute.
        shared_hit_weight: ``cache_aware``: a prefix in the shared tier (any
            engine loads it) is worth this fraction of the same prefix in G1.
        max_imbalance: ``cache_aware``: an engine with this many more requests
            in flight than the least loaded is never picked for its cache.
        memory_wait_tokens: ``cache_aware``: each answer token a request must
            wait for (its engine's G1 being full) costs as much as this many
            prompt tokens (``policy.py``; 0: G1 memory not weighed).
        max_saved_keys: Shared-tier keys remembered (oldest forgotten).
        signals_window_s: Sliding window of the scaling signals (TTFT percentiles,
            prefill demand and capacity; ``docs/fleet.md``).
        ttft_target_s: The TTFT p99 the recommended replica count aims for.
        min_replicas: Fewest replicas recommended.
        max_replicas: Most replicas recommended.
        target_utilization: Share of an engine's measured prefill capacity the
            recommendation plans to use.
        failover: Continue a stream whose engine drops or stalls after its first
            byte on another engine, and re-issue a non-streamed request whose
            engine drops (``docs/router.md``, Streams that survive their engine).
        stall_timeout_s: An engine silent this long mid-stream (or out of the
            pool this long while a non-streamed answer is awaited) is lost.
        max_failovers: Engines one stream may be continued on.
        warm_max_prefixes: Hottest prefixes handed to a joining engine (0: no warm-up).
        warm_fraction: Share of a joining engine's G1 (in tokens) warm-up may fill.
        warm_deadline_s: Longest warm-up; the engine takes traffic after it.
        warm_cancel_load: Warm-up stops early when every other engine has this
            many requests in flight (or none serves): traffic needs the engine.
        hot_prefixes: Prefixes whose hits the router counts (the warm-up's
            candidates; the least recently hit are forgotten).
        engine_api_key: Sent to the engines as a bearer token (else the
            client's ``Authorization`` header is passed on).
        api_key: What the router's own callers must send (``Authorization:
            Bearer <key>``) on every path but ``/health`` and ``/metrics``;
            None: no key (then bind it where only trusted clients reach it).
    """

    engines: tuple[EngineSpec, ...]
    policy: Policy = "cache_aware"
    model: str | None = None
    health_interval_s: float = 1.0
    health_timeout_s: float = 5.0
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0
    max_attempts: int = 3
    kv_events: bool = True
    events_wait_s: float = 5.0
    vllm_events: tuple[VllmEventSource, ...] = ()
    tier_events: str | None = None
    tier_events_token: str | None = field(default=None, repr=False)
    decode_cost_tokens: int = 256
    shared_hit_weight: float = 0.8
    max_imbalance: int = 4
    memory_wait_tokens: int = 16
    max_saved_keys: int = 1_000_000
    signals_window_s: float = 30.0
    ttft_target_s: float = 2.0
    min_replicas: int = 1
    max_replicas: int = 64
    target_utilization: float = 0.4
    failover: bool = True
    stall_timeout_s: float = 30.0
    max_failovers: int = 3
    warm_max_prefixes: int = 32
    warm_fraction: float = 0.5
    warm_deadline_s: float = 60.0
    warm_cancel_load: int = 4
    hot_prefixes: int = 1024
    engine_api_key: str | None = field(default=None, repr=False)
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.engines:
            raise RouterConfigError("give at least one engine (--engine URL)")
        urls = [e.url for e in self.engines]
        if len(set(urls)) != len(urls):
            raise RouterConfigError(f"an engine is listed twice: {urls}")
        if self.policy not in POLICIES:
            raise RouterConfigError(
                f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}"
            )
        roles = {e.role for e in self.engines}
        if ("prefill" in roles) != ("decode" in roles):
            raise RouterConfigError("P/D needs at least one prefill and one decode engine")
        sourced = [v.engine for v in self.vllm_events]
        if unknown := set(sourced) - set(urls):
            raise RouterConfigError(f"KV events given for engines not listed: {sorted(unknown)}")
        if len(set(sourced)) != len(sourced):
            raise RouterConfigError(f"KV events given twice for an engine: {sourced}")
        if self.tier_events is not None and not self.tier_events.startswith(
            ("http://", "https://")
        ):
            raise RouterConfigError(
                f"tier_events must start with http:// or https://, got {self.tier_events!r}"
            )
        for name in ("health_interval_s", "health_timeout_s", "connect_timeout_s",
                     "request_timeout_s", "events_wait_s"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise RouterConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_attempts < 1 or self.max_imbalance < 0 or self.decode_cost_tokens < 0:
            raise RouterConfigError(
                "max_attempts >= 1, max_imbalance >= 0, decode_cost_tokens >= 0"
            )
        if self.memory_wait_tokens < 0:
            raise RouterConfigError(f"memory_wait_tokens >= 0, got {self.memory_wait_tokens}")
        if not 0.0 <= self.shared_hit_weight <= 1.0:
            raise RouterConfigError(
                f"shared_hit_weight must be in [0, 1], got {self.shared_hit_weight}"
            )
        if self.max_saved_keys < 1:
            raise RouterConfigError("max_saved_keys must be positive")
        if self.stall_timeout_s <= 0 or self.warm_deadline_s <= 0:
            raise RouterConfigError("stall_timeout_s and warm_deadline_s must be positive")
        if self.max_failovers < 1 or self.warm_max_prefixes < 0 or self.hot_prefixes < 1:
            raise RouterConfigError("max_failovers >= 1, warm_max_prefixes >= 0, hot_prefixes >= 1")
        if self.warm_cancel_load < 1:
            raise RouterConfigError(f"warm_cancel_load must be >= 1, got {self.warm_cancel_load}")
        if not 0.0 < self.warm_fraction <= 1.0:
            raise RouterConfigError(f"warm_fraction must be in (0, 1], got {self.warm_fraction}")
        if not (self.signals_window_s > 0 and self.ttft_target_s > 0):
            raise RouterConfigError("signals_window_s and ttft_target_s must be positive")
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise RouterConfigError(
                f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, got "
                f"{self.min_replicas} and {self.max_replicas}"
            )
        if not 0 < self.target_utilization <= 1:
            raise RouterConfigError(
                f"target_utilization must be in (0, 1], got {self.target_utilization}"
            )

    @property
    def disaggregated(self) -> bool:
        """True when requests run as a prefill leg and a decode leg."""
        return any(e.role == "prefill" for e in self.engines)
