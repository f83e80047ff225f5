"""Shared builders for the kernel tests: caches in several layouts, slots, poison.

Imported by the test modules of this folder as ``tests.kernels.kernel_cases``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from kvtier.kernels import QuantizedChunk, reference

# How the cache tensor is laid out in memory (its shape is always
# [L, 2, NB, BS, H, D]):
#   contiguous    plain contiguous tensor
#   kv_first      a [2, L, NB, BS, H, D] allocation viewed with K/V and layers swapped
#   padded        a slice of [L+1, 2, NB, BS, H, D+6]: storage offset, padded rows
#   offset_major  a [L, 2, BS, NB, H, D] allocation with the block and offset dims
#                 transposed: slots cannot be flattened into one dim
LAYOUTS = ("contiguous", "kv_first", "padded", "offset_major")

_BITS = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float8_e4m3fn: torch.uint8,
    torch.int8: torch.int8,
}

# Values a kernel never produces, written into outputs before a run.
INT8_POISON = -128
FP8_POISON_BITS = 0x7F  # a NaN code


@dataclass(frozen=True)
class Case:
    """One kernel test input: cache geometry, dtype, layout and slots."""

    layers: int
    blocks: int
    block_size: int
    heads: int
    head_dim: int
    tokens: int
    dtype: torch.dtype
    layout: str
    skip: int = 2  # how many slots are -1
    slot_dtype: torch.dtype = torch.int64

    @property
    def id(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        slot = str(self.slot_dtype).removeprefix("torch.")
        return (
            f"L{self.layers}-NB{self.blocks}-BS{self.block_size}-H{self.heads}-D{self.head_dim}"
            f"-T{self.tokens}-{dtype}-{self.layout}-skip{self.skip}-{slot}"
        )


# Small shapes (the interpreter runs every program in Python) covering every
# dtype, layout and slot dtype, odd head counts, head_dim 1/64/80/96/128/1024.
SMALL_CASES = [
    Case(2, 4, 16, 3, 80, 8, torch.float16, "contiguous"),
    Case(2, 4, 16, 3, 80, 8, torch.bfloat16, "padded", slot_dtype=torch.int32),
    Case(1, 3, 16, 5, 96, 7, torch.bfloat16, "kv_first"),
    Case(2, 5, 8, 1, 64, 6, torch.float32, "offset_major", skip=0),
    Case(2, 2, 16, 2, 128, 5, torch.float16, "offset_major", skip=1, slot_dtype=torch.int32),
    Case(1, 2, 16, 7, 96, 6, torch.float32, "kv_first", skip=3),
    # 5 heads of 1024 split over two programs (BLOCK_H 4), 1 = odd sizes
    Case(1, 2, 4, 5, 1024, 3, torch.bfloat16, "padded", skip=1),
    Case(1, 1, 16, 1, 1, 4, torch.float16, "contiguous", skip=1),
]


def make_cache(
    case: Case, seed: int, device: str | torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(kv_cache view, its base allocation)`` filled from ``seed``.

    The same seed gives the same values on every device.
    """
    gen = torch.Generator().manual_seed(seed)
    L, NB, BS, H, D = case.layers, case.blocks, case.block_size, case.heads, case.head_dim
    if case.layout == "contiguous":
        shape = (L, 2, NB, BS, H, D)
    elif case.layout == "kv_first":
        shape = (2, L, NB, BS, H, D)
    elif case.layout == "padded":
        shape = (L + 1, 2, NB, BS, H, D + 6)
    elif case.layout == "offset_major":
        shape = (L, 2, BS, NB, H, D)
    else:
        raise ValueError(f"unknown layout {case.layout}")
    base = torch.randn(shape, generator=gen).to(case.dtype).to(device)
    if case.layout == "contiguous":
        view = base
    elif case.layout == "kv_first":
        view = base.permute(1, 0, 2, 3, 4, 5)
    elif case.layout == "padded":
        view = base[1:, :, :, :, :, 3 : 3 + D]
    else:
        view = base.transpose(2, 3)
    assert view.shape == (L, 2, NB, BS, H, D)
    return view, base


def make_slots(case: Case, seed: int, device: str | torch.device) -> torch.Tensor:
    """Distinct random slots over the whole cache, ``case.skip`` of them -1."""
    gen = torch.Generator().manual_seed(seed + 1)
    num_slots = case.blocks * case.block_size
    assert case.tokens <= num_slots
    slots = torch.randperm(num_slots, generator=gen)[: case.tokens]
    skipped = torch.randperm(case.tokens, generator=gen)[: case.skip]
    slots[skipped] = -1
    return slots.to(case.slot_dtype).to(device)


def make_chunk(case: Case, seed: int, device: str | torch.device) -> torch.Tensor:
    """A random contiguous chunk ``[L, 2, T, H, D]`` in the case dtype."""
    gen = torch.Generator().manual_seed(seed + 2)
    shape = (case.layers, 2, case.tokens, case.heads, case.head_dim)
    return torch.randn(shape, generator=gen).to(case.dtype).to(device)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor reinterpreted as integers (NaN-safe, sign-of-zero-exact), on the CPU."""
    return tensor.detach().cpu().contiguous().view(_BITS[tensor.dtype])


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Asserts same shape, dtype and bits; reports how many elements differ."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    diff = bits(actual) != bits(expected)
    assert not bool(diff.any()), (
        f"{what}: {int(diff.sum())} of {diff.numel()} elements differ; first at "
        f"{diff.nonzero()[0].tolist()}: {actual.detach().cpu()[diff][:4].tolist()} vs "
        f"{expected.detach().cpu()[diff][:4].tolist()}"
    )


def poison_(tensor: torch.Tensor) -> torch.Tensor:
    """Fills ``tensor`` with a value no kernel writes (NaN / -128 / fp8 NaN) in place."""
    if tensor.dtype == torch.int8:
        return tensor.fill_(INT8_POISON)
    if tensor.dtype == torch.float8_e4m3fn:
        tensor.view(torch.uint8).fill_(FP8_POISON_BITS)
        return tensor
    return tensor.fill_(float("nan"))


def poisoned_quantized(case: Case, encoding: str, device: str | torch.device) -> QuantizedChunk:
    """A preallocated, poisoned ``QuantizedChunk`` for ``case``."""
    data_dtype = torch.int8 if encoding == "int8" else torch.float8_e4m3fn
    shape = (case.layers, 2, case.tokens, case.heads, case.head_dim)
    data = poison_(torch.empty(shape, dtype=data_dtype, device=device))
    scales = poison_(torch.empty(shape[:-1], dtype=torch.float32, device=device))
    return QuantizedChunk(data, scales)


def check_against_reference(kernels: ModuleType, case: Case, seed: int, device: str) -> None:
    """Runs every kernel of ``kernels`` on ``device`` and the reference on the CPU.

    Every output (or the whole cache allocation, for scatters) is poisoned
    before the run and must match the reference bit for bit, so an element a
    kernel forgot to write, or wrote outside its view, fails.
    """
    cache, _ = make_cache(case, seed, device)
    ref_cache, _ = make_cache(case, seed, "cpu")
    slots = make_slots(case, seed, device)
    ref_slots = make_slots(case, seed, "cpu")

    # gather, into a poisoned buffer and into a fresh one
    expected = reference.gather_kv(ref_cache, ref_slots)
    out = poison_(torch.empty(expected.shape, dtype=case.dtype, device=device))
    result = kernels.gather_kv(cache, slots, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert_bitwise_equal(out, expected, f"gather_kv {case.id}")
    assert_bitwise_equal(kernels.gather_kv(cache, slots), expected, f"gather_kv(new) {case.id}")

    # gather + quantize
    for encoding in ("int8", "fp8_e4m3"):
        expected_q = reference.gather_kv_quantized(ref_cache, ref_slots, encoding)
        out_q = poisoned_quantized(case, encoding, device)
        kernels.gather_kv_quantized(cache, slots, encoding, out=out_q)
        assert_bitwise_equal(out_q.data, expected_q.data, f"{encoding} data {case.id}")
        assert_bitwise_equal(out_q.scales, expected_q.scales, f"{encoding} scales {case.id}")

        # dequantize + scatter into a poisoned cache (whole allocation compared)
        target, target_base = make_cache(case, seed, device)
        ref_target, ref_target_base = make_cache(case, seed, "cpu")
        poison_(target)
        poison_(ref_target)
        kernels.scatter_kv_dequantized(
            expected_q.data.to(device), expected_q.scales.to(device), target, slots
        )
        reference.scatter_kv_dequantized(expected_q.data, expected_q.scales, ref_target, ref_slots)
        assert_bitwise_equal(target_base, ref_target_base, f"{encoding} dequant-scatter {case.id}")

    # scatter a random chunk into a poisoned cache (whole allocation compared)
    chunk = make_chunk(case, seed, device)
    ref_chunk = make_chunk(case, seed, "cpu")
    target, target_base = make_cache(case, seed, device)
    ref_target, ref_target_base = make_cache(case, seed, "cpu")
    poison_(target)
    poison_(ref_target)
    kernels.scatter_kv(chunk, target, slots)
    reference.scatter_kv(ref_chunk, ref_target, ref_slots)
    assert_bitwise_equal(target_base, ref_target_base, f"scatter_kv {case.id}")
