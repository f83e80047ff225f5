"""The messages between the API process and the engine-core process.

Both directions carry pickled messages over a pipe, one ``send_bytes`` per
message. The engine core sends **one message per step** holding every
request's delta (new token ids and text), never whole prompts or histories,
so the cost of a message does not grow with context length.

::

    API process (ProcessEngine)                 engine-core process (run_engine_core)
    ---------------------------                 -------------------------------------
    AddRequest / AbortRequest  ───cmd pipe───►  drained between steps
    MetricsQuery                                 answered between steps
    FlushSaves                                   answered between steps (after the flush)
    Shutdown                                     aborts what runs, flushes the connector
                               ◄──out pipe───   Ready | StartFailed (once, at start)
                                                 StepOutputs (per step, and after commands)
                                                 AddRejected, MetricsReply, FlushReply, Stopped

A step's message also carries the KV events of that step (``kv_events.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.engine.kv_cache import KVCapacity
from kvtier.engine.kv_events import KvEvent
from kvtier.engine.models.config import ModelConfig
from kvtier.engine.outputs import EngineStats, FinishReason, RequestOutput, TokenLogprob
from kvtier.engine.prompt import PreparedPrompt
from kvtier.keys import CacheNamespace

# ---- API process -> engine core ----------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    """Queue a validated request; ``arrival_time`` is ``time.monotonic()`` (system-wide)."""

    prepared: PreparedPrompt
    arrival_time: float


@dataclass(frozen=True)
class AbortRequest:
    """Abort a request wherever it is (a no-op if it already finished)."""

    request_id: str


@dataclass(frozen=True)
class MetricsQuery:
    """Ask for the Prometheus text of the engine core's registries."""

    token: int


@dataclass(frozen=True)
class FlushSaves:
    """Wait (between steps) until the connector's queued saves reached the store's tiers."""

    token: int
    timeout_s: float


@dataclass(frozen=True)
class Shutdown:
    """Abort everything, shut the connector down (it flushes its writes), exit."""


Command = AddRequest | AbortRequest | MetricsQuery | FlushSaves | Shutdown

# ---- engine core -> API process ----------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """The model is loaded and the loop runs."""

    model_id: str
    fingerprint: str
    max_model_len: int
    model_config: ModelConfig
    num_threads: int
    pid: int
    kv_namespace: CacheNamespace | None = None  # the keys of its KV events (None: no events)
    block_size: int = 16
    capacity: KVCapacity | None = None


@dataclass(frozen=True)
class StartFailed:
    """The engine could not start; ``kind`` is the exception class name."""

    kind: str
    message: str


@dataclass(frozen=True)
class OutputDelta:
    """What one step added to one request (see ``RequestOutput`` for the fields)."""

    request_id: str
    delta_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_external_tokens: int
    ttft_s: float | None
    new_logprobs: list[TokenLogprob] | None
    stop_reason: str | int | None

    @staticmethod
    def of(out: RequestOutput) -> OutputDelta:
        """The delta of a full output (the logprobs of its new tokens only)."""
        new_logprobs = None
        if out.logprobs is not None:
            new_logprobs = out.logprobs[len(out.token_ids) - len(out.delta_token_ids) :]
        return OutputDelta(
            request_id=out.request_id,
            delta_token_ids=out.delta_token_ids,
            delta_text=out.delta_text,
            finished=out.finished,
            finish_reason=out.finish_reason,
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            num_external_tokens=out.num_external_tokens,
            ttft_s=out.ttft_s,
            new_logprobs=new_logprobs,
            stop_reason=out.stop_reason,
        )


@dataclass(frozen=True)
class StepOutputs:
    """The deltas of one step and the stats after it.

    Attributes:
        outputs: One delta per request that produced a token, finished or was aborted.
        stats: ``LLMEngine.stats()`` after the step.
        adds_seen: ``AddRequest`` commands handled so far (the API process
            counts the ones sent but not yet seen as waiting).
        kv_events: Blocks stored in / evicted from G1 and objects saved, in this step.
    """

    outputs: list[OutputDelta]
    stats: EngineStats
    adds_seen: int
    kv_events: list[KvEvent] = field(default_factory=list)


@dataclass(frozen=True)
class AddRejected:
    """An ``AddRequest`` the engine refused (a duplicate id)."""

    request_id: str
    message: str
    field: str | None


@dataclass(frozen=True)
class MetricsReply:
    """Prometheus exposition text for a ``MetricsQuery``."""

    token: int
    text: bytes


@dataclass(frozen=True)
class FlushReply:
    """The answer to ``FlushSaves``: ``ok`` unless the flush timed out."""

    token: int
    ok: bool


@dataclass(frozen=True)
class Stopped:
    """The loop ended; ``error`` is set when it died of an unexpected exception."""

    error: str | None = None


Event = Ready | StartFailed | StepOutputs | AddRejected | MetricsReply | FlushReply | Stopped
