"""One simulated engine: a continuous-batching step loop over a G1 block cache.

Each step is planned as ``engine/scheduler.py`` plans it, under a token
budget (``max_batched_tokens``) and a sequence cap (``max_num_seqs``):

1. running requests in admission order: a decode takes 1 token, a request in
   prefill its next chunk (the rest of its prompt, up to the budget left);
   requests still loading KV are skipped (they hold their blocks, as vLLM's
   ``WAITING_FOR_REMOTE_KVS``);
2. then waiting requests in strict FIFO order, each only when blocks for its
   whole prompt and answer are free (so nothing is ever preempted): G1 hit,
   then the external match (shared tier) — a load runs asynchronously and the
   request is scheduled when it lands — then a first chunk.

The step lasts ``StepCosts.step_s`` of its shape. A stretch of decode-only
steps is one event (a *macro step*): with B sequences and context C, step
``j`` lasts ``D0 + c·B·j`` (``D0 = base + s·B + c·C``), so the stretch up to
the next finish has a closed form. An arrival or a finished load cuts it at
the end of the step in progress, the moment the real engine would next plan.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvtier.bench.fleet.costs import EngineSpec, chunk_pairs
from kvtier.bench.fleet.g1 import G1Cache, KeyListener
from kvtier.bench.fleet.request import Phase, Role, SimRequest
from kvtier.router.policy import Reservation


class EngineHost(Protocol):
    """What an engine needs from the fleet around it."""

    now: float

    def schedule(self, t: float, fn: Callable[[Any], None], arg: Any) -> None:
        """Calls ``fn(arg)`` at time ``t``."""

    def external_match(self, engine: SimEngine, req: SimRequest) -> int:
        """Prompt tokens after ``req.computed`` to load from the shared tier (0: none)."""

    def start_load(self, engine: SimEngine, req: SimRequest, tokens: int) -> float:
        """Starts moving ``tokens`` of KV into ``engine`` for ``req``; returns when it lands."""

    def prompt_done(self, engine: SimEngine, req: SimRequest) -> None:
        """``req``'s first token was produced on ``engine`` (prefill or full role)."""

    def finished(self, engine: SimEngine, req: SimRequest) -> None:
        """``req`` left ``engine`` for good: its answer is complete (or handed off)."""


@dataclass(frozen=True)
class BulkItl:
    """Inter-token gaps of steps ``1..steps-1`` of a macro step: ``first + inc·j``, ``weight`` each."""

    first: float
    inc: float
    steps: int
    weight: int


@dataclass
class _Step:
    """The step in flight: regular (``chunks`` non-empty) or a macro of decode-only steps."""

    t0: float
    chunks: list[tuple[SimRequest, int]]
    decoders: list[SimRequest]
    first_s: float  # duration of the first (or only) step
    inc_s: float = 0.0  # growth per step of a macro
    steps: int = 1

    def elapsed(self, m: int) -> float:
        """Seconds of the first ``m`` steps."""
        return m * self.first_s + self.inc_s * m * (m - 1) / 2


class SimEngine:
    """An engine in the fleet. Driven by its host's event loop; not thread-safe."""

    def __init__(
        self,
        eid: int,
        spec: EngineSpec,
        host: EngineHost,
        on_stored: KeyListener | None = None,
        on_evicted: KeyListener | None = None,
        macro_steps: bool = True,
    ) -> None:
        self.eid = eid
        self.spec = spec
        self.host = host
        self.g1 = G1Cache(spec.g1_capacity_blocks, on_stored, on_evicted)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.pending_prefill_tokens = 0  # the router's estimate of the prompt tokens queued here
        self.busy_s = 0.0
        self.steps = 0
        self.requests = 0
        self.in_flight = 0  # requests queued or admitted here
        # what the router counts of them (the shipped router's Engine.reservations), by rid
        self._reserved: dict[int, Reservation] = {}
        self.itl_single: list[float] = []
        self.itl_bulk: list[BulkItl] = []
        self.macro_steps = macro_steps
        self._step: _Step | None = None
        self._version = 0
        self._ending = False  # inside _end_step: it plans the next step itself

    @property
    def load(self) -> int:
        """Requests it is busy with (what the shipped router calls an engine's load)."""
        return self.in_flight

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens its G1 holds (the shipped router reads it from the engine's metrics)."""
        return self.spec.g1_capacity_tokens

    @property
    def reservations(self) -> list[Reservation]:
        """Its requests in flight as the router counts them: oldest first."""
        return list(self._reserved.values())

    # ---- queue --------------------------------------------------------------------------

    def enqueue(self, req: SimRequest, role: Role) -> None:
        """Queues ``req`` here in ``role``.

        Raises:
            ValueError: if the request can never fit in this engine's G1.
        """
        req.role, req.phase, req.engine = role, Phase.WAITING, self.eid
        req.computed = req.registered = req.private_blocks = 0
        req.held = []
        if self._blocks_needed(req) > self.g1.capacity:
            raise ValueError(
                f"request {req.rid} needs {req.tokens_here()} tokens of KV, "
                f"more than engine G1 holds ({self.spec.g1_capacity_tokens})"
            )
        self.requests += 1
        self.in_flight += 1
        kv = req.tokens_here()
        hit = req.prompt_tokens - req.est_tokens if req.role is not Role.DECODE else 0
        self._reserved[req.rid] = Reservation(kv, kv - req.prompt_tokens, kv - hit)
        self.waiting.append(req)
        self.pending_prefill_tokens += req.est_tokens
        self.wake()

    def wake(self) -> None:
        """Something changed (an arrival, a load landed): plan now, or at the next step end."""
        step = self._step
        if self._ending:
            return
        if step is None:
            self._begin_step()
        elif step.steps > 1:
            self._cut_macro(step)

    # ---- planning -------------------------------------------------------------------------

    def _blocks_needed(self, req: SimRequest) -> int:
        return math.ceil(req.tokens_here() / self.spec.block_tokens)

    def _admit(self, req: SimRequest) -> bool:
        bs = self.spec.block_tokens
        limit = (req.prompt_tokens if req.role is Role.DECODE else req.prompt_tokens - 1) // bs
        hits = self.g1.match(req.keys, limit)
        hit_keys = req.keys[:hits]
        total = self._blocks_needed(req)
        if not self.g1.can_allocate(hit_keys, total):
            return False
        self.g1.allocate(hit_keys, total)
        req.held, req.registered, req.private_blocks = list(hit_keys), hits, total - hits
        req.computed = hits * bs
        if req.admitted_s < 0:
            req.admitted_s = self.host.now
        if req.role is Role.DECODE:
            req.decode_g1_tokens = req.computed
            load = req.prompt_tokens - req.computed
            req.handoff_tokens = load
        else:
            req.g1_tokens = req.computed
            load = self.host.external_match(self, req)
            req.tier_tokens = load
        if load > 0:
            req.phase = Phase.LOADING
            self.host.schedule(self.host.start_load(self, req, load), self._load_done, req)
        else:
            req.phase = Phase.DECODE if req.role is Role.DECODE else Phase.PREFILL
        return True

    def _begin_step(self) -> None:
        budget = self.spec.max_batched_tokens
        chunks: list[tuple[SimRequest, int]] = []
        decoders: list[SimRequest] = []
        for r in self.running:
            if budget <= 0:
                break
            if r.phase is Phase.DECODE:
                decoders.append(r)
                budget -= 1
            elif r.phase is Phase.PREFILL:
                n = min(r.prompt_tokens - r.computed, budget)
                chunks.append((r, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.spec.max_num_seqs:
            r = self.waiting[0]
            if not self._admit(r):
                break
            self.waiting.popleft()
            self.running.append(r)
            if r.phase is Phase.PREFILL:
                n = min(r.prompt_tokens - r.computed, budget)
                chunks.append((r, n))
                budget -= n
            elif r.phase is Phase.DECODE:
                decoders.append(r)
                budget -= 1
        if not chunks and not decoders:
            self._step = None
            return
        costs = self.spec.costs
        ctx = sum(r.prompt_tokens + r.generated for r in decoders)
        b = len(decoders)
        if chunks or not self.macro_steps:
            tokens = sum(n for _, n in chunks)
            pairs = sum(chunk_pairs(r.computed, n) for r, n in chunks)
            step = _Step(self.host.now, chunks, decoders, costs.step_s(tokens, pairs, b, ctx))
        else:
            k = min(r.answer_tokens - r.generated for r in decoders)
            step = _Step(
                self.host.now,
                [],
                decoders,
                costs.step_s(0, 0, b, ctx),
                costs.decode_s_per_ctx * b,
                k,
            )
        self._start(step)

    def _start(self, step: _Step) -> None:
        self._step = step
        self._version += 1
        self.host.schedule(step.t0 + step.elapsed(step.steps), self._end_step, self._version)

    def _cut_macro(self, step: _Step) -> None:
        """Ends the macro step at the end of the step in progress."""
        x = self.host.now - step.t0
        lo, hi = 1, step.steps
        while lo < hi:  # the fewest steps whose end is at or after now
            mid = (lo + hi) // 2
            if step.elapsed(mid) >= x:
                hi = mid
            else:
                lo = mid + 1
        if lo < step.steps:
            step.steps = lo
            self._start(step)

    # ---- step end --------------------------------------------------------------------------

    def _end_step(self, version: int) -> None:
        if version != self._version or self._step is None:
            return  # superseded by a cut
        step, self._step = self._step, None
        self._ending = True
        now = self.host.now
        self.busy_s += step.elapsed(step.steps)
        self.steps += step.steps
        done: list[SimRequest] = []
        first_end = step.t0 + step.first_s
        for r in step.decoders:
            self._emit_first(r, first_end)
            r.generated += step.steps
            r.last_token_s = now
            if r.generated >= r.answer_tokens:
                done.append(r)
        if step.steps > 1:
            self.itl_bulk.append(BulkItl(step.first_s, step.inc_s, step.steps, len(step.decoders)))
        bs = self.spec.block_tokens
        for r, n in step.chunks:
            r.computed += n
            self._register(r, r.computed // bs)
            if r.computed == r.prompt_tokens:
                self.pending_prefill_tokens -= r.est_tokens
                r.generated = 1
                r.first_token_s = r.last_token_s = now
                if r.role is Role.PREFILL or r.answer_tokens == 1:
                    done.append(r)
                else:
                    r.phase = Phase.DECODE
                self.host.prompt_done(self, r)
        for r in done:
            self._leave(r)
        self._ending = False
        self._begin_step()

    def _emit_first(self, r: SimRequest, t: float) -> None:
        """The first token of this step for ``r``: one inter-token gap sample."""
        gap = t - r.last_token_s
        self.itl_single.append(gap)
        if r.role is Role.DECODE and r.generated == 1:
            r.handoff_gap_s = gap

    def _register(self, r: SimRequest, upto: int) -> None:
        upto = min(upto, len(r.keys))
        for j in range(r.registered, upto):
            key = r.keys[j]
            if self.g1.register(key):
                r.held.append(key)
                r.private_blocks -= 1
        r.registered = max(r.registered, upto)

    def _leave(self, r: SimRequest) -> None:
        """``r`` is done here: its computed blocks stay cached, the rest is freed."""
        self._register(r, (r.prompt_tokens + r.generated - 1) // self.spec.block_tokens)
        self.g1.release(r.held, r.private_blocks)
        r.held, r.private_blocks = [], 0
        self.running.remove(r)
        self.in_flight -= 1
        self._reserved.pop(r.rid, None)
        if r.role is not Role.PREFILL:
            r.phase = Phase.DONE
            r.finish_s = self.host.now
            r.finishes += 1
        self.host.finished(self, r)

    def _load_done(self, r: SimRequest) -> None:
        r.computed += r.handoff_tokens if r.role is Role.DECODE else r.tier_tokens
        self._register(r, r.computed // self.spec.block_tokens)
        r.phase = Phase.DECODE if r.role is Role.DECODE else Phase.PREFILL
        self.wake()

    # ---- results ---------------------------------------------------------------------------

    def itl_samples(self) -> tuple[np.ndarray, np.ndarray]:
        """All inter-token gaps seen here, as (seconds, weights)."""
        values = [np.asarray(self.itl_single, dtype=float)]
        weights = [np.ones(len(self.itl_single))]
        for b in self.itl_bulk:
            j = np.arange(1, b.steps, dtype=float)
            values.append(b.first + b.inc * j)
            weights.append(np.full(len(j), float(b.weight)))
        return np.concatenate(values), np.concatenate(weights)

    def check_integrity(self) -> None:
        """Asserts the engine's invariants (tests call it)."""
        self.g1.check_integrity()
        assert len(self.running) <= self.spec.max_num_seqs
        assert all(r.phase is Phase.WAITING for r in self.waiting)
        assert len({id(r) for r in self.running}) == len(self.running)
        assert self.in_flight == len(self.waiting) + len(self.running)
