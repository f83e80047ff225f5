"""The connector's scheduler side: lookups, load offers, the save plan (every engine's).

It plans; the worker side (``worker_side.py``) moves bytes. The engine
adapters (``kvtier_connector.py`` for the bundled engine, ``vllm.py`` for
vLLM) translate their engine's calls into these::

    engine                                   ConnectorScheduler
    ──────                                   ──────────────────
    a request is considered for admission:
      get_num_new_matched_tokens(req, n_local) keys (the request's own, computed once), a
                                               lookup on an I/O thread (lookup.py), the offer:
                                               (n, load async) | (None: ask again next step;
                                               not when less than a chunk is past n_local)
      update_state_after_alloc(req, blocks, n) a PlannedLoad of the accepted tokens
    each step:
      set_blocks / plan_saves(req, computed)   PlannedSaves: new full chunks, the prompt's
                                               tail at the end of its prefill, objects to verify
      take_plan() ─► StepPlan ─► worker side
      update(loads ended, WorkerReport)        failed loads rewind the save plan; bad keys
                                               are quarantined; stuck load threads stop offers
    request_finished(req, blocks)              with save_decode: the chunks and tail of
                                               prompt + answer (True: keep the blocks until
                                               the worker has gathered them)

Rules that keep every engine correct:

* **A failed load is never offered again.** After a failed asynchronous
  load with nothing placed, vLLM frees the blocks and asks again; offering
  the same hit again loops forever (observed with vLLM 0.32). Under vLLM
  (``offer_once``) a request whose load was planned gets 0 from then on; the
  bundled engine asks again only for a request it preempted (its blocks
  freed), which is offered its hit again unless its load failed or still runs.
* **An offer never exceeds what the lookup found**, and leaves the prompt's
  last token to the engine; whatever the worker fails to place is reported
  failed, and the engine recomputes it.
* **Saves after a failed load wait for the news** (``PlannedSave.after_failed_load``).

Requests with LoRA adapters, multimodal inputs or prompt embeddings are not
cached (their KV depends on more than the tokens): a miss, counted.
``cache_salt`` isolates requests as a tenant salt of the namespace.

**Sampled verification** (``verify.py``, ``connector.verify_fraction``; on by
default where a tier is shared): each loadable object is sampled; the offer
stops before the first sampled one, so the engine computes it and what
follows, and the save plan hands those objects, once computed, to the worker
(``PlannedSave.verify``), which compares them with their stored blocks. Keys
the worker found wrong come back in its report and are quarantined here:
lookups do not offer them, saves do not store them, for a while.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.config import KvtierConfig, effective_verify_fraction
from kvtier.connectors.load_job import Fetcher
from kvtier.connectors.lookup import AsyncLookups, LookupStats
from kvtier.connectors.plan import Counters, PlannedLoad, PlannedSave, StepPlan, WorkerReport
from kvtier.connectors.request_state import RequestState
from kvtier.connectors.verify import Quarantine, Sampler, random_sampler
from kvtier.keys import CacheNamespace, PrefixKeys
from kvtier.metrics import StoreMetrics
from kvtier.prefix import ObjectRef
from kvtier.store import TieredStore

log = logging.getLogger(__name__)

LOOKUP_REUSE_S = 1.0
"""A request waiting for blocks is asked for its match every step; its lookup is reused this long."""


def uncacheable(request: Any) -> str | None:
    """Why a request's KV cannot be keyed by its tokens alone, or None."""
    if getattr(request, "lora_request", None) is not None:
        return "LoRA adapter"
    if getattr(request, "mm_features", None):
        return "multimodal input"
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings"
    if getattr(request, "prompt_token_ids", None) is None:
        return "no prompt token ids"
    return None


@dataclass
class _Tracked:
    """What the scheduler side keeps of one request."""

    request: Any  # the engine's request (or its view), read as it changes
    state: RequestState | None  # None: not cacheable
    block_ids: list[int] = field(default_factory=list)
    offered_from: int = 0  # n_local of the last offer
    load_planned: bool = False  # never offer again once set
    loading: bool = False  # an asynchronous load is in flight
    failed_load: bool = False  # the worker reported the load failed


class ConnectorScheduler:
    """The scheduler side (see the module docstring).

    A request is any object with ``request_id``, ``prompt_token_ids``,
    ``all_token_ids`` (the live prompt + output) and ``num_computed_tokens``;
    ``prefix_keys`` (its keys, computed once by the engine) and
    ``cache_salt`` are read when present.

    Args:
        config: kvtier's configuration.
        namespace: Where this model's KV lives.
        store: The store the lookups ask.
        load_async: Offer hits as asynchronous loads.
        counters: Where to count.
        metrics: kvtier's metrics.
        verify_sampler: Decides which loadable objects are verified (by default
            each with probability ``effective_verify_fraction(config)``).
        fetcher: The I/O threads lookups run on (default: its own pool; an
            engine that runs both sides in one process shares one).
        quarantine: Keys found wrong (default: its own).
        offer_once: Never offer a request a second load (vLLM); else only a
            request whose last load ended well is offered again (after the
            engine preempted it).
    """

    def __init__(
        self,
        *,
        config: KvtierConfig,
        namespace: CacheNamespace,
        store: TieredStore,
        load_async: bool,
        counters: Counters,
        metrics: StoreMetrics,
        verify_sampler: Sampler | None = None,
        fetcher: Fetcher | None = None,
        quarantine: Quarantine | None = None,
        offer_once: bool = True,
    ) -> None:
        self._config = config
        self._offer_once = offer_once
        self.namespace = namespace
        self._load_async = load_async
        self._counters = counters
        self._metrics = metrics
        self._requests: dict[str, _Tracked] = {}
        self._loads: list[PlannedLoad] = []
        self._saves: list[PlannedSave] = []
        self._worker_stuck = False
        self.refused_offers = 0
        fraction = effective_verify_fraction(config)
        self._sample = verify_sampler
        if self._sample is None and fraction > 0:
            self._sample = random_sampler(fraction)
            log.info("kvtier: sampled verification of %.3g of loaded chunks", fraction)
        self.quarantine = quarantine if quarantine is not None else Quarantine()
        """Keys the worker's verification found wrong: neither offered nor saved while they stay."""
        self._owns_fetcher = fetcher is None
        self._fetcher = (
            fetcher if fetcher is not None else Fetcher(store, config.connector.load_workers)
        )
        self._lookups = AsyncLookups(
            self._fetcher,
            timeout_s=config.connector.lookup_timeout_s,
            metrics=metrics,
            quarantine=self.quarantine,
            on_count=self._lookup_counted,
        )

    # ---- lookup and offer ---------------------------------------------------------------

    def _track(self, request: Any) -> _Tracked:
        rid = request.request_id
        tracked = self._requests.get(rid)
        if tracked is None:
            reason = uncacheable(request)
            state = None
            if reason is None:
                state = RequestState.new(
                    self._keys_for(request), self._config.page_tokens, request.prompt_token_ids
                )
            else:
                self._counters.add("skipped_requests")
                log.debug("kvtier: request %s is not cached (%s)", rid, reason)
            tracked = self._requests[rid] = _Tracked(request, state)
        return tracked

    def _keys_for(self, request: Any) -> PrefixKeys:
        """The request's keys: its own when the engine computed them in this namespace."""
        ns = self.namespace
        salt = getattr(request, "cache_salt", None)
        if salt:
            ns = ns.with_tenant(salt)
        keys = getattr(request, "prefix_keys", None)
        if isinstance(keys, PrefixKeys) and keys.namespace == ns:
            return keys  # NOTE: one hash per request: the engine's G1 and events read the same
        return PrefixKeys(ns, self._config.page_tokens)

    def _lookup_counted(self, what: str) -> None:
        names = {
            "deferred": "lookups_deferred",
            "not_waited": "lookups_not_waited",
            "timeout": "lookup_timeouts",
        }
        self._counters.add(names.get(what, "refused_lookups"))

    @property
    def lookup_stats(self) -> LookupStats:
        """Lookups deferred a step, timed out, or refused (``lookup.py``)."""
        return self._lookups.stats

    def any_lookup_answered(self) -> bool:
        """Whether a lookup in flight has an answer waiting (its request can be admitted)."""
        return self._lookups.any_answered()

    def close(self) -> None:
        """Stops the lookup threads it owns (one stuck in a tier is left to end on its own)."""
        if self._owns_fetcher:
            self._fetcher.shutdown()

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens to load beyond the engine's own ``num_computed_tokens``, and whether asynchronously.

        ``None`` tokens: the lookup is still in flight; the engine asks again next step.
        """
        tracked = self._track(request)
        state = tracked.state
        if state is None:
            return 0, False
        if tracked.load_planned and (self._offer_once or tracked.loading or tracked.failed_load):
            return 0, False
        first = state.prefix is None
        if not state.lookup_is_fresh(LOOKUP_REUSE_S):
            # NOTE: the most a lookup can add is the prompt past the engine's own hit, less
            # the last token. Below min_load_tokens nothing could be offered: no lookup.
            # Below a chunk the request does not wait a step for a slow answer: under load
            # a step costs more than computing less than a chunk, and a load adds a step of
            # its own. A warmed vLLM replica whose G1 held every hot document waited a step
            # on nearly every request (lookups_deferred ~ lookups) for lookups that could
            # not find more than G1 held (bench/RESULTS.md, "Warm start").
            gain = state.num_prompt_tokens - 1 - num_computed_tokens
            if gain < self._config.connector.min_load_tokens:
                return 0, False
            wait = gain >= self.namespace.chunk_size
            prefix = self._lookups.poll(request.request_id, state, wait=wait)
            if prefix is None:
                return (None, False) if wait else (0, False)
            state.remember_lookup(prefix)
        assert state.prefix is not None
        prompt = state.num_prompt_tokens
        if first:
            self._counters.add("lookups")
            self._counters.add("lookup_tokens", prompt)
            self._counters.add("hit_tokens", state.prefix.num_tokens)
            self._metrics.lookup_tokens.labels("requested").inc(prompt)
            self._metrics.lookup_tokens.labels("hit").inc(state.prefix.num_tokens)
        end = min(state.prefix.num_tokens, prompt - 1)  # the engine computes the last token
        if self._sample is not None:  # a sampled object is computed by the engine, then compared
            end = state.plan_verification(num_computed_tokens, end, self._sample)
        n = end - num_computed_tokens
        if n < self._config.connector.min_load_tokens:
            return 0, False
        if self._worker_stuck or self._fetcher.saturated:  # loads would queue behind a stuck tier
            self.refused_offers += 1
            self._counters.add("refused_tokens", n)
            self._metrics.load_tokens.labels("refused").inc(n)
            return 0, False
        tracked.offered_from = num_computed_tokens
        return n, self._load_async

    def update_state_after_alloc(
        self, request: Any, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """The engine allocated ``block_ids`` (all of the request's); plans the load it accepted."""
        tracked = self._track(request)
        tracked.block_ids = list(block_ids)
        if num_external_tokens <= 0:
            return  # no load, or vLLM's second call of an asynchronous one
        start = tracked.offered_from
        end = start + num_external_tokens
        prefix = tracked.state.prefix if tracked.state is not None else None
        objects: tuple[ObjectRef, ...] = ()
        again = tracked.load_planned and (
            self._offer_once or tracked.loading or tracked.failed_load
        )
        if prefix is not None and end <= prefix.num_tokens and not again:
            objects = tuple(prefix.objects_from(start))
        else:
            # the engine accepted more than was offered: load nothing, so that
            # the load fails and every token is recomputed
            log.warning(
                "kvtier: the engine accepted tokens [%d, %d) of %s that were not offered",
                start,
                end,
                request.request_id,
            )
        tracked.load_planned = True
        tracked.loading = self._load_async
        self._loads.append(
            PlannedLoad(
                request.request_id,
                start,
                end,
                objects,
                tuple(block_ids),
                sync=not self._load_async,
            )
        )

    # ---- the step's plan ---------------------------------------------------------------

    def num_prompt_tokens(self, request_id: str) -> int | None:
        """The prompt length of a tracked, cacheable request (None otherwise)."""
        tracked = self._requests.get(request_id)
        if tracked is None or tracked.state is None:
            return None
        return tracked.state.num_prompt_tokens

    def set_blocks(
        self, request_id: str, block_ids: Sequence[int], *, append: bool = False
    ) -> None:
        """The request's block table now is ``block_ids`` (or grew by them, with ``append``)."""
        tracked = self._requests.get(request_id)
        if tracked is None:
            return
        if append:
            tracked.block_ids.extend(block_ids)
        else:
            tracked.block_ids = list(block_ids)

    def plan_saves(
        self,
        request_id: str,
        computed: int,
        *,
        decode: bool,
        token_ids: Sequence[int] | None = None,
        block_ids: Sequence[int] | None = None,
    ) -> None:
        """After this step the first ``computed`` tokens have KV: plans what to save of them.

        Args:
            request_id: The request.
            computed: Tokens whose KV is in the cache after this step's forward pass.
            decode: The step computed output tokens (not the prompt).
            token_ids: Prompt + output so far (default: the tracked request's).
            block_ids: Its block table (default: the tracked one).
        """
        tracked = self._requests.get(request_id)
        if tracked is None or tracked.state is None:
            return
        if decode and not self._config.connector.save_decode:
            return
        if block_ids is not None:
            tracked.block_ids = list(block_ids)
        state = tracked.state
        tokens = token_ids if token_ids is not None else tracked.request.all_token_ids
        prompt = state.num_prompt_tokens
        objects = state.chunks_to_save(tokens, computed)
        if self._config.save_partial_chunks and not decode and computed >= prompt:
            tail = state.tail_to_save(tokens, prompt, exact=True)
            if tail is not None:
                objects.append(tail)
        objects = [o for o in objects if o.key not in self.quarantine]  # found wrong here
        verify = state.verifiable(computed) if self._sample is not None else []
        if objects or verify:
            self._saves.append(
                PlannedSave(
                    request_id,
                    tuple(objects),
                    tuple(tracked.block_ids),
                    after_failed_load=tracked.failed_load,
                    verify=tuple(verify),
                )
            )

    def take_plan(self) -> StepPlan:
        """What was planned since the last call: loads accepted, saves (finished requests' first)."""
        plan = StepPlan(tuple(self._loads), tuple(self._saves))
        self._loads.clear()
        self._saves.clear()
        return plan

    # ---- what the worker saw -----------------------------------------------------------

    def update(self, finished_loads: Iterable[str], report: WorkerReport | None) -> None:
        """Loads that ended (asynchronous ones), and the worker's report."""
        for rid in finished_loads:
            tracked = self._requests.get(rid)
            if tracked is not None:
                tracked.loading = False
        if report is None:
            return
        self._worker_stuck = report.stuck
        for key in report.bad_keys:
            self.quarantine.add(key)
        for rid, token in report.failed_loads.items():
            tracked = self._requests.get(rid)
            if tracked is None or tracked.state is None:
                continue
            tracked.failed_load = True
            tracked.state.load_failed_at(token)  # the engine recomputes from there: save it again

    def request_finished(self, request: Any, block_ids: Sequence[int]) -> bool:
        """Plans the finished request's last saves; True when its blocks must wait for them."""
        tracked = self._requests.pop(request.request_id, None)
        self._lookups.cancel(request.request_id)
        if tracked is None or tracked.state is None or tracked.loading:
            return False  # a load in flight: the worker drops it, the blocks are freed after
        if not self._config.connector.save_decode:
            return False
        state = tracked.state
        tokens = request.all_token_ids
        computed = request.num_computed_tokens
        objects = state.chunks_to_save(tokens, computed)
        if self._config.save_partial_chunks:
            tail = state.tail_to_save(tokens, computed)
            if tail is not None:
                objects.append(tail)
        objects = [o for o in objects if o.key not in self.quarantine]
        if not objects:
            return False
        self._saves.insert(
            0,
            PlannedSave(
                request.request_id,
                tuple(objects),
                tuple(block_ids),
                after_failed_load=tracked.failed_load,
                release=True,
            ),
        )
        return True

    @property
    def num_tracked(self) -> int:
        """Requests the scheduler side holds state for (they leave at ``request_finished``)."""
        return len(self._requests)
