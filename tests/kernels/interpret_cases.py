"""Triton kernels vs. the torch reference, in Triton's CPU interpreter.

Not collected by a plain ``pytest tests/kernels`` (the name does not start
with ``test_``): ``test_kernel_interpret.py`` runs this file in a child
pytest process, so that ``TRITON_INTERPRET=1`` is set before triton is first
imported there and never leaks into other tests of the parent session.
Running it directly (``pytest tests/kernels/interpret_cases.py``) works too.
"""

from __future__ import annotations

import os
import zlib

# NOTE: must precede any import of triton (and of kvtier's kernel module) in
# this process: triton decides interpreter vs. compiler when a kernel is
# decorated. test_interpreter_is_what_runs proves it took effect.
os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from kvtier.kernels import reference, triton_kv
from tests.kernels.kernel_cases import (
    SMALL_CASES,
    Case,
    assert_bitwise_equal,
    check_against_reference,
    make_cache,
    make_chunk,
    poison_,
    poisoned_quantized,
)


def test_interpreter_is_what_runs() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert triton_kv.kernels_interpreted(), "Triton kernels were compiled, not interpreted"


@pytest.mark.parametrize("case", SMALL_CASES, ids=lambda c: c.id)
def test_kernels_match_reference(case: Case) -> None:
    check_against_reference(triton_kv, case, seed=zlib.crc32(case.id.encode()), device="cpu")


def test_unchecked_out_of_range_slots_are_skipped_like_reference() -> None:
    case = Case(2, 3, 16, 3, 64, 6, torch.bfloat16, "padded", skip=0)
    cache, _ = make_cache(case, 5, "cpu")
    num_slots = case.blocks * case.block_size
    slots = torch.tensor([4, num_slots, -7, 47, 10**12, 0])
    expected = reference.gather_kv(cache, slots, check_slots=False)
    assert_bitwise_equal(triton_kv.gather_kv(cache, slots, check_slots=False), expected, "gather")
    assert bool((expected[:, :, [1, 2, 4]] == 0).all())
    q = triton_kv.gather_kv_quantized(cache, slots, "int8", check_slots=False)
    q_ref = reference.gather_kv_quantized(cache, slots, "int8", check_slots=False)
    assert_bitwise_equal(q.data, q_ref.data, "int8 data")
    assert_bitwise_equal(q.scales, q_ref.scales, "int8 scales")

    chunk = make_chunk(case, 5, "cpu")
    target, target_base = make_cache(case, 6, "cpu")
    ref_target, ref_base = make_cache(case, 6, "cpu")
    triton_kv.scatter_kv(chunk, target, slots, check_slots=False)
    reference.scatter_kv(chunk, ref_target, slots, check_slots=False)
    assert_bitwise_equal(target_base, ref_base, "scatter")
    target, target_base = make_cache(case, 6, "cpu")
    triton_kv.scatter_kv_dequantized(q.data, q.scales, target, slots, check_slots=False)
    reference.scatter_kv_dequantized(q.data, q.scales, ref_target, slots, check_slots=False)
    assert_bitwise_equal(target, ref_target, "dequant-scatter")


def _rows_with_unit_scale(values: torch.Tensor, qmax: float, head_dim: int) -> torch.Tensor:
    """Packs ``values`` into float32 head rows whose first element is ``qmax``.

    Each row's amax is then exactly ``qmax``, so its scale is exactly 1 and
    the kernel quantizes the values themselves: a direct test of rounding.
    """
    per_row = head_dim - 1
    rows = -(-values.numel() // per_row)
    padded = torch.zeros(rows * per_row)
    padded[: values.numel()] = values
    body = padded.view(rows, per_row).clamp(-qmax, qmax)
    return torch.cat([torch.full((rows, 1), qmax), body], dim=1)


@pytest.mark.parametrize("encoding", ["int8", "fp8_e4m3"])
def test_quantize_rounding_ties_and_edges(encoding: str) -> None:
    """Every tie, near-tie and fp8 code boundary rounds exactly as torch does."""
    if encoding == "int8":
        qmax = 127.0
        k = torch.arange(-127, 127, dtype=torch.float32)
        ties = k + 0.5
        values = torch.cat([ties, ties.nextafter(ties + 1), ties.nextafter(ties - 1), k])
    else:
        qmax = 448.0
        codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        codes = torch.sort(codes[~codes.isnan()]).values
        mids = (codes[1:] + codes[:-1]) / 2  # exact in float32: ties
        values = torch.cat(
            [
                codes,
                mids,
                mids.nextafter(mids + 1),
                mids.nextafter(mids - 1),
                torch.tensor([-0.0, 1e-30, -1e-30, 2.0**-10, 3 * 2.0**-11, 447.9, 460.0, -500.0]),
            ]
        )
    head_dim = 128
    rows = _rows_with_unit_scale(values, qmax, head_dim)  # [R, D]
    heads = 2
    tokens = -(-rows.shape[0] // heads)
    full = torch.zeros(tokens * heads, head_dim)
    full[: rows.shape[0]] = rows
    full[rows.shape[0] :, 0] = qmax
    # cache: 1 layer, K = V = the rows, one block holding every token
    cache = full.view(1, 1, 1, tokens, heads, head_dim).expand(1, 2, 1, tokens, heads, head_dim)
    cache = cache.contiguous()
    slots = torch.arange(tokens)
    q = triton_kv.gather_kv_quantized(cache, slots, encoding)
    q_ref = reference.gather_kv_quantized(cache, slots, encoding)
    assert bool((q_ref.scales == 1.0).all())
    assert_bitwise_equal(q.scales, q_ref.scales, f"{encoding} scales")
    assert_bitwise_equal(q.data, q_ref.data, f"{encoding} codes")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fp8_decode_all_codes(dtype: torch.dtype) -> None:
    """All 256 fp8 codes times random scales dequantize exactly as torch does."""
    gen = torch.Generator().manual_seed(3)
    tokens, heads, head_dim = 4, 2, 128  # 4 * 2 rows of 128 = every code 4 times
    codes = torch.arange(256, dtype=torch.uint8).repeat(4)
    data = codes[torch.randperm(codes.numel(), generator=gen)]
    data = data.view(torch.float8_e4m3fn).view(1, 1, tokens, heads, head_dim)
    data = data.expand(1, 2, tokens, heads, head_dim).contiguous()
    scales = torch.rand(1, 2, tokens, heads, generator=gen) * 3
    case = Case(1, 1, tokens, heads, head_dim, tokens, dtype, "contiguous")
    cache, _ = make_cache(case, 1, "cpu")
    ref_cache = cache.clone()
    poison_(cache)
    poison_(ref_cache)
    slots = torch.arange(tokens)
    triton_kv.scatter_kv_dequantized(data, scales, cache, slots)
    reference.scatter_kv_dequantized(data, scales, ref_cache, slots)
    nan = ref_cache.isnan()
    assert int(nan.sum()) == 2 * 4 * 2  # codes 0x7F and 0xFF, 4 times each, in K and V
    assert bool((cache.isnan() == nan).all())
    assert_bitwise_equal(cache[~nan], ref_cache[~nan], "fp8 decode")


def test_empty_slot_mapping_launches_nothing() -> None:
    case = Case(2, 2, 16, 3, 64, 0, torch.float16, "contiguous", skip=0)
    cache, _ = make_cache(case, 0, "cpu")
    slots = torch.empty(0, dtype=torch.int64)
    assert triton_kv.gather_kv(cache, slots).shape == (2, 2, 0, 3, 64)
    q = triton_kv.gather_kv_quantized(cache, slots, "fp8_e4m3")
    assert q.data.shape == (2, 2, 0, 3, 64) and q.scales.shape == (2, 2, 0, 3)
    before = cache.clone()
    triton_kv.scatter_kv(torch.empty(2, 2, 0, 3, 64, dtype=torch.float16), cache, slots)
    assert torch.equal(cache, before)
    out = poisoned_quantized(case, "int8", "cpu")
    triton_kv.scatter_kv_dequantized(out.data, out.scales, cache, slots)
    assert torch.equal(cache, before)
