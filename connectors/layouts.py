"""Paged KV caches, read and written as kvtier chunks: the connector's layout adapters.

The worker side (``worker_side.py``) moves KV only through a :class:`PagedKV`:
``gather`` a token range out of a request's blocks as a chunk
``[L, 2, T, H, D]`` (contiguous; the stored format), ``scatter`` one back.
Token ``p`` of a request whose block table is ``block_ids`` lives in block
``block_ids[p // block_size]`` at offset ``p % block_size``. One adapter per
cache layout::

    EngineKV      the bundled engine's one tensor [L, 2, blocks, block_size, H, D]

    TokenKV       vLLM's CUDA backends (FLASH_ATTN, TRITON_ATTN, FLASHINFER,
                  FLEX_ATTENTION): per layer [blocks, H, block_size, C], C = 2·head_dim,
                  cache[b, h, n] = K[token] ‖ V[token]        a token's K/V are slices

    PackedCpuKV   vLLM's CPU backend (CPU_ATTN, ISA vec and vec16), contiguous:
                  page cache[b, h] = block_size · 2D elements =
                      Kᵀ [D][block_size]                      a token's K is a column
                      V  [block_size][D]

(The CPU packing was checked against vLLM's own ``cpu_attn_reshape_and_cache``:
``tests/vllm/test_layout_vs_vllm.py``. The AMX ISA packs K and V in VNNI
tiles instead and is refused.) A chunk saved by vLLM on a CPU loads into vLLM
on a GPU or into the bundled engine, and back.

**All layers in one operation.** The bundled engine keeps one tensor; vLLM
allocates the layers of a KV cache group in one buffer at an even spacing,
which ``TokenKV`` and ``PackedCpuKV`` view as one strided tensor
(``_layer_stride``), so moving a chunk is one gather or scatter per K and V
whatever the layer count. Layers that are not evenly spaced are moved one by
one.

``EngineKV`` and ``TokenKV`` go through :mod:`kvtier.kernels` (Triton on
CUDA, the torch reference elsewhere) on ``[L, 2, blocks, block_size, H, D]``
strided views; on CUDA they also gather-and-quantize and
dequantize-and-scatter in one kernel. The CPU layout's K is transposed inside
its page (head_dim is not contiguous), which those kernels do not take; it is
moved here with copies of whole pages and strided token views.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError
from kvtier.kernels import (
    Encoding,
    KernelInputError,
    QuantizedChunk,
    gather_kv,
    gather_kv_quantized,
    scatter_kv,
    scatter_kv_dequantized,
    slots_for_tokens,
)

CPU_BACKEND = "CPU_ATTN"
CPU_ISAS = ("vec", "vec16")
"""CPU attention ISAs whose page packing (Kᵀ then V) kvtier reads and writes."""
TOKEN_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "FLEX_ATTENTION")
"""CUDA attention backends whose ``C`` is a token's K ‖ V."""


@dataclass(frozen=True)
class KVGeometry:
    """The dimensions of a paged cache, as registered.

    Attributes:
        num_layers: Attention layers (L).
        num_blocks: Blocks per layer.
        num_kv_heads: KV heads (H).
        block_size: Tokens per block.
        head_dim: Size of one head (D).
        dtype: The cache dtype.
        device: Where the cache lives.
    """

    num_layers: int
    num_blocks: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """``[L, 2, T, H, D]``."""
        return (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_dim)


class PagedKV(ABC):
    """An engine's paged cache, moved as whole chunks ``[L, 2, T, H, D]``.

    The caller owns the cache tensors; a layout only views them. Not
    thread-safe: call it from the thread that runs the engine's forward pass.
    Errors: :class:`~kvtier.kernels.KernelInputError` for a bad block table,
    range or chunk; nothing is written then.
    """

    geometry: KVGeometry

    @abstractmethod
    def gather(self, block_ids: Sequence[int], start: int, num_tokens: int) -> torch.Tensor:
        """A copy of tokens ``[start, start + num_tokens)``: ``[L, 2, T, H, D]``, contiguous."""

    @abstractmethod
    def scatter(self, chunk: torch.Tensor, block_ids: Sequence[int], start: int) -> None:
        """Writes ``chunk`` (``[L, 2, T, H, D]``) as tokens ``[start, start + T)``."""

    def gather_quantized(
        self, block_ids: Sequence[int], start: int, num_tokens: int, encoding: Encoding
    ) -> QuantizedChunk | None:
        """The same tokens gathered and quantized on the device, or None where that is not fused."""
        return None

    def scatter_quantized(
        self, data: torch.Tensor, scales: torch.Tensor, block_ids: Sequence[int], start: int
    ) -> bool:
        """Dequantizes and scatters on the device in one step; False where that is not fused
        (the caller dequantizes and calls ``scatter``)."""
        return False


def _layer_stride(tensors: Sequence[torch.Tensor]) -> int | None:
    """Elements from one layer to the next when all layers view one storage evenly spaced.

    Returns None unless every tensor has the same shape, strides, dtype,
    device and storage, at offsets ``o, o + s, o + 2s, ...`` with ``s`` at
    least one layer's extent (no overlap).
    """
    first = tensors[0]
    if len(tensors) == 1:
        return 0
    storage = first.untyped_storage().data_ptr()
    step = int(tensors[1].storage_offset() - first.storage_offset())
    extent = 1 + sum((n - 1) * s for n, s in zip(first.shape, first.stride(), strict=True))
    if step < extent:
        return None
    for i, t in enumerate(tensors):
        same = (
            t.shape == first.shape
            and t.stride() == first.stride()
            and t.dtype == first.dtype
            and t.device == first.device
            and t.untyped_storage().data_ptr() == storage
        )
        if not same or t.storage_offset() != first.storage_offset() + i * step:
            return None
    return step


def _check_layers(tensors: Sequence[torch.Tensor], head_dim: int) -> KVGeometry:
    if not tensors:
        raise ConfigError("vLLM registered no KV cache layers")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.dim() != 4:
            raise ConfigError(
                f"KV cache layer {i}: expected [num_blocks, num_kv_heads, block_size, 2*head_dim], "
                f"got shape {tuple(t.shape)}"
            )
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ConfigError(
                f"KV cache layer {i} is {tuple(t.shape)} {t.dtype} on {t.device}; layer 0 is "
                f"{tuple(first.shape)} {first.dtype} on {first.device}: kvtier needs one geometry"
            )
    num_blocks, num_kv_heads, block_size, c = first.shape
    if c != 2 * head_dim:
        raise ConfigError(
            f"KV cache last dim is {c}; expected 2 * head_dim = {2 * head_dim} (K and V)"
        )
    return KVGeometry(
        len(tensors), num_blocks, num_kv_heads, block_size, head_dim, first.dtype, first.device
    )


def _check_chunk(chunk: torch.Tensor, geom: KVGeometry) -> int:
    """Tokens in ``chunk``, after checking it is ``[L, 2, T, H, D]`` in the cache dtype."""
    if not isinstance(chunk, torch.Tensor) or chunk.dim() != 5:
        raise KernelInputError(f"chunk: expected a 5-D tensor [L, 2, T, H, D], got {chunk!r:.80}")
    t = chunk.shape[2]
    if tuple(chunk.shape) != geom.chunk_shape(t):
        raise KernelInputError(
            f"chunk: expected shape {geom.chunk_shape(t)}, got {tuple(chunk.shape)}"
        )
    if chunk.dtype != geom.dtype:
        raise KernelInputError(f"chunk: expected dtype {geom.dtype}, got {chunk.dtype}")
    return int(t)


class StridedKV(PagedKV):
    """Caches viewed as ``[L, 2, blocks, block_size, H, D]`` strided tensors (kernels' layout).

    ``_views`` holds ``(first layer, last layer + 1, view)``: one view for the
    whole cache when its layers are evenly spaced, else one per layer.
    """

    _views: list[tuple[int, int, torch.Tensor]]

    @property
    def num_views(self) -> int:
        """Strided views the layers are moved through (1 when evenly spaced)."""
        return len(self._views)

    def _slots(self, block_ids: Sequence[int], start: int, num_tokens: int) -> torch.Tensor:
        g = self.geometry
        return slots_for_tokens(list(block_ids), g.block_size, start, num_tokens, device=g.device)

    def _fused(self) -> torch.Tensor | None:
        """The one view, where quantization fuses into the move (CUDA), else None."""
        if len(self._views) != 1 or self.geometry.device.type != "cuda":
            return None
        return self._views[0][2]

    def gather(self, block_ids: Sequence[int], start: int, num_tokens: int) -> torch.Tensor:
        slots = self._slots(block_ids, start, num_tokens)
        if len(self._views) == 1:
            return gather_kv(self._views[0][2], slots)
        out = torch.empty(
            self.geometry.chunk_shape(num_tokens), dtype=self.geometry.dtype, device=slots.device
        )
        for lo, hi, view in self._views:
            out[lo:hi] = gather_kv(view, slots)
        return out

    def gather_quantized(
        self, block_ids: Sequence[int], start: int, num_tokens: int, encoding: Encoding
    ) -> QuantizedChunk | None:
        view = self._fused()
        if view is None:
            return None
        return gather_kv_quantized(view, self._slots(block_ids, start, num_tokens), encoding)

    def scatter(self, chunk: torch.Tensor, block_ids: Sequence[int], start: int) -> None:
        t = _check_chunk(chunk, self.geometry)
        slots = self._slots(block_ids, start, t)
        chunk = chunk.to(self.geometry.device, non_blocking=True).contiguous()
        for lo, hi, view in self._views:
            scatter_kv(chunk[lo:hi], view, slots)

    def scatter_quantized(
        self, data: torch.Tensor, scales: torch.Tensor, block_ids: Sequence[int], start: int
    ) -> bool:
        view = self._fused()
        if view is None:
            return False
        device = self.geometry.device
        slots = self._slots(block_ids, start, int(data.shape[2]))
        scatter_kv_dequantized(
            data.to(device).contiguous(), scales.to(device).contiguous(), view, slots
        )
        return True


class EngineKV(StridedKV):
    """The bundled engine's cache: one tensor ``[L, 2, blocks, block_size, H, D]``.

    Args:
        kv_cache: The engine's cache (``engine/kv_cache.py``).

    Raises:
        ConfigError: if ``kv_cache`` is not 6-D.
    """

    def __init__(self, kv_cache: torch.Tensor) -> None:
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ConfigError(
                f"the engine's KV cache must be [L, 2, blocks, block_size, H, D], got "
                f"{tuple(kv_cache.shape)}"
            )
        num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        self.geometry = KVGeometry(
            num_layers,
            num_blocks,
            num_kv_heads,
            block_size,
            head_dim,
            kv_cache.dtype,
            kv_cache.device,
        )
        self._views = [(0, num_layers, kv_cache)]


class TokenKV(StridedKV):
    """vLLM's CUDA backends' cache: ``C`` = a token's K ‖ V (see the module docstring).

    Each layer ``[NB, H, BS, 2D]`` (strides ``sB, sH, sN, 1``) is viewed as
    ``[2, NB, BS, H, D]`` with strides ``D, sB, sN, sH, 1`` — K at ``c < D``,
    V at ``c >= D`` — which is :mod:`kvtier.kernels`' cache layout.

    Args:
        layers: The per-layer caches, in layer order.
        head_dim: Size of one head.

    Raises:
        ConfigError: if the layers do not have one ``[NB, H, BS, 2D]``
            geometry with ``C`` contiguous.
    """

    def __init__(self, layers: Sequence[torch.Tensor], head_dim: int) -> None:
        self.geometry = g = _check_layers(layers, head_dim)
        if layers[0].stride(3) != 1:
            raise ConfigError(
                f"KV cache: expected its last dim contiguous, got {layers[0].stride()}"
            )
        step = _layer_stride(layers)
        sb, sh, sn, _ = layers[0].stride()
        inner = (g.num_blocks, g.block_size, g.num_kv_heads, head_dim)
        if step is not None:
            first = layers[0]
            self._views = [
                (
                    0,
                    g.num_layers,
                    first.as_strided(
                        (g.num_layers, 2, *inner),
                        (step, head_dim, sb, sn, sh, 1),
                        first.storage_offset(),
                    ),
                )
            ]
        else:
            self._views = [
                (i, i + 1, t.as_strided((1, 2, *inner), (1, head_dim, sb, sn, sh, 1)))
                for i, t in enumerate(layers)
            ]


class PackedCpuKV(PagedKV):
    """The CPU backend's cache: each (block, head) page is Kᵀ then V (see the module docstring).

    Whole blocks move page by page, a copy per block for K and one for V
    (all layers and heads at once); the tokens of a block only partly in the
    range move one by one through token views. NOTE: the per-token views
    alone (two-index gathers and ``index_put_``) took 5-15x longer for whole
    blocks. The copies run on torch's threads as the forward pass does:
    switching to one thread around them was faster on a loaded host in a
    plain process, but inside vLLM's worker, whose OpenMP threads are bound
    to its CPUs, it made loads and the next forward pass slower. Per layer, with
    ``sB = H·BS·2D`` and ``sH = BS·2D``::

        pages   K as [NB, H, D, BS]: strides (sB, sH, BS, 1), offset 0
                V as [NB, H, BS, D]: strides (sB, sH, D, 1),  offset BS·D
        tokens  K as [NB, BS, H, D]: strides (sB, 1, sH, BS)  (Kᵀ: a token is a column)
                V as [NB, BS, H, D]: strides (sB, D, sH, 1)

    and with evenly spaced layers a leading ``[L]`` dim of the layer stride.

    Args:
        layers: The per-layer caches, in layer order, each contiguous.
        head_dim: Size of one head.

    Raises:
        ConfigError: if a layer is not a contiguous ``[NB, H, BS, 2D]`` tensor
            or the layers differ.
    """

    def __init__(self, layers: Sequence[torch.Tensor], head_dim: int) -> None:
        self.geometry = g = _check_layers(layers, head_dim)
        if not all(t.is_contiguous() for t in layers):
            raise ConfigError("the CPU KV cache layers must be contiguous (packed pages)")
        bs, d, h, nb = g.block_size, head_dim, g.num_kv_heads, g.num_blocks
        sh = bs * 2 * d
        sb = h * sh
        step = _layer_stride(layers)
        groups = [(0, g.num_layers, layers[0], step)] if step is not None else None
        if groups is None:
            groups = [(i, i + 1, t, 0) for i, t in enumerate(layers)]
        self._views = []
        for lo, hi, t, ls in groups:
            o, n = t.storage_offset(), hi - lo
            self._views.append(
                _PackedViews(
                    lo,
                    hi,
                    page_k=t.as_strided((n, nb, h, d, bs), (ls, sb, sh, bs, 1), o),
                    page_v=t.as_strided((n, nb, h, bs, d), (ls, sb, sh, d, 1), o + bs * d),
                    token_k=t.as_strided((n, nb, bs, h, d), (ls, sb, 1, sh, bs), o),
                    token_v=t.as_strided((n, nb, bs, h, d), (ls, sb, d, sh, 1), o + bs * d),
                )
            )

    @property
    def num_views(self) -> int:
        """Strided view groups the layers are moved through (1 when evenly spaced)."""
        return len(self._views)

    def _runs(self, block_ids: Sequence[int], start: int, num_tokens: int) -> list[_Run]:
        """The range split by block: (block id, first token, tokens, offset in the block)."""
        g = self.geometry
        bs = g.block_size
        if start < 0 or num_tokens < 0:
            raise KernelInputError(f"start, num_tokens: expected >= 0, got {start}, {num_tokens}")
        end = start + num_tokens
        if num_tokens and (end - 1) // bs >= len(block_ids):
            raise KernelInputError(
                f"block_ids: tokens [{start}, {end}) need {(end - 1) // bs + 1} blocks of {bs}, "
                f"the table has {len(block_ids)}"
            )
        runs = []
        pos = start
        while pos < end:
            block = int(block_ids[pos // bs])
            if not 0 <= block < g.num_blocks:
                raise KernelInputError(
                    f"block_ids: block {block} is outside the cache's {g.num_blocks} blocks"
                )
            n = min(end, (pos // bs + 1) * bs) - pos
            runs.append(_Run(block, pos - start, n, pos % bs))
            pos += n
        return runs

    def gather(self, block_ids: Sequence[int], start: int, num_tokens: int) -> torch.Tensor:
        runs = self._runs(block_ids, start, num_tokens)
        bs = self.geometry.block_size
        # out: [L, 2, T, H, D]
        out = torch.empty(self.geometry.chunk_shape(num_tokens), dtype=self.geometry.dtype)
        for v in self._views:
            dst = out[v.lo : v.hi]
            for r in runs:
                k_dst, v_dst = dst[:, 0, r.at : r.at + r.n], dst[:, 1, r.at : r.at + r.n]
                if r.n == bs:  # a whole page: [layers, H, D, BS] -> [layers, BS, H, D]
                    k_dst.copy_(v.page_k[:, r.block].permute(0, 3, 1, 2))
                    v_dst.copy_(v.page_v[:, r.block].permute(0, 2, 1, 3))
                else:
                    k_dst.copy_(v.token_k[:, r.block, r.offset : r.offset + r.n])
                    v_dst.copy_(v.token_v[:, r.block, r.offset : r.offset + r.n])
        return out

    def scatter(self, chunk: torch.Tensor, block_ids: Sequence[int], start: int) -> None:
        t = _check_chunk(chunk, self.geometry)
        runs = self._runs(block_ids, start, t)
        bs = self.geometry.block_size
        chunk = chunk.cpu()
        for v in self._views:
            src = chunk[v.lo : v.hi]
            for r in runs:
                k_src, v_src = src[:, 0, r.at : r.at + r.n], src[:, 1, r.at : r.at + r.n]
                if r.n == bs:  # a whole page: [layers, BS, H, D] -> [layers, H, D, BS]
                    v.page_k[:, r.block].copy_(k_src.permute(0, 2, 3, 1))
                    v.page_v[:, r.block].copy_(v_src.permute(0, 2, 1, 3))
                else:
                    v.token_k[:, r.block, r.offset : r.offset + r.n].copy_(k_src)
                    v.token_v[:, r.block, r.offset : r.offset + r.n].copy_(v_src)


@dataclass(frozen=True)
class _Run:
    """Tokens of a range within one block."""

    block: int  # block id
    at: int  # index of its first token in the range
    n: int  # tokens
    offset: int  # offset of its first token in the block


@dataclass(frozen=True)
class _PackedViews:
    """Strided views of layers ``[lo, hi)`` of the CPU cache (see ``PackedCpuKV``)."""

    lo: int
    hi: int
    page_k: torch.Tensor  # [layers, NB, H, D, BS]
    page_v: torch.Tensor  # [layers, NB, H, BS, D]
    token_k: torch.Tensor  # [layers, NB, BS, H, D]
    token_v: torch.Tensor  # [layers, NB, BS, H, D]


def layout_for(
    backend: str, layers: Sequence[torch.Tensor], head_dim: int, isa: str | None = None
) -> PagedKV:
    """The layout of vLLM's caches under attention ``backend``.

    Args:
        backend: vLLM's attention backend name (``"CPU_ATTN"``, ``"FLASH_ATTN"`` ...).
        layers: The registered per-layer caches, in layer order.
        head_dim: Size of one head.
        isa: The CPU backend's ISA (``"vec"``, ``"vec16"``, ``"amx"`` ...).

    Raises:
        ConfigError: for a backend or ISA whose packing kvtier does not know,
            or caches that do not fit it.
    """
    if backend == CPU_BACKEND:
        if isa not in CPU_ISAS:
            raise ConfigError(
                f"vLLM's CPU attention uses ISA {isa!r}, whose KV page packing kvtier does not "
                f"read (it reads {', '.join(CPU_ISAS)}); AMX packs bfloat16 KV in VNNI tiles: serve "
                "in float16 or float32 (--dtype), or on a CPU without AMX"
            )
        return PackedCpuKV(layers, head_dim)
    if backend in TOKEN_BACKENDS:
        return TokenKV(layers, head_dim)
    raise ConfigError(
        f"vLLM attention backend {backend!r} is not supported by kvtier "
        f"(supported: {CPU_BACKEND}, {', '.join(TOKEN_BACKENDS)})"
    )
