"""The KV connector seam: how an external KV store plugs into the engine.

Modelled on vLLM's ``KVConnectorBase_V1``, reduced to what a single-process
engine needs. One connector object plays both roles:

* scheduler side — ``get_num_new_matched_tokens`` (how many more prompt tokens
  it can supply), ``update_state_after_alloc`` (blocks were allocated for
  them), ``request_finished`` (the request ends; its blocks are still intact);
* worker side — ``register_kv_caches`` (once, the paged cache and its layout),
  ``start_load_kv`` / ``wait_for_load`` (before a step's forward pass) and
  ``save_kv`` (after it).

Order of calls in one engine step::

    scheduler.schedule()
      └─ for each newly admitted request:
           get_num_new_matched_tokens(req, num_g1_tokens) -> n
           (blocks allocated for g1 + n + chunk)
           update_state_after_alloc(req, block_ids, n)
    start_load_kv(LoadMetadata)        # only when some request has n > 0
    wait_for_load() -> LoadOutcome     # engine recomputes what was not loaded
    model forward (writes new KV into the paged cache)
    save_kv(SaveMetadata)              # must not block: copy/queue and return
    ... request finishes or is aborted:
    request_finished(req, block_ids)   # before its blocks are freed

Contract:

* Buffers: the engine owns ``kv_cache``; a connector writes into it only
  inside ``start_load_kv``/``wait_for_load`` and only into the slots named in
  ``LoadMetadata``; it reads from it in ``save_kv`` (copying out whatever it
  keeps: the slots may be reused after the call returns).
* Metadata objects and the token/block lists inside them are read-only and
  valid only during the call.
* Errors: a connector method may raise; the engine catches it, logs it,
  counts it, and degrades (a failed lookup matches 0 tokens, a failed load
  recomputes, a failed save is dropped). A cache failure never fails a request.
* A miss is a value: ``get_num_new_matched_tokens`` returns 0.
* ``wait_for_load`` must report every request of the last ``LoadMetadata``;
  a request missing from the outcome counts as a failed load with 0 tokens.
* Threading: all methods are called from the engine's step thread.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Literal

import torch

from kvtier.engine.errors import ConnectorError
from kvtier.engine.kv_cache import KVCacheLayout

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
    """

    request_id: str
    prompt_token_ids: list[int]
    all_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


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
    """Per-request results of the last ``start_load_kv``."""

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
    ) -> int:
        """How many tokens beyond ``num_computed_tokens`` this connector can load.

        Must be side-effect free (it may be called again for the same request)
        and must leave at least one prompt token to compute: the result should
        be at most ``len(request.all_token_ids) - 1 - num_computed_tokens``
        (the engine clamps it too). Returns 0 on a miss.
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
        """Blocks until the loads of the last ``start_load_kv`` are done; reports each."""

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
    ) -> int:
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
