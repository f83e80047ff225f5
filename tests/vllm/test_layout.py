"""vLLM's CPU and CUDA KV layouts, built by hand, against plain per-token references.

No vLLM needed: the caches are torch tensors laid out as vLLM 0.32 lays them
out (``kvtier.connectors.vllm_layout``'s docstring); the references below
write and read them token by token with explicit index arithmetic.
``test_layout_vs_vllm.py`` checks the CPU packing against vLLM's own kernel.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.connectors.layouts import (
    PackedCpuKV,
    PagedKV,
    TokenKV,
    layout_for,
)
from kvtier.errors import ConfigError
from kvtier.kernels import KernelInputError

L, NB, H, BS, D = 3, 6, 2, 8, 4


def _positions(block_ids: list[int], start: int, n: int) -> list[tuple[int, int]]:
    return [(block_ids[p // BS], p % BS) for p in range(start, start + n)]


# ---- references: one token at a time ------------------------------------------------------


def _cpu_write(layers: list[torch.Tensor], chunk: torch.Tensor, block_ids: list[int], start: int):
    """Packs like vLLM's CPU kernel: page[b, h] = Kᵀ [D][BS] then V [BS][D]."""
    for t, (b, o) in enumerate(_positions(block_ids, start, chunk.shape[2])):
        for layer, cache in enumerate(layers):
            for h in range(H):
                page = cache[b, h].reshape(-1)
                for d in range(D):
                    page[d * BS + o] = chunk[layer, 0, t, h, d]
                    page[BS * D + o * D + d] = chunk[layer, 1, t, h, d]


def _cpu_read(layers: list[torch.Tensor], block_ids: list[int], start: int, n: int):
    out = torch.zeros(L, 2, n, H, D, dtype=layers[0].dtype)
    for t, (b, o) in enumerate(_positions(block_ids, start, n)):
        for layer, cache in enumerate(layers):
            for h in range(H):
                page = cache[b, h].reshape(-1)
                for d in range(D):
                    out[layer, 0, t, h, d] = page[d * BS + o]
                    out[layer, 1, t, h, d] = page[BS * D + o * D + d]
    return out


def _token_write(layers: list[torch.Tensor], chunk: torch.Tensor, block_ids: list[int], start: int):
    """CUDA backends: cache[b, h, o] = K ‖ V of the token."""
    for t, (b, o) in enumerate(_positions(block_ids, start, chunk.shape[2])):
        for layer, cache in enumerate(layers):
            for h in range(H):
                cache[b, h, o, :D] = chunk[layer, 0, t, h]
                cache[b, h, o, D:] = chunk[layer, 1, t, h]


def _token_read(layers: list[torch.Tensor], block_ids: list[int], start: int, n: int):
    out = torch.zeros(L, 2, n, H, D, dtype=layers[0].dtype)
    for t, (b, o) in enumerate(_positions(block_ids, start, n)):
        for layer, cache in enumerate(layers):
            for h in range(H):
                out[layer, 0, t, h] = cache[b, h, o, :D]
                out[layer, 1, t, h] = cache[b, h, o, D:]
    return out


# ---- caches as vLLM allocates them --------------------------------------------------------


def _one_buffer(dtype: torch.dtype) -> list[torch.Tensor]:
    """All layers in one buffer, evenly spaced (vLLM's allocation): [NB, H, BS, 2D] views."""
    buf = torch.randn(L, NB, H, BS, 2 * D).to(dtype)
    return [buf[i] for i in range(L)]


def _separate(dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(NB, H, BS, 2 * D).to(dtype) for _ in range(L)]


def _nhd_physical(dtype: torch.dtype) -> list[torch.Tensor]:
    """CUDA's LBNHC layout: memory [L, NB, BS, H, 2D], logical [NB, H, BS, 2D] views."""
    buf = torch.randn(L, NB, BS, H, 2 * D).to(dtype)
    return [buf[i].permute(0, 2, 1, 3) for i in range(L)]


CASES = [
    ("cpu", PackedCpuKV, _cpu_write, _cpu_read, _one_buffer),
    ("cpu-separate", PackedCpuKV, _cpu_write, _cpu_read, _separate),
    ("token", TokenKV, _token_write, _token_read, _one_buffer),
    ("token-separate", TokenKV, _token_write, _token_read, _separate),
    ("token-nhd", TokenKV, _token_write, _token_read, _nhd_physical),
]

# (block table, start, tokens): aligned whole blocks, a partial first and last block, one token
RANGES = [([5, 2, 0], 0, 3 * BS), ([4, 1, 3], 3, 2 * BS + 2), ([1, 5], BS + 7, 1)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("name", "cls", "write", "read", "alloc"), CASES, ids=[c[0] for c in CASES]
)
def test_gather_and_scatter_match_the_per_token_reference(name, cls, write, read, alloc, dtype):
    for block_ids, start, n in RANGES:
        layers = alloc(dtype)
        layout: PagedKV = cls(layers, D)
        assert layout.geometry.num_layers == L and layout.geometry.block_size == BS
        # gather reads what the reference wrote
        chunk = torch.randn(L, 2, n, H, D).to(dtype)
        write(layers, chunk, block_ids, start)
        got = layout.gather(block_ids, start, n)
        assert got.shape == (L, 2, n, H, D) and got.is_contiguous()
        assert torch.equal(got, chunk)
        # scatter writes where the reference reads, and nothing else
        before = [t.clone() for t in layers]
        new = torch.randn(L, 2, n, H, D).to(dtype)
        layout.scatter(new, block_ids, start)
        assert torch.equal(read(layers, block_ids, start, n), new)
        write(before, new, block_ids, start)  # the expected caches: only those tokens changed
        for t, expect in zip(layers, before, strict=True):
            assert torch.equal(t, expect)


@pytest.mark.parametrize(
    ("name", "cls", "alloc", "views"),
    [
        ("cpu", PackedCpuKV, _one_buffer, 1),
        ("cpu", PackedCpuKV, _separate, L),
        ("token", TokenKV, _one_buffer, 1),
        ("token", TokenKV, _nhd_physical, 1),
        ("token", TokenKV, _separate, L),
    ],
)
def test_evenly_spaced_layers_move_in_one_view(name, cls, alloc, views) -> None:
    assert cls(alloc(torch.float32), D).num_views == views


def test_a_layer_view_that_overlaps_the_next_is_not_taken_as_evenly_spaced() -> None:
    buf = torch.randn(NB * H * BS * 2 * D + 2 * D)
    # layers 2D elements apart: they overlap, so they must be moved one by one
    layers = [
        buf[i * 2 * D : i * 2 * D + NB * H * BS * 2 * D].view(NB, H, BS, 2 * D) for i in range(2)
    ]
    layout = TokenKV(layers, D)
    assert layout.num_views == 2


@pytest.mark.parametrize("cls", [PackedCpuKV, TokenKV])
def test_bad_ranges_and_chunks_raise_and_write_nothing(cls) -> None:
    layers = _one_buffer(torch.float32)
    layout = cls(layers, D)
    before = [t.clone() for t in layers]
    with pytest.raises(KernelInputError):
        layout.gather([0], 0, BS + 1)  # the block table ends before the range
    with pytest.raises(KernelInputError):
        layout.scatter(torch.zeros(L, 2, 4, H, D), [NB], 0)  # a block outside the cache
    with pytest.raises(KernelInputError):
        layout.scatter(torch.zeros(L, 2, 4, H, D + 1), [0], 0)
    with pytest.raises(KernelInputError):
        layout.scatter(torch.zeros(L, 2, 4, H, D, dtype=torch.float16), [0], 0)
    with pytest.raises(KernelInputError):
        layout.scatter(torch.zeros(L - 1, 2, 4, H, D), [0], 0)
    for t, b in zip(layers, before, strict=True):
        assert torch.equal(t, b)


def test_layout_for_picks_the_packing_and_refuses_unknown_ones() -> None:
    layers = _one_buffer(torch.bfloat16)
    assert isinstance(layout_for("CPU_ATTN", layers, D, "vec"), PackedCpuKV)
    assert isinstance(layout_for("CPU_ATTN", layers, D, "vec16"), PackedCpuKV)
    assert isinstance(layout_for("FLASH_ATTN", layers, D), TokenKV)
    with pytest.raises(ConfigError, match="amx"):
        layout_for("CPU_ATTN", layers, D, "amx")
    with pytest.raises(ConfigError, match="not supported"):
        layout_for("FLASHMLA", layers, D)
    with pytest.raises(ConfigError, match="2 \\* head_dim"):
        layout_for("FLASH_ATTN", layers, D + 1)
    with pytest.raises(ConfigError, match="one geometry"):
        TokenKV([layers[0], torch.zeros(NB + 1, H, BS, 2 * D, dtype=torch.bfloat16)], D)
    with pytest.raises(ConfigError, match="contiguous"):
        PackedCpuKV(_nhd_physical(torch.bfloat16), D)


@pytest.mark.gpu
@pytest.mark.parametrize("alloc", [_one_buffer, _nhd_physical, _separate])
def test_token_layout_on_cuda_matches_the_cpu_reference(alloc) -> None:
    cpu = alloc(torch.bfloat16)
    layers = [t.cuda() for t in cpu]
    if alloc is not _separate:  # keep vLLM's one-buffer allocation on the device too
        base = torch.stack([t.contiguous() for t in cpu]).cuda() if alloc is _one_buffer else None
        layers = [base[i] for i in range(L)] if base is not None else [t.cuda() for t in cpu]
    layout = TokenKV(layers, D)
    block_ids, start, n = [4, 1, 3], 3, 2 * BS + 2
    chunk = torch.randn(L, 2, n, H, D).to(torch.bfloat16)
    layout.scatter(chunk.cuda(), block_ids, start)
    host = [t.cpu() for t in layers]
    assert torch.equal(_token_read(host, block_ids, start, n), chunk)
    assert torch.equal(layout.gather(block_ids, start, n).cpu(), chunk)
    q = layout.gather_quantized(block_ids, start, n, "int8")
    if layout.num_views == 1:
        assert q is not None and q.data.shape == (L, 2, n, H, D)
