"""The paged KV cache: one tensor for all layers, sized from a memory budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.engine.errors import EngineConfigError
from kvtier.engine.models.config import ModelConfig


@dataclass(frozen=True)
class KVCacheLayout:
    """Everything a connector needs to interpret (and address) the engine's KV cache.

    The cache tensor is ``[num_layers, 2, num_blocks, block_size, num_kv_heads,
    head_dim]`` (2 = K, V), contiguous; token slot ``s`` of the cache is
    ``(s // block_size, s % block_size)``.

    Attributes:
        model_id: Readable model name.
        fingerprint: Hex digest of the model's weights.
        num_layers: Decoder layers.
        num_kv_heads: KV heads per layer.
        head_dim: Size of one head.
        dtype: KV dtype name (``"bfloat16"``, ``"float32"``).
        block_size: Tokens per block.
        num_blocks: Blocks in the cache.
        device: ``"cpu"`` or ``"cuda:0"`` ...
    """

    model_id: str
    fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    num_blocks: int
    device: str

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """Shape of the cache tensor."""
        return (
            self.num_layers,
            2,
            self.num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        )


@dataclass(frozen=True)
class KVCapacity:
    """What the KV cache holds, as an engine reports it at start-up (vLLM prints the same).

    Attributes:
        tokens: Token slots of the cache (blocks x block size).
        nbytes: Its size in bytes.
        dtype: KV dtype name.
        max_model_len: Longest sequence a request may reach.
        max_num_seqs: Most requests the scheduler runs at once.
    """

    tokens: int
    nbytes: int
    dtype: str
    max_model_len: int
    max_num_seqs: int

    @property
    def max_concurrency(self) -> float:
        """How many requests of ``max_model_len`` tokens the cache holds at once."""
        return self.tokens / self.max_model_len

    def __str__(self) -> str:
        return (
            f"KV cache: {self.tokens:,} tokens ({self.dtype}, {self.nbytes / 2**30:.2f} GiB); "
            f"maximum concurrency for {self.max_model_len:,} tokens per request: "
            f"{self.max_concurrency:.2f}x (at most {self.max_num_seqs} running)"
        )


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return config.kv_bytes_per_token * block_size * elem


def num_blocks_for_budget(
    config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int
) -> int:
    """How many blocks fit in ``budget_bytes``.

    Raises:
        EngineConfigError: if not even two blocks fit.
    """
    per_block = kv_bytes_per_block(config, block_size, dtype)
    n = budget_bytes // per_block
    if n < 2:
        raise EngineConfigError(
            f"kv_cache_memory of {budget_bytes} bytes holds {n} block(s) of {per_block} bytes; "
            "at least 2 are needed"
        )
    return int(n)


def allocate_kv_cache(layout: KVCacheLayout, dtype: torch.dtype) -> torch.Tensor:
    """Allocates the zeroed cache tensor.

    NOTE: zeroed, not empty: padded positions of a batched decode are masked
    out of the softmax, but a NaN left in uninitialised memory would still
    poison ``0 * NaN`` in the value product.
    """
    return torch.zeros(layout.shape, dtype=dtype, device=layout.device)
