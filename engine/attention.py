"""Paged attention in PyTorch (CPU and CUDA tensors), behind one backend seam.

Tokens of a step are laid out decode-first: the first ``num_decode_tokens``
rows of ``q`` are one-token decodes (one row per sequence); the rest are
prefill chunks, one contiguous span per sequence.

    flat batch:  [ d0 d1 ... d(B-1) | p0 p0 p0 ... | p1 p1 ... ]
                   decodes (q_len=1)  prefill spans (q_len>=2, causal)

Decodes are batched: their block tables are padded to the longest context,
gathered once per layer, and attended with a padding mask. GQA is handled
without repeating K/V by viewing the query heads as ``[kv_heads, group]``.
Prefill spans with no cached prefix use the new K/V directly with a causal
kernel; spans after a cached prefix gather their blocks and attend in query
tiles so that the masked work stays close to the causal triangle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kvtier.engine.cpu_kernels import CpuKernels

# Queries per tile when a prefill span follows a cached prefix.
DEFAULT_PREFILL_TILE = 512


@dataclass
class PrefillSpan:
    """One sequence's prefill chunk inside the flat batch.

    Attributes:
        q_start: First row of the span in the flat batch.
        q_len: Rows (new tokens) in the span.
        prefix_len: Tokens already in the cache before this chunk.
        block_ids: ``[ceil((prefix_len + q_len) / block_size)]`` long, the
            blocks to gather (or for the prefill kernel to read); ``None``
            when ``prefix_len == 0`` and the backend does not read in place.
        tiles: ``(q_from, q_to, k_len, mask)`` per query tile, ``mask``
            ``[q_to - q_from, k_len]`` bool (True = attend); empty when
            ``prefix_len == 0``.
    """

    q_start: int
    q_len: int
    prefix_len: int
    block_ids: torch.Tensor | None = None
    tiles: list[tuple[int, int, int, torch.Tensor]] = field(default_factory=list)


@dataclass
class AttentionMetadata:
    """Per-step inputs of attention, shared by all layers.

    Attributes:
        slot_mapping: ``[T]`` long, cache slot of every token in the batch
            (``block_id * block_size + offset``).
        num_decode_tokens: Leading rows that are one-token decodes.
        decode_block_table: ``[B, max_blocks]`` long (padded with block 0), or None.
        decode_mask: ``[B, 1, 1, max_blocks * block_size]`` bool, True for
            positions ``< context length``; or None.
        decode_lens: ``[B]`` int64 context length of each decode (CPU), or None.
        prefills: The prefill spans after the decodes.
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int = 0
    decode_block_table: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)


class AttentionBackend(Protocol):
    """The seam for attention kernels.

    ``forward`` writes the new ``k``/``v`` of layer ``layer`` into the paged
    cache at ``meta.slot_mapping`` and returns attention outputs for ``q``.
    Implementations own no request state; everything per-step is in ``meta``.
    """

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``q`` ``[T, heads, D]``, ``k``/``v`` ``[T, kv_heads, D]`` -> ``[T, heads, D]``."""
        ...


def build_prefill_tiles(
    prefix_len: int, q_len: int, tile: int, device: torch.device
) -> list[tuple[int, int, int, torch.Tensor]]:
    """Query tiles and causal-with-offset masks for a span after a cached prefix.

    Query ``i`` of the span sits at position ``prefix_len + i`` and may attend
    keys ``0 .. prefix_len + i``.
    """
    out = []
    for a in range(0, q_len, tile):
        b = min(q_len, a + tile)
        k_len = prefix_len + b
        qpos = torch.arange(prefix_len + a, prefix_len + b, device=device)
        mask = torch.arange(k_len, device=device)[None, :] <= qpos[:, None]
        out.append((a, b, k_len, mask))
    return out


class TorchPagedAttention:
    """Paged attention with ``scaled_dot_product_attention``.

    Args:
        kv_cache: ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``.
        num_heads: Query heads.
        kernels: The CPU kernels (``cpu_kernels.py``): decodes,
            and prefill spans of a bfloat16 cache, use them instead of
            gather + SDPA when they support the cache.
    """

    def __init__(
        self,
        kv_cache: torch.Tensor,
        num_heads: int,
        kernels: CpuKernels | None = None,
    ) -> None:
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError(f"kv_cache must be [L, 2, N, B, H, D], got {tuple(kv_cache.shape)}")
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.block_size = kv_cache.shape[3]
        self.num_kv_heads = kv_cache.shape[4]
        self.head_dim = kv_cache.shape[5]
        if num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of the cache's kv heads")
        self.group = num_heads // self.num_kv_heads
        if kernels is not None and not kernels.supports(kv_cache):
            kernels = None
        self.decode_kernel = kernels
        self.prefill_kernel = (
            kernels if kernels is not None and kernels.supports_prefill(kv_cache) else None
        )
        # prefill spans read K/V from the cache in place: they need block
        # tables (a cold span too) and no query tiles or masks
        self.prefill_in_place = self.prefill_kernel is not None

    def write_kv(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Scatters ``k``/``v`` ``[T, kv_heads, D]`` into the cache slots of ``layer``."""
        hk, d = self.num_kv_heads, self.head_dim
        self.kv_cache[layer, 0].view(-1, hk, d).index_copy_(0, slot_mapping, k)
        self.kv_cache[layer, 1].view(-1, hk, d).index_copy_(0, slot_mapping, v)

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """See ``AttentionBackend.forward``."""
        self.write_kv(layer, k, v, meta.slot_mapping)
        if not meta.prefills:  # decode-only step: no scatter into a joint output
            return self._decode(layer, q, meta)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.num_decode_tokens:
            out[: meta.num_decode_tokens] = self._decode(layer, q, meta)
        for span in meta.prefills:
            self._prefill(layer, q, k, v, span, out)
        return out

    def _decode(self, layer: int, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        assert meta.decode_block_table is not None and meta.decode_mask is not None
        b, hk, d = meta.num_decode_tokens, self.num_kv_heads, self.head_dim
        if self.decode_kernel is not None and meta.decode_lens is not None:
            # reads K/V in place: no gather of the whole context
            return self.decode_kernel.decode(
                q[:b],
                self.kv_cache[layer, 0],
                self.kv_cache[layer, 1],
                meta.decode_block_table,
                meta.decode_lens,
                d**-0.5,
            )
        flat = meta.decode_block_table.view(-1)  # [B * nb]
        # NOTE: index_select over whole blocks is ~9x faster on CPU than
        # advanced indexing with the 2-D table.
        # k, v: [B * nb, block, hk, d] -> [B, hk, nb * block, d]
        kd = self.kv_cache[layer, 0].index_select(0, flat).view(b, -1, hk, d).transpose(1, 2)
        vd = self.kv_cache[layer, 1].index_select(0, flat).view(b, -1, hk, d).transpose(1, 2)
        qd = q[:b].view(b, hk, self.group, d)  # query head h uses kv head h // group
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask)
        return o.reshape(b, self.num_heads, d)

    def _prefill(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        span: PrefillSpan,
        out: torch.Tensor,
    ) -> None:
        s, n = span.q_start, span.q_len
        if self.prefill_kernel is not None:
            assert span.block_ids is not None
            # flash attention reading K/V in place, the span's own included
            out[s : s + n] = self.prefill_kernel.prefill(
                q[s : s + n],
                self.kv_cache[layer, 0],
                self.kv_cache[layer, 1],
                span.block_ids,
                span.prefix_len,
                self.head_dim**-0.5,
            )
            return
        qs = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
        if span.prefix_len == 0:
            ks = k[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, n, d]
            vs = v[s : s + n].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            out[s : s + n] = o[0].transpose(0, 1)
            return
        assert span.block_ids is not None
        hk, d = self.num_kv_heads, self.head_dim
        ctx = span.prefix_len + n
        # [nb, block, hk, d] -> [1, hk, ctx, d]
        kall = self.kv_cache[layer, 0].index_select(0, span.block_ids).view(-1, hk, d)[:ctx]
        vall = self.kv_cache[layer, 1].index_select(0, span.block_ids).view(-1, hk, d)[:ctx]
        kall = kall.transpose(0, 1).unsqueeze(0)
        vall = vall.transpose(0, 1).unsqueeze(0)
        for a, b, k_len, mask in span.tiles:
            o = F.scaled_dot_product_attention(
                qs[:, :, a:b],
                kall[:, :, :k_len],
                vall[:, :, :k_len],
                attn_mask=mask,
                enable_gqa=True,
            )
            out[s + a : s + b] = o[0].transpose(0, 1)
