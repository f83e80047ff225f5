"""The engine's one typed configuration."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal

from kvtier.engine.errors import EngineConfigError

DType = Literal["auto", "bfloat16", "float32"]
Device = Literal["auto", "cpu", "cuda"]
AUTO_THREADS: Literal["auto"] = "auto"
NumThreads = int | Literal["auto"] | None
"""``num_threads``: a count, ``"auto"``, or ``None`` for the default (``"auto"``)."""

DEFAULT_KV_CACHE_MEMORY = "512MiB"
# NOTE: the default context cap keeps the KV budget meaningful on CPU; a
# caller who needs the full context of a long-context model sets it.
DEFAULT_MAX_MODEL_LEN_CAP = 8192

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str) -> int:
    """Parses a byte size: an int, or a string such as ``"512MiB"``, ``"2GB"``, ``"1000"``.

    Raises:
        EngineConfigError: if the value is not a positive size.
    """
    if isinstance(value, bool):
        raise EngineConfigError(f"not a byte size: {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise EngineConfigError(
                f"not a byte size: {value!r} (use e.g. 536870912, '512MiB', '2GB')"
            )
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise EngineConfigError(f"not a byte size: {value!r}")
    if n <= 0:
        raise EngineConfigError(f"byte size must be positive, got {value!r}")
    return n


@dataclass
class EngineConfig:
    """Everything that shapes one engine instance.

    Attributes:
        model: Path to a ``.gguf`` file or a Hugging Face-style directory.
        dtype: Weights and KV dtype. ``auto`` picks bfloat16 on CUDA and on CPUs
            with native bf16 matmul (AVX512-BF16/AMX), else float32.
        device: ``cpu``, ``cuda`` or ``auto`` (CUDA when available).
        block_size: Tokens per KV block.
        kv_cache_memory: KV cache budget in bytes or as a string (``"512MiB"``).
        num_kv_blocks: Exact number of KV blocks; overrides ``kv_cache_memory``.
        max_num_seqs: Most requests in the running batch.
        max_num_batched_tokens: Token budget of one step (prefill chunks + decodes).
        max_model_len: Longest sequence (prompt + generated); default the
            model's context length capped at 8192 and at the KV capacity.
        enable_prefix_caching: Reuse KV of identical full blocks across requests.
        kv_connector: Name of a registered KV connector (or ``module:Class``).
        kv_connector_config: Path to the connector's own config file.
        num_threads: Torch CPU threads: a count, or ``"auto"`` (the default,
            also for ``None``): all usable cores, fewer while other processes
            keep some of them busy (``kvtier.engine.threads``).
        seed: Seed for requests that do not set their own.
    """

    model: str
    dtype: DType = "auto"
    device: Device = "auto"
    block_size: int = 16
    kv_cache_memory: int | str = DEFAULT_KV_CACHE_MEMORY
    num_kv_blocks: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    kv_connector: str | None = None
    kv_connector_config: str | None = None
    num_threads: NumThreads = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.model, str | os.PathLike) or not str(self.model):
            raise EngineConfigError("model must be a path to a .gguf file or a model directory")
        self.model = os.fspath(self.model)
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise EngineConfigError(
                f"dtype must be 'auto', 'bfloat16' or 'float32', got {self.dtype!r}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise EngineConfigError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        _positive_int("block_size", self.block_size)
        if self.block_size > 1024 or self.block_size & (self.block_size - 1):
            raise EngineConfigError(
                f"block_size must be a power of two <= 1024, got {self.block_size}"
            )
        self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
            if self.max_model_len < 2:
                raise EngineConfigError("max_model_len must be at least 2")
        if not isinstance(self.enable_prefix_caching, bool):
            raise EngineConfigError("enable_prefix_caching must be a bool")
        if self.kv_connector is not None and (
            not isinstance(self.kv_connector, str) or not self.kv_connector
        ):
            raise EngineConfigError("kv_connector must be None or a non-empty name")
        if self.kv_connector_config is not None and not isinstance(self.kv_connector_config, str):
            raise EngineConfigError("kv_connector_config must be None or a path")
        if self.num_threads is not None and self.num_threads != AUTO_THREADS:
            if isinstance(self.num_threads, str):
                raise EngineConfigError(
                    f"num_threads must be 'auto' or an integer >= 1, got {self.num_threads!r}"
                )
            _positive_int("num_threads", self.num_threads)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise EngineConfigError(f"seed must be an integer >= 0, got {self.seed!r}")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EngineConfigError(f"{name} must be an integer >= 1, got {value!r}")
