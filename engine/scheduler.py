"""Continuous-batching scheduler with chunked prefill, preemption and connector loads.

One ``schedule()`` call plans one engine step under a token budget
(``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``):

1. Running requests, oldest first, each get their remaining tokens (one for
   a decode, the rest of the prompt — up to the budget — for a request in
   chunked prefill). When blocks run out, the newest running request is
   preempted (blocks freed, recomputed later) until the current one fits.
2. If nothing was preempted, waiting requests are admitted strictly in FIFO
   order (a head that does not fit blocks the queue: no overtaking). For
   each: G1 prefix-cache hit, then the connector's external match, then
   a prefill chunk within the remaining budget. A request is admitted only
   when blocks for its whole prompt are free, and takes them all at once.
   A request whose external KV loads asynchronously is admitted into
   LOADING instead (blocks held, no tokens this step); when the connector
   reports its load over (``apply_async_outcome``, at the start of a later
   step) it joins the running batch with what was loaded.

Token ranges of an admitted request in its first step::

    0            g1             g1+ext            g1+ext+n        len
    |-- G1 hit --|-- ext load --|-- computed now --|-- later --|
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from kvtier.engine.block_manager import BlockManager
from kvtier.engine.connector import (
    ConnectorRequest,
    KVConnector,
    LoadMetadata,
    LoadOutcome,
    LoadSpec,
)
from kvtier.engine.outputs import FinishReason
from kvtier.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledChunk:
    """What one request does in one step.

    Attributes:
        request: The request.
        load_start: Tokens already computed when scheduled.
        num_external: Tokens to load through the connector from ``load_start``.
        num_tokens: Tokens to compute after the loaded ones.
    """

    request: Request
    load_start: int
    num_external: int
    num_tokens: int

    @property
    def compute_start(self) -> int:
        """Position of the first token computed this step."""
        return self.load_start + self.num_external

    @property
    def samples(self) -> bool:
        """True when this step computes the request's last token (so it samples)."""
        return self.compute_start + self.num_tokens == self.request.num_tokens


class _LookupPending:
    """``_try_admit``'s answer for a request whose connector lookup has not answered yet."""


LOOKUP_PENDING = _LookupPending()


@dataclass
class SchedulerOutput:
    """The plan of one step."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    async_loads: list[LoadSpec] = field(default_factory=list)  # admitted into LOADING
    lookups_pending: int = 0  # waiting requests passed over: their connector lookup is in flight

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed in this step."""
        return sum(c.num_tokens for c in self.chunks)


@dataclass
class SchedulerCounters:
    """Cumulative scheduler counters."""

    external_query_tokens: int = 0
    external_matched_tokens: int = 0
    external_loaded_tokens: int = 0
    load_failures: int = 0
    recomputed_after_load_failure_tokens: int = 0
    connector_errors: int = 0
    num_preemptions: int = 0


def connector_view(request: Request) -> ConnectorRequest:
    """The read-only view of a request handed to connectors."""
    return ConnectorRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        all_token_ids=request.token_ids,
        block_ids=request.block_ids,
        num_computed_tokens=request.num_computed_tokens,
        prefix_keys=request.prefix_keys,
    )


class Scheduler:
    """Plans steps; owns the waiting and running queues and the block manager.

    Not thread-safe: used only from the engine's step thread.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        connector: KVConnector,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.block_manager = block_manager
        self.connector = connector
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # admitted requests whose external KV is being fetched asynchronously:
        # request id -> (request, tokens being loaded)
        self.loading: dict[str, tuple[Request, int]] = {}
        self.counters = SchedulerCounters()

    # ---- queues ---------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queues a new request at the back of the waiting queue."""
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting or self.running or self.loading)

    def find(self, request_id: str) -> Request | None:
        """The unfinished request with this id, if any."""
        for r in self.running:
            if r.request_id == request_id:
                return r
        for r in self.waiting:
            if r.request_id == request_id:
                return r
        entry = self.loading.get(request_id)
        return entry[0] if entry is not None else None

    # ---- planning ---------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plans one step (see the module docstring)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # 1. running requests, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            target = req.num_computed_tokens + num_new
            while not bm.can_append(req, target):
                victim = self.running.pop()  # newest
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break  # it preempted itself: it was the newest, nothing follows
            bm.append(req, target)
            out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, 0, num_new))
            budget -= num_new
            i += 1

        # 2. waiting requests, FIFO, only when nothing had to be preempted; a request
        # whose connector lookup is still in flight is passed over until it answers
        i = 0
        while (
            i < len(self.waiting)
            and budget > 0
            and not out.preempted
            and len(self.running) + len(self.loading) < self.max_num_seqs
        ):
            req = self.waiting[i]
            admitted = self._try_admit(req, budget)
            if admitted is None:
                break
            if isinstance(admitted, _LookupPending):
                out.lookups_pending += 1
                i += 1
                continue
            del self.waiting[i]
            if isinstance(admitted, LoadSpec):  # fetched in the background; no tokens now
                req.status = RequestStatus.LOADING
                self.loading[req.request_id] = (req, admitted.num_tokens)
                out.async_loads.append(admitted)
                continue
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.chunks.append(admitted)
            budget -= admitted.num_tokens
        return out

    def _try_admit(
        self, req: Request, budget: int
    ) -> ScheduledChunk | LoadSpec | _LookupPending | None:
        bm = self.block_manager
        total = req.num_tokens
        hits = bm.find_cached_prefix(req)
        num_g1 = len(hits) * bm.block_size
        match = self._external_match(req, num_g1)
        if match is None:
            return LOOKUP_PENDING
        num_ext, load_async = match
        num_new = min(total - num_g1 - num_ext, budget)
        # NOTE: blocks for the whole prompt are taken at admission, not for the
        # first chunk only: a request admitted on its first chunk's blocks can
        # find the rest taken by later admissions and be preempted mid-prefill,
        # and with a small cache requests then preempt each other in turn,
        # recomputing their prompts again and again (docs/engine.md, "Serving").
        if not bm.can_allocate(hits, total):
            return None
        bm.allocate(req, hits, total)
        req.num_computed_tokens = num_g1
        bm.record_lookup(total, num_g1)
        if req.num_cached_tokens is None:
            req.num_cached_tokens = num_g1
        self.counters.external_query_tokens += total - num_g1
        self.counters.external_matched_tokens += num_ext
        try:
            self.connector.update_state_after_alloc(connector_view(req), req.block_ids, num_ext)
        except Exception:  # a connector failure must not fail the request
            logger.exception("kv connector update_state_after_alloc failed")
            self.counters.connector_errors += 1
        if load_async and num_ext > 0:
            return LoadSpec(
                request_id=req.request_id,
                token_ids=req.token_ids,
                block_ids=req.block_ids,
                start=num_g1,
                num_tokens=num_ext,
                asynchronous=True,
            )
        return ScheduledChunk(req, num_g1, num_ext, num_new)

    def _external_match(self, req: Request, num_g1: int) -> tuple[int, bool] | None:
        """The connector's match, clamped; ``(tokens, load asynchronously)``, None while pending."""
        try:
            answer = self.connector.get_num_new_matched_tokens(connector_view(req), num_g1)
            if answer is None:
                return None
            n, load_async = answer if isinstance(answer, tuple) else (answer, False)
            n = int(n)
        except Exception:  # a lookup failure is a miss, counted
            logger.exception("kv connector get_num_new_matched_tokens failed")
            self.counters.connector_errors += 1
            self.counters.load_failures += 1
            return 0, False
        # NOTE: the last token is always computed: its logits give the next token.
        return max(0, min(n, req.num_tokens - 1 - num_g1)), bool(load_async)

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.counters.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- connector loads ------------------------------------------------------------

    @staticmethod
    def load_metadata(out: SchedulerOutput) -> LoadMetadata | None:
        """Loads to start this step: synchronous ones (needed before this step's
        forward pass) and asynchronous ones (None if nothing)."""
        specs = [*out.async_loads] + [
            LoadSpec(
                request_id=c.request.request_id,
                token_ids=c.request.token_ids,
                block_ids=c.request.block_ids,
                start=c.load_start,
                num_tokens=c.num_external,
            )
            for c in out.chunks
            if c.num_external > 0
        ]
        return LoadMetadata(specs) if specs else None

    def apply_load_outcome(self, out: SchedulerOutput, outcome: LoadOutcome | None) -> None:
        """Keeps only what was actually loaded; the rest is recomputed in this step's chunk.

        ``outcome`` None means the load raised: nothing was loaded.
        """
        for c in out.chunks:
            if c.num_external == 0:
                continue
            result = outcome.results.get(c.request.request_id) if outcome is not None else None
            loaded = 0 if result is None else max(0, min(int(result.loaded_tokens), c.num_external))
            failed = result is None or result.failed or loaded < c.num_external
            if failed:
                self.counters.load_failures += 1
                self.counters.recomputed_after_load_failure_tokens += c.num_external - loaded
            self.counters.external_loaded_tokens += loaded
            c.request.num_external_tokens += loaded
            c.num_external = loaded

    def apply_async_outcome(self, outcome: LoadOutcome) -> list[Request]:
        """Moves LOADING requests whose load ended into the running batch.

        Each keeps what was loaded (``num_computed_tokens`` advances, the
        loaded full blocks join the prefix cache) and computes the rest.

        Returns:
            The requests that joined the running batch.
        """
        joined = []
        for rid, result in outcome.results.items():
            entry = self.loading.pop(rid, None)
            if entry is None:
                continue  # finished or aborted while its fetch ran
            req, wanted = entry
            loaded = max(0, min(int(result.loaded_tokens), wanted))
            if result.failed or loaded < wanted:
                self.counters.load_failures += 1
                self.counters.recomputed_after_load_failure_tokens += wanted - loaded
            self.counters.external_loaded_tokens += loaded
            req.num_external_tokens += loaded
            req.num_computed_tokens += loaded
            self.block_manager.cache_blocks(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            joined.append(req)
        return joined

    # ---- after the forward pass ---------------------------------------------------------

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advances computed-token counts and registers newly full blocks."""
        for c in out.chunks:
            req = c.request
            req.num_computed_tokens = c.compute_start + c.num_tokens
            self.block_manager.cache_blocks(req)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """Ends ``req`` (finished, stopped or aborted): tells the connector, frees blocks."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status == RequestStatus.LOADING:
            self.loading.pop(req.request_id, None)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        try:
            self.connector.request_finished(connector_view(req), req.block_ids)
        except Exception:  # a connector failure must not fail the request
            logger.exception("kv connector request_finished failed")
            self.counters.connector_errors += 1
        self.block_manager.free(req)
