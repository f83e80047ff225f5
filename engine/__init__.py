"""kvtier's bundled paged-attention inference engine.

Public API: ``LLMEngine``, ``LLM``, ``AsyncLLMEngine``, ``EngineConfig``,
``SamplingParams``, ``RequestOutput``, ``EngineStats``, and the connector
seam in ``kvtier.engine.connector``.
"""

from __future__ import annotations

from kvtier.engine.async_engine import AsyncLLMEngine
from kvtier.engine.config import EngineConfig
from kvtier.engine.errors import (
    ConnectorError,
    EngineConfigError,
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    ModelLoadError,
)
from kvtier.engine.llm import LLM
from kvtier.engine.llm_engine import LLMEngine
from kvtier.engine.outputs import EngineStats, RequestOutput, TokenLogprob
from kvtier.engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncLLMEngine",
    "ConnectorError",
    "EngineConfig",
    "EngineConfigError",
    "EngineDeadError",
    "EngineError",
    "EngineStats",
    "InvalidRequestError",
    "LLMEngine",
    "ModelLoadError",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
]
