"""The Triton kernels compile to GPU code (PTX and cubin) without a GPU.

The interpreter tests check the kernels' arithmetic but bypass Triton's code
generator. Compiling for real targets here checks what the interpreter
cannot: that every kernel lowers for sm_80 (no native fp8) and sm_90, that
float divisions are IEEE (``div.rn.f32``, never the approximate
``div.full``/``div.approx`` Triton's ``/`` gives), and that fp8 needs no
hardware conversion.
"""

from __future__ import annotations

import os
import re

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvtier.kernels import triton_kv  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1: kernels are interpreted here", allow_module_level=True)

_SCALARS = {
    "slot_stride": "i64",
    "num_slots": "i64",
    "block_size": "i32",
    "s_layer": "i64",
    "s_kv": "i64",
    "s_block": "i64",
    "s_offset": "i64",
    "s_head": "i32",
    "num_tokens": "i32",
    "num_heads": "i32",
    "head_dim": "i32",
}


def _variants(dtype: str) -> list[tuple[str, dict[str, str], dict[str, object]]]:
    """(kernel name, pointer types, constexprs) as the wrappers launch them."""
    tile = {"BLOCK_H": 4, "BLOCK_D": 128}
    out = [
        (
            "gather_kv_kernel",
            {"cache_ptr": f"*{dtype}", "slots_ptr": "*i64", "out_ptr": f"*{dtype}"},
            tile,
        ),
        (
            "scatter_kv_kernel",
            {"chunk_ptr": f"*{dtype}", "slots_ptr": "*i32", "cache_ptr": f"*{dtype}"},
            tile,
        ),
    ]
    for fp8 in (False, True):
        data = "*u8" if fp8 else "*i8"
        out.append(
            (
                "gather_quantize_kernel",
                {
                    "cache_ptr": f"*{dtype}",
                    "slots_ptr": "*i64",
                    "data_ptr": data,
                    "scales_ptr": "*fp32",
                },
                {"QMAX": 448.0 if fp8 else 127.0, "SCALE_FLOOR": 1e-12, "IS_FP8": fp8, **tile},
            )
        )
        out.append(
            (
                "dequantize_scatter_kernel",
                {
                    "data_ptr": data,
                    "scales_ptr": "*fp32",
                    "slots_ptr": "*i64",
                    "cache_ptr": f"*{dtype}",
                },
                {"IS_FP8": fp8, "OUT_BF16": dtype == "bf16", **tile},
            )
        )
    return out


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_kernels_compile_with_ieee_division(arch: int, dtype: str) -> None:
    assert not triton_kv.kernels_interpreted()
    kernels = triton_kv._kernels()
    for name, pointers, constexprs in _variants(dtype):
        fn = getattr(kernels, name)
        signature = {
            arg: pointers.get(arg) or ("constexpr" if arg in constexprs else _SCALARS[arg])
            for arg in fn.arg_names
        }
        source = ASTSource(
            fn=fn,
            signature=signature,
            constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
        )
        compiled = triton.compile(
            source, target=GPUTarget("cuda", arch, 32), options={"enable_fp_fusion": False}
        )
        ptx = compiled.asm["ptx"]
        assert compiled.asm["cubin"], f"{name}: no cubin"
        float_divs = set(re.findall(r"\bdiv\.[a-z.]*f32\b", ptx))
        if name == "gather_quantize_kernel":
            assert float_divs == {"div.rn.f32"}, f"{name}: float divisions {float_divs}"
        else:
            assert not float_divs, f"{name}: unexpected float divisions {float_divs}"
        assert "e4m3" not in ptx, f"{name}: uses a hardware fp8 conversion"
