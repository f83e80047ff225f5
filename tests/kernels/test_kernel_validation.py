"""Every bad argument raises KernelInputError, on both paths, before anything is written.

The Triton wrappers check before they import or launch anything, so these run
without a GPU and without the interpreter.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch

import kvtier.kernels as dispatch
from kvtier.kernels import KernelInputError, QuantizedChunk, reference, triton_kv

BACKENDS = [
    pytest.param(reference, id="reference"),
    pytest.param(triton_kv, id="triton"),
    pytest.param(dispatch, id="dispatch"),
]

L, NB, BS, H, D, T = 2, 3, 4, 3, 8, 5


def cache(**kw: object) -> torch.Tensor:
    return torch.randn(L, 2, NB, BS, H, D).to(kw.get("dtype", torch.float16))


def slots() -> torch.Tensor:
    return torch.tensor([0, 5, -1, 11, 2])


def chunk(dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.randn(L, 2, T, H, D).to(dtype)


def qdata(dtype: torch.dtype = torch.int8) -> torch.Tensor:
    return torch.zeros(L, 2, T, H, D, dtype=dtype)


def qscales() -> torch.Tensor:
    return torch.ones(L, 2, T, H)


Call = Callable[[ModuleType], object]

# (id, call, text the message must contain)
BAD_CALLS: list[tuple[str, Call, str]] = [
    # kv_cache
    ("cache-not-tensor", lambda k: k.gather_kv([1, 2], slots()), "kv_cache"),
    ("cache-5d", lambda k: k.gather_kv(cache()[0], slots()), "kv_cache: expected 6 dims"),
    ("cache-kv-3", lambda k: k.gather_kv(torch.zeros(L, 3, NB, BS, H, D), slots()), "dim 1 == 2"),
    ("cache-float64", lambda k: k.gather_kv(cache(dtype=torch.float64), slots()), "float16"),
    (
        "cache-int8",
        lambda k: k.gather_kv(cache().to(torch.int8), slots()),
        "kv_cache: expected dtype",
    ),
    (
        "cache-last-dim-strided",
        lambda k: k.gather_kv(torch.randn(L, 2, NB, BS, D, H).transpose(4, 5), slots()),
        "head_dim contiguous",
    ),
    (
        "cache-zero-heads",
        lambda k: k.gather_kv(torch.zeros(L, 2, NB, BS, 0, D), slots()),
        "num_kv_heads",
    ),
    (
        "cache-expanded-scatter",
        lambda k: k.scatter_kv(chunk(), cache()[:, :, :1].expand(L, 2, NB, BS, H, D), slots()),
        "expanded",
    ),
    # slot_mapping
    (
        "slots-2d",
        lambda k: k.gather_kv(cache(), slots().view(1, -1)),
        "slot_mapping: expected 1 dim",
    ),
    (
        "slots-float",
        lambda k: k.gather_kv(cache(), slots().float()),
        "slot_mapping: expected dtype",
    ),
    ("slots-int16", lambda k: k.gather_kv(cache(), slots().short()), "int64 or int32"),
    ("slots-list", lambda k: k.gather_kv(cache(), [0, 1]), "slot_mapping: expected a torch.Tensor"),
    (
        "slots-device",
        lambda k: k.gather_kv(cache(), slots().to("meta")),
        "slot_mapping: expected device",
    ),
    (
        "slots-too-big",
        lambda k: k.gather_kv(cache(), torch.tensor([0, NB * BS])),
        "got min 0, max 12",
    ),
    ("slots-minus-2", lambda k: k.gather_kv(cache(), torch.tensor([-2, 1])), "or -1"),
    (
        "slots-range-scatter",
        lambda k: k.scatter_kv(chunk()[:, :, :2], cache(), torch.tensor([3, 99])),
        "slot_mapping",
    ),
    # out
    (
        "out-shape",
        lambda k: k.gather_kv(cache(), slots(), out=chunk()[:, :, :4]),
        "out: expected shape",
    ),
    (
        "out-dtype",
        lambda k: k.gather_kv(cache(), slots(), out=chunk(torch.float32)),
        "out: expected dtype",
    ),
    (
        "out-strided",
        lambda k: k.gather_kv(
            cache(), slots(), out=torch.zeros(L, 2, T, H, 2 * D).half()[..., ::2]
        ),
        "out: expected a contiguous",
    ),
    # chunk
    (
        "chunk-tokens",
        lambda k: k.scatter_kv(chunk()[:, :, :4], cache(), slots()),
        "chunk: expected shape",
    ),
    (
        "chunk-heads",
        lambda k: k.scatter_kv(torch.zeros(L, 2, T, H + 1, D).half(), cache(), slots()),
        "chunk: expected shape",
    ),
    (
        "chunk-layers",
        lambda k: k.scatter_kv(torch.zeros(L + 1, 2, T, H, D).half(), cache(), slots()),
        "chunk: expected shape",
    ),
    (
        "chunk-dtype",
        lambda k: k.scatter_kv(chunk(torch.bfloat16), cache(), slots()),
        "chunk: expected dtype",
    ),
    (
        "chunk-strided",
        lambda k: k.scatter_kv(torch.zeros(L, 2, H, T, D).half().transpose(2, 3), cache(), slots()),
        "chunk: expected a contiguous",
    ),
    (
        "chunk-device",
        lambda k: k.scatter_kv(chunk().to("meta"), cache(), slots()),
        "chunk: expected device",
    ),
    (
        "chunk-not-tensor",
        lambda k: k.scatter_kv(None, cache(), slots()),
        "chunk: expected a torch.Tensor",
    ),
    # quantized gather
    ("encoding", lambda k: k.gather_kv_quantized(cache(), slots(), "int4"), "encoding"),
    (
        "qout-type",
        lambda k: k.gather_kv_quantized(cache(), slots(), "int8", out=(qdata(), qscales())),
        "out: expected a QuantizedChunk",
    ),
    (
        "qout-dtype",
        lambda k: k.gather_kv_quantized(
            cache(), slots(), "fp8_e4m3", out=QuantizedChunk(qdata(), qscales())
        ),
        "out.data: expected dtype",
    ),
    (
        "qout-scales-shape",
        lambda k: k.gather_kv_quantized(
            cache(), slots(), "int8", out=QuantizedChunk(qdata(), qscales()[:, :, :2])
        ),
        "out.scales: expected shape",
    ),
    # dequantized scatter
    (
        "data-float16",
        lambda k: k.scatter_kv_dequantized(qdata(torch.float16), qscales(), cache(), slots()),
        "data: expected dtype int8 or float8_e4m3fn",
    ),
    (
        "data-shape",
        lambda k: k.scatter_kv_dequantized(qdata()[:, :, :3], qscales(), cache(), slots()),
        "data: expected shape",
    ),
    (
        "scales-dtype",
        lambda k: k.scatter_kv_dequantized(qdata(), qscales().half(), cache(), slots()),
        "scales: expected dtype float32",
    ),
    (
        "scales-shape",
        lambda k: k.scatter_kv_dequantized(qdata(), qscales()[..., :1], cache(), slots()),
        "scales: expected shape",
    ),
    (
        "scales-strided",
        lambda k: k.scatter_kv_dequantized(
            qdata(), torch.ones(L, 2, H, T).transpose(2, 3), cache(), slots()
        ),
        "scales: expected a contiguous",
    ),
    (
        "scales-device",
        lambda k: k.scatter_kv_dequantized(qdata(), qscales().to("meta"), cache(), slots()),
        "scales: expected device",
    ),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("call", "message"), [pytest.param(c, m, id=i) for i, c, m in BAD_CALLS])
def test_bad_input_raises(backend: ModuleType, call: Call, message: str) -> None:
    with pytest.raises(KernelInputError, match=message.replace("(", r"\(")):
        call(backend)


def test_kernel_input_error_is_a_value_error() -> None:
    assert issubclass(KernelInputError, ValueError)


@pytest.mark.parametrize("backend", BACKENDS)
def test_failed_scatter_writes_nothing(backend: ModuleType) -> None:
    kv = cache()
    before = kv.clone()
    with pytest.raises(KernelInputError):
        backend.scatter_kv(chunk(), kv, torch.tensor([0, 1, 2, 3, NB * BS]))
    with pytest.raises(KernelInputError):
        backend.scatter_kv_dequantized(qdata(), qscales(), kv, torch.tensor([0, 1, 2, 3, -5]))
    assert torch.equal(kv, before)


def test_unchecked_slots_skip_instead_of_raising() -> None:
    kv = cache()
    bad = torch.tensor([0, NB * BS, -9, 3, 1])
    out = reference.gather_kv(kv, bad, check_slots=False)
    assert bool((out[:, :, 1:3] == 0).all())
    assert torch.equal(out[:, :, 0], kv[:, :, 0, 0])
