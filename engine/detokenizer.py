"""Incremental detokenization and stop-string handling for one request."""

from __future__ import annotations

from typing import Protocol

# Prompt tokens decoded ahead of the output so that the first generated token
# renders with the right leading space (SentencePiece-style tokenizers).
_CONTEXT_TOKENS = 6


class _Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one token at a time.

    Each call decodes only a short window (the tokens since the last emitted
    boundary). A window whose text ends in U+FFFD is an incomplete UTF-8
    sequence (a multi-byte character split across tokens): nothing is
    emitted until a later token completes it.
    """

    def __init__(
        self, tokenizer: _Decoder, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Appends one token; returns the newly completed text (maybe empty)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            # The tokens just rendered become the next window's context; older
            # ones are dropped so windows stay short.
            self._ids = self._ids[self._read_offset :]
            self._prefix_offset = 0
            self._read_offset = len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        """Returns any held-back text (an incomplete sequence at the very end)."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""


class StopStringMatcher:
    """Finds stop strings in generated text and bounds what may be streamed.

    Text within ``max_len - 1`` characters of the end could still become the
    start of a stop string, so it is held back until more text arrives or
    the request finishes.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = list(stops)
        self.holdback = max((len(s) for s in stops), default=1) - 1

    def find(self, text: str, new_from: int) -> tuple[int, str] | None:
        """First stop string that ends at or after ``new_from``.

        Returns:
            ``(index where it starts, the stop string)`` or ``None``.
        """
        if not self.stops:
            return None
        best: tuple[int, str] | None = None
        start = max(0, new_from - self.holdback)
        for s in self.stops:
            i = text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def streamable(self, text_len: int) -> int:
        """How many leading characters may be emitted while the request runs."""
        return max(0, text_len - self.holdback) if self.stops else text_len
