"""The compiled Triton kernels on a real CUDA device vs. the torch reference on the CPU.

Besides what the interpreter tests show, this checks what only hardware can:
compiled code generation, IEEE division (``div_rn``; the interpreter's ``/``
is IEEE anyway), 64-bit addressing with real strides, and launch shapes.

NOTE: never import ``interpret_cases`` here: it sets ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from kvtier.kernels import backend_for, gather_kv, reference, triton_kv
from tests.kernels.kernel_cases import (
    SMALL_CASES,
    Case,
    assert_bitwise_equal,
    check_against_reference,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CASES = [
    *SMALL_CASES,
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; a 256-token chunk
    Case(30, 64, 16, 3, 64, 256, torch.bfloat16, "contiguous", skip=7),
    # Llama-3-8B-like: 32 layers, 8 KV heads, head_dim 128
    Case(32, 32, 16, 8, 128, 256, torch.bfloat16, "kv_first", skip=0, slot_dtype=torch.int32),
    Case(4, 40, 16, 8, 128, 256, torch.float16, "padded", skip=30),
    Case(4, 40, 16, 40, 128, 256, torch.float32, "offset_major", skip=3),
]


def test_compiled_not_interpreted() -> None:
    assert not triton_kv.kernels_interpreted(), "unset TRITON_INTERPRET for the GPU tests"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_triton_matches_reference_on_cuda(case: Case) -> None:
    check_against_reference(triton_kv, case, seed=zlib.crc32(case.id.encode()), device="cuda")


def test_dispatch_sends_cuda_to_triton() -> None:
    cache = torch.randn(2, 2, 4, 16, 3, 64, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([3, -1, 40], device="cuda")
    assert backend_for(cache) == "triton"
    chunk = gather_kv(cache, slots)
    assert chunk.is_cuda
    assert_bitwise_equal(chunk, reference.gather_kv(cache.cpu(), slots.cpu()), "gather")
