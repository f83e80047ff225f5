"""One simulated request (a turn of a session) and what happened to it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvtier.bench.fleet.workload import Session


class Phase(enum.Enum):
    """Where a request is inside an engine."""

    WAITING = "waiting"  # queued, holds nothing
    LOADING = "loading"  # admitted, holds its blocks, KV arriving from the tier or a peer
    PREFILL = "prefill"  # computing its prompt, a chunk per step
    DECODE = "decode"  # one token per step
    DONE = "done"


class Role(enum.Enum):
    """What the engine holding the request does with it."""

    FULL = "full"  # colocated: prefill and decode
    PREFILL = "prefill"  # P/D prefill pool: compute the prompt and the first token
    DECODE = "decode"  # P/D decode pool: load the prompt's KV, generate the rest


@dataclass(slots=True, eq=False)
class SimRequest:
    """A request's static shape and its progress.

    Attributes:
        rid: Index in arrival order.
        session: The session it belongs to.
        turn: Which turn of the session.
        arrival_s: When it reached the router.
        prompt_tokens: Prompt length P.
        answer_tokens: Tokens to generate A (the first comes from the prefill).
        keys: Chain keys of the full blocks of its P + A tokens.
        role: What the current engine does with it.
        phase: Where it is in the current engine.
        engine: The current engine's id (-1: none).
        computed: Prompt tokens whose KV is in the current engine.
        generated: Tokens generated so far.
        held: Keys it references in the current engine's G1 (hits and blocks it stored).
        private_blocks: Blocks it holds in the current engine that carry no shared key.
        registered: Leading keys already hit or registered in the current engine.
        g1_tokens: Prompt tokens found in the prefill engine's G1.
        tier_tokens: Prompt tokens loaded from the shared tier instead of computed.
        decode_g1_tokens: P/D: prompt tokens the decode engine already held.
        handoff_tokens: P/D: prompt tokens moved to the decode engine.
        handoff_ready_s: P/D: when the prompt's KV can be read by a decode engine.
        est_tokens: The router's estimate of the prompt tokens it queued for prefill.
        prefill_engine: Engine that computed its prompt.
        decode_engine: Engine that generated the rest (== prefill_engine when colocated).
        admitted_s: When its first engine admitted it.
        first_token_s: When its first token was produced.
        last_token_s: When its latest token was produced.
        finish_s: When it finished.
        handoff_gap_s: P/D: time from the first token to the second.
        finishes: How many times it finished (the invariant says once).
    """

    rid: int
    session: Session
    turn: int
    arrival_s: float
    prompt_tokens: int
    answer_tokens: int
    keys: list[int]
    role: Role = Role.FULL
    phase: Phase = Phase.WAITING
    engine: int = -1
    computed: int = 0
    generated: int = 0
    held: list[int] = field(default_factory=list)
    private_blocks: int = 0
    registered: int = 0
    g1_tokens: int = 0
    tier_tokens: int = 0
    decode_g1_tokens: int = 0
    handoff_tokens: int = 0
    handoff_ready_s: float = 0.0
    est_tokens: int = 0
    prefill_engine: int = -1
    decode_engine: int = -1
    admitted_s: float = -1.0
    first_token_s: float = -1.0
    last_token_s: float = -1.0
    finish_s: float = -1.0
    handoff_gap_s: float = -1.0
    finishes: int = 0

    def tokens_here(self) -> int:
        """Tokens the current engine must hold KV blocks for."""
        if self.role is Role.PREFILL:
            return self.prompt_tokens + 1
        return self.prompt_tokens + self.answer_tokens
