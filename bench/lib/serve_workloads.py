"""Workloads of ``bench/serve.py``: synthetic conversations and documents, and when they arrive.

A :class:`Workload` is a set of *lanes*. A lane is one user (``multi-round``)
or one question (``doc-qa``): its turns are sent one after another, each at
its arrival time or when the lane's previous answer completed, whichever is
later. The server's actual answers go back into the lane's history.

* ``multi-round``: ``users`` users share one system prompt of
  ``system_tokens`` tokens; each has its own context of ``context_tokens``
  tokens. Round r sends the system prompt, the context, every earlier
  question with the server's answer, and a new question; answers are
  ``answer_tokens`` long (``ignore_eos``). Arrivals form one Poisson process
  at ``qps``; its k-th arrival is round ``k // users`` of user ``k % users``,
  so every user's rounds are ``users / qps`` seconds apart on average.
* ``sustained``: users keep arriving, so the server never drains. Users
  join as a Poisson process at ``user_rate`` per second for ``duration_s``;
  each is a multi-round conversation as above (shared system prompt, its
  own context, ``rounds`` rounds re-sending the history), and sends its
  next round ``think_s`` after its previous answer completed. The rate is
  chosen per host by ``bench/serve.py`` from a calibration of the host's
  prefill and decode speed (:func:`sustained_user_rate`): the same offered
  load (engine seconds per second) for every system, counted with the
  prompt tokens a big G1 computes (``prefill_tokens_per_user``); for the
  small-KV systems with decode at the batch their budget holds (one or two
  users at a time), which therefore get fewer users. That is the load a
  small G1 carries when a tier serves its misses; without one it computes
  ~3.7x the prompt tokens (its users' histories) and falls behind.
* ``doc-qa``: a pool of ``documents`` documents of ``min_tokens`` to
  ``max_tokens`` tokens (never a multiple of 16, so no prompt lines up with
  a block or chunk boundary); ``questions`` independent requests, each about
  one document drawn by Zipf popularity (weight ``1 / rank**zipf_s``),
  arriving as a Poisson process at ``qps``.

Text is readable synthetic English: words of a fixed vocabulary in sentences,
drawn by a seeded RNG per user, document and question, and sized in tokens
with the served model's tokenizer (the pre-tokenizer splits at word
boundaries, so the count of a text is the sum of its words' counts).
Everything is deterministic for a given seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

Message = dict[str, str]
CountTokens = Callable[[str], int]

_VOCAB_TEXT = """
able about above across action after again against age ago agree air all almost alone along
already also always among amount animal answer any appear area arm around art ask away back
ball bank base bear beauty become bed before began begin behind believe best better between
big bird black blue board boat body book both bottom box boy bread bring brother brown build
busy call came care carry case catch cause center certain chair change check child city class
clean clear close cloud cold color common complete condition consider contain control cook
corner correct cost could country course cover cross crowd current dark day deep degree
develop different direction discover distance doctor door down draw dream dress drink drive
during early earth east easy edge effect egg energy enough even evening event ever every
example exercise experience explain face fact fair fall family farm fast father feel field
figure fill final find fine fire first fish floor flower fly follow food foot force forest
form forward free fresh friend front fruit full game garden gather general gentle glass gold
good govern grass great green ground group grow guess half hand happen happy hard heart heat
heavy help high hill history hold home hope horse hour house huge idea important inch include
island keep kind king know lake land language large laugh lead learn leave letter level light
line list listen little live long look machine main major make many map mark market matter
measure meet method middle might mile mind minute modern moment money month moon morning
mother mountain move music name nation nature near need never new next night noise north note
notice number object ocean offer often open order other paper parent part party pass path
pattern people perhaps period person picture piece place plain plan plant play point poor
position power practice prepare present press pretty print problem produce product protect
provide pull push question quick quiet rain reach read ready real reason record region remember
report rest result river road rock room round rule safe sail same sand save school science sea
season seat second section seed serve settle shape share ship shore short show side sign simple
since sister size sky sleep slow small snow soft soil some song soon sound south space speak
special speed spring square stand star start station stay steel step still stone story street
strong student study subject success summer sun support surface system table talk teach team
test thank thought through time today together tool top touch toward town track trade train
travel tree true turn under unit until usual valley value village visit voice wait walk warm
watch water wave weather week weight west wheel while white whole wide wild wind window winter
wish wonder wood word work world write year young
"""
_VOCAB = _VOCAB_TEXT.split()


class TextMaker:
    """Synthetic sentences of an exact token count.

    Args:
        count_tokens: Tokens of a text for the target model, without special tokens.
    """

    def __init__(self, count_tokens: CountTokens) -> None:
        self._count = count_tokens
        self._cost: dict[str, int] = {}
        self._single = [w for w in _VOCAB if self._piece_cost(" " + w) == 1]
        if not self._single:
            raise ValueError("no vocabulary word is a single token for this tokenizer")

    def _piece_cost(self, piece: str) -> int:
        cost = self._cost.get(piece)
        if cost is None:
            cost = self._cost[piece] = self._count(piece)
        return cost

    def text(self, n_tokens: int, rng: random.Random) -> str:
        """Sentences of ``n_tokens`` tokens (exact when the tokenizer splits at spaces)."""
        pieces: list[str] = []
        total = 0
        words_in_sentence, sentence_len = 0, rng.randint(8, 18)
        while total < n_tokens:
            remaining = n_tokens - total
            if words_in_sentence >= sentence_len and remaining >= 2:
                piece = "."
                words_in_sentence, sentence_len = 0, rng.randint(8, 18)
            else:
                word = rng.choice(_VOCAB)
                word = word.capitalize() if words_in_sentence == 0 else word
                piece = word if not pieces else " " + word
                if self._piece_cost(piece) > remaining:
                    piece = " " + rng.choice(self._single)
                    if not pieces:
                        piece = piece[1:]
                words_in_sentence += 1
            pieces.append(piece)
            total += self._piece_cost(piece)
        return "".join(pieces)


def poisson_arrivals(rate: float, n: int, rng: random.Random) -> list[float]:
    """``n`` arrival times (seconds from 0) of a Poisson process of ``rate`` per second."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


class Session(Protocol):
    """A lane's conversation: what to send next, and what the server answered."""

    def messages(self) -> list[Message]:
        """The chat messages of the next turn."""
        ...

    def answered(self, text: str) -> None:
        """Records the server's answer to the last turn sent."""
        ...


@dataclass
class Lane:
    """Turns sent in order: turn i at ``arrivals[i]`` or ``think_s`` after turn i-1
    completed, whichever is later."""

    name: str
    session: Session
    arrivals: list[float]
    think_s: float = 0.0


@dataclass
class Workload:
    """Lanes plus what every request asks for."""

    name: str
    lanes: list[Lane]
    max_tokens: int
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def planned(self) -> int:
        return sum(len(lane.arrivals) for lane in self.lanes)


class Conversation:
    """One multi-round user: the shared system prompt, its context, questions, answers so far."""

    def __init__(self, system: str, context: str, questions: list[str]) -> None:
        self.system = system
        self.context = context
        self.questions = questions
        self.answers: list[str] = []

    def messages(self) -> list[Message]:
        r = len(self.answers)
        msgs = [
            {"role": "system", "content": self.system},
            {"role": "user", "content": f"{self.context}\n\n{self.questions[0]}"},
        ]
        for i in range(1, r + 1):
            msgs.append({"role": "assistant", "content": self.answers[i - 1]})
            msgs.append({"role": "user", "content": self.questions[i]})
        return msgs

    def answered(self, text: str) -> None:
        self.answers.append(text)


class SingleTurn:
    """One request with fixed messages."""

    def __init__(self, messages: list[Message]) -> None:
        self._messages = messages

    def messages(self) -> list[Message]:
        return self._messages

    def answered(self, text: str) -> None:
        pass


def _positive(**values: float) -> None:
    for name, v in values.items():
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")


@dataclass(frozen=True)
class MultiRoundConfig:
    """The multi-round workload; the defaults are the reference workload."""

    users: int = 6
    rounds: int = 4
    system_tokens: int = 1000
    context_tokens: int = 1000
    question_tokens: int = 24
    answer_tokens: int = 20
    qps: float = 0.6
    seed: int = 0
    arrival_seed: int | None = None  # the arrivals' own seed (None: ``seed``); two runs
    # with other texts and the same arrivals compare like with like

    def __post_init__(self) -> None:
        _positive(
            users=self.users,
            rounds=self.rounds,
            system_tokens=self.system_tokens,
            context_tokens=self.context_tokens,
            question_tokens=self.question_tokens,
            answer_tokens=self.answer_tokens,
            qps=self.qps,
        )


@dataclass(frozen=True)
class DocQaConfig:
    """The document-QA workload."""

    documents: int = 8
    min_tokens: int = 1000
    max_tokens: int = 3000
    questions: int = 24
    question_tokens: int = 24
    answer_tokens: int = 20
    zipf_s: float = 1.1
    qps: float = 0.6
    seed: int = 0

    def __post_init__(self) -> None:
        _positive(
            documents=self.documents,
            min_tokens=self.min_tokens,
            questions=self.questions,
            question_tokens=self.question_tokens,
            answer_tokens=self.answer_tokens,
            zipf_s=self.zipf_s,
            qps=self.qps,
        )
        if self.max_tokens - self.min_tokens < 16:
            raise ValueError("max_tokens must exceed min_tokens by at least 16")


@dataclass(frozen=True)
class SustainedConfig:
    """The sustained workload: users keep joining for ``duration_s`` at ``user_rate`` per second."""

    user_rate: float
    duration_s: float = 150.0
    rounds: int = 4
    system_tokens: int = 1000
    context_tokens: int = 1000
    question_tokens: int = 24
    answer_tokens: int = 20
    think_s: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        _positive(
            user_rate=self.user_rate,
            duration_s=self.duration_s,
            rounds=self.rounds,
            system_tokens=self.system_tokens,
            context_tokens=self.context_tokens,
            question_tokens=self.question_tokens,
            answer_tokens=self.answer_tokens,
        )
        if self.think_s < 0:
            raise ValueError(f"think_s must be >= 0, got {self.think_s}")

    @property
    def prefill_tokens_per_user(self) -> int:
        """Prompt tokens one user makes the server compute once the system prompt is cached:
        its context and first question, then each later round's previous answer and new
        question, plus the chat template's few tokens and the partial block a prefix
        cache recomputes (about half a 16-token block) per round."""
        per_round = self.answer_tokens + self.question_tokens + 8 + 8
        return self.context_tokens + self.question_tokens + 8 + (self.rounds - 1) * per_round

    @property
    def longest_prompt_tokens(self) -> int:
        """About the tokens of a user's last round: system prompt, context, every earlier
        exchange and the new question, with the chat template's few tokens per message."""
        exchanges = self.rounds * (self.question_tokens + 8) + (self.rounds - 1) * (
            self.answer_tokens + 8
        )
        return self.system_tokens + 8 + self.context_tokens + exchanges

    @property
    def generated_tokens_per_user(self) -> int:
        return self.rounds * self.answer_tokens


def sustained_user_rate(
    cfg_prefill_tokens: int,
    cfg_generated_tokens: int,
    prefill_tokens_per_s: float,
    decode_tokens_per_s: float,
    load: float = 0.75,
) -> float:
    """Users per second that offer ``load`` seconds of engine work per second.

    A user costs ``prefill tokens / prefill speed + generated tokens / decode
    speed`` seconds, both speeds measured on this host
    (``serve_calibrate.calibrate``), so a slow and a fast CPU are loaded alike.
    """
    if min(cfg_prefill_tokens, cfg_generated_tokens) <= 0 or load <= 0:
        raise ValueError("tokens per user and load must be positive")
    if min(prefill_tokens_per_s, decode_tokens_per_s) <= 0:
        raise ValueError("measured speeds must be positive")
    cost_s = cfg_prefill_tokens / prefill_tokens_per_s + cfg_generated_tokens / decode_tokens_per_s
    return load / cost_s


def _rng(seed: int, *parts: object) -> random.Random:
    # NOTE: str seeds are hashed with SHA-512 by random.seed, so they are stable
    # across processes (no PYTHONHASHSEED dependence).
    return random.Random(":".join(map(str, (seed, *parts))))


def _question(maker: TextMaker, n_tokens: int, rng: random.Random) -> str:
    return maker.text(max(1, n_tokens - 1), rng) + "?"


def warmup_messages(count_tokens: CountTokens, n_tokens: int = 600) -> list[Message]:
    """A request of its own text (it seeds no cache a workload uses), long enough that a
    KV connector saves some chunks of it."""
    text = TextMaker(count_tokens).text(n_tokens, random.Random("warm-up"))
    return [{"role": "system", "content": "Warm-up."}, {"role": "user", "content": text}]


def build_multi_round(cfg: MultiRoundConfig, count_tokens: CountTokens) -> Workload:
    """The multi-round workload (see the module docstring)."""
    maker = TextMaker(count_tokens)
    system = maker.text(cfg.system_tokens, _rng(cfg.seed, "system"))
    arrival_seed = cfg.seed if cfg.arrival_seed is None else cfg.arrival_seed
    arrivals = poisson_arrivals(cfg.qps, cfg.users * cfg.rounds, _rng(arrival_seed, "arrivals"))
    lanes = []
    for u in range(cfg.users):
        context = maker.text(cfg.context_tokens, _rng(cfg.seed, "context", u))
        qrng = _rng(cfg.seed, "questions", u)
        questions = [_question(maker, cfg.question_tokens, qrng) for _ in range(cfg.rounds)]
        times = arrivals[u :: cfg.users]
        lanes.append(Lane(f"user{u}", Conversation(system, context, questions), times))
    params = {"workload": "multi-round", **vars(cfg)}
    return Workload("multi-round", lanes, cfg.answer_tokens, params)


def build_sustained(cfg: SustainedConfig, count_tokens: CountTokens) -> Workload:
    """The sustained workload (see the module docstring): one lane per user that joins
    before ``duration_s``."""
    maker = TextMaker(count_tokens)
    system = maker.text(cfg.system_tokens, _rng(cfg.seed, "sustained-system"))
    arrivals_rng = _rng(cfg.seed, "sustained-arrivals")
    joins: list[float] = []
    t = arrivals_rng.expovariate(cfg.user_rate)
    while t < cfg.duration_s:
        joins.append(t)
        t += arrivals_rng.expovariate(cfg.user_rate)
    lanes = []
    for u, join in enumerate(joins):
        context = maker.text(cfg.context_tokens, _rng(cfg.seed, "sustained-context", u))
        qrng = _rng(cfg.seed, "sustained-questions", u)
        questions = [_question(maker, cfg.question_tokens, qrng) for _ in range(cfg.rounds)]
        conversation = Conversation(system, context, questions)
        lanes.append(Lane(f"user{u}", conversation, [join] * cfg.rounds, cfg.think_s))
    params = {
        "workload": "sustained",
        **vars(cfg),
        "users": len(lanes),
        "prefill_tokens_per_user": cfg.prefill_tokens_per_user,
    }
    return Workload("sustained", lanes, cfg.answer_tokens, params)


def doc_lengths(cfg: DocQaConfig) -> list[int]:
    """Token lengths of the documents: uniform in [min, max], never a multiple of 16."""
    rng = _rng(cfg.seed, "doc-lengths")
    out = []
    for _ in range(cfg.documents):
        n = rng.randint(cfg.min_tokens, cfg.max_tokens)
        while n % 16 == 0:
            n = rng.randint(cfg.min_tokens, cfg.max_tokens)
        out.append(n)
    return out


def zipf_choices(n_items: int, k: int, s: float, rng: random.Random) -> list[int]:
    """``k`` draws from ``range(n_items)``, item i with weight ``1 / (i + 1) ** s``."""
    weights = [1 / (i + 1) ** s for i in range(n_items)]
    return rng.choices(range(n_items), weights=weights, k=k)


def build_doc_qa(cfg: DocQaConfig, count_tokens: CountTokens) -> Workload:
    """The document-QA workload (see the module docstring)."""
    maker = TextMaker(count_tokens)
    lengths = doc_lengths(cfg)
    docs = [maker.text(n, _rng(cfg.seed, "doc", i)) for i, n in enumerate(lengths)]
    picks = zipf_choices(len(docs), cfg.questions, cfg.zipf_s, _rng(cfg.seed, "popularity"))
    arrivals = poisson_arrivals(cfg.qps, cfg.questions, _rng(cfg.seed, "arrivals"))
    qrng = _rng(cfg.seed, "questions")
    lanes = []
    for q, (doc, at) in enumerate(zip(picks, arrivals, strict=True)):
        question = _question(maker, cfg.question_tokens, qrng)
        content = f"Read the document, then answer.\n\n{docs[doc]}\n\nQuestion: {question}"
        lanes.append(
            Lane(f"q{q}-doc{doc}", SingleTurn([{"role": "user", "content": content}]), [at])
        )
    requests_per_doc = [picks.count(i) for i in range(len(docs))]
    params = {
        "workload": "doc-qa",
        **vars(cfg),
        "doc_tokens": lengths,
        "doc_requests": requests_per_doc,
    }
    return Workload("doc-qa", lanes, cfg.answer_tokens, params)


def token_counter(tokenizer: str) -> Callable[[str], int]:
    """Counts tokens of a text with the model's tokenizer (no weights are loaded)."""
    from kvtier.engine.fetch import lookup_known, resolve_model
    from kvtier.engine.models.loader import load_tokenizer

    path = resolve_model(tokenizer) if lookup_known(tokenizer) else Path(tokenizer)
    tok = load_tokenizer(path)
    return lambda text: len(tok.encode(text, add_special_tokens=False))
