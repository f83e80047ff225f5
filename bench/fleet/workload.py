"""Workload of the fleet simulation: multi-turn sessions over Zipf-popular prefixes.

A session starts at a Poisson arrival, picks one prefix (a system prompt or a
document) by Zipf popularity (weight ``1 / rank**zipf_s``) and runs a few
turns. Turn ``k`` sends the prefix, every earlier question and answer, and a
new question; the next turn arrives a think time (exponential) after the
answer completes, so arrivals of later turns depend on how fast the fleet
serves (closed loop per session). Everything is drawn up front from one seed.

Content is never materialised: a prompt is named by the chain keys of its
KV blocks, as kvtier names chunks (``key_i`` depends on every token before
block ``i``). A block that lies wholly inside the prefix has a key shared by
every session on that prefix; any later block (including the one straddling
the prefix's end) is the session's own. Because a turn re-sends the whole
history, its blocks' keys are the previous turn's plus new ones::

    tokens: |------ prefix p ------|-- q1 --|-- a1 --|-- q2 --| ...
    keys:   (p,0) (p,1) ... (p,m-1) (s,m) (s,m+1) ...
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_BLOCK_BITS = 24  # block index within a prompt (2^24 blocks: far beyond any context)


@dataclass(frozen=True)
class WorkloadSpec:
    """What sessions look like and how often they start.

    Attributes:
        sessions: Number of sessions.
        session_rate: New sessions per second (Poisson).
        prefixes: Distinct prefixes (system prompts, documents).
        zipf_s: Zipf exponent of prefix popularity (0: uniform).
        prefix_tokens: (min, max) prefix length, uniform.
        turns_mean: Mean turns per session (geometric, at least 1).
        turns_max: Most turns per session.
        question_tokens: (min, max) new tokens per turn, uniform.
        answer_tokens: (min, max) generated tokens per turn, uniform.
        think_s: Mean think time between an answer and the next turn (exponential).
        max_context_tokens: A turn whose prompt plus answer would exceed this ends the session.
        unique_prefixes: Every session gets a prefix of its own (no sharing).
        spike: ``(start_s, end_s, factor)``: sessions start ``factor`` times as
            often between ``start_s`` and ``end_s`` (None: a steady rate).
        seed: Seed of every draw.
    """

    sessions: int
    session_rate: float
    prefixes: int = 200
    zipf_s: float = 1.0
    prefix_tokens: tuple[int, int] = (512, 3072)
    turns_mean: float = 3.0
    turns_max: int = 8
    question_tokens: tuple[int, int] = (32, 256)
    answer_tokens: tuple[int, int] = (16, 128)
    think_s: float = 8.0
    max_context_tokens: int = 8192
    unique_prefixes: bool = False
    spike: tuple[float, float, float] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.session_rate <= 0 or self.prefixes < 1:
            raise ValueError("sessions, session_rate and prefixes must be positive")
        if self.turns_mean < 1 or self.turns_max < 1 or self.think_s < 0 or self.zipf_s < 0:
            raise ValueError("turns_mean, turns_max >= 1; think_s, zipf_s >= 0")
        for name in ("prefix_tokens", "question_tokens", "answer_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be (min, max) with 1 <= min <= max")
        if self.prefix_tokens[1] + self.question_tokens[1] + self.answer_tokens[1] > (
            self.max_context_tokens
        ):
            raise ValueError("max_context_tokens must fit a first turn of maximal size")
        if self.spike is not None:
            start, end, factor = self.spike
            if not (0 <= start < end and factor > 0):
                raise ValueError("spike must be (start_s, end_s, factor) with 0 <= start < end")

    def sessions_until(self, t: float) -> float:
        """Expected sessions started by time ``t`` (the rate, spike included, integrated)."""
        if self.spike is None:
            return self.session_rate * t
        start, end, factor = self.spike
        extra = (factor - 1) * max(0.0, min(t, end) - start)
        return self.session_rate * (t + extra)


@dataclass(frozen=True)
class Turn:
    """One request of a session: its new question, its answer length, the think time after it."""

    question_tokens: int
    answer_tokens: int
    think_s: float


@dataclass(frozen=True)
class Session:
    """A user conversation over one prefix.

    Attributes:
        session_id: Index of the session.
        arrival_s: When its first turn arrives.
        prefix_id: Which prefix it uses.
        prefix_tokens: That prefix's length.
        turns: Its turns, in order.
    """

    session_id: int
    arrival_s: float
    prefix_id: int
    prefix_tokens: int
    turns: tuple[Turn, ...]

    def prompt_tokens(self, turn: int) -> int:
        """Prompt length of turn ``turn``: prefix, all earlier turns, the new question."""
        history = sum(t.question_tokens + t.answer_tokens for t in self.turns[:turn])
        return self.prefix_tokens + history + self.turns[turn].question_tokens

    def block_keys(self, num_tokens: int, block_tokens: int) -> list[int]:
        """Chain keys of the full blocks among the first ``num_tokens`` tokens of this session."""
        shared = self.prefix_tokens // block_tokens
        pk = (self.prefix_id + 1) << _BLOCK_BITS
        sk = -((self.session_id + 1) << _BLOCK_BITS)
        n = num_tokens // block_tokens
        return [pk + j for j in range(min(shared, n))] + [sk - j for j in range(shared, n)]


def zipf_weights(n: int, s: float) -> np.ndarray:
    """Normalised popularity of ranks 1..n: ``1 / rank**s``."""
    w = 1.0 / np.arange(1, n + 1, dtype=float) ** s
    return w / w.sum()


def _spiked(steady: np.ndarray, start: float, end: float, factor: float) -> np.ndarray:
    """Arrival times of a steady Poisson process mapped onto one whose rate is ``factor``
    times higher in ``[start, end)`` (the inverse of the integrated rate)."""
    t = steady
    in_spike = start + (end - start) * factor  # steady time at which the spike ends
    return np.where(
        t < start, t, np.where(t < in_spike, start + (t - start) / factor, end + (t - in_spike))
    )


def build_sessions(spec: WorkloadSpec) -> list[Session]:
    """The sessions of ``spec``, deterministic for its seed."""
    rng = np.random.default_rng(spec.seed)
    n = spec.sessions
    arrivals = np.cumsum(rng.exponential(1.0 / spec.session_rate, n))
    if spec.spike is not None:
        arrivals = _spiked(arrivals, *spec.spike)
    lo, hi = spec.prefix_tokens
    if spec.unique_prefixes:
        prefix_ids = np.arange(n)
        prefix_lens = rng.integers(lo, hi + 1, n)
        lens_of = prefix_lens
    else:
        prefix_ids = rng.choice(spec.prefixes, size=n, p=zipf_weights(spec.prefixes, spec.zipf_s))
        lens_of = rng.integers(lo, hi + 1, spec.prefixes)
    turn_counts = np.minimum(rng.geometric(1.0 / spec.turns_mean, n), spec.turns_max)
    sessions = []
    for i in range(n):
        plen = int(lens_of[i] if spec.unique_prefixes else lens_of[prefix_ids[i]])
        k = int(turn_counts[i])
        qs = rng.integers(spec.question_tokens[0], spec.question_tokens[1] + 1, k)
        ans = rng.integers(spec.answer_tokens[0], spec.answer_tokens[1] + 1, k)
        thinks = rng.exponential(spec.think_s, k) if spec.think_s > 0 else np.zeros(k)
        turns: list[Turn] = []
        context = plen
        for q, a, t in zip(qs, ans, thinks, strict=True):
            if context + q + a > spec.max_context_tokens:
                break
            turns.append(Turn(int(q), int(a), float(t)))
            context += int(q + a)
        sessions.append(Session(i, float(arrivals[i]), int(prefix_ids[i]), plen, tuple(turns)))
    return sessions
