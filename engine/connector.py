"""The KV connector seam: how an external KV store plugs into the engine.

Modelled on vLLM's ``KVConnectorBase_V1``, reduced to what a single-process
engine needs. One connector object plays both roles:

* scheduler side — ``get_num_new_matched_tokens`` (how many more prompt tokens
  it can supply, and whether it loads them asynchronously),
  ``update_state_after_alloc`` (blocks were allocated for them),
  ``request_finished`` (the request ends; its blocks are still intact);
* worker side — ``register_kv_caches`` (once, the paged cache and its layout),
  ``start_load_kv``, then ``wait_for_load`` (synchronous loads, before the
  same step's forward pass) or ``get_finished`` (asynchronous loads, polled
  at the start of later steps), and ``save_kv`` (after a forward pass).

A load is synchronous or asynchronous, as the connector says in
``get_num_new_matched_tokens`` (vLLM's ``load_kv_async``)::

    synchronous (n, False) or n:             asynchronous (n, True):
    step k: admit R, start_load_kv,          step k:   admit R (LOADING: blocks held,
            wait_for_load, R computes                  not scheduled), start_load_kv
            the rest in this forward         step k+j: get_finished() reports R — its
                                                       KV is in place — R joins the
                                                       running batch and computes the rest
                                             meanwhile every other request keeps stepping

Order of calls in one engine step::

    get_finished() -> LoadOutcome      # only while async loads are pending
    scheduler.schedule()
      └─ for each newly admitted request:
           get_num_new_matched_tokens(req, num_g1_tokens) -> n | (n, async) | None (pending)
           (blocks allocated for the whole prompt)
           update_state_after_alloc(req, block_ids, n)
    start_load_kv(LoadMetadata)        # when some request has n > 0 (both kinds)
    wait_for_load() -> LoadOutcome     # synchronous ones; engine recomputes what was not loaded
    model forward (writes new KV into the paged cache)
    save_kv(SaveMetadata)              # must not block: copy/queue and return
    ... request finishes or is aborted (also while LOADING):
    request_finished(req, block_ids)   # before its blocks are freed

When only LOADING requests are left the engine calls
``wait_for_async_loads(timeout_s)`` instead of spinning.

Contract:

* Buffers: the engine owns ``kv_cache``; a connector writes into it only
  inside ``wait_for_load`` / ``get_finished`` (on the step thread) and only
  into the slots named in ``LoadMetadata``; it reads from it in ``save_kv``
  and ``request_finished`` (copying out whatever it keeps: the slots may be
  reused after the call returns). After ``request_finished`` it never writes
  that request's slots again, even if a fetch for it completes later.
* Metadata objects and the token/block lists inside them are read-only and
  valid only during the call.
* Errors: a connector method may raise; the engine catches it, logs it,
  counts it, and degrades (a failed lookup matches 0 tokens, a failed load
  recomputes, a failed save is dropped). A cache failure never fails a request.
* A miss is a value: ``get_num_new_matched_tokens`` returns 0.
* ``wait_for_load`` must report every synchronous request of the last
  ``LoadMetadata``; a request missing from the outcome counts as a failed
  load with 0 tokens. Every asynchronous load must be reported by
  ``get_finished`` once, within the connector's own deadline.
* Threading: all methods are called from the engine's step thread.
"""

from __future__ import annotations

import importlib
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Literal

import torch

from kvtier.engine.errors import ConnectorError
from kvtier.engine.kv_cache import KVCacheLayout
from kvtier.keys import CacheNamespace, PrefixKeys

# Built-in connector names -> "module:Class".
CONNECTOR_REGISTRY: dict[str, str] = {
    "null": "kvtier.engine.connector:NullConnector",
    "kvtier": "kvtier.connectors.kvtier_connector:KvtierConnector",
}


@dataclass(frozen=True)
class ConnectorRequest:
    """What a connector sees of one request.

    Attributes:
        request_id: The engine's request id.
        prompt_token_ids: The prompt.
        all_token_ids: Prompt plus tokens generated so far.
        block_ids: The request's block table (may be empty before allocation).
        num_computed_tokens: Leading tokens whose KV is in the paged cache.
        prefix_keys: The request's keys in ``keys_namespace``, computed once by
            the engine (its prefix cache is keyed by them; vLLM's
            ``request.block_hashes``): a connector keying requests in that
            namespace reads them instead of hashing the prompt again.
    """

    request_id: str
    prompt_token_ids: list[int]
    all_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    prefix_keys: PrefixKeys | None = None


@dataclass(frozen=True)
class LoadSpec:
    """Load ``num_tokens`` tokens of KV, starting at token ``start``, into the request's blocks.

    Token ``t`` goes to slot ``block_ids[t // block_size] * block_size + t % block_size``
    of every layer. ``start`` is what the engine already had (a multiple of the
    block size); ``start + num_tokens < len(token_ids)`` always holds.
    """

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int
    num_tokens: int
    asynchronous: bool = False


@dataclass(frozen=True)
class LoadMetadata:
    """All loads of one step."""

    requests: list[LoadSpec] = field(default_factory=list)


@dataclass(frozen=True)
class RequestLoadResult:
    """How one request's load went.

    Attributes:
        loaded_tokens: Leading tokens (from ``LoadSpec.start``) now valid in
            the cache; the engine recomputes everything after them.
        failed: The load failed (fully or partly).
    """

    loaded_tokens: int
    failed: bool = False


@dataclass(frozen=True)
class LoadOutcome:
    """Per-request results of loads (``wait_for_load`` or ``get_finished``)."""

    results: dict[str, RequestLoadResult] = field(default_factory=dict)


@dataclass(frozen=True)
class SaveSpec:
    """KV of one request that the connector may save after this step.

    Attributes:
        request_id: The engine's request id.
        token_ids: Prompt plus generated tokens.
        block_ids: The request's block table.
        num_prompt_tokens: Length of the prompt.
        num_computed_tokens: Leading tokens whose KV is now in the cache.
        num_computed_prompt_tokens: ``min(num_computed_tokens, num_prompt_tokens)``.
        phase: ``"prefill"`` while prompt tokens were computed this step;
            ``"decode"`` when decode tokens just completed a block.
        prefill_done: The whole prompt's KV is in the cache.
    """

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    num_computed_prompt_tokens: int
    phase: Literal["prefill", "decode"]
    prefill_done: bool


@dataclass(frozen=True)
class SaveMetadata:
    """All saves of one step."""

    requests: list[SaveSpec] = field(default_factory=list)


class KVConnector(ABC):
    """Base class of KV connectors (see the module docstring for the contract).

    Args:
        config_path: The connector's own configuration file, if any
            (``EngineConfig.kv_connector_config``).
    """

    def __init__(self, config_path: str | None = None) -> None:
        self.config_path = config_path

    # ---- scheduler side -------------------------------------------------

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> int | tuple[int, bool] | None:
        """How many tokens beyond ``num_computed_tokens`` this connector can load.

        Returns ``n`` or ``(n, load_async)``: with ``load_async`` the load is
        asynchronous (reported by ``get_finished``, the request waits in
        LOADING meanwhile); a plain ``n`` is a synchronous load. ``None``: the
        lookup is still in flight — the request stays waiting, the other
        waiting requests are considered, and the engine asks again next step
        (waiting in ``wait_for_async_loads`` when nothing else can run), as
        vLLM's scheduler does. Must be
        side-effect free (it may be called again for the same request, e.g.
        while it waits for blocks) and must leave at least one prompt token to
        compute: ``n`` should be at most
        ``len(request.all_token_ids) - 1 - num_computed_tokens`` (the engine
        clamps it too). Returns 0 on a miss.
        """

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Blocks for the request (including ``num_external_tokens`` to load) were allocated."""
        return None

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> None:
        """The request finished or was aborted; its blocks are freed after this returns."""
        return None

    # ---- worker side ----------------------------------------------------

    def register_kv_caches(self, kv_cache: torch.Tensor, layout: KVCacheLayout) -> None:
        """Called once with the engine's paged cache and its layout."""
        return None

    @abstractmethod
    def start_load_kv(self, metadata: LoadMetadata) -> None:
        """Starts loading the KV described by ``metadata`` into the paged cache."""

    @abstractmethod
    def wait_for_load(self) -> LoadOutcome:
        """Blocks until the synchronous loads of the last ``start_load_kv`` are done; reports each."""

    def get_finished(self) -> LoadOutcome:
        """Asynchronous loads that ended since the last call, their KV in place (never blocks).

        A load reported here is over: ``loaded_tokens`` leading tokens are
        valid, the engine recomputes the rest.
        """
        return LoadOutcome()

    def wait_for_async_loads(self, timeout_s: float) -> None:
        """Blocks until an asynchronous load may have ended, or ``timeout_s`` passed."""
        time.sleep(timeout_s)

    @abstractmethod
    def save_kv(self, metadata: SaveMetadata) -> None:
        """Saves (copies out or queues) KV after a forward pass. Must not block on I/O."""

    def shutdown(self) -> None:
        """Releases resources; called once when the engine shuts down."""
        return None


class NullConnector(KVConnector):
    """The default connector: nothing is stored, nothing is ever matched."""

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> int | tuple[int, bool]:
        """Always a miss."""
        return 0

    def start_load_kv(self, metadata: LoadMetadata) -> None:
        """Nothing to load."""
        return None

    def wait_for_load(self) -> LoadOutcome:
        """Reports nothing loaded."""
        return LoadOutcome()

    def save_kv(self, metadata: SaveMetadata) -> None:
        """Drops everything."""
        return None


DEFAULT_CHUNK_SIZE = 256
"""The chunk size of kvtier's default configuration: the namespace of an engine
whose connector has none (its keys still match a router's)."""


def keys_namespace(connector: KVConnector, layout: KVCacheLayout) -> CacheNamespace:
    """The namespace the engine keys its requests in: its connector's (``namespace``,
    once ``register_kv_caches`` ran), else one built from the KV layout."""
    ns = getattr(connector, "namespace", None)
    if isinstance(ns, CacheNamespace):
        return ns
    chunk = -(-DEFAULT_CHUNK_SIZE // layout.block_size) * layout.block_size
    return CacheNamespace(
        model_id=layout.model_id,
        weights_fingerprint=layout.fingerprint,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        kv_dtype=layout.dtype,
        chunk_size=chunk,
    )


def make_connector(name: str | None, config_path: str | None = None) -> KVConnector:
    """Creates a connector by registered name or ``"package.module:Class"`` path.

    The class is constructed as ``Class(config_path)``.

    Raises:
        ConnectorError: for an unknown name, an import failure, or a class that
            is not a ``KVConnector``.
    """
    if name is None:
        return NullConnector(config_path)
    target = CONNECTOR_REGISTRY.get(name)
    if target is None:
        if ":" not in name:
            known = ", ".join(sorted(CONNECTOR_REGISTRY))
            raise ConnectorError(
                f"unknown kv connector {name!r}; known: {known} (or give 'module:Class')"
            )
        target = name
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConnectorError(f"kv connector {name!r}: cannot import {module_name}: {e}") from e
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type) or not issubclass(cls, KVConnector):
        raise ConnectorError(f"kv connector {name!r}: {target} is not a KVConnector class")
    try:
        return cls(config_path)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ConnectorError(f"kv connector {name!r} failed to start: {e}") from e
