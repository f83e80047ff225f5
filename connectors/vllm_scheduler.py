"""The vLLM connector's scheduler side: lookups, load offers and the save plan.

Runs in vLLM's ``EngineCore`` process, on its scheduler thread. For each
request it keeps a ``RequestState`` (keys, lookup, save plan: shared with the
bundled engine's connector) and answers vLLM's scheduler hooks::

    get_num_new_matched_tokens(req, n_local)
        keys of the prompt ─► store.contains (one batched call per tier, on an I/O thread:
        ``lookup.py``; None while it is in flight, vLLM asks again next step) ─► longest
        stored prefix
        offer: min(prefix, prompt - 1) - n_local tokens (0 below min_load_tokens),
               loaded sync or async (VllmSettings.load_mode)
    update_state_after_alloc(req, blocks, n)   n > 0: plan a LoadSpec of [n_local, n_local + n)
    build_connector_meta(step)                 the planned loads, and a SaveSpec for every
                                               request whose chunks (or prompt tail) complete
                                               in this step
    update_connector_output(out)               WorkerReport: failed loads rewind the save plan
    request_finished(req, blocks)              with save_decode: the chunks and tail of
                                               prompt + answer; True keeps vLLM's blocks
                                               until the worker has gathered them

Rules that keep vLLM correct:

* **A request is offered a load at most once.** After a failed
  asynchronous load with nothing placed, vLLM frees the blocks and asks
  again; offering the same hit again loops forever (observed with vLLM
  0.32). A request whose load was planned gets 0 from then on.
* **An offer never exceeds what the lookup found**, and leaves the prompt's
  last token to vLLM; whatever the worker fails to place is reported as
  failed blocks, so vLLM recomputes it (``vllm_worker.py``).
* **Saves after a failed load wait for the news** (``SaveSpec.after_failed_load``).

Requests with LoRA adapters, multimodal inputs or prompt embeddings are not
cached (their KV depends on more than the tokens): a miss, counted.
``cache_salt`` isolates requests as a tenant salt of the namespace.

**Sampled verification** (``connectors/verify.py``, ``connector.verify_fraction``;
on by default where a tier is shared): each loadable object is sampled;
the offer stops before the first sampled one, so vLLM computes it and what
follows, and the save plan hands those objects, once computed, to the worker
(``SaveSpec.verify``), which compares them with their stored blocks. Keys
the worker found wrong come back in its report and are quarantined here:
lookups do not offer them again for a while.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.config import KvtierConfig, effective_verify_fraction
from kvtier.connectors.load_job import Fetcher
from kvtier.connectors.lookup import AsyncLookups
from kvtier.connectors.prefix import ObjectRef
from kvtier.connectors.request_state import RequestState
from kvtier.connectors.verify import Quarantine, Sampler, random_sampler
from kvtier.connectors.vllm_plan import Counters, LoadSpec, SaveSpec, StepPlan, WorkerReport
from kvtier.keys import CacheNamespace
from kvtier.metrics import StoreMetrics
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

    request: Any  # vLLM's Request, read as it changes (all_token_ids, num_computed_tokens)
    state: RequestState | None  # None: not cacheable
    block_ids: list[int] = field(default_factory=list)
    offered_from: int = 0  # n_local of the last offer
    load_planned: bool = False  # never offer again once set
    loading: bool = False  # an asynchronous load is in flight
    failed_load: bool = False  # the worker reported the load failed


class VllmScheduler:
    """The scheduler side (see the module docstring).

    Args:
        config: kvtier's configuration.
        namespace: Where this model's KV lives.
        store: The store the lookups ask.
        load_async: Offer hits as asynchronous loads.
        counters: Where to count (handed to vLLM's stats).
        metrics: kvtier's metrics.
        verify_sampler: Decides which loadable objects are verified (by default
            each with probability ``effective_verify_fraction(config)``).
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
    ) -> None:
        self._config = config
        self._ns = namespace
        self._store = store
        self._load_async = load_async
        self._counters = counters
        self._metrics = metrics
        self._requests: dict[str, _Tracked] = {}
        self._loads: list[LoadSpec] = []
        self._releases: list[SaveSpec] = []
        self._worker_stuck = False
        fraction = effective_verify_fraction(config)
        self._sample = verify_sampler
        if self._sample is None and fraction > 0:
            self._sample = random_sampler(fraction)
            log.info("kvtier: sampled verification of %.3g of loaded chunks", fraction)
        self.quarantine = Quarantine()
        """Keys the worker's verification found wrong: never offered while they stay."""
        # NOTE: the scheduler process's own I/O threads: lookups only (loads are the worker's)
        self._fetcher = Fetcher(store, config.connector.load_workers)
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
                ns = self._ns
                salt = getattr(request, "cache_salt", None)
                if salt:
                    ns = ns.with_tenant(salt)
                state = RequestState.new(ns, self._config.block_tokens, request.prompt_token_ids)
            else:
                self._counters.add("skipped_requests")
                log.debug("kvtier: request %s is not cached (%s)", rid, reason)
            tracked = self._requests[rid] = _Tracked(request, state)
        return tracked

    def _lookup_counted(self, what: str) -> None:
        self._counters.add(
            {"deferred": "lookups_deferred", "timeout": "lookup_timeouts"}.get(
                what, "refused_lookups"
            )
        )

    def close(self) -> None:
        """Stops the lookup threads (one stuck in a tier is left to end on its own)."""
        self._fetcher.shutdown()

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens to load beyond vLLM's own ``num_computed_tokens``, and whether asynchronously.

        ``None`` tokens: the lookup is still in flight; vLLM asks again next step.
        """
        tracked = self._track(request)
        state = tracked.state
        if state is None or tracked.load_planned:
            return 0, False
        first = state.prefix is None
        if not state.lookup_is_fresh(LOOKUP_REUSE_S):
            prefix = self._lookups.poll(request.request_id, state)
            if prefix is None:
                return None, False
            state.remember_lookup(prefix)
        assert state.prefix is not None
        prompt = state.num_prompt_tokens
        if first:
            self._counters.add("lookups")
            self._counters.add("lookup_tokens", prompt)
            self._counters.add("hit_tokens", state.prefix.num_tokens)
            self._metrics.lookup_tokens.labels("requested").inc(prompt)
            self._metrics.lookup_tokens.labels("hit").inc(state.prefix.num_tokens)
        end = min(state.prefix.num_tokens, prompt - 1)  # vLLM computes at least the last token
        if self._sample is not None:  # a sampled object is computed by vLLM, then compared
            end = state.plan_verification(num_computed_tokens, end, self._sample)
        n = end - num_computed_tokens
        if n < self._config.connector.min_load_tokens:
            return 0, False
        if self._worker_stuck:
            self._counters.add("refused_tokens", n)
            self._metrics.load_tokens.labels("refused").inc(n)
            return 0, False
        tracked.offered_from = num_computed_tokens
        return n, self._load_async

    def update_state_after_alloc(
        self, request: Any, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """vLLM allocated ``block_ids`` (all of the request's); plan the load of what it accepted."""
        tracked = self._track(request)
        tracked.block_ids = list(block_ids)
        if num_external_tokens <= 0:
            return  # no load, or the second call of an asynchronous one
        start = tracked.offered_from
        end = start + num_external_tokens
        prefix = tracked.state.prefix if tracked.state is not None else None
        objects: tuple[ObjectRef, ...] = ()
        if prefix is not None and end <= prefix.num_tokens and not tracked.load_planned:
            objects = tuple(prefix.objects_from(start))
        else:
            # vLLM accepted more than was offered: load nothing, so that every
            # block is reported failed and recomputed.
            log.warning(
                "kvtier: vLLM accepted tokens [%d, %d) of %s that were not offered",
                start,
                end,
                request.request_id,
            )
        tracked.load_planned = True
        tracked.loading = self._load_async
        self._loads.append(
            LoadSpec(
                request.request_id,
                start,
                end,
                objects,
                tuple(block_ids),
                sync=not self._load_async,
            )
        )

    # ---- the step's plan ---------------------------------------------------------------

    def build_plan(self, scheduler_output: Any) -> StepPlan:
        """This step's loads, and the saves of what its forward pass completes."""
        so = scheduler_output
        saves: list[SaveSpec] = list(self._releases)
        self._releases.clear()
        for new in so.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            self._plan_saves(
                tracked, new.num_computed_tokens, so.num_scheduled_tokens.get(new.req_id, 0), saves
            )
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            tracked = self._requests.get(rid)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                tracked.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                tracked.block_ids.extend(new_ids[0])
            self._plan_saves(
                tracked, cached.num_computed_tokens[i], so.num_scheduled_tokens.get(rid, 0), saves
            )
        loads = tuple(self._loads)
        self._loads.clear()
        return StepPlan(loads, tuple(saves))

    def _plan_saves(
        self, tracked: _Tracked, computed: int, scheduled: int, saves: list[SaveSpec]
    ) -> None:
        state = tracked.state
        if state is None or scheduled <= 0:
            return
        prompt = state.num_prompt_tokens
        decode = computed >= prompt
        if decode and not self._config.connector.save_decode:
            return
        after = computed + scheduled  # tokens whose KV is in the cache after this step
        tokens = tracked.request.all_token_ids
        objects = state.chunks_to_save(tokens, after)
        if self._config.save_partial_chunks and not decode and after >= prompt:
            tail = state.tail_to_save(tokens, prompt, exact=True)
            if tail is not None:
                objects.append(tail)
        objects = [o for o in objects if o.key not in self.quarantine]  # found wrong here
        verify = state.verifiable(after) if self._sample is not None else []
        if objects or verify:
            saves.append(
                SaveSpec(
                    tracked.request.request_id,
                    tuple(objects),
                    tuple(tracked.block_ids),
                    after_failed_load=tracked.failed_load,
                    verify=tuple(verify),
                )
            )

    # ---- what the worker saw -----------------------------------------------------------

    def update(self, finished_recving: Iterable[str], report: WorkerReport | None) -> None:
        """Loads that ended (async) and the worker's report of failures."""
        for rid in finished_recving:
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
            tracked.state.load_failed_at(token)  # vLLM recomputes from there: save it again

    def request_finished(self, request: Any, block_ids: Sequence[int]) -> bool:
        """Plans the finished request's last saves; True when vLLM must keep its blocks for them."""
        tracked = self._requests.pop(request.request_id, None)
        self._lookups.cancel(request.request_id)
        if tracked is None or tracked.state is None or tracked.loading:
            return False  # a load in flight: the worker drops it, vLLM frees the blocks after
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
        if not objects:
            return False
        self._releases.append(
            SaveSpec(
                request.request_id,
                tuple(objects),
                tuple(block_ids),
                after_failed_load=tracked.failed_load,
                release=True,
            )
        )
        return True

    @property
    def num_tracked(self) -> int:
        """Requests the scheduler side holds state for (they leave at ``request_finished``)."""
        return len(self._requests)
