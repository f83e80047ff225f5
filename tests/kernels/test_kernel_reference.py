"""Properties of the torch reference (the CPU path and the Triton kernels' oracle)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.kernels import SCALE_FLOOR, Encoding, dequantize_chunk, quantize_chunk, reference
from tests.kernels.kernel_cases import (
    LAYOUTS,
    Case,
    assert_bitwise_equal,
    bits,
    make_cache,
    make_chunk,
    make_slots,
    poison_,
    poisoned_quantized,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# Half an ulp of each cache dtype, relative: the rounding of a dequantized value.
HALF_ULP = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}

# Mean relative error |x' - x|.sum() / |x|.sum() of quantize -> dequantize on
# activation-like data (see _activation_like). Measured (torch 2.13, CPU):
# int8 0.0200, fp8_e4m3 0.0207 for float16, bfloat16 and float32 alike.
MEAN_REL_ERROR_BOUND = {"int8": 0.022, "fp8_e4m3": 0.023}


def naive_gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token at a time: the definition of gather."""
    L, _, _, BS, H, D = cache.shape
    out = torch.zeros(L, 2, slots.numel(), H, D, dtype=cache.dtype)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            out[:, :, t] = cache[:, :, slot // BS, slot % BS]
    return out


def naive_scatter(chunk: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """One token at a time: the definition of scatter."""
    BS = cache.shape[3]
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            cache[:, :, slot // BS, slot % BS] = chunk[:, :, t]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_matches_token_loop(dtype: torch.dtype, layout: str) -> None:
    case = Case(3, 5, 16, 3, 80, 20, dtype, layout, skip=4)
    cache, _ = make_cache(case, 1, "cpu")
    slots = make_slots(case, 1, "cpu")
    out = poison_(torch.empty(3, 2, 20, 3, 80, dtype=dtype))
    assert reference.gather_kv(cache, slots, out=out) is out
    assert_bitwise_equal(out, naive_gather(cache, slots), "gather")
    skipped = slots == -1
    assert bool((bits(out[:, :, skipped]) == 0).all()), "skipped tokens must be +0.0"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_matches_token_loop(dtype: torch.dtype, layout: str) -> None:
    case = Case(3, 5, 16, 3, 80, 20, dtype, layout, skip=4, slot_dtype=torch.int32)
    chunk = make_chunk(case, 2, "cpu")
    slots = make_slots(case, 2, "cpu")
    target, base = make_cache(case, 3, "cpu")
    expected, expected_base = make_cache(case, 3, "cpu")
    reference.scatter_kv(chunk, target, slots)
    naive_scatter(chunk, expected, slots)
    assert_bitwise_equal(base, expected_base, "scatter (whole allocation)")


@settings(max_examples=25, deadline=None)
@given(
    layers=st.integers(1, 3),
    blocks=st.integers(1, 6),
    block_size=st.sampled_from([1, 4, 16]),
    heads=st.integers(1, 5),
    head_dim=st.sampled_from([1, 8, 80, 96, 128]),
    dtype=st.sampled_from(DTYPES),
    layout=st.sampled_from(LAYOUTS),
    slot_dtype=st.sampled_from([torch.int64, torch.int32]),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_scatter_then_gather_round_trips_bitwise(
    layers: int,
    blocks: int,
    block_size: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    layout: str,
    slot_dtype: torch.dtype,
    seed: int,
    data: st.DataObject,
) -> None:
    tokens = data.draw(st.integers(1, blocks * block_size), label="tokens")
    case = Case(layers, blocks, block_size, heads, head_dim, tokens, dtype, layout, 0, slot_dtype)
    cache, base = make_cache(case, seed, "cpu")
    slots = make_slots(case, seed, "cpu")
    chunk = reference.gather_kv(cache, slots)

    # Scattering a gathered chunk back where it came from changes nothing.
    before = base.clone()
    reference.scatter_kv(chunk, cache, slots)
    assert_bitwise_equal(base, before, "scatter(gather(x)) in place")

    # Into a poisoned cache at other slots, then back out: the same bits.
    other, _ = make_cache(case, seed + 7, "cpu")
    poison_(other)
    other_slots = make_slots(case, seed + 11, "cpu")
    reference.scatter_kv(chunk, other, other_slots)
    assert_bitwise_equal(reference.gather_kv(other, other_slots), chunk, "gather(scatter(c))")


def test_skipped_slots_are_left_alone_by_scatter() -> None:
    case = Case(2, 4, 16, 3, 64, 30, torch.bfloat16, "padded", skip=10)
    target, base = make_cache(case, 4, "cpu")
    before = base.clone()
    slots = make_slots(case, 4, "cpu")
    reference.scatter_kv(make_chunk(case, 4, "cpu"), target, slots)
    changed = (bits(base) != bits(before)).flatten(4).any(-1)  # [L+1, 2, NB, BS]
    written = torch.zeros(case.blocks * case.block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    expected = written.view(case.blocks, case.block_size)
    assert bool((changed[1:] == expected).all())
    assert not bool(changed[0].any()), "the padding layer is outside the view"


def test_empty_and_all_skipped() -> None:
    case = Case(2, 2, 16, 3, 64, 5, torch.float16, "contiguous", skip=5)
    cache, base = make_cache(case, 0, "cpu")
    before = base.clone()
    slots = make_slots(case, 0, "cpu")
    assert bool((reference.gather_kv(cache, slots) == 0).all())
    reference.scatter_kv(make_chunk(case, 0, "cpu"), cache, slots)
    q = reference.gather_kv_quantized(cache, slots, "int8")
    reference.scatter_kv_dequantized(q.data, q.scales, cache, slots)
    assert_bitwise_equal(base, before, "cache after all-skipped scatters")
    empty = torch.empty(0, dtype=torch.int64)
    assert reference.gather_kv(cache, empty).shape == (2, 2, 0, 3, 64)


def _activation_like(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Standard normal values with two outlier channels (x8) per head, as in K caches."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    channels = torch.randint(0, shape[-1], (*shape[:2], 1, shape[3], 2), generator=gen)
    boost = torch.ones(*shape[:2], 1, shape[3], shape[-1]).scatter_(-1, channels, 8.0)
    return (x * boost).to(dtype)


@pytest.mark.parametrize("encoding", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantization_error_on_activation_like_data(dtype: torch.dtype, encoding: str) -> None:
    x = _activation_like((4, 2, 64, 4, 128), dtype, seed=0)
    q = quantize_chunk(x, encoding)
    y = dequantize_chunk(q.data, q.scales, dtype)
    xf, yf = x.float(), y.float()
    mean_rel = float((yf - xf).abs().sum() / xf.abs().sum())
    assert mean_rel < MEAN_REL_ERROR_BOUND[encoding], f"mean relative error {mean_rel:.5f}"
    assert mean_rel > 0.5 * MEAN_REL_ERROR_BOUND[encoding], "suspiciously exact: not quantized?"
    # Every element within the encoding's rounding bound, then the dtype's.
    scale = q.scales.unsqueeze(-1)
    if encoding == "int8":
        bound = 0.5 * scale * (1 + 2e-5)
        assert bool((q.data.abs() <= 127).all())
    else:
        # 3 mantissa bits: half an ulp is 2**-4 relative; subnormals 2**-10 absolute.
        bound = torch.maximum(xf.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 2e-5)
    bound = bound + yf.abs() * HALF_ULP[dtype]
    assert bool(((yf - xf).abs() <= bound).all())
    # Each head's largest magnitude maps to the top code.
    top = q.data.float().abs().amax(-1)
    assert bool((top == (127.0 if encoding == "int8" else 448.0)).all())


@pytest.mark.parametrize("encoding", ["int8", "fp8_e4m3"])
def test_scales_follow_the_definition(encoding: str) -> None:
    x = _activation_like((2, 2, 16, 3, 64), torch.float32, seed=1)
    q = quantize_chunk(x, encoding)
    qmax = 127.0 if encoding == "int8" else 448.0
    # float64 division rounded once to float32 is the IEEE float32 quotient.
    expected = (x.double().abs().amax(-1) / qmax).float().clamp_min(SCALE_FLOOR)
    assert_bitwise_equal(q.scales, expected, "scales")
    assert q.scales.is_contiguous() and q.data.is_contiguous()


@pytest.mark.parametrize("encoding", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_and_tiny_vectors(dtype: torch.dtype, encoding: str) -> None:
    x = torch.zeros(1, 2, 3, 2, 64, dtype=dtype)
    x[0, 1, 2, 1] = torch.full((64,), 1e-7).to(dtype)  # tiny but nonzero
    q = quantize_chunk(x, encoding)
    assert bool(torch.isfinite(q.scales).all())
    assert bool((q.scales[0, 0] == SCALE_FLOOR).all())
    assert bool((bits(q.data[0, 0]) == 0).all())
    y = dequantize_chunk(q.data, q.scales, dtype)
    assert bool(torch.isfinite(y.float()).all())
    assert bool((bits(y[0, 0]) == 0).all()), "an all-zero vector must come back as +0.0"
    assert float(y[0, 1, 2, 1].float().sub(x[0, 1, 2, 1].float()).abs().max()) <= 1e-8


@pytest.mark.parametrize("encoding", ["int8", "fp8_e4m3"])
def test_gather_quantized_is_gather_then_quantize(encoding: str) -> None:
    case = Case(2, 4, 16, 3, 96, 20, torch.bfloat16, "offset_major", skip=3)
    cache, _ = make_cache(case, 8, "cpu")
    slots = make_slots(case, 8, "cpu")
    out = poisoned_quantized(case, encoding, "cpu")
    result = reference.gather_kv_quantized(cache, slots, encoding, out=out)
    assert result is out
    expected = quantize_chunk(naive_gather(cache, slots), encoding)
    assert_bitwise_equal(out.data, expected.data, "data")
    assert_bitwise_equal(out.scales, expected.scales, "scales")
    skipped = slots == -1
    assert bool((out.scales[:, :, skipped] == SCALE_FLOOR).all())
    assert out.encoding is Encoding.parse(encoding)


@pytest.mark.parametrize("encoding", ["int8", "fp8_e4m3"])
def test_scatter_dequantized_is_dequantize_then_scatter(encoding: str) -> None:
    case = Case(2, 4, 16, 3, 96, 20, torch.float16, "kv_first", skip=3)
    slots = make_slots(case, 9, "cpu")
    q = quantize_chunk(make_chunk(case, 9, "cpu"), encoding)
    target, base = make_cache(case, 10, "cpu")
    expected, expected_base = make_cache(case, 10, "cpu")
    reference.scatter_kv_dequantized(q.data, q.scales, target, slots)
    naive_scatter(dequantize_chunk(q.data, q.scales, torch.float16), expected, slots)
    assert_bitwise_equal(base, expected_base, "dequantized scatter")


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_leaves_its_input_alone(dtype: torch.dtype) -> None:
    x = _activation_like((2, 2, 8, 3, 64), dtype, seed=2)
    before = x.clone()
    q = quantize_chunk(x, "int8")
    dequantize_chunk(q.data, q.scales, dtype)
    assert_bitwise_equal(x, before, "quantize input")


def test_whole_block_fast_path_matches_token_path() -> None:
    """Aligned whole-block slot runs take the row-copy path; it must equal the per-token path."""
    from kvtier.kernels import slots_for_tokens
    from kvtier.kernels.checks import check_gather

    g = torch.Generator().manual_seed(0)
    # Padding on the layer and K/V dims: rows stay contiguous, the tensor does not.
    base = torch.randn(3, 2, 12, 4, 2, 8, generator=g)
    cache = torch.randn(4, 3, 12, 4, 2, 8, generator=g)[:3, :2]
    cache.copy_(base)
    slots = slots_for_tokens([9, 0, 4], 4, 0, 12)
    geom = check_gather(cache, slots, None, check_slots=True)
    assert reference._block_rows(cache, slots, geom) is not None
    token_path = cache.reshape(3, 2, 48, 2, 8)[:, :, slots]
    assert torch.equal(reference.gather_kv(cache, slots), token_path)
    target = torch.zeros_like(cache)
    reference.scatter_kv(token_path.contiguous(), target, slots)
    expect = torch.zeros_like(cache).reshape(3, 2, 48, 2, 8)
    expect[:, :, slots] = token_path
    assert torch.equal(target.reshape(3, 2, 48, 2, 8), expect)
    # A run that starts mid-block does not take the fast path.
    shifted = slots_for_tokens([9, 0, 4], 4, 1, 8)
    assert (
        reference._block_rows(cache, shifted, check_gather(cache, shifted, None, check_slots=True))
        is None
    )
