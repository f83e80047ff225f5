"""A per-step trace for profiling a served engine: ``KVTIER_STEP_TRACE=path``.

One JSON line per forward pass, appended to ``path``::

    {"t": 1234.5, "forward_s": 0.041, "threads": 2, "decodes": 6,
     "prefill": [[1008, 1032]]}

``t`` is ``time.perf_counter()`` at the start of the forward pass,
``prefill`` lists ``[first position, tokens]`` of every prefill chunk in the
step. It shows what the step counters cannot: which steps carried which
chunks, and how long each took (docs/engine.md, "Sustained load", was found
with it). Off unless the variable is set; a trace that cannot be written is
a warning, never an engine failure.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import IO, TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvtier.engine.scheduler import ScheduledChunk

logger = logging.getLogger(__name__)

ENV = "KVTIER_STEP_TRACE"


class StepTrace:
    """Appends one line per step to an open file."""

    def __init__(self, out: IO[str]) -> None:
        self._out: IO[str] | None = out

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get(ENV)
        if not path:
            return None
        try:
            return cls(open(path, "a", encoding="utf-8"))
        except OSError as e:
            logger.warning("%s=%s cannot be opened (%s): no step trace", ENV, path, e)
            return None

    def record(self, t: float, forward_s: float, chunks: Sequence[ScheduledChunk]) -> None:
        if self._out is None:
            return
        line = {
            "t": round(t, 6),
            "forward_s": round(forward_s, 6),
            "threads": torch.get_num_threads(),
            "decodes": sum(1 for c in chunks if c.num_tokens == 1),
            "prefill": [[c.compute_start, c.num_tokens] for c in chunks if c.num_tokens > 1],
        }
        try:
            self._out.write(json.dumps(line) + "\n")
            self._out.flush()
        except OSError as e:
            logger.warning("step trace write failed (%s): tracing stops", e)
            self.close()

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None
