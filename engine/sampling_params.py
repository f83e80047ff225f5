"""Per-request sampling parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvtier.engine.errors import InvalidRequestError

# NOTE: bounds that keep a single request from starving the engine or asking
# for tensors of absurd size; they are generous for every real use.
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request.

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_p: Nucleus sampling: keep the smallest set of tokens whose
            probability mass reaches ``top_p`` (1.0 = off).
        top_k: Keep only the ``top_k`` most likely tokens (0 = off).
        max_tokens: Maximum number of generated tokens.
        stop: Stop strings. Generation stops when the text contains one; the
            returned text ends right before it (the stop string is excluded).
        stop_token_ids: Extra token ids that end generation.
        ignore_eos: Keep generating past the model's end-of-sequence token.
        seed: Per-request seed; with it, sampling is reproducible regardless
            of what else is batched with the request.
        logprobs: If set, return the log-probability of each chosen token and
            of the ``logprobs`` most likely alternatives.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        """True when the request samples by argmax."""
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Checks every field.

        Args:
            vocab_size: When given, stop token ids must be below it.

        Raises:
            InvalidRequestError: naming the first bad field.
        """
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise InvalidRequestError("temperature must be a number", "temperature")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be a finite number >= 0, got {self.temperature}", "temperature"
            )
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float):
            raise InvalidRequestError("top_p must be a number", "top_p")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(
                f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}", "top_k"
            )
        if (
            isinstance(self.max_tokens, bool)
            or not isinstance(self.max_tokens, int)
            or self.max_tokens < 1
        ):
            raise InvalidRequestError(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens"
            )
        if isinstance(self.stop, str) or not isinstance(self.stop, list | tuple):
            raise InvalidRequestError("stop must be a list of strings", "stop")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(
                f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}", "stop"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError("every stop string must be a non-empty string", "stop")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(
                    f"stop strings are limited to {MAX_STOP_STRING_CHARS} characters", "stop"
                )
        if not isinstance(self.stop_token_ids, list | tuple):
            raise InvalidRequestError("stop_token_ids must be a list of integers", "stop_token_ids")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise InvalidRequestError(
                    f"stop_token_ids must hold integers >= 0, got {t!r}", "stop_token_ids"
                )
            if vocab_size is not None and t >= vocab_size:
                raise InvalidRequestError(
                    f"stop token id {t} is outside the vocabulary (size {vocab_size})",
                    "stop_token_ids",
                )
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError("ignore_eos must be a bool", "ignore_eos")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0
        ):
            raise InvalidRequestError(
                f"seed must be None or an integer >= 0, got {self.seed!r}", "seed"
            )
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool)
            or not isinstance(self.logprobs, int)
            or not (0 <= self.logprobs <= MAX_LOGPROBS)
        ):
            raise InvalidRequestError(
                f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
                "logprobs",
            )
