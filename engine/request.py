"""The engine's per-request state."""

from __future__ import annotations

import enum
import time

import torch

from kvtier.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from kvtier.engine.outputs import FinishReason, TokenLogprob
from kvtier.engine.sampling_params import SamplingParams
from kvtier.keys import PrefixKeys


class RequestStatus(enum.Enum):
    """Where a request is in its lifecycle."""

    WAITING = "waiting"
    LOADING = "loading"  # admitted, blocks allocated, its external KV being fetched
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """One generation request: tokens, KV bookkeeping, sampling and text state.

    ``token_ids`` holds the prompt followed by generated tokens; the KV of
    ``token_ids[:num_computed_tokens]`` is in the blocks of ``block_ids``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        generator: torch.Generator | None,
        detokenizer: IncrementalDetokenizer,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.generator = generator
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING

        # KV bookkeeping (scheduler / block manager)
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        # its keys (kvtier.keys.PrefixKeys), computed once: G1, connector and KV events read them
        self.prefix_keys: PrefixKeys | None = None
        self.num_cached_blocks = 0  # leading blocks registered in the prefix cache
        self.num_cached_tokens: int | None = None  # G1 hit at first admission
        self.num_external_tokens = 0
        self.num_preemptions = 0

        # Output state (engine)
        self.detokenizer = detokenizer
        self.stop_matcher = StopStringMatcher(params.stop)
        self.text = ""
        self.num_emitted_chars = 0
        self.num_emitted_tokens = 0
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.num_emitted_logprobs = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """How many tokens were generated."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        """True once the request has a finish reason."""
        return self.status == RequestStatus.FINISHED
